"""Float weights into GGML quantized blocks, with torch.

`quantize_weight(w, "q8_0")` turns a [N, K] float weight into the uint8 tensor
[N, K / block_size * type_size] that a GGUF file would hold for it: each row is its
K / block_size blocks, one after another, in GGML's block layout, so that
`gguf.quants.dequantize` (and the quantized kernels) read it back.

Q8_0, Q4_0 and MXFP4 are byte-identical to `gguf.quants.quantize` (GGML's reference
rounding, including Q8_0's round-half-away-from-zero, Q4_0's signed maximum mapping to
-8 and MXFP4's nearest code, the first on ties; MXFP4 blocks whose largest magnitude
is below 2^-125 take exponent 0, where gguf's exponent falls below the range of its
uint8 cast). Q4_K and Q6_K have no reference quantizer there: each sub-block's
scale (and Q4_K's min) is a least-squares fit over a small grid of candidate scales,
then the sub-block scales are quantized to 6 bits (Q4_K) or int8 (Q6_K) against a
per-super-block fp16 scale and the values requantized with those.

All work is vectorized over blocks and done a chunk of rows at a time, so the
temporaries stay at a few tens of MB whatever the weight's size.
"""

from __future__ import annotations

import torch

import pyllm.ops as ops

# The types quantize_weight writes, by lower-case name.
_NAMES = ("q4_0", "q8_0", "q4_k", "q6_k", "mxfp4")
# Names to GGML type ids (gguf.GGMLQuantizationType).
QUANT_TYPES_BY_NAME: dict[str, int] = {name: ops.QUANT_TYPES[name.upper()][0] for name in _NAMES}

# (weights per block, bytes per block)
_BLOCK_SIZES: dict[str, tuple[int, int]] = {
    name: ops.QUANT_TYPES[name.upper()][1:] for name in _NAMES
}

# Float32 elements quantized per chunk; the K-types' candidate grids multiply their
# temporaries by 7, and MXFP4's distances to its 16 values by 16, so they take smaller
# chunks (peak about 100 MB either way).
_CHUNK_ELEMENTS = {
    "q4_0": 1 << 20,
    "q8_0": 1 << 20,
    "q4_k": 1 << 19,
    "q6_k": 1 << 19,
    "mxfp4": 1 << 19,
}

# Candidate scale offsets tried per sub-block (in units of one quantization level).
_Q4K_STEPS = torch.linspace(-1.0, 1.0, 7)
_Q6K_STEPS = torch.linspace(-0.6, 0.6, 7)


def _check_qtype(qtype: str) -> str:
    name = qtype.lower() if isinstance(qtype, str) else qtype
    if name not in _BLOCK_SIZES:
        raise ValueError(f"qtype must be one of {sorted(_BLOCK_SIZES)}, got {qtype!r}")
    return name


def quantized_shape(shape: tuple[int, ...] | torch.Size, qtype: str) -> tuple[int, int]:
    """The uint8 shape [N, K / block_size * type_size] of a [N, K] weight in `qtype`;
    raises ValueError if K is not a multiple of the type's block size."""
    name = _check_qtype(qtype)
    if len(shape) != 2:
        raise ValueError(
            f"weight must be 2-D [N, K] to quantize to {name}, got shape {tuple(shape)}"
        )
    n, k = shape
    block, type_size = _BLOCK_SIZES[name]
    if k % block != 0 or k == 0:
        raise ValueError(
            f"weight of shape {tuple(shape)} cannot be quantized to {name}: its row length "
            f"{k} is not a positive multiple of the {name} block size {block}"
        )
    return n, k // block * type_size


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """[N, K] float32/bfloat16/float16 -> uint8 [N, K / block_size * type_size], GGML
    blocks of `qtype` ("q8_0", "q4_0", "q4_k", "q6_k", "mxfp4"), on the weight's
    device."""
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    name = _check_qtype(qtype)
    if not weight.is_floating_point():
        raise ValueError(f"weight must be a floating-point tensor, got {weight.dtype}")
    n, row_bytes = quantized_shape(weight.shape, name)
    k = weight.shape[1]
    block, type_size = _BLOCK_SIZES[name]
    out = torch.empty((n, row_bytes), dtype=torch.uint8, device=weight.device)
    quantize_blocks = _QUANTIZERS[name]
    rows_per_chunk = max(1, _CHUNK_ELEMENTS[name] // k)
    for start in range(0, n, rows_per_chunk):
        stop = min(n, start + rows_per_chunk)
        chunk = weight[start:stop].to(torch.float32)
        if not torch.isfinite(chunk).all():
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} has non-finite values in rows "
                f"{start}..{stop - 1}; cannot quantize to {name}"
            )
        blocks = chunk.reshape(-1, block)
        out[start:stop].view(-1, type_size).copy_(quantize_blocks(blocks))
    return out


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    # C's roundf (torch.round rounds half to even); exact, unlike floor(|x| + 0.5).
    a = x.abs()
    whole = a.floor()
    return (whole + (2 * (a - whole)).floor()).copysign(x)


