"""The sparse MLP of mixture-of-experts families (Qwen3-MoE, Mixtral): a router and
num_experts gated MLPs, run together by one ops.fused_moe call.

Its parameters, named as the loaders fill them (pyllm.model.weights):
``mlp.gate.weight [E, H]`` (+ ``.bias``), the router, kept in floats; and per
projection of every expert ``mlp.experts.{gate,up}_proj.weight [E, I, H]`` and
``mlp.experts.down_proj.weight [E, H, I]`` (+ ``.bias [E, N]``), each either floats
or, kept quantized, one uint8 tensor of GGUF blocks ``[E, N, row bytes]``.

Tensor parallelism gives each rank every expert's share of I (gate/up rows, down
columns; the ranks' outputs meet in one all-reduce); expert parallelism gives each rank
whole experts, config.expert_range, and the op skips the others' choices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import pyllm.ops as ops
from pyllm import _C  # the per-layer ops, bound directly (csrc/torch_bindings.cpp)
from pyllm.model.config import ModelConfig
from pyllm.model.linear import empty_param, linear_small_batch, takes_small_batch_path
from pyllm.model.module import Module


class Router(Module):
    """Logits [T, num_experts] = x W^T (+ b), in the model's dtype (as HF computes them).
    Not a linear.Linear: it stays in floats when the projections are quantized, and its
    few rows would keep the model's projections from being word-packed."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool, dtype, device) -> None:
        super().__init__()
        self.weight = empty_param(num_experts, hidden_size, dtype=dtype, device=device)
        self.bias = empty_param(num_experts, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes_small_batch_path(x):
            return linear_small_batch(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class ExpertProjection(Module):
    """One projection of every expert held: weight [E, N, K] floats, or after
    set_quantized qweight uint8 [E, N, row bytes] of GGML type qtype; bias [E, N]."""

    def __init__(self, experts: int, out_features: int, in_features: int, bias: bool,
                 dtype, device) -> None:  # fmt: skip
        super().__init__()
        self.num_experts, self.out_features, self.in_features = experts, out_features, in_features
        self.weight = empty_param(experts, out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(experts, out_features, dtype=dtype, device=device) if bias else None
        self.qweight: torch.Tensor | None = None
        self.qtype = ops.FLOAT_WEIGHT_TYPES[dtype]

    def set_quantized(self, qweight: torch.Tensor, qtype: int) -> None:
        """Keeps the weight as GGUF blocks (the float weight goes)."""
        shape = (self.num_experts, self.out_features, ops.quant_row_bytes(qtype, self.in_features))
        if qweight.dtype != torch.uint8 or tuple(qweight.shape) != shape:
            raise ValueError(
                f"quantized expert weight must be uint8 {shape}, got {qweight.dtype} "
                f"{tuple(qweight.shape)}"
            )
        self.qweight, self.qtype, self.weight = qweight, qtype, None

    @property
    def data(self) -> torch.Tensor:
        """What fused_moe reads, with qtype."""
        return self.weight if self.qweight is None else self.qweight

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [E, N, K] (quantized blocks read back; for tests)."""
        if self.qweight is None:
            return self.weight
        out = torch.empty(self.num_experts, self.out_features, self.in_features, dtype=dtype,
                          device=self.qweight.device)  # fmt: skip
        for e in range(self.num_experts):
            _C.dequantize_rows(out[e], self.qweight[e], self.qtype, None)
        return out


class SparseMoeBlock(Module):
    """The MLP of a sparse layer: x [T, H] -> [T, H]. `reduce` (tensor or expert
    parallelism) sums the ranks' partial outputs."""

    def __init__(self, config: ModelConfig, dtype, device) -> None:
        super().__init__()
        held = config.expert_range
        hidden, inter, bias = config.hidden_size, config.moe_intermediate_size, config.expert_bias
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.activation = config.moe_activation
        self.alpha, self.limit = config.moe_alpha, config.moe_limit
        self.expert_start = held.start
        self.gate = Router(hidden, config.num_experts, config.router_bias, dtype, device)
        self.experts = nn.Module()
        self.experts.gate_proj = ExpertProjection(len(held), inter, hidden, bias, dtype, device)
        self.experts.up_proj = ExpertProjection(len(held), inter, hidden, bias, dtype, device)
        self.experts.down_proj = ExpertProjection(len(held), hidden, inter, bias, dtype, device)
        self.reduce = None

    def projections(self) -> tuple[ExpertProjection, ExpertProjection, ExpertProjection]:
        e = self.experts
        return e.gate_proj, e.up_proj, e.down_proj

    def forward(self, x: torch.Tensor, step=None) -> torch.Tensor:
        """step: the step's buffers, read for its prompt_rows (the experts write a tensor
        of their own)."""
        logits = self.gate(x)
        out = torch.empty_like(x)
        gate, up, down = self.projections()
        _C.fused_moe(
            out, x, logits, self.top_k, self.renormalize, gate.data, up.data, down.data,
            gate.qtype, up.qtype, down.qtype, gate.bias, up.bias, down.bias, self.activation,
            self.alpha, self.limit, self.expert_start, 0 if step is None else step.prompt_rows,
        )  # fmt: skip
        return out if self.reduce is None else self.reduce(out)
