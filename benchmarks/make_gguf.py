"""Writes GGUF files of real model shapes with random weights, so that large models can
be measured without downloading them: Llama-architecture dense shapes, and the
mixture-of-experts shapes qwen3-30b-a3b (GGUF arch qwen3moe: per layer a router and 3-D
ffn_{gate,up,down}_exps tensors holding every expert) and gpt-oss-20b (arch gpt-oss,
with its biases, sinks, windows and YaRN; --type MXFP4 gives its releases' mix: MXFP4
experts, Q8_0 elsewhere).

    python benchmarks/make_gguf.py --shape llama-2-7b --type Q4_K_M
    python benchmarks/make_gguf.py --shape tinyllama-1.1b --type Q8_0 --out /some/dir
    python benchmarks/make_gguf.py --shape smollm2-135m --type Q4_0 --layers 2 --force
    python benchmarks/make_gguf.py --shape qwen3-30b-a3b --type Q4_K_M --layers 8
    python benchmarks/make_gguf.py --shape gpt-oss-20b --type MXFP4

Every file has the real layer shapes of its model (hidden size, FFN size, layer count,
heads, KV heads, RoPE theta, norm epsilon, context length; mistral-7b keeps its real
context length, 32768) but SmolLM2's vocabulary: the `tokenizer.*` metadata of the
bundled SmolLM2-135M GGUF (gpt2 BPE, 49152 tokens) is copied into every file and the
vocabulary size is 49152 for every shape. The text such a model generates is garbage;
the files are for measuring speed and memory, and load in pyllm and in llama.cpp.

Weights are written as valid random blocks of their GGML type, without a quantizer:
random quants and random (but sensible) block scales, chosen so that every dequantized
2-D weight has mean 0 and standard deviation WEIGHT_STD; norm weights are F32 near 1.
The data is generated chunk by chunk from a fixed seed and streamed to disk, so memory
stays small whatever the file size, and the same arguments always give the same bytes.

Types (--type): Q8_0, Q4_0, Q4_K_M, Q5_K_M and F16, each the mix llama.cpp's quantizer makes
for that file type (see tensor_type), and MXFP4 (every projection MXFP4, the head
Q8_0: gpt-oss's format on a dense model's projections); --pure gives every 2-D weight
the one type.
Files go to --out (default ~/.cache/pyllm-bench) as <shape>.<type>.gguf; an existing
file of the right size is kept unless --force.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import gguf.quants
import numpy as np

Q = gguf.GGMLQuantizationType

VOCAB_SIZE = 49152
WEIGHT_STD = 0.02  # of every dequantized 2-D weight
NORM_STD = 0.02  # norm weights are 1 + this much noise
DEFAULT_OUT = Path("~/.cache/pyllm-bench")
CHUNK_BYTES = 32 << 20  # random data generated and written at a time
MIN_MEM_AVAILABLE = 1 << 30  # peak use is a few chunks plus the tokenizer metadata
DISK_MARGIN = 256 << 20


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    norm_eps: float
    context: int
    tied: bool  # the output head reuses token_embd
    arch: str = "llama"  # general.architecture
    # Mixture of experts: every layer's FFN is `experts` experts of expert_ff rows, of
    # which each token uses experts_used (a router ffn_gate_inp picks them).
    experts: int = 0
    experts_used: int = 0
    expert_ff: int = 0
    qk_norm: bool = False  # per-head q/k RMSNorm weights (Qwen3)
    # gpt-oss: q/k/v/o, router and expert biases, a sink per head, windowed layers in turn
    # (sliding_window) and YaRN over original_context.
    sliding_window: int = 0
    original_context: int = 0


# fmt: off
SHAPES = {
    "smollm2-135m": Shape(576, 1536, 30, 9, 3, 64, 100000.0, 1e-5, 8192, tied=True),
    "tinyllama-1.1b": Shape(2048, 5632, 22, 32, 4, 64, 10000.0, 1e-5, 2048, tied=False),
    "llama-2-7b": Shape(4096, 11008, 32, 32, 32, 128, 10000.0, 1e-5, 4096, tied=False),
    "mistral-7b": Shape(4096, 14336, 32, 32, 8, 128, 1000000.0, 1e-5, 32768, tied=False),
    # Qwen3-30B-A3B: 128 experts of 768 rows, 8 per token (about 3.3B weights active).
    "qwen3-30b-a3b": Shape(
        2048, 6144, 48, 32, 4, 128, 1000000.0, 1e-6, 40960, tied=False,
        arch="qwen3moe", experts=128, experts_used=8, expert_ff=768, qk_norm=True,
    ),
    # gpt-oss-20b: 32 experts of 2880 rows, 4 per token (about 3.6B weights active).
    "gpt-oss-20b": Shape(
        2880, 2880, 24, 64, 8, 64, 150000.0, 1e-5, 131072, tied=False, arch="gpt-oss",
        experts=32, experts_used=4, expert_ff=2880, sliding_window=128,
        original_context=4096,
    ),
}
# fmt: on

# --type -> (the type of most 2-D weights, general.file_type)
FILE_TYPES = {
    "Q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (Q.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "Q4_K_M": (Q.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),
    "Q5_K_M": (Q.Q5_K, gguf.LlamaFileType.MOSTLY_Q5_K_M),
    "F16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "MXFP4": (Q.MXFP4, gguf.LlamaFileType.MOSTLY_MXFP4_MOE),
}


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, cols) for 2-D weights
    qtype: Q

    @property
    def nbytes(self) -> int:
        block_size, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block_size * type_size


# ---------------------------------------------------------------------------
# Which type each tensor gets.


def _more_bits(layer: int, layers: int) -> bool:
    """The layers that get more bits in a _M mix: the first and last eighth, and every
    third one in between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _fallback(qtype: Q, cols: int) -> Q:
    """A type whose blocks tile a row of cols weights: a 256-weight K-quant falls back
    to a 32-weight type of about as many bits (as llama.cpp's quantizer does)."""
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    if cols % block_size == 0:
        return qtype
    fallback = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}.get(qtype, Q.F16)
    if cols % gguf.GGML_QUANT_SIZES[fallback][0] != 0:
        fallback = Q.F16
    return fallback


