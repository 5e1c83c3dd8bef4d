"""GGUF files (llama.cpp's format) into a LlamaForCausalLM.

The file is parsed and memory-mapped once (pyllm.model.gguf_file). Projection weights
and the token table of a type pyllm.ops.quant_linear reads stay in their blocks: each is
read where it lies: a uint8 view of the file's read-only map when its rows need no
reordering or split, else its own copy read from the file (linear.QuantPart). Every other
tensor (and all of them with keep_quantized=False) is dequantized (by `gguf.quants`) to
float32 on its own, renamed from llama.cpp's names (``blk.3.attn_k.weight``) to HF's
(``model.layers.3.self_attn.k_proj.weight``), and copied into its slot. llama.cpp's
converter reorders the rows of the Llama q/k projections (per head, it interleaves the
two rotary halves for its GPT-J-style rope); we undo that, on float rows or on rows of
blocks alike, so the neox-style rotary kernel sees HF's layout.

Mixture-of-experts files hold each sparse layer's router (``ffn_gate_inp``, [E, H]) and
one 3-D tensor per projection of all its experts (``ffn_{gate,up,down}_exps``, numpy
shape [E, N, K]). Kept quantized, each is read into one uint8 tensor [E, N, row bytes]
(this rank's share of it); otherwise it is widened one expert at a time.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import replace

import numpy as np
import torch

import pyllm.ops as ops
from pyllm.model.config import ModelConfig
from pyllm.model.dtype import resolve_dtype
from pyllm.model.gguf_file import GGUFFile, GGUFTensor, open_gguf
from pyllm.model.llama import LlamaForCausalLM
from pyllm.model.memory import zeros_committed
from pyllm.model.registry import model_class
from pyllm.model.strip_cache import ALIGN, StripCache
from pyllm.model.strip_cache import enabled as strip_cache_enabled
from pyllm.model.weights import (
    WeightFiller,
    expert_block_ranges,
    per_expert_name,
    shard_rows,
)

# The tensor types we dequantize (each tested in tests/model/test_gguf.py): the float
# types and those quant_linear reads.
SUPPORTED_TYPES = ("F32", "F16", "BF16", *ops.QUANT_TYPES)

# Tensors that are not weights of ours: rope factors go into the config.
_NOT_WEIGHTS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")

logger = logging.getLogger("pyllm")


def _open(path: str) -> GGUFFile:
    try:
        return open_gguf(path)
    except OSError as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise ValueError(f"{path} is not a readable GGUF file: {error}") from None


def _metadata(gguf_file: GGUFFile) -> dict:
    """Scalar and string fields by key; of arrays only tokenizer.ggml.tokens (whose
    length is the vocabulary size) is kept."""
    out = {}
    for key, value in gguf_file.metadata.items():
        if isinstance(value, (list, np.ndarray)):
            if key == "tokenizer.ggml.tokens":
                out[key] = range(len(value))  # only the length is needed
            continue
        out[key] = value
    return out


def _config(gguf_file: GGUFFile, path: str) -> ModelConfig:
    """Rope factors some files keep as tensors: Llama 3.1's per-frequency divisors and
    Phi-3's LongRoPE factors."""
    tensors = gguf_file.tensors
    factors = {
        name: tuple(float(x) for x in dequantize(tensors[name + ".weight"], path).reshape(-1))
        for name in ("rope_freqs", "rope_factors_short", "rope_factors_long")
        if name + ".weight" in tensors
    }
    config = ModelConfig.from_gguf_metadata(_metadata(gguf_file), set(tensors), path, factors)
    # llama.cpp's Llama q/k rows pair each head's rotary halves as rows 2i, 2i + 1;
    # rotating those pairs keeps the rows where they lie (one mapped run with v).
    return replace(config, rope_interleaved=config.architecture == "llama")


def read_gguf_config(path: str) -> ModelConfig:
    return _config(_open(path), path)


