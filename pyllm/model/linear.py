"""Projections: the Linear layer, the forms its weight may be held in (plain, GGUF
blocks, word-packed, oneDNN-packed), and linear_forward, the one place that picks the
kernel for a form (Linear and the tied LM head both go through it).

The model's helpers are named linear_*; the ops they call (ops.quant_linear,
ops.packed_linear, ops.small_batch_linear) take an output tensor and raw weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import pyllm.ops as ops
from pyllm import _C  # the per-layer ops, bound directly (csrc/torch_bindings.cpp)
from pyllm.model.module import Module


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """A parameter for the loader to fill: allocating uninitialised keeps construction cheap."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


@dataclass(slots=True)
class QuantPart:
    """Output features [start, stop) of a layer whose weight stays quantized: qweight holds
    their rows as GGUF blocks of GGML type qtype (ops.quant_linear). A fused projection
    (q/k/v, gate/up) whose parts come in different types keeps one part per type."""

    qweight: torch.Tensor
    qtype: int
    start: int
    stop: int


def linear_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    qparts: list[QuantPart] | None = None,
    words: torch.Tensor | None = None,
    onednn: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    many_rows: int = 0,
) -> torch.Tensor:
    """x [..., K] W^T (+ bias) with the kernel for the form W is held in: quantized parts,
    else word-packed, else (few rows on the CPU, plain W) small-batch, else oneDNN's
    packed copy, else F.linear (see Linear). out: a contiguous [rows, N] tensor for a 2-D
    x, written where the kernel takes one (quantized, word-packed, small-batch); the
    result is returned either way, out or a new tensor. many_rows: quantized parts
    compute x's first many_rows rows as a many-row call would (ops.quant_linear)."""
    if qparts is not None:
        return linear_quantized(x, qparts, bias, out, many_rows)
    if words is not None:
        return linear_word_packed(x, words, bias, out)
    if weight is not None and takes_small_batch_path(x):
        return linear_small_batch(x, weight, bias, out)
    if onednn is not None:
        return torch.ops.mkldnn._linear_pointwise(x, onednn, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_quantized(
    x: torch.Tensor,
    parts: list[QuantPart],
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    many_rows: int = 0,
) -> torch.Tensor:
    """x [..., K] times the quantized weight of parts (in order, covering the output
    features), each writing its output columns; x's first many_rows rows (a step's
    prompt tokens) as a many-row call computes them."""
    if x.dim() != 2:
        rows = linear_quantized(x.reshape(-1, x.shape[-1]), parts, bias, many_rows=many_rows)
        return rows.view(*x.shape[:-1], rows.shape[1])
    if out is None:
        out = torch.empty(x.shape[0], parts[-1].stop, dtype=x.dtype, device=x.device)
    if len(parts) == 1:
        p = parts[0]
        _C.quant_linear(out, x, p.qweight, p.qtype, bias, many_rows)
        return out
    for p in parts:
        part_bias = None if bias is None else bias[p.start : p.stop]
        _C.quant_linear(out[:, p.start : p.stop], x, p.qweight, p.qtype, part_bias, many_rows)
    return out


def linear_word_packed(
    x: torch.Tensor,
    words: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] times a weight word-packed by ops.pack_weight_words."""
    if x.dim() != 2:
        rows = linear_word_packed(x.reshape(-1, x.shape[-1]), words, bias)
        return rows.view(*x.shape[:-1], rows.shape[1])
    if out is None:
        out = torch.empty(x.shape[0], words.shape[0] * 16, dtype=x.dtype, device=x.device)
    _C.packed_linear(out, x, words, bias)
    return out


def takes_small_batch_path(x: torch.Tensor) -> bool:
    """Rows few enough for linear_small_batch, on the CPU (cuBLAS does these on a GPU)."""
    return x.dim() == 2 and x.shape[0] <= ops.SMALL_BATCH_MAX_ROWS and x.device.type == "cpu"


def linear_small_batch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= ops.SMALL_BATCH_MAX_ROWS) times a plain weight, streamed."""
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _C.small_batch_linear(out, x, weight, bias)
    return out


def dequantize_parts(parts: list[QuantPart], in_features: int, dtype) -> torch.Tensor:
    """The float weight [N, K] of quantized parts (for tests and dense_weight)."""
    pieces = []
    for p in parts:
        w = torch.empty(p.stop - p.start, in_features, dtype=dtype, device=p.qweight.device)
        _C.dequantize_rows(w, p.qweight, p.qtype, None)
        pieces.append(w)
    return torch.cat(pieces)


class Linear(Module):
    """y = x W^T (+ b), with W allocated once and filled by the loader.

    A GGUF model's quantized weights stay quantized (set_quantized): W is then kept as
    the file's blocks and every batch size goes through ops.quant_linear.

    On the CPU pack() lays W out once for a faster kernel. Where pyllm's packed_linear
    has a vector kernel for the dtype (AVX-512: float32, and bf16 with AVX512-BF16 but
    no AMX, see can_pack_weight_words) W becomes
    word-packed (ops.pack_weight_words) and every batch size goes through it: it
    measured as fast as or faster than both oneDNN and linear_small_batch from 1 to
    512 rows on SmolLM2's projections (benchmarks/bench_linear.py). Elsewhere up to
    ops.SMALL_BATCH_MAX_ROWS rows (a decode step of a few sequences) go through
    linear_small_batch, which streams W at memory bandwidth without a GEMM library's
    per-call cost, and more rows through oneDNN with W in its blocked layout (a plain
    F.linear lets oneDNN re-lay-out the whole weight on every call, which costs more
    than the product itself at small batches, bf16 especially). pack(keep_plain=True)
    keeps W beside the packed copy, at twice the weight memory.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.word_weight: torch.Tensor | None = None  # pyllm's word-packed copy
        self.packed_weight: torch.Tensor | None = None  # oneDNN's packed copy
        self.qparts: list[QuantPart] | None = None  # GGUF blocks, by output range
        # Row-parallel (tensor parallelism): sums the ranks' partial outputs.
        self.reduce = None

    def set_quantized(self, parts: list[QuantPart]) -> None:
        """Keeps W as quantized parts covering all output features (the float W goes)."""
        covered = sorted((p.start, p.stop) for p in parts)
        if (
            not covered
            or covered[0][0] != 0
            or covered[-1][1] != self.out_features
            or any(a[1] != b[0] for a, b in zip(covered, covered[1:], strict=False))
        ):
            raise ValueError(f"quantized parts {covered} do not cover [0, {self.out_features})")
        self.qparts = sorted(parts, key=lambda p: p.start)
        self.weight = None

    def forward(
        self, x: torch.Tensor, out: torch.Tensor | None = None, many_rows: int = 0
    ) -> torch.Tensor:
        """x W^T (+ b); out: where to write it if the kernel can; many_rows: x's rows
        that are prompt tokens, first (see linear_forward)."""
        y = linear_forward(
            x, self.weight, self.bias, self.qparts, self.word_weight, self.packed_weight, out,
            many_rows,
        )  # fmt: skip
        return y if self.reduce is None else self.reduce(y)

    def pack(self, keep_plain: bool = False) -> None:
        """Adds the packed copy of the weight: word-packed where can_pack_weight_words,
        else oneDNN's. Without keep_plain the plain weight is dropped (one copy in
        memory; dense_weight() still reads it back)."""
        if can_pack_weight_words(self.weight):
            self.word_weight = ops.pack_weight_words(self.weight)
        else:
            self.packed_weight = pack_linear_weight(self.weight)
        if not keep_plain:
            self.weight = None

    def dense_weight(self) -> torch.Tensor:
        if self.weight is not None:
            return self.weight
        if self.qparts is not None:
            dtype = self.bias.dtype if self.bias is not None else torch.float32
            return dequantize_parts(self.qparts, self.in_features, dtype)
        if self.word_weight is not None:
            return unpack_weight_words(self.word_weight)
        return self.packed_weight.to_dense()


def can_pack_weight_words(weight: torch.Tensor) -> bool:
    """Whether packed_linear runs weight fast: a CPU weight of a dtype it has a vector
    kernel for in this build, with [N, K] that the word layout takes. Not bf16 on CPUs
    with AMX: oneDNN multiplies bf16 there with AMX tiles, several times vdpbf16ps's
    rate (oneDNN took 75 ms for a 512-token bf16 prefill's projections with AMX;
    packed_linear about 285 ms for them on a CPU without it)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    if weight.dtype == torch.bfloat16 and _cpu_has_amx():
        return False
    n, k = weight.shape
    return ops.packed_linear_vectorized(weight.dtype) and n % 16 == 0 and k % 2 == 0


