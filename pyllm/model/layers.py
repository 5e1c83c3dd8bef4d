"""The layers of a Llama-family decoder over a flat batch of tokens: norms, rotary
tables, attention and the dense MLP (projections: linear.py; sparse MLPs: moe.py).

A step's batch has no padding: T tokens from many sequences back to back, prefill
tokens first (every sequence that processes a prompt or a prompt chunk this step),
then decode tokens (one per sequence). The hot path calls pyllm's ops directly
(``pyllm._C``: on CPU tensors without the dispatcher); the step's attention backend
(pyllm.attention) writes the KV cache and runs attention in the layout the step's
metadata belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pyllm import _C  # the per-layer ops, bound directly (csrc/torch_bindings.cpp)
from pyllm.attention.backend import KVPair
from pyllm.attention.metadata import AttentionMetadata
from pyllm.model.config import ModelConfig, rope_inv_freq
from pyllm.model.linear import Linear, empty_param
from pyllm.model.memory import zeros_uncommitted
from pyllm.model.module import Module


class RMSNorm(Module):
    def __init__(self, hidden_size: int, eps: float, dtype, device) -> None:
        super().__init__()
        self.weight = empty_param(hidden_size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Without residual: returns norm(x). With residual: in place, residual += x and
        x = norm(residual); returns x."""
        if residual is None:
            out = torch.empty_like(x)
            _C.rms_norm(out, x, self.weight, self.eps)
            return out
        _C.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x


def rotary_cos_sin_cache(config: ModelConfig, max_positions: int, device) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of every (position, frequency) in the first
    half, sin in the second (the layout rotary_embedding reads). LongRoPE: positions past
    the pretraining context take the long factors (as vLLM does; HF switches a whole
    sequence once it grows past it), and cos/sin carry the attention factor."""
    return rotary_cos_sin_rows(config, 0, max_positions).to(device)


def rotary_cos_sin_rows(config: ModelConfig, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of rotary_cos_sin_cache, on the CPU: each row is computed alone,
    so the rows of any split equal the whole table's."""
    positions = torch.arange(start, stop, dtype=torch.float32)
    freqs = torch.outer(positions, rope_inv_freq(config))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "longrope":
        long = max(scaling["original_max_position_embeddings"] - start, 0)
        freqs[long:] = torch.outer(positions[long:], rope_inv_freq(config, long=True))
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    if scaling.get("attention_factor", 1.0) != 1.0:
        cache = cache * scaling["attention_factor"]
    return cache.contiguous()