def dequantize(tensor: GGUFTensor, path: str, expert: int | None = None) -> np.ndarray:
    """One GGUF tensor as float32 [rows, cols] (numpy order: GGUF lists dims reversed);
    of a 3-D tensor of experts, expert `expert`'s [rows, cols] alone if given.
    Also takes a gguf.GGUFReader tensor (tests read files through both)."""
    import gguf.quants

    if isinstance(tensor, GGUFTensor):
        qtype = gguf.GGMLQuantizationType(tensor.type_id)
        data, shape = tensor.raw, tensor.shape
    else:
        qtype = tensor.tensor_type
        data, shape = tensor.data, tuple(int(d) for d in reversed(tensor.shape))
    if expert is not None:
        data, shape = data[expert], shape[1:]
    if qtype.name not in SUPPORTED_TYPES:
        raise ValueError(
            f"{path}: tensor {tensor.name!r} has quantization type {qtype.name}, which is not "
            f"supported; supported: {', '.join(SUPPORTED_TYPES)}"
        )
    values = gguf.quants.dequantize(data, qtype)
    return np.asarray(values, dtype=np.float32).reshape(shape)


def hf_names(config: ModelConfig, slots: dict, tensors: dict[str, GGUFTensor]) -> dict[str, str]:
    """llama.cpp tensor name -> HF name for this model, from gguf's own tables
    (gguf.get_tensor_name_map): of the HF names gguf lists for a tensor of the
    architecture, the slot of the model with the tensor's shape (Phi-3's ffn_up is
    gate_up_proj, Llama's is up_proj). Names the architecture's table lacks come from
    llama's: a qwen3moe file's dense layers (mlp_only_layers) hold llama's ffn_gate."""
    import gguf

    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == config.architecture)
    names = {}
    for fallback, table_arch in enumerate((arch, gguf.MODEL_ARCH.LLAMA)):
        table = gguf.get_tensor_name_map(table_arch, config.num_hidden_layers)
        found = {}
        for hf_base, (_, gguf_base) in table.mapping.items():
            for kind in ("weight", "bias"):
                hf, name = f"{hf_base}.{kind}", f"{gguf_base}.{kind}"
                if kind == "weight" and hf_base in slots:
                    hf = hf_base  # a bare parameter (gpt-oss's self_attn.sinks)
                if hf not in slots or (fallback and name in names):
                    continue
                tensor = tensors.get(name)
                if name not in found or (tensor and slots[hf].full_shape == tensor.shape):
                    found[name] = hf
        names.update(found)
    return names


def load_gguf(
    path: str,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    max_model_len: int | None = None,
    keep_quantized: bool = True,
    tp=None,
) -> LlamaForCausalLM:
    """The model of a GGUF file. keep_quantized: projection and embedding weights of the
    types ops.QUANT_TYPES lists stay in their blocks (read from the file straight into
    their one copy, never widened); other types, and everything with keep_quantized
    False, are dequantized to the model's dtype as before. tp: load this rank's shard
    (pyllm.model.shard says which part)."""
    gguf_file = _open(path)
    config = _config(gguf_file, path)
    model_cls = model_class(config.architecture)
    model = model_cls(config, resolve_dtype(dtype, device), device, max_model_len, tp)
    filler = WeightFiller(model, path)
    names = hf_names(config, filler.slots, gguf_file.tensors)
    quantized = _load_quantized(model, gguf_file, filler, names) if keep_quantized else set()
    if keep_quantized:
        _log_widened(path, gguf_file, quantized, model.dtype)
    for tensor in gguf_file.tensors.values():
        if tensor.name in _NOT_WEIGHTS or tensor.name in quantized:
            continue
        name = names.get(tensor.name)
        if name is None:
            raise ValueError(f"{path}: unexpected tensor {tensor.name!r} (not part of this model)")
        if len(tensor.shape) == 3 and name in filler.fused:
            _fill_experts(filler, tensor, name, path)
            continue
        values = dequantize(tensor, path)
        with warnings.catch_warnings():
            # F32 tensors come back as read-only views of the memory-mapped file; they
            # are only read (copied into the parameter), never written.
            warnings.simplefilter("ignore", UserWarning)
            tensor_values = torch.from_numpy(values)
        filler.fill(name, tensor_values, where=f"{path} ({tensor.name})")
        del tensor_values
        del values
    filler.finish()
    return model


