"""pyllm's kernels over GGUF-quantized weights: linear layers over weights kept in their
GGML blocks, and the mixture-of-experts ops. Part of ``pyllm.ops`` (which re-exports
every public name here); the same contract as its other wrappers."""

from __future__ import annotations

import torch

import pyllm._C  # noqa: F401  (loads the library, which registers torch.ops.pyllm)
from pyllm._checks import _check_args, _check_range, _positive_int, _tensor

_C = torch.ops.pyllm

# GGML type name -> (type id, weights per block, bytes per block): the block formats
# quant_linear and dequantize_rows read, as a GGUF file stores them (the one list is
# csrc/quantization/gguf_formats.h's).
QUANT_TYPES: dict[str, tuple[int, int, int]] = {
    name: (type_id, block, nbytes)
    for name, type_id, block, nbytes in zip(*_C.quant_types(), strict=True)
}
_QUANT_BY_ID = {
    type_id: (name, block, nbytes) for name, (type_id, block, nbytes) in QUANT_TYPES.items()
}

# GGML type id -> the id of its rows rearranged in strips of 16 (pack_strips): a CPU
# layout of the same bytes, outside GGML's ids, that quant_linear and dequantize_rows read.
STRIPS_TYPES: dict[int, int] = dict(zip(*_C.strip_types(), strict=True))
for _plain, _strips in STRIPS_TYPES.items():
    _name, _block, _bytes = _QUANT_BY_ID[_plain]
    _QUANT_BY_ID[_strips] = (f"{_name}_STRIPS", _block, _bytes)


def quant_row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one weight row of in_features values in GGML type qtype."""
    name, block, nbytes = _quant_type(qtype)
    if in_features % block:
        raise ValueError(
            f"in_features ({in_features}) must be a multiple of {name}'s block of {block}"
        )
    return in_features // block * nbytes


def set_batch_invariant(on: bool) -> None:
    """Batch-invariant mode, process-wide: quant_linear and fused_moe take the int8
    products at every row count, so a row's result never depends on the other rows of
    the call. Off (the default), many rows (from 32 in bf16, or with AMX 16, 64 over
    strips) go through dequantized panels or AMX tiles instead where those are faster,
    and their rounding differs from the int8 products', so a prompt's output may depend
    on how it was batched or chunked. Weights in strips (strips_native() builds)
    without AMX keep the int8 products at every count anyway: there the mode changes
    only the other formats."""
    if not isinstance(on, bool):
        raise ValueError(f"on must be True or False, got {on!r}")
    _C.set_batch_invariant(on)


def batch_invariant() -> bool:
    """Whether batch-invariant mode is on (set_batch_invariant)."""
    return bool(_C.batch_invariant())


def pack_strips(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """A weight of a type with strips (the keys of STRIPS_TYPES: every type of
    QUANT_TYPES), uint8 ``[N, quant_row_bytes(qtype, K)]`` on the CPU, rearranged in
    strips of 16 rows, of type ``STRIPS_TYPES[qtype]``: each strip's blocks
    interleaved so that the AVX-512 kernels read eight weights of 16 output features
    per 64-byte load (AVX2: of 8 per 32-byte half), with no sums across lanes
    (csrc/quantization/quant_strips.h).
    Same bytes and shape; rows past the last whole strip stay as they were. A 3-D
    ``[E, N, row bytes]`` weight of experts (fused_moe) packs each expert's rows apart.
    Results equal the GGUF rows' up to float rounding. Worth it where
    ``strips_native()``; other builds turn the strips back into GGUF rows on every
    quant_linear call, and fused_moe refuses them there."""
    qweight = _tensor("qweight", qweight)
    strips = qweight.clone()
    _C.pack_strips_(strips, qtype)
    return strips


def strips_native() -> bool:
    """Whether this build's kernels read strips (pack_strips) as they lie (AVX2 and
    AVX-512 builds; not the portable one)."""
    return bool(_C.strips_native())


def _quant_type(qtype: object) -> tuple[str, int, int]:
    if isinstance(qtype, bool) or not isinstance(qtype, int) or qtype not in _QUANT_BY_ID:
        supported = ", ".join(f"{n}={t}" for n, (t, _, _) in QUANT_TYPES.items())
        raise ValueError(f"qtype must be a supported GGML type id ({supported}), got {qtype!r}")
    return _QUANT_BY_ID[qtype]


def quant_linear(
    out: torch.Tensor,
    input: torch.Tensor,
    qweight: torch.Tensor,
    qtype: int,
    bias: torch.Tensor | None = None,
    many_rows: int = 0,
) -> None:
    """out = input @ W.T (+ bias) with W [N, K] kept quantized: ``qweight`` holds its N
    rows of GGUF blocks of GGML type ``qtype`` (``QUANT_TYPES``), uint8
    ``[N, quant_row_bytes(qtype, K)]``, exactly as a GGUF file stores the tensor.
    ``input [M, K]`` and ``out [M, N]`` float32/bf16/fp16, ``bias [N]``.

    On the CPU each input row is quantized to int8 in groups of 32 and multiplied with
    the weights' integers (VNNI or AVX2 integer dot products), scaled per group and
    accumulated in float32: the error against a float product is bounded by half a
    quantization step of the input per weight. Many rows take float products of
    dequantized weights instead where the CPU has a fast path for them. Input rows and
    out rows may be strided (row views); their elements must be packed.

    ``many_rows`` (in [0, M]): rows [0, many_rows) take the many-row arithmetic
    whatever their count, the others that of their own count. Each path computes a row
    the same whatever rows share the call, so a prompt's rows passed this way give the
    same results whole, in chunks, or a few at a time.
    """
    _check_args(
        _C.quant_linear, out=out, input=input, qweight=qweight, qtype=qtype, bias=bias,
        many_rows=many_rows,
    )  # fmt: skip
    _C.quant_linear(out, input, qweight, qtype, bias, many_rows)


def dequantize_rows(
    out: torch.Tensor, qweight: torch.Tensor, qtype: int, rows: torch.Tensor | None = None
) -> None:
    """out[i] = row rows[i] of the quantized weight, as floats (all rows in order when
    rows is None): ``out [R, K]`` float32/bf16/fp16, ``qweight`` as for quant_linear,
    ``rows [R]`` int64. An embedding lookup in a quantized token table."""
    _check_args(_C.dequantize_rows, out=out, qweight=qweight, qtype=qtype, rows=rows)
    if rows is not None and qweight.dim():
        _check_range("rows", rows, torch.int64, 0, qweight.shape[0])
    _C.dequantize_rows(out, qweight, qtype, rows)


# ---------------------------------------------------------------------------
# Mixture of experts.

# GGML's type ids of float tensors: an expert weight of one of these types is floats
# of the activations' dtype (fused_moe).
FLOAT_WEIGHT_TYPES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 30,
}


def moe_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts: ``router_logits [T, E]`` -> (weights ``[T, top_k]``
    float32, ids ``[T, top_k]`` int32), largest first (the lower id first on ties).
    Weights are the softmax over all E experts (in float32), renormalized over the
    chosen ones if asked: with renormalize, equal to a softmax over the top_k logits
    alone (gpt-oss's top-k-then-softmax)."""
    _tensor("router_logits", router_logits)
    _positive_int("top_k", top_k)
    rows = router_logits.shape[0] if router_logits.dim() else 0
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(rows, top_k, dtype=torch.int32, device=router_logits.device)
    _check_args(_C.moe_topk, topk_weights=weights, topk_ids=ids, router_logits=router_logits,
                renormalize=renormalize)  # fmt: skip
    _C.moe_topk(weights, ids, router_logits, renormalize)
    return weights, ids