def _reciprocal_or_zero(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _fp16_bytes(d: torch.Tensor) -> torch.Tensor:
    """[B] float32 -> [B, 2] uint8 (little-endian fp16)."""
    return d.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _quantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    q = _round_half_away(blocks * _reciprocal_or_zero(d)).to(torch.int8)
    return torch.cat([_fp16_bytes(d), q.view(torch.uint8)], dim=1)


def _quantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # The value of largest magnitude (the first, on ties), with its sign, maps to -8.
    biggest = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))
    d = biggest / -8
    q = torch.trunc(blocks * _reciprocal_or_zero(d) + 8.5).clamp_(0, 15).to(torch.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat([_fp16_bytes(d), packed], dim=1)


# MXFP4's 4-bit codes as twice their E2M1 values (gguf.quants.MXFP4.kvalues).
_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (int32) -> 2^(e - 128) in float32, from bits as ggml builds them:
    exponent field e - 1, or the subnormal 0x00200000 << e for e < 2."""
    subnormal = torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e.clamp(max=1))
    return torch.where(e < 2, subnormal, (e - 1) << 23).view(torch.float32)


def _quantize_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    amax = blocks.abs().amax(dim=1)
    # gguf's exponent: floor(log2(amax)) - 2, biased by 127, so that amax lands in the
    # values 8..12 (or is clipped to 12). log2 is taken in float64 and rounded to
    # float32, as numpy's float32 log2 rounds (a max just below a power of two may
    # round up to it, which decides the floor).
    log2 = torch.log2(amax.double()).float().floor()
    e = torch.where(amax > 0, log2 + 125, 0).clamp_(min=0).to(torch.int32)
    d = _e8m0_half(e)
    values = torch.tensor(_MXFP4_VALUES, dtype=torch.float32, device=blocks.device)
    # The nearest value per weight (the first on ties), by float32 distances as gguf.
    distance = (d[:, None, None] * values - blocks[:, :, None]).abs_()
    q = distance.argmin(dim=2).to(torch.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat([e.to(torch.uint8)[:, None], packed], dim=1)


def _least_squares(q: torch.Tensor, x: torch.Tensor):
    """For q [S, C, n] (C candidate assignments of x [S, n] to levels): the scale >= 0
    and offset <= 0 minimizing sum((scale * q + offset - x)^2), that sum, and whether
    the fit is determined (q not constant); each [S, C]."""
    n = x.shape[1]
    sum_q = q.sum(dim=2)
    sum_qq = torch.linalg.vecdot(q, q)
    sum_xq = torch.bmm(q, x.unsqueeze(2)).squeeze(2)
    sum_x = x.sum(dim=1, keepdim=True)
    sum_xx = torch.linalg.vecdot(x, x).unsqueeze(1)
    det = n * sum_qq - sum_q * sum_q
    ok = det > 0
    safe_det = torch.where(ok, det, torch.ones_like(det))
    scale = (n * sum_xq - sum_x * sum_q) / safe_det
    offset = (sum_qq * sum_x - sum_q * sum_xq) / safe_det
    # The offset is stored as a non-negative min subtracted: refit the scale alone at 0.
    positive = offset > 0
    scale = torch.where(positive, sum_xq / sum_qq.clamp(min=1), scale).clamp(min=0)
    offset = torch.where(positive, torch.zeros_like(offset), offset)
    # The squared error, expanded so that no [S, C, n] temporary is needed.
    err = (
        scale * scale * sum_qq
        + 2 * scale * offset * sum_q
        + n * offset * offset
        - 2 * scale * sum_xq
        - 2 * offset * sum_x
        + sum_xx
    )
    return scale, offset, err, ok


def _fit_scale_min(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of x [S, n]: (scale >= 0, offset <= 0) with x ~ scale * q + offset,
    q in 0..levels. A few candidate grids around the min/max one assign q and get
    their least-squares scale and offset; the best one is refined once more by
    reassigning q to its nearest levels and refitting."""
    lo = x.amin(dim=1, keepdim=True).clamp(max=0)
    span = x.amax(dim=1, keepdim=True) - lo
    steps = _Q4K_STEPS.to(x.device)
    inv = (levels + steps) / torch.where(span > 0, span, torch.ones_like(span))  # [S, C]
    q = torch.round((x - lo).unsqueeze(1) * inv.unsqueeze(2)).clamp_(0, levels)  # [S, C, n]
    scale, offset, err, ok = _least_squares(q, x)
    err = torch.where(ok, err, torch.full_like(err, float("inf")))
    best = err.argmin(dim=1, keepdim=True)
    scale = scale.gather(1, best)
    offset = offset.gather(1, best)
    q = torch.round((x - offset) * _reciprocal_or_zero(scale)).clamp_(0, levels)
    refit_scale, refit_offset, _, refit_ok = _least_squares(q.unsqueeze(1), x)
    scale = torch.where(refit_ok, refit_scale, scale).squeeze(1)
    offset = torch.where(refit_ok, refit_offset, offset).squeeze(1)
    # Constant sub-blocks (no fit is determined): the plain min/max grid is exact.
    valid = ok.any(dim=1)
    scale = torch.where(valid, scale, (span / levels).squeeze(1))
    offset = torch.where(valid, offset, lo.squeeze(1))
    return scale, offset


def _q4_k_levels(x, d, dmin, sc, mn):
    """x [num, 8, 32] to levels 0..15 (as floats) under w = d * sc * q - dmin * mn."""
    step = (d.unsqueeze(1) * sc).unsqueeze(2)  # [num, 8, 1]
    shift = (dmin.unsqueeze(1) * mn).unsqueeze(2)
    return torch.round((x + shift) * _reciprocal_or_zero(step)).clamp_(0, 15)


def _refit_super_block(x, q, d, dmin, sc, mn):
    """With the levels q and 6-bit sc, mn fixed, the fp16 (d, dmin) of least squared
    error over the super-block (kept as they are where that fit is degenerate)."""
    a = sc.unsqueeze(2) * q  # [num, 8, 32]
    b = mn  # [num, 8]
    saa = a.square().sum(dim=(1, 2))
    sbb = 32 * b.square().sum(dim=1)
    sab = (a.sum(dim=2) * b).sum(dim=1)
    sax = (a * x).sum(dim=(1, 2))
    sbx = (x.sum(dim=2) * b).sum(dim=1)
    det = sab * sab - saa * sbb
    safe = torch.where(det != 0, det, torch.ones_like(det))
    new_d = (sab * sbx - sax * sbb) / safe
    new_dmin = (saa * sbx - sab * sax) / safe
    new_d = new_d.to(torch.float16).to(torch.float32)
    new_dmin = new_dmin.to(torch.float16).to(torch.float32)
    use = (det != 0) & (new_d >= 0) & (new_dmin >= 0) & new_d.isfinite() & new_dmin.isfinite()
    return torch.where(use, new_d, d), torch.where(use, new_dmin, dmin)


def _quantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    num = blocks.shape[0]
    sub = blocks.reshape(num * 8, 32)
    scale, offset = _fit_scale_min(sub, 15)
    scale = scale.reshape(num, 8)
    mins = (-offset).reshape(num, 8)
    # 6-bit sub-block scales and mins against fp16 super-block factors.
    d = (scale.amax(dim=1) / 63).to(torch.float16).to(torch.float32)
    dmin = (mins.amax(dim=1) / 63).to(torch.float16).to(torch.float32)
    sc = torch.round(scale * _reciprocal_or_zero(d).unsqueeze(1)).clamp_(0, 63)
    mn = torch.round(mins * _reciprocal_or_zero(dmin).unsqueeze(1)).clamp_(0, 63)
    x = blocks.reshape(num, 8, 32)
    q = _q4_k_levels(x, d, dmin, sc, mn)
    d, dmin = _refit_super_block(x, q, d, dmin, sc, mn)
    q = _q4_k_levels(x, d, dmin, sc, mn)
    q = q.to(torch.uint8)
    q = q.reshape(num, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(num, 128)
    sc = sc.to(torch.uint8)
    mn = mn.to(torch.uint8)
    # GGML's 12 scale bytes: the low 6 bits of sub-blocks 0-3 in bytes 0-7, and those
    # of sub-blocks 4-7 split into low nibbles (bytes 8-11) and top 2 bits (bits 6-7
    # of bytes 0-7).
    scales = torch.cat(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4),
        ],
        dim=1,
    )
    return torch.cat([_fp16_bytes(d), _fp16_bytes(dmin), scales, qs], dim=1)