def tensor_type(
    name: str, cols: int, layer: int | None, shape: Shape, file_type: str, pure: bool = False
) -> Q:
    """The type of one 2-D weight, following the mixes of llama.cpp's quantizer:
    - the output head (token_embd when the embeddings are tied) is Q6_K in every
      quantized mix except Q8_0, which keeps Q8_0, and MXFP4, whose head is Q8_0;
    - in Q4_K_M (Q5_K_M), attn_v and ffn_down are Q6_K in the layers _more_bits picks,
      and every other weight (token_embd of an untied model included) is Q4_K (Q5_K);
    - in Q8_0, Q4_0 and MXFP4 every other weight has the file's type (but a gpt-oss
      MXFP4 file's weights other than the experts' are Q8_0, as its releases are);
      F16 is all F16;
    - a row that the chosen type's blocks cannot tile gets _fallback's type (SmolLM2's
      576-wide rows make its Q4_K weights Q5_0 and its Q6_K ones Q8_0).
    pure gives every weight the file's base type, still with the fallback."""
    base = FILE_TYPES[file_type][0]
    if base == Q.F16 or pure:
        return _fallback(base, cols)
    if base == Q.MXFP4 and shape.arch == "gpt-oss" and "_exps." not in name:
        return Q.Q8_0  # gpt-oss's own files: MXFP4 experts, Q8_0 for the rest
    qtype = base
    is_head = name == "output.weight" or (shape.tied and name == "token_embd.weight")
    more_bits_names = ("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")
    if is_head:
        if base == Q.MXFP4:
            qtype = Q.Q8_0
        elif base != Q.Q8_0:
            qtype = Q.Q6_K
    elif file_type in ("Q4_K_M", "Q5_K_M") and layer is not None:
        if name.endswith(more_bits_names) and _more_bits(layer, shape.layers):
            qtype = Q.Q6_K
    return _fallback(qtype, cols)


