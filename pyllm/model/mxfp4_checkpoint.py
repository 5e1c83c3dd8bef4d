"""gpt-oss's HF checkpoints keep the experts in MXFP4, in the OCP microscaling layout:
``mlp.experts.{gate_up,down}_proj_blocks [E, N, K / 32, 16]`` (two 4-bit codes per
byte, element 2i in the low nibble, 2i + 1 in the high one) beside
``..._scales [E, N, K / 32]`` (each block's E8M0 exponent). GGML's MXFP4 block holds the
same codes and exponent in another order (the exponent byte, then element l in the low
nibble of byte l and element l + 16 in its high nibble), so the experts are repacked
and kept in their blocks for ops.fused_moe, or widened per expert on request.
gate_up_proj's rows interleave the two projections: row 2k is gate's k, 2k + 1 up's.
"""

from __future__ import annotations

import torch

import pyllm.ops as ops
from pyllm.model.weights import WeightFiller, expert_share, per_expert_name

MXFP4, BLOCK, BLOCK_BYTES = ops.QUANT_TYPES["MXFP4"]  # 32 weights in 17 bytes
BLOCKS, SCALES = "_blocks", "_scales"
MXFP4_PARTS = (BLOCKS, SCALES)


def ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OCP blocks [..., G, 16] and exponents [..., G] (uint8) -> GGML MXFP4 rows
    [..., G * 17]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
            "as [..., G, 16] and [..., G]"
        )
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # element order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    ggml = torch.cat((scales.unsqueeze(-1), packed), dim=-1)
    return ggml.flatten(-2)


def checkpoint_pairs(names) -> dict[str, str]:
    """blocks name -> its scales' name, for every MXFP4 pair among names."""
    pairs = {}
    for name in names:
        if name.endswith(BLOCKS):
            scales = name[: -len(BLOCKS)] + SCALES
            if scales not in names:
                raise ValueError(f"MXFP4 tensor {name!r} has no {scales!r} beside it")
            pairs[name] = scales
    return pairs


def load_mxfp4_experts(model, filler: WeightFiller, read, pairs: dict[str, str], keep: bool):
    """Fills the experts of every pair: kept as GGML blocks (keep), else widened to the
    model's dtype one expert at a time. read(name) -> the checkpoint tensor."""
    for blocks_name, scales_name in pairs.items():
        qweight = ggml_blocks(read(blocks_name), read(scales_name))
        base = blocks_name[: -len(BLOCKS)]  # ...mlp.experts.gate_up_proj
        experts, _, kind = base.rpartition(".")
        parts = {"down_proj": qweight}
        if kind == "gate_up_proj":
            parts = {"gate_proj": qweight[:, 0::2], "up_proj": qweight[:, 1::2]}
        for proj, rows in parts.items():
            name = f"{experts}.{proj}.weight"
            if name not in filler.slots:
                raise ValueError(f"unexpected tensor {blocks_name!r} (not part of this model)")
            module = model.get_submodule(f"{experts}.{proj}")
            if keep and module.in_features % BLOCK == 0:
                module.set_quantized(expert_share(model, module, rows, MXFP4), MXFP4)
                filler.mark(name)
            else:
                _widen(filler, name, rows, rows.shape[2] // BLOCK_BYTES * BLOCK)
        del qweight


def _widen(filler: WeightFiller, name: str, qweight: torch.Tensor, in_features: int) -> None:
    for e in filler.held:
        dense = torch.empty(qweight.shape[1], in_features)
        ops.dequantize_rows(dense, qweight[e].contiguous(), MXFP4)
        filler.fill(per_expert_name(name, e), dense)
    filler.mark(name)