class RotaryTable:
    """A rotary_cos_sin_cache computed as steps reach its positions, ROWS at a time, in
    memory committed as it is written (on the CPU): Gemma 3's two tables for 32,768
    positions held 64 MB from the first step. The table is allocated whole, so its
    address never changes (kernel graphs hold it); elsewhere it is computed at once."""

    ROWS = 4096

    def __init__(self, config: ModelConfig, max_positions: int, device):
        self.config, self.size = config, max_positions
        if torch.device(device).type == "cpu":
            self.table = zeros_uncommitted((max_positions, config.head_dim), torch.float32)
            self.filled = 0
        else:
            self.table = rotary_cos_sin_cache(config, max_positions, device)
            self.filled = max_positions

    def ensure(self, positions: int) -> None:
        """Rows [0, positions) computed."""
        if positions > self.filled:
            stop = min(self.size, -(-positions // self.ROWS) * self.ROWS)
            self.table[self.filled : stop] = rotary_cos_sin_rows(self.config, self.filled, stop)
            self.filled = stop


@dataclass(slots=True)
class StepBuffers:
    """A step's activations, allocated once per forward and shared by the layers: each
    layer writes its q/k/v, attention output, MLP intermediates and block output into
    these tensors, and each is consumed before the next layer writes it. At batch 1 the
    six allocations and eight views a layer would make cost about as much time as its
    small kernels. A projection whose kernel cannot write into a buffer returns its own
    tensor, and the layer reads that instead."""

    qkv: torch.Tensor  # [T, q_size + 2 kv_size]: the fused projection's output
    q: torch.Tensor  # its row views: q [T, Hq * D], k [T, Hkv * D] (rotated in place)
    k: torch.Tensor
    heads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v as [T, H, D]
    out: torch.Tensor  # [T, Hq, D]: attention's output
    out_rows: torch.Tensor  # the same as [T, Hq * D], o_proj's input
    hidden: torch.Tensor  # [T, hidden_size]: o_proj's and down_proj's output
    gate_up: torch.Tensor | None  # [T, 2 I] and [T, I] (None: no dense MLP layer)
    act: torch.Tensor | None
    attention: Any = None  # the attention backend's scratch for the step
    # The step's first rows that are prompt tokens: kept quantized weights compute them
    # as a many-row call does however few they are (ops.quant_linear's many_rows), so a
    # prompt computes alike whole, chunked or after a prefix-cache hit.
    prompt_rows: int = 0


def step_buffers(
    config: ModelConfig, num_tokens: int, dtype, device, attention, prompt_rows: int = 0
) -> StepBuffers:
    """config: the rank's (its local heads and MLP width)."""
    T, D = num_tokens, config.head_dim
    q_size, kv_size = config.q_size, config.kv_size
    qkv = torch.empty(T, q_size + 2 * kv_size, dtype=dtype, device=device)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=1)
    heads = (q.view(T, -1, D), k.view(T, -1, D), v.view(T, -1, D))
    out = torch.empty(T, config.num_attention_heads, D, dtype=dtype, device=device)
    hidden = torch.empty(T, config.hidden_size, dtype=dtype, device=device)
    gate_up = act = None
    if config.has_dense_layers:
        act = torch.empty(T, config.intermediate_size, dtype=dtype, device=device)
        gate_up = torch.empty(T, 2 * config.intermediate_size, dtype=dtype, device=device)
    return StepBuffers(qkv, q, k, heads, out, out.view(T, q_size), hidden, gate_up, act,
                       attention, prompt_rows)  # fmt: skip


class Attention(Module):
    """Grouped-query attention with one fused q/k/v projection.

    The projection's output row is [q (Hq*D) | k (Hkv*D) | v (Hkv*D)]; rotary and the
    cache write work in place on row views of it, so q, k and v are never copied.
    With sliding_window set, each query sees only the last sliding_window positions.
    """

    def __init__(self, config: ModelConfig, dtype, device, sliding_window: int | None = None):
        super().__init__()
        self.sliding_window = sliding_window or 0
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_halves = not config.rope_interleaved  # rotary_embedding's is_neox
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.attn_scale or self.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, dtype, device
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_bias, dtype, device)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None
        # gpt-oss: a learned logit per head that joins every softmax with no value
        # (float32, as the attention ops take it).
        self.sinks = (
            empty_param(self.num_heads, dtype=torch.float32, device=device)
            if config.attn_sinks
            else None
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: KVPair,
        meta: AttentionMetadata,
        step: StepBuffers,
    ) -> torch.Tensor:
        """Projects hidden [T, hidden_size] to q/k/v, rotates q and k, and has the step's
        backend cache k/v and attend (step.attention: its per-step scratch); returns
        o_proj of the heads' outputs."""
        qkv = self.qkv_proj(hidden, step.qkv, step.prompt_rows)
        if qkv is step.qkv and self.q_norm is None:
            q, k, heads = step.q, step.k, step.heads
        else:
            q, k, heads = self._split(qkv)
        _C.rotary_embedding(positions, q, k, self.head_dim, cos_sin_cache, self.rope_halves)
        meta.backend.forward(self, step.out, *heads, positions, kv_cache, meta, step.attention)
        return self.o_proj(step.out_rows, step.hidden, step.prompt_rows)

    def _split(self, qkv: torch.Tensor):
        """q and k [T, H * D] (row views of qkv, or normed copies) and q, k, v as [T, H, D]."""
        T, D = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=1)
        if self.q_norm is not None:
            q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
        return q, k, (q.view(T, -1, D), k.view(T, -1, D), v.view(T, -1, D))

    def _head_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head of x [T, H * D] (a row view of qkv): a new [T, H * D].
        The norm reads the heads where they lie (rms_norm takes rows of a strided dim 0)."""
        heads = x.view(x.shape[0], -1, self.head_dim)
        return norm(heads).view(x.shape[0], -1)


class MLP(Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one projection; act is
    SiLU or (Gemma) the tanh approximation of GELU."""

    def __init__(self, config: ModelConfig, dtype, device) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gelu = config.hidden_act == "gelu_tanh"
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, config.mlp_bias, dtype, device
        )
        self.down_proj = Linear(
            config.intermediate_size, config.hidden_size, config.mlp_bias, dtype, device
        )

    def forward(self, x: torch.Tensor, step: StepBuffers | None = None) -> torch.Tensor:
        """step: the buffers to write into (None: new tensors)."""
        if step is None:
            prompt_rows, out = 0, None
            gate_up = self.gate_up_proj(x)
            act = torch.empty(x.shape[0], self.intermediate_size, dtype=x.dtype, device=x.device)
        else:
            prompt_rows, act, out = step.prompt_rows, step.act, step.hidden
            gate_up = self.gate_up_proj(x, step.gate_up, prompt_rows)
        if self.gelu:
            _C.gelu_tanh_and_mul(act, gate_up)
        else:
            _C.silu_and_mul(act, gate_up)
        return self.down_proj(act, out, prompt_rows)