def plan_tensors(shape: Shape, file_type: str, pure: bool = False) -> list[TensorPlan]:
    """Every tensor of the file in writing order, with its shape and type."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type must be one of {', '.join(FILE_TYPES)}, got {file_type!r}")
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    plans = []

    def weight(name: str, rows: int, cols: int, layer: int | None = None, experts: int = 0):
        qtype = tensor_type(name, cols, layer, shape, file_type, pure)
        plans.append(TensorPlan(name, (experts, rows, cols) if experts else (rows, cols), qtype))

    def norm(name: str, size: int = shape.hidden) -> None:
        plans.append(TensorPlan(name, (size,), Q.F32))

    def small(name: str, *size: int) -> None:  # biases and sinks: F32 near zero
        plans.append(TensorPlan(name, size, Q.F32))

    oss = shape.arch == "gpt-oss"

    weight("token_embd.weight", VOCAB_SIZE, shape.hidden)
    for i in range(shape.layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        weight(p + "attn_q.weight", q_rows, shape.hidden, i)
        weight(p + "attn_k.weight", kv_rows, shape.hidden, i)
        weight(p + "attn_v.weight", kv_rows, shape.hidden, i)
        weight(p + "attn_output.weight", shape.hidden, q_rows, i)
        if oss:
            for part, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows),
                               ("attn_output", shape.hidden)):  # fmt: skip
                small(p + part + ".bias", rows)
            small(p + "attn_sinks.weight", shape.heads)
        if shape.qk_norm:
            norm(p + "attn_q_norm.weight", shape.head_dim)
            norm(p + "attn_k_norm.weight", shape.head_dim)
        norm(p + ("post_attention_norm.weight" if oss else "ffn_norm.weight"))
        if shape.experts:
            # llama.cpp keeps the router in F32 whatever the file type.
            plans.append(
                TensorPlan(p + "ffn_gate_inp.weight", (shape.experts, shape.hidden), Q.F32)
            )
            ff, e = shape.expert_ff, shape.experts
            weight(p + "ffn_gate_exps.weight", ff, shape.hidden, i, e)
            weight(p + "ffn_up_exps.weight", ff, shape.hidden, i, e)
            weight(p + "ffn_down_exps.weight", shape.hidden, ff, i, e)
            if oss:
                small(p + "ffn_gate_inp.bias", e)
                for part, rows in (("gate", ff), ("up", ff), ("down", shape.hidden)):
                    small(p + f"ffn_{part}_exps.bias", e, rows)
            continue
        weight(p + "ffn_gate.weight", shape.intermediate, shape.hidden, i)
        weight(p + "ffn_up.weight", shape.intermediate, shape.hidden, i)
        weight(p + "ffn_down.weight", shape.hidden, shape.intermediate, i)
    norm("output_norm.weight")
    if not shape.tied:
        weight("output.weight", VOCAB_SIZE, shape.hidden)
    return plans


# ---------------------------------------------------------------------------
# Random blocks.
#
# Each block is random bytes (uniform quants) with its scale fields overwritten by one
# of TABLE_SIZE random headers. Each type's headers are drawn so that the block
# weights have mean 0 (a random sign on the scale, or mins that cancel the quants'
# mean) and WEIGHT_STD standard deviation over the table.

TABLE_SIZE = 4096


@dataclass(frozen=True)
class _Headers:
    offset: int  # where a block's scale fields start
    table: np.ndarray  # [TABLE_SIZE, header bytes] uint8


def _spread(rng: np.random.Generator) -> np.ndarray:
    """Per-block magnitudes, so that blocks differ in scale as real ones do."""
    return rng.uniform(0.5, 1.5, TABLE_SIZE)


def _signed(rng: np.random.Generator, values: np.ndarray) -> np.ndarray:
    return values * rng.choice(np.array([-1.0, 1.0]), values.shape)


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_q4_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block -> the 12 packed bytes: bytes 0-3 hold
    scales 0-3 and bytes 4-7 mins 0-3 in their low 6 bits; scales and mins 4-7 keep
    their low 4 bits in bytes 8-11 and their high 2 bits in the top of bytes 0-7."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _q_rms(levels: int, center: float) -> float:
    """RMS of (q - center) for q uniform on 0..levels-1."""
    q = np.arange(levels, dtype=np.float64)
    return float(np.sqrt(np.mean((q - center) ** 2)))


def _headers(qtype: Q, seed: int) -> _Headers:
    rng = np.random.default_rng([seed, int(qtype), 1])
    u = _spread(rng)
    if qtype == Q.Q8_0:
        # q uniform on -127..127 (-128 is clamped to -127, see _random_blocks)
        q = np.arange(-127, 128, dtype=np.float64)
        q_rms = float(np.sqrt((np.sum(q**2) + 127.0**2) / 256))
        d = _signed(rng, u) * WEIGHT_STD / (q_rms * np.sqrt(np.mean(u**2)))
        return _Headers(0, _fp16_bytes(d))
    if qtype in (Q.Q4_0, Q.Q5_0):
        levels = 16 if qtype == Q.Q4_0 else 32
        q_rms = _q_rms(levels, levels // 2)
        d = _signed(rng, u) * WEIGHT_STD / (q_rms * np.sqrt(np.mean(u**2)))
        return _Headers(0, _fp16_bytes(d))
    if qtype == Q.Q5_1:
        # w = d*q + m with m = -15.5*d: mean 0 (d and m fp16, then 4 bytes of fifth bits)
        d = _signed(rng, u) * WEIGHT_STD / (_q_rms(32, 15.5) * np.sqrt(np.mean(u**2)))
        d16 = d.astype(np.float16)
        m16 = (-15.5 * d16.astype(np.float32)).astype(np.float16)
        return _Headers(0, np.concatenate([_fp16_bytes(d16), _fp16_bytes(m16)], axis=1))
    if qtype in (Q.Q4_K, Q.Q5_K):
        # w = d*sc*q - dmin*m with dmin = c*d and m = sc: d*sc*(q - c), mean 0 (c: the
        # middle of the quants, 7.5 or 15.5); Q5_K's fifth bits follow the header
        center = 7.5 if qtype == Q.Q4_K else 15.5
        sc = rng.integers(32, 64, (TABLE_SIZE, 8)).astype(np.uint8)
        eff = u[:, None] * sc
        d = u * WEIGHT_STD / (_q_rms(int(2 * center + 1), center) * np.sqrt(np.mean(eff**2)))
        d16 = d.astype(np.float16)
        dmin16 = (center * d16.astype(np.float32)).astype(np.float16)
        table = np.concatenate(
            [_fp16_bytes(d16), _fp16_bytes(dmin16), _pack_q4_k_scales(sc, sc)], axis=1
        )
        return _Headers(0, table)
    if qtype == Q.Q6_K:
        # 16 signed 8-bit scales, then fp16 d, after the 192 bytes of quants
        sc = _signed(rng, rng.integers(64, 128, (TABLE_SIZE, 16)).astype(np.float64))
        eff = u[:, None] * sc
        d = u * WEIGHT_STD / (_q_rms(64, 32) * np.sqrt(np.mean(eff**2)))
        table = np.concatenate([sc.astype(np.int8).view(np.uint8), _fp16_bytes(d)], axis=1)
        return _Headers(192, table)
    if qtype == Q.MXFP4:
        # w = value * 2^(e - 128), values uniform over the 16 codes (mean 0). The block
        # scale is a power of two: each block's target s takes the power just below or
        # above it, the one above with the probability that keeps E[scale^2] = s^2.
        values = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float64)
        s = u * WEIGHT_STD / (np.sqrt(np.mean(values**2)) * np.sqrt(np.mean(u**2)))
        low = np.floor(np.log2(s))
        up = rng.random(TABLE_SIZE) < (4.0 ** (np.log2(s) - low) - 1) / 3
        e = (low + up + 128).astype(np.uint8)
        return _Headers(0, e.reshape(-1, 1))
    raise ValueError(f"no random block generator for type {qtype.name}")


class RandomBlocks:
    """Random blocks of one type, any number at a time."""

    def __init__(self, qtype: Q, seed: int):
        self.qtype = qtype
        self.block_size, self.type_size = gguf.GGML_QUANT_SIZES[qtype]
        self.headers = None if qtype in (Q.F32, Q.F16) else _headers(qtype, seed)

    def __call__(self, rng: np.random.Generator, n_blocks: int) -> np.ndarray:
        """[n_blocks, type_size] uint8."""
        if self.headers is None:
            return self._floats(rng, n_blocks)
        n = n_blocks * self.type_size
        raw = rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]
        blocks = raw.reshape(n_blocks, self.type_size)
        h = self.headers
        pick = rng.integers(0, TABLE_SIZE, n_blocks)
        blocks[:, h.offset : h.offset + h.table.shape[1]] = h.table[pick]
        if self.qtype == Q.Q8_0:
            # symmetric int8 quants, as quantizers make them (-128 has no negation)
            quants = blocks[:, 2:].view(np.int8)
            np.maximum(quants, -127, out=quants)
        return blocks

    def _floats(self, rng: np.random.Generator, n_blocks: int) -> np.ndarray:
        if self.qtype == Q.F32:  # norm weights (and routers, whose values are checked less)
            values = 1.0 + NORM_STD * rng.standard_normal(n_blocks, dtype=np.float32)
            return values.reshape(-1, 1).view(np.uint8)
        values = (WEIGHT_STD * rng.standard_normal(n_blocks, dtype=np.float32)).astype(np.float16)
        return values.reshape(-1, 1).view(np.uint8)


def tensor_chunks(plan: TensorPlan, index: int, seed: int, generators: dict, chunk_bytes: int):
    """The tensor's data as a sequence of uint8 arrays of whole rows."""
    gen = generators.get(plan.qtype)
    if gen is None:
        gen = generators[plan.qtype] = RandomBlocks(plan.qtype, seed)
    rng = np.random.default_rng([seed, index, 0])
    if plan.name.endswith((".bias", "attn_sinks.weight")):  # small F32 values, in one go
        values = WEIGHT_STD * rng.standard_normal(math.prod(plan.shape), dtype=np.float32)
        yield values.view(np.uint8)
        return
    rows = math.prod(plan.shape[:-1]) if len(plan.shape) >= 2 else 1
    row_bytes = plan.nbytes // rows
    blocks_per_row = row_bytes // gen.type_size
    rows_per_chunk = max(1, chunk_bytes // row_bytes)
    for start in range(0, rows, rows_per_chunk):
        n = min(rows_per_chunk, rows - start)
        yield gen(rng, n * blocks_per_row).reshape(-1)


# ---------------------------------------------------------------------------
# Metadata.


def tokenizer_metadata(path: str | os.PathLike | None = None) -> list[tuple]:
    """The tokenizer.* key/values of a GGUF file (default: the bundled SmolLM2) as
    (key, value, value type, array item type) tuples for GGUFWriter.add_key_value."""
    if path is None:
        from pyllm.model.default_model import default_model_path

        path = default_model_path()
    try:
        from pyllm.model.gguf_file import GGUFFile
    except ImportError:
        items = _tokenizer_metadata_slow(path)
    else:
        metadata = GGUFFile(path).metadata
        items = [(k, *_typed(k, v)) for k, v in metadata.items() if k.startswith("tokenizer.")]
    tokens = [v for k, v, *_ in items if k == "tokenizer.ggml.tokens"]
    if not tokens or len(tokens[0]) != VOCAB_SIZE:
        raise ValueError(f"{path}: expected a tokenizer of {VOCAB_SIZE} tokens")
    return items


def _typed(key: str, value) -> tuple:
    """(value, type, item type) of a parsed metadata value; integers are written as
    uint32 (what token ids are) unless negative."""
    V = gguf.GGUFValueType

    def scalar_type(v) -> gguf.GGUFValueType:
        if isinstance(v, bool | np.bool_):
            return V.BOOL
        if isinstance(v, str):
            return V.STRING
        if isinstance(v, int | np.integer):
            return V.UINT32 if v >= 0 else V.INT32
        if isinstance(v, float | np.floating):
            return V.FLOAT32
        raise ValueError(f"metadata {key!r}: cannot copy a value of type {type(v).__name__}")

    if isinstance(value, np.ndarray):
        item_types = {
            np.dtype(np.int32): V.INT32,
            np.dtype(np.uint32): V.UINT32,
            np.dtype(np.float32): V.FLOAT32,
            np.dtype(np.int64): V.INT64,
            np.dtype(np.uint8): V.UINT8,
            np.dtype(np.bool_): V.BOOL,
        }
        if value.dtype not in item_types:
            raise ValueError(f"metadata {key!r}: cannot copy an array of {value.dtype}")
        return value.tolist(), V.ARRAY, item_types[value.dtype]
    if isinstance(value, list):
        if not value:
            raise ValueError(f"metadata {key!r}: cannot copy an empty array")
        return value, V.ARRAY, scalar_type(value[0])
    return value, scalar_type(value), None


def _tokenizer_metadata_slow(path) -> list[tuple]:
    reader = gguf.GGUFReader(str(path))
    items = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            items.append((key, field.contents(), vtype, sub_type))
    return items


def _add_metadata(writer: gguf.GGUFWriter, name: str, shape: Shape, file_type: str, tokenizer):
    writer.add_name(f"random {name}")
    writer.add_file_type(int(FILE_TYPES[file_type][1]))
    if file_type != "F16":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.norm_eps)
    writer.add_vocab_size(VOCAB_SIZE)
    if shape.head_dim * shape.heads != shape.hidden:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ff)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.original_context:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(shape.context / shape.original_context)
        writer.add_rope_scaling_orig_ctx_len(shape.original_context)
    for key, value, vtype, sub_type in tokenizer:
        writer.add_key_value(key, value, vtype, sub_type)