def _symmetric_least_squares(q: torch.Tensor, x: torch.Tensor):
    """For q [S, C, n] (candidate assignments of x [S, n]): the scale minimizing
    sum((scale * q - x)^2) and that sum, each [S, C]."""
    sum_qq = torch.linalg.vecdot(q, q).clamp(min=1)
    sum_xq = torch.bmm(q, x.unsqueeze(2)).squeeze(2)
    scale = sum_xq / sum_qq
    err = torch.linalg.vecdot(x, x).unsqueeze(1) - scale * sum_xq
    return scale, err


def _fit_symmetric_scale(x: torch.Tensor, levels: int) -> torch.Tensor:
    """Per row of x [S, n]: a scale with x ~ scale * q, q in -levels..levels-1. The
    value of largest magnitude sets a few candidate grids (it maps near -levels); each
    grid's q gets its least-squares scale, and the best one is refined once more by
    reassigning q to its nearest levels and refitting."""
    biggest = x.gather(1, x.abs().argmax(dim=1, keepdim=True))  # [S, 1]
    steps = _Q6K_STEPS.to(x.device)
    safe = torch.where(biggest == 0, torch.ones_like(biggest), biggest)
    inv = -(levels + steps) / safe  # [S, C]
    q = torch.round(x.unsqueeze(1) * inv.unsqueeze(2)).clamp_(-levels, levels - 1)
    scale, err = _symmetric_least_squares(q, x)
    scale = scale.gather(1, err.argmin(dim=1, keepdim=True))
    q = torch.round(x * _reciprocal_or_zero(scale)).clamp_(-levels, levels - 1)
    scale = _symmetric_least_squares(q.unsqueeze(1), x)[0].squeeze(1)
    return torch.where(biggest.squeeze(1) == 0, torch.zeros_like(scale), scale)