def _log_widened(path: str, gguf_file, quantized: set[str], dtype: torch.dtype) -> None:
    """Says which quantized types of the file were widened despite keep_quantized."""
    widened = sorted(
        {
            t.type_name
            for t in gguf_file.tensors.values()
            if t.name not in quantized and t.type_name not in ("F32", "F16", "BF16")
        }
    )
    if widened:
        logger.info(
            "pyllm: %s: tensors of type %s are widened to %s at load (quant_linear reads "
            "%s only, and only weights whose in_features is a whole number of blocks)",
            path, ", ".join(widened), dtype, ", ".join(ops.QUANT_TYPES),
        )  # fmt: skip


def _fill_experts(filler: WeightFiller, tensor: GGUFTensor, name: str, path: str) -> None:
    """A 3-D tensor of experts widened one expert at a time (of those this rank holds)."""
    expected = filler.slots[name].full_shape
    if tensor.shape != expected:
        raise ValueError(
            f"{path}: tensor {tensor.name!r} has shape {tensor.shape}, the model expects "
            f"{expected} ({name})"
        )
    for e in filler.held:
        values = torch.from_numpy(dequantize(tensor, path, expert=e))
        filler.fill(per_expert_name(name, e), values, where=f"{path} ({tensor.name})")
    filler.mark(name)


# Which GGUF tensors make up each projection, in output order: (module path, parts).
# Phi-3's files keep q/k/v in one tensor (attn_qkv) and gate/up in one (ffn_up).
def _projections(config: ModelConfig, tensors: dict[str, GGUFTensor]) -> list[tuple[str, list]]:
    out = []
    for i in range(config.num_hidden_layers):
        blk = f"blk.{i}."
        layer = f"model.layers.{i}."
        qkv = ["attn_qkv"] if blk + "attn_qkv.weight" in tensors else ["attn_q", "attn_k", "attn_v"]
        out += [
            (layer + "self_attn.qkv_proj", [blk + part for part in qkv]),
            (layer + "self_attn.o_proj", [blk + "attn_output"]),
        ]
        if config.is_moe_layer(i):
            continue  # _expert_projections
        gate_up = ["ffn_gate", "ffn_up"] if blk + "ffn_gate.weight" in tensors else ["ffn_up"]
        out += [
            (layer + "mlp.gate_up_proj", [blk + part for part in gate_up]),
            (layer + "mlp.down_proj", [blk + "ffn_down"]),
        ]
    if not config.tie_word_embeddings:
        out.append(("lm_head", ["output"]))
    return out


def _expert_projections(config: ModelConfig) -> list[tuple[str, str]]:
    """(module path, GGUF tensor name) of every sparse layer's expert projections."""
    return [
        (f"model.layers.{i}.mlp.experts.{proj}_proj", f"blk.{i}.ffn_{proj}_exps.weight")
        for i in range(config.num_hidden_layers)
        if config.is_moe_layer(i)
        for proj in ("gate", "up", "down")
    ]


def _quantizable(tensor: GGUFTensor | None, in_features: int) -> bool:
    if tensor is None or tensor.type_name not in ops.QUANT_TYPES:
        return False
    return in_features % ops.QUANT_TYPES[tensor.type_name][1] == 0


def _load_quantized(
    model: LlamaForCausalLM, gguf_file: GGUFFile, filler: WeightFiller, hf_of: dict[str, str]
) -> set:
    """Gives every projection (and the token table) whose GGUF tensors are all of a
    quantized type pyllm multiplies its blocks as they are; returns the names of the
    tensors used. Parts of one fused projection that share a type share one tensor.
    Packed weights come from, or go to, the file's strip cache (pyllm.model.strip_cache)."""
    cache = _open_strip_cache(model, gguf_file)
    try:
        with open(gguf_file.path, "rb") as file:
            used = _read_quantized(model, gguf_file, filler, hf_of, file, cache)
    except BaseException:
        if cache is not None:
            cache.abandon()
        raise
    if cache is not None:
        cache.finish()
    return used