def fused_moe(
    out: torch.Tensor,
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    gate_type: int,
    up_type: int,
    down_type: int,
    renormalize: bool = True,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    expert_start: int = 0,
    many_rows: int = 0,
) -> None:
    """A mixture-of-experts feed-forward in one op:
    ``out[t] = sum_j w[t, j] * (down_e(act(gate_e(x_t), up_e(x_t))) + down_bias[e])``
    over token t's top_k experts e (routed as moe_topk does), with
    ``gate_e(x) = x @ w_gate[e].T + gate_bias[e]`` and likewise up and down.

    ``hidden``, ``out``: ``[T, H]`` float32/bf16/fp16 (hidden's rows may be strided);
    ``router_logits [T, E_total]``. Each weight is either GGUF blocks kept as stored, uint8
    ``[E, N, quant_row_bytes(type, K)]`` of the type id given (``QUANT_TYPES``), or floats
    ``[E, N, K]`` of hidden's dtype with type ``FLOAT_WEIGHT_TYPES[dtype]``: w_gate and w_up
    ``[E, I, H]``, w_down ``[E, H, I]``; biases ``[E, N]`` in hidden's dtype. activation:
    ``"silu"`` (silu(gate) * up) or ``"swigluoai"`` (gpt-oss: gate clamped above at limit,
    up to [-limit, limit], ``(up + 1) * gate * sigmoid(alpha * gate)``). The weights hold
    experts ``[expert_start, expert_start + E)`` of the E_total the router scores (expert
    parallelism); a token's choices outside them add nothing. On CUDA, up_type must equal
    gate_type (gate and up are multiplied in one pass). On the CPU, GGUF weights multiply
    int8-quantized activations (as quant_linear's) for an expert with few rows,
    dequantized weights for one with many (tokens ``[0, many_rows)``: whatever its rows,
    as quant_linear's many_rows; CUDA ignores it); each token sums its experts in its own
    top-k order, whatever the thread count.
    """
    args = dict(  # in the schema's order: _check_args names them, the op takes them in turn
        out=out, hidden=hidden, router_logits=router_logits, top_k=top_k,
        renormalize=renormalize, w_gate=w_gate, w_up=w_up, w_down=w_down, gate_type=gate_type,
        up_type=up_type, down_type=down_type, gate_bias=gate_bias, up_bias=up_bias,
        down_bias=down_bias, activation=activation, alpha=alpha, limit=limit,
        expert_start=expert_start, many_rows=many_rows,
    )  # fmt: skip
    _check_args(_C.fused_moe, **args)
    _C.fused_moe(*{**args, "alpha": float(alpha), "limit": float(limit)}.values())