def _cpu_has_amx() -> bool:
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def unpack_weight_words(words: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight back from ops.pack_weight_words' [N / 16, K / E, 16, E]."""
    blocks, k_words, lanes, e = words.shape
    return words.permute(0, 2, 1, 3).reshape(blocks * lanes, k_words * e)


def plain_copy_fits(nbytes: int) -> bool:
    """Whether keeping nbytes of weights twice (plain for the small-batch path beside
    oneDNN's packed copy) leaves the machine's memory comfortable: the second copy may
    take up to a quarter of it. For SmolLM2-135M in float32 that is 0.5 GB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return False
    return nbytes <= total // 4


def can_pack_linear_weights(device: torch.device | str, dtype: torch.dtype) -> bool:
    """oneDNN-packed weights: CPU tensors, in builds of torch with oneDNN, of a dtype
    oneDNN multiplies on this CPU (its bf16 and fp16 paths need AVX-512 or AVX-NE-CONVERT;
    on an AVX2-only CPU packing them raises, so those weights stay plain)."""
    if not (
        torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    # The batch-size hint picks oneDNN's block layout. Measured here on SmolLM2's shapes
    # (benchmarks of M = 1, 32, 512 rows): bfloat16 is best with 1 (hint 32 up to 30%
    # slower at M = 1); float32 with 32 (hint 1 up to 2x slower at M = 32, and slower at
    # M = 1 as well).
    hint = 32 if weight.dtype == torch.float32 else 1
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), hint)