def _quantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    num = blocks.shape[0]
    scale = _fit_symmetric_scale(blocks.reshape(num * 16, 16), 32).reshape(num, 16)
    # int8 sub-block scales: the one of largest magnitude maps to -128.
    biggest = scale.gather(1, scale.abs().argmax(dim=1, keepdim=True)).squeeze(1)
    d = (biggest / -128).to(torch.float16).to(torch.float32)
    sc = torch.round(scale * _reciprocal_or_zero(d).unsqueeze(1)).clamp_(-128, 127)
    step = (d.unsqueeze(1) * sc).unsqueeze(2)  # [num, 16, 1]
    x = blocks.reshape(num, 16, 16)
    q = torch.round(x * _reciprocal_or_zero(step)).clamp_(-32, 31).add_(32).to(torch.uint8)
    # Weight v = 128h + 64s + j: ql byte 64h + j, nibble s; v = 128h + 32t + j: qh byte
    # 32h + j, bits 2t..2t+1.
    low = (q & 0xF).reshape(num, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(num, 128)
    high = (q >> 4).reshape(num, 2, 4, 32)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    scales = sc.to(torch.int8).view(torch.uint8)
    return torch.cat([ql, qh.reshape(num, 64), scales, _fp16_bytes(d)], dim=1)


_QUANTIZERS = {
    "q4_0": _quantize_q4_0,
    "q8_0": _quantize_q8_0,
    "q4_k": _quantize_q4_k,
    "q6_k": _quantize_q6_k,
    "mxfp4": _quantize_mxfp4,
}