# ---------------------------------------------------------------------------
# Writing.


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def _pad(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass
class Result:
    path: Path
    size: int
    seconds: float
    written: bool  # False: an existing file of the right size was kept


def file_name(shape_name: str, file_type: str, layers: int | None = None, pure: bool = False):
    return (
        f"{shape_name}{f'-{layers}l' if layers is not None else ''}"
        f".{file_type}{'-pure' if pure else ''}.gguf"
    )


def write_gguf(
    shape_name: str,
    file_type: str,
    out_dir: str | os.PathLike,
    *,
    layers: int | None = None,
    pure: bool = False,
    seed: int = 0,
    force: bool = False,
    tokenizer: list[tuple] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    verify: bool = True,
) -> Result:
    """Writes one file (see the module docstring) and returns where, how big, how long."""
    start = time.perf_counter()
    if shape_name not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {shape_name!r}")
    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type must be one of {', '.join(FILE_TYPES)}, got {file_type!r}")
    shape = SHAPES[shape_name]
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be at least 1, got {layers}")
        shape = Shape(**{**shape.__dict__, "layers": layers})
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if mem_available() < MIN_MEM_AVAILABLE:
        raise MemoryError(
            f"only {mem_available() / 2**30:.2f} GiB of memory available; writing a file "
            f"needs {MIN_MEM_AVAILABLE / 2**30:.1f} GiB"
        )
    out_dir = Path(out_dir).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / file_name(shape_name, file_type, layers, pure)
    partial = path.with_name(path.name + ".partial")
    plans = plan_tensors(shape, file_type, pure)
    if tokenizer is None:
        tokenizer = tokenizer_metadata()

    # The header first (to the partial file): its size gives the file's.
    writer = gguf.GGUFWriter(str(partial), shape.arch)
    _add_metadata(writer, shape_name, shape, file_type, tokenizer)
    for p in plans:
        writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    align = writer.data_alignment
    data_start = _pad(partial.stat().st_size, align)
    size = data_start + sum(_pad(p.nbytes, align) for p in plans)

    if path.exists() and path.stat().st_size == size and not force:
        partial.unlink()
        return Result(path, size, time.perf_counter() - start, written=False)
    path.unlink(missing_ok=True)
    free = os.statvfs(out_dir).f_bavail * os.statvfs(out_dir).f_frsize
    if free < size + DISK_MARGIN:
        partial.unlink()
        raise OSError(
            f"{out_dir}: {free / 2**30:.2f} GiB free, {path.name} needs "
            f"{(size + DISK_MARGIN) / 2**30:.2f} GiB"
        )

    generators: dict = {}
    try:
        with open(partial, "ab") as f:
            f.write(bytes(data_start - f.tell()))
            for index, plan in enumerate(plans):
                written = 0
                for chunk in tensor_chunks(plan, index, seed, generators, chunk_bytes):
                    chunk.tofile(f)
                    written += chunk.nbytes
                assert written == plan.nbytes, (plan.name, written, plan.nbytes)
                f.write(bytes(_pad(written, align) - written))
        if partial.stat().st_size != size:
            raise RuntimeError(f"{partial}: wrote {partial.stat().st_size} bytes, expected {size}")
        if verify:
            verify_file(partial, plans)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return Result(path, size, time.perf_counter() - start, written=True)


# ---------------------------------------------------------------------------
# Checking.


def sample_rows(tensor, rows: int = 4) -> np.ndarray:
    """Dequantized rows from the start, middle and end of a reader tensor: [k, cols]."""
    data = tensor.data
    if data.ndim == 1:  # a 1-D F32/F16 tensor
        return np.asarray(data, dtype=np.float32).reshape(1, -1)
    data = data.reshape(-1, data.shape[-1])  # a 3-D expert tensor: all experts' rows
    picks = sorted({int(i) for i in np.linspace(0, data.shape[0] - 1, rows)})
    values = gguf.quants.dequantize(np.ascontiguousarray(data[picks]), tensor.tensor_type)
    return np.asarray(values, dtype=np.float32).reshape(len(picks), -1)


def check_stats(name: str, values: np.ndarray, is_norm: bool) -> None:
    """Raises unless values look like what the generator intends."""
    if not np.all(np.isfinite(values)):
        raise ValueError(f"{name}: non-finite values")
    mean, std = float(values.mean()), float(values.std())
    if is_norm:
        ok = abs(mean - 1) < 0.05 and std < 0.1
    else:
        ok = abs(mean) < 0.1 * WEIGHT_STD and abs(std / WEIGHT_STD - 1) < 0.15
    if not ok:
        raise ValueError(f"{name}: mean {mean:.4g}, std {std:.4g} is not what was intended")


def verify_file(path: str | os.PathLike, plans: list[TensorPlan]) -> None:
    """Reopens a written file with gguf's reader: every tensor has the planned name,
    type and shape, and sampled rows of each dequantize to the intended statistics."""
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    if sorted(tensors) != sorted(p.name for p in plans):
        raise ValueError(f"{path}: tensor names differ from the plan")
    for p in plans:
        t = tensors[p.name]
        if t.tensor_type != p.qtype or tuple(int(d) for d in reversed(t.shape)) != p.shape:
            raise ValueError(
                f"{path}: {p.name} is {t.tensor_type.name} {list(t.shape)}, expected "
                f"{p.qtype.name} {list(reversed(p.shape))}"
            )
        if p.name.endswith((".bias", "attn_sinks.weight")):
            continue  # small values, written in one piece: nothing to check per block
        is_norm = len(p.shape) == 1 or p.name.endswith("ffn_gate_inp.weight")
        # An expert's rows are short (768 weights: 3 K-quant blocks): sample more of them.
        check_stats(p.name, sample_rows(t, 16 if len(p.shape) == 3 else 4), is_norm=is_norm)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, choices=list(SHAPES))
    parser.add_argument("--type", dest="file_type", required=True, choices=list(FILE_TYPES))
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="folder (default %(default)s)")
    parser.add_argument("--layers", type=int, help="override the layer count (for quick tests)")
    parser.add_argument("--pure", action="store_true", help="one type for every 2-D weight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rewrite an existing file")
    parser.add_argument("--no-verify", action="store_true", help="skip reading the file back")
    args = parser.parse_args(argv)
    result = write_gguf(
        args.shape,
        args.file_type,
        args.out,
        layers=args.layers,
        pure=args.pure,
        seed=args.seed,
        force=args.force,
        verify=not args.no_verify,
    )
    action = "wrote" if result.written else "kept existing"
    print(f"{action} {result.path}: {result.size / 2**30:.3f} GiB in {result.seconds:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