def _open_strip_cache(model: LlamaForCausalLM, gguf_file: GGUFFile) -> StripCache | None:
    """The strip cache of this file and rank where this load packs weights: a complete one
    to map, or a new one to pack into; None where there is neither."""
    capacity = sum(
        -(-t.nbytes // ALIGN) * ALIGN
        for t in gguf_file.tensors.values()
        if _packs_strips(model, t.type_id)
    )
    if not capacity or not strip_cache_enabled():
        return None
    cache = StripCache(gguf_file.path, model.shard.rank, model.shard.size)
    return cache if cache.open() or cache.start(capacity) else None


def _read_quantized(
    model: LlamaForCausalLM,
    gguf_file: GGUFFile,
    filler: WeightFiller,
    hf_of: dict[str, str],
    file,
    cache: StripCache | None,
) -> set:
    config = model.config
    tensors = gguf_file.tensors
    used: set[str] = set()
    for module_path, names in _projections(config, tensors):
        module = model.get_submodule(module_path)
        parts = [tensors.get(name + ".weight") for name in names]
        if not all(_quantizable(t, module.in_features) for t in parts):
            continue
        if any(name + ".bias" in tensors for name in names) and module.bias is None:
            continue  # the filler reports the unexpected bias
        module.set_quantized(
            _read_parts(file, model, parts, module.in_features, strips=True, cache=cache)
        )
        for t in parts:
            used.add(t.name)
            filler.mark(hf_of[t.name])
    for module_path, name in _expert_projections(config):
        module, tensor = model.get_submodule(module_path), tensors.get(name)
        if tensor is None or not _quantizable(tensor, module.in_features):
            continue  # missing: the filler names it; widened otherwise
        full = filler.slots[hf_of[name]].full_shape
        module.set_quantized(*_read_experts(file, model, tensor, module, full, cache))
        used.add(name)
        filler.mark(hf_of[name])
    embedding = tensors.get("token_embd.weight")
    if _quantizable(embedding, config.hidden_size):
        # A tied head multiplies the table every step: strips where projections are.
        tied = config.tie_word_embeddings
        (part,) = _read_parts(
            file, model, [embedding], config.hidden_size, strips=tied, cache=cache
        )
        model.set_quantized_embedding(part)
        used.add(embedding.name)
        filler.mark("model.embed_tokens.weight")
    return used


def _shard_rows(model: LlamaForCausalLM, tensor: GGUFTensor) -> tuple[list[range], int]:
    """(row ranges of the file's tensor this rank reads, rows it allocates for them):
    every row unsplit; a tensor-parallel rank its heads, MLP rows or vocabulary rows
    (weights.weight_slots has the same rule for named float tensors)."""
    config, shard = model.config, model.shard
    rows = tensor.shape[0]
    kind = tensor.name.split(".")[-2]
    if shard.size == 1 or kind in ("attn_output", "ffn_down"):
        return [range(rows)], rows
    if kind in ("token_embd", "output"):
        return [model.vocab_range], shard.padded_split(rows)[1]
    q, kv, mlp = shard_rows(model)
    inter = config.intermediate_size

    def moved(r: range, by: int) -> range:
        return range(r.start + by, r.stop + by)

    ranges = {
        "attn_q": [q],
        "attn_k": [kv],
        "attn_v": [kv],
        "attn_qkv": [q, moved(kv, config.q_size), moved(kv, config.q_size + config.kv_size)],
        "ffn_gate": [mlp],
        "ffn_up": [mlp, moved(mlp, inter)] if rows == 2 * inter else [mlp],
    }[kind]
    return ranges, sum(len(r) for r in ranges)


def _read_rows(file, tensor: GGUFTensor, ranges: list[range], dest: np.ndarray, cols: range):
    """Reads the rows `ranges` of the tensor's blocks into dest, keeping the bytes
    `cols` of each row (all of them unless a row-parallel rank's share)."""
    row_bytes = tensor.nbytes // math.prod(tensor.shape[:-1])
    at = 0
    for r in ranges:
        whole = len(cols) == row_bytes
        buffer = dest[at : at + len(r)] if whole else np.empty((len(r), row_bytes), np.uint8)
        file.seek(tensor.offset + r.start * row_bytes)
        if file.readinto(memoryview(buffer).cast("B")) != len(r) * row_bytes:
            raise ValueError(f"{file.name}: tensor {tensor.name!r} is cut short")
        if not whole:
            dest[at : at + len(r)] = buffer[:, cols.start : cols.stop]
        at += len(r)


def _read_parts(
    file,
    model: LlamaForCausalLM,
    tensors: list[GGUFTensor],
    in_features: int,
    strips=False,
    cache: StripCache | None = None,
) -> list:
    """QuantParts for consecutive tensors (their rows one after another in the output),
    each run of one type read from the file into one uint8 tensor. in_features: the
    layer's (a row-parallel rank's share of the tensor's columns). strips: runs of a
    type with strips (ops.pack_strips) become strips where this build reads them
    natively: mapped from the strip cache, or a copy packed in place (in the cache's
    new file, else in private memory)."""
    from pyllm.model.linear import QuantPart

    parts, start, i = [], 0, 0
    while i < len(tensors):
        run = [tensors[i]]
        while i + len(run) < len(tensors) and tensors[i + len(run)].type_id == run[0].type_id:
            run.append(tensors[i + len(run)])
        shares = [_shard_rows(model, t) for t in run]
        rows = sum(n for _, n in shares)
        row_bytes = ops.quant_row_bytes(run[0].type_id, in_features)
        pack = strips and _packs_strips(model, run[0].type_id)
        mapped = _mapped_run(model, run, in_features)
        key, shape = ",".join(t.name for t in run), (rows, row_bytes)
        packed = _cached(cache, key, run[0].type_id, shape) if pack else None
        if packed is not None or (mapped is not None and not pack):
            type_id = run[0].type_id if packed is None else ops.STRIPS_TYPES[run[0].type_id]
            weight = mapped if packed is None else packed
            parts.append(QuantPart(weight.to(model.device), type_id, start, start + rows))
            start += rows
            i += len(run)
            continue
        qweight = _packing_memory(cache if pack else None, key, run[0].type_id, shape)
        if mapped is not None:  # copied by every thread: the new pages fault in parallel
            qweight.copy_(mapped)
            for t in run:
                t.drop_pages()
        else:
            _read_run(file, model, run, shares, in_features, qweight)
        type_id = _pack_in_place(qweight, run[0].type_id) if pack else run[0].type_id
        parts.append(QuantPart(qweight.to(model.device), type_id, start, start + rows))
        start += rows
        i += len(run)
    return parts


def _read_run(file, model, run: list[GGUFTensor], shares, in_features: int, qweight) -> None:
    """Reads each tensor's share of rows (and of each row) into qweight, one after another."""
    shard, at = model.shard, 0
    row_bytes = qweight.shape[1]
    for t, (ranges, n) in zip(run, shares, strict=True):
        split_cols = t.shape[1] != in_features
        if t.shape[1] != in_features * (shard.size if split_cols else 1):
            raise ValueError(
                f"{file.name}: tensor {t.name!r} has shape {t.shape}, expected "
                f"[rows, {in_features * (shard.size if split_cols else 1)}]"
            )
        first = shard.rank if split_cols else 0  # a row-parallel rank's share of a row
        cols = range(first * row_bytes, (first + 1) * row_bytes)
        _read_rows(file, t, ranges, qweight[at : at + n].numpy(), cols)
        at += n


def _cached(cache: StripCache | None, key: str, type_id: int, shape) -> torch.Tensor | None:
    """The packed weight `key` from the strip cache, or None."""
    return None if cache is None else cache.take(key, ops.STRIPS_TYPES[type_id], shape)


def _packing_memory(cache: StripCache | None, key: str, type_id: int, shape) -> torch.Tensor:
    """Zeroed uint8 memory to read a weight into: in the strip cache's new file when one
    is being written, else private and committed at once."""
    placed = None if cache is None else cache.place(key, ops.STRIPS_TYPES[type_id], shape)
    return placed if placed is not None else zeros_committed(shape, torch.uint8)


def _pack_in_place(qweight: torch.Tensor, type_id: int) -> int:
    """Packs a private copy of blocks into strips in place; returns the strips' type id."""
    torch.ops.pyllm.pack_strips_(qweight, type_id)
    return ops.STRIPS_TYPES[type_id]


def _packs_strips(model: LlamaForCausalLM, type_id: int) -> bool:
    """Whether rows of this type are read as strips (ops.pack_strips): every quantized
    type (Q4_0 to MXFP4), whose GGUF-row kernels were bound by their own instructions (2
    threads of a Zen 4, 2048x2048 Q4_K weights streamed: 4 / 8 rows 1.4x / 1.5x the GGUF
    rows' speed; SmolLM2 Q4_1's projections 1.4x at 1 row, 1.9x at 8; Q6_K 2048x5632 at
    8 rows 2.1x, at 1 row 0.86-1.08x; Q8_0 49152x2048 from memory at 1 / 5 / 8 rows
    1.3x / 2.0x / 1.9x; gpt-oss-20b's MXFP4 experts, decode at 1 / 8 tokens 67 / 274 ->
    54 / 242 ms a step, a 512-token prompt 1.35x; TinyLlama-1.1B Q5_K_M's Q5_K, a
    decode step at 1 / 8 tokens 28.3-28.8 / 85-88 -> 21.2-26.2 / 44-49 ms), projections
    and experts alike, on a CPU build whose kernels read strips as they lie."""
    return (
        type_id in ops.STRIPS_TYPES
        and torch.device(model.device).type == "cpu"
        and ops.strips_native()
    )


def _mapped_run(model: LlamaForCausalLM, run: list[GGUFTensor], in_features: int):
    """The blocks of `run` as one uint8 [rows, row bytes] view of the file's read-only map,
    no copy (the page cache is shared by every process that maps the file), where they lie
    as the kernel reads them: one rank, each tensor right after the one before. None
    otherwise (the caller reads a private copy). The view holds the map.
    """
    if model.shard.size != 1:
        return None
    if any(t.shape[-1] != in_features for t in run):
        return None  # the caller names the shape mismatch
    if any(b.offset != a.offset + a.nbytes for a, b in zip(run, run[1:], strict=False)):
        return None
    first = run[0]
    nbytes = sum(t.nbytes for t in run)
    data = first._map[first.offset : first.offset + nbytes]
    rows = sum(t.shape[0] for t in run)
    with warnings.catch_warnings():
        # Read-only: the kernels only read weights; a write would fault, not corrupt.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(data)).view(rows, nbytes // rows)


def _read_experts(
    file, model: LlamaForCausalLM, tensor: GGUFTensor, module, full, cache: StripCache | None
) -> tuple[torch.Tensor, int]:
    """A 3-D tensor of experts' blocks, of the model's shape `full` [E, N, K], as this
    rank's uint8 [E', N', row bytes] (expert_block_ranges says which part), and its type:
    strips where this build reads them (mapped from the strip cache, or packed)."""
    if tensor.shape != full:
        raise ValueError(
            f"{file.name}: tensor {tensor.name!r} has shape {tensor.shape}, the model expects "
            f"{full}"
        )
    _, rows, cols = full
    full_bytes = ops.quant_row_bytes(tensor.type_id, cols)
    held, mine, cut = expert_block_ranges(model, module, rows, full_bytes, tensor.type_id)
    shape, type_id = (len(held), len(mine), len(cut)), tensor.type_id
    pack = _packs_strips(model, type_id)
    packed = _cached(cache, tensor.name, type_id, shape) if pack else None
    if packed is not None:
        return packed, ops.STRIPS_TYPES[type_id]
    if pack:
        qweight = _packing_memory(cache, tensor.name, type_id, shape)
    else:
        qweight = torch.empty(shape, dtype=torch.uint8)
    ranges = [range(e * rows + mine.start, e * rows + mine.stop) for e in held]
    _read_rows(file, tensor, ranges, qweight.view(-1, shape[-1]).numpy(), cut)
    if pack:
        type_id = _pack_in_place(qweight, type_id)
    return qweight.to(model.device), type_id
