"""Weights into a LlamaForCausalLM: HF safetensors folders and GGUF files.

Both formats end in the same place: each checkpoint tensor, named as in HF
(``model.layers.3.self_attn.k_proj.weight``), is copied into its slot of the model's
parameters -- a row range of the fused qkv_proj / gate_up_proj for q/k/v and
gate/up -- and freed. The parameters are allocated once; no second copy of the
model exists at any time.
"""

from __future__ import annotations

import json
import logging
import math
import os

import torch

import pyllm.ops as ops
from pyllm.model.config import ModelConfig
from pyllm.model.dtype import resolve_dtype
from pyllm.model.llama import LlamaForCausalLM
from pyllm.model.mxfp4_checkpoint import MXFP4_PARTS, checkpoint_pairs, load_mxfp4_experts
from pyllm.model.registry import model_class
from pyllm.model.weights import WeightFiller

logger = logging.getLogger("pyllm")


def load_model(
    path: str | os.PathLike,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    max_model_len: int | None = None,
    pack_weights: bool = True,
    quantization: str | None = "auto",
    tp=None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Builds and fills a model from an HF folder (config.json + *.safetensors) or a
    .gguf file; returns it and its config. pack_weights: on the CPU, hand the
    projection weights to oneDNN in its packed layout (LlamaForCausalLM.pack_weights).
    quantization: "auto" keeps a GGUF file's quantized weights in their blocks, "none"
    (or None) widens them to dtype (EngineConfig.QUANTIZATION_MODES). tp: a
    TensorParallelGroup, to load only this rank's shard (pyllm.distributed)."""
    path = os.fspath(path)
    quantization = "none" if quantization is None else quantization
    if os.path.isfile(path) and path.endswith(".gguf"):
        from pyllm.model.loader_gguf import load_gguf

        model = load_gguf(
            path, dtype, device, max_model_len, keep_quantized=quantization == "auto", tp=tp
        )
    elif os.path.isdir(path):
        config = ModelConfig.from_hf_dir(path)
        model_cls = model_class(config.architecture)
        model = model_cls(config, resolve_dtype(dtype, device), device, max_model_len, tp)
        load_safetensors(model, path, keep_quantized=quantization == "auto")
        if quantization not in ("auto", "none"):
            quantize_linears(model, quantization)
    elif not os.path.exists(path):
        raise FileNotFoundError(f"model path {path} does not exist")
    else:
        raise ValueError(f"{path} is neither an HF model folder nor a .gguf file")
    if pack_weights:
        model.pack_weights()
    return model, model.config


def quantize_linears(model: LlamaForCausalLM, qtype: str) -> None:
    """Quantizes every projection's float weight to GGML type qtype ("q8_0", "q4_0",
    "q4_k", "mxfp4"), one layer at a time (experts one expert at a time), so that the model
    multiplies the blocks through ops.quant_linear / ops.fused_moe as it would a GGUF
    file's. A layer whose in_features is not a multiple of the type's block keeps its
    float weight (logged); so does a router, whose choices rounding could flip."""
    from pyllm.model.linear import Linear, QuantPart
    from pyllm.model.moe import ExpertProjection
    from pyllm.model.quantize import QUANT_TYPES_BY_NAME, quantize_weight

    type_id = QUANT_TYPES_BY_NAME[qtype]
    block = next(b for t, b, _ in ops.QUANT_TYPES.values() if t == type_id)
    kept = []
    for name, module in model.named_modules():
        if not isinstance(module, (Linear, ExpertProjection)) or module.weight is None:
            continue
        if module.in_features % block:
            kept.append(name)
            continue
        if isinstance(module, ExpertProjection):
            module.set_quantized(_quantize_experts(module.weight.detach(), qtype), type_id)
            continue
        qweight = quantize_weight(module.weight.detach(), qtype)
        module.set_quantized([QuantPart(qweight, type_id, 0, module.out_features)])
    if kept:
        logger.info(
            "pyllm: %d projection(s) keep float weights (in_features not a multiple of "
            "%s's block of %d): %s",
            len(kept),
            qtype,
            block,
            ", ".join(kept[:3]),
        )


def _quantize_experts(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """[E, N, K] floats -> uint8 [E, N, row bytes], one expert at a time."""
    from pyllm.model.quantize import quantize_weight, quantized_shape

    out = torch.empty(weight.shape[0], *quantized_shape(weight.shape[1:], qtype),
                      dtype=torch.uint8, device=weight.device)  # fmt: skip
    for e in range(weight.shape[0]):
        out[e] = quantize_weight(weight[e], qtype)
    return out


def estimate_weight_bytes(
    path: str | os.PathLike, dtype: torch.dtype, quantization: str | None = "auto"
) -> int:
    """Bytes the model's weights will take in memory, read from the file's tensor table
    without loading it: a GGUF tensor kept quantized (a projection, the experts' 3-D
    tensors, the token table) takes its bytes in the file, every other tensor numel x
    dtype's size (an HF folder quantized at load is first loaded in dtype, so that is
    its peak)."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from pyllm.model.gguf_file import open_gguf

        keep = quantization == "auto"
        total = 0
        for t in open_gguf(path).tensors.values():
            if keep and t.type_name in ops.QUANT_TYPES and len(t.shape) in (2, 3):
                total += t.nbytes
            else:
                total += math.prod(t.shape) * dtype.itemsize
        return total
    if not os.path.isdir(path):
        return 0  # load_model names the problem
    from safetensors import safe_open

    total, keep = 0, quantization == "auto"
    for file in safetensors_files(path):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                numel = math.prod(f.get_slice(key).get_shape())
                if key.endswith(MXFP4_PARTS):  # uint8: 2 weights a byte, 1 scale a block
                    widened = 2 * numel * dtype.itemsize if key.endswith(MXFP4_PARTS[0]) else 0
                    total += numel if keep else widened
                else:
                    total += numel * dtype.itemsize
    return total


def load_config(path: str | os.PathLike) -> ModelConfig:
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from pyllm.model.loader_gguf import read_gguf_config

        return read_gguf_config(path)
    return ModelConfig.from_hf_dir(path)


# ---------------------------------------------------------------------------
# HF safetensors.


def safetensors_files(folder: str) -> list[str]:
    """The checkpoint's files: the shards listed in model.safetensors.index.json, or
    model.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{index} is not a valid safetensors index ({error!r})") from None
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
    else:
        single = os.path.join(folder, "model.safetensors")
        if not os.path.isfile(single):
            raise FileNotFoundError(
                f"{folder} holds neither model.safetensors nor model.safetensors.index.json"
            )
        files = [single]
    for file in files:
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file} (listed in {index}) is missing")
    return files


def load_safetensors(model: LlamaForCausalLM, folder: str, keep_quantized: bool = True) -> None:
    """Fills the model from the folder's safetensors files. MXFP4 experts (gpt-oss's
    ``*_blocks`` / ``*_scales`` pairs) stay in their blocks where keep_quantized, else
    are widened to the model's dtype."""
    from safetensors import SafetensorError

    filler = WeightFiller(model, folder)
    where = {name: file for file in safetensors_files(folder) for name in _tensor_names(file)}
    pairs = checkpoint_pairs(where)
    try:
        load_mxfp4_experts(model, filler, lambda name: _read(where[name], name), pairs,
                           keep_quantized)  # fmt: skip
        paired = set(pairs) | set(pairs.values())
        for name, file in where.items():
            if name not in paired:
                _fill_one(filler, file, name)
    except SafetensorError as error:
        raise ValueError(f"{folder} holds an invalid safetensors file: {error}") from None
    filler.finish()


def _tensor_names(file: str) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as f:
            return list(f.keys())
    except SafetensorError as error:
        raise ValueError(f"{file} is not a valid safetensors file: {error}") from None


def _read(file: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        return f.get_tensor(name)


def _fill_one(filler: WeightFiller, file: str, name: str) -> None:
    """One tensor into its slot. safe_open maps the whole file, and every page read
    stays resident (and counted) while it is open: reopening it per tensor releases
    each tensor's pages after its copy, so loading peaks near the model's size plus one
    tensor instead of twice the model's size."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        whole = f.get_slice(name)
        index = filler.part_to_read(name, tuple(whole.get_shape()))
        # A tensor-parallel rank reads only its part of a split tensor.
        tensor = f.get_tensor(name) if index is None else whole[index]
    filler.fill(name, tensor, where=file, hf=True, part=index is not None)
