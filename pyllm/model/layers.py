"""The layers of a Llama-family decoder over a flat batch of tokens and a paged KV cache
(projections: linear.py).

A step's batch has no padding: T tokens from many sequences back to back, prefill
tokens first (every sequence that processes a prompt or a prompt chunk this step),
then decode tokens (one per sequence). The hot path calls ``torch.ops.pyllm.*``
directly; ``AttentionMetadata.validate`` checks the step's index tensors once instead
of once per layer and op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import pyllm.ops as ops
from pyllm.model.config import ModelConfig, rope_inv_freq
from pyllm.model.linear import Linear, empty_param

_C = torch.ops.pyllm

# Decode attention switches from paged_attention_v1 (one pass per sequence and head)
# to v2 (partitions of ops.PARTITION_SIZE tokens, merged after) past this context
# length. Measured on 2 CPU cores with SmolLM2's 9/3 heads, 1-32 sequences,
# contexts 128-16384: v1 and v2 within noise of each other (v1 already spreads
# sequences x heads over the cores), so the CPU switches only for very long contexts.
V2_MIN_SEQ_LEN = 8192
# A GPU needs hundreds of (sequence, head) pairs in flight to fill its SMs; with fewer,
# splitting each sequence into partitions is what keeps it busy.
CUDA_V2_MAX_SEQ_HEADS = 512


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token of the step lives in the paged KV cache.

    slot_mapping: [T] int64, slot = block_number * block_size + offset (-1 skips).
    Prefill part (P sequences, the first num_prefill_tokens tokens):
      prefill_query_start_loc [P + 1] int32, prefill_seq_lens [P] int32 (tokens cached
      after this step, earlier chunks included), prefill_block_tables [P, B] int32,
      max_query_len.
    Decode part (D sequences, one token each, the remaining T - num_prefill_tokens):
      decode_seq_lens [D] int32, decode_block_tables [D, B'] int32, max_decode_seq_len.

    Contiguous KV cache (contiguous=True, see pyllm.kv_cache.KVArena): a sequence is addressed
    by its arena slot, so prefill_seq_slots [P] / decode_seq_slots [D] int32 replace the
    block tables, and slot_mapping holds each token's sequence slot (-1 skips); the
    token's position in the slot is its position.
    """

    slot_mapping: torch.Tensor
    num_prefill_tokens: int
    prefill_query_start_loc: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    max_query_len: int = 0
    decode_seq_lens: torch.Tensor | None = None
    decode_block_tables: torch.Tensor | None = None
    max_decode_seq_len: int = 0
    contiguous: bool = False
    prefill_seq_slots: torch.Tensor | None = None
    decode_seq_slots: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_decode_tokens(self) -> int:
        return self.num_tokens - self.num_prefill_tokens

    def use_v2(self, num_heads: int, device: torch.device) -> bool:
        """Whether this step's decode attention runs paged_attention_v2 (see V2_MIN_SEQ_LEN)."""
        if self.max_decode_seq_len <= ops.PARTITION_SIZE:
            return False  # one partition: v2 would only add the merge
        if self.max_decode_seq_len > V2_MIN_SEQ_LEN:
            return True
        few_pairs = self.num_decode_tokens * num_heads <= CUDA_V2_MAX_SEQ_HEADS
        return device.type == "cuda" and few_pairs

    def validate(self, num_blocks: int, block_size: int, device: torch.device) -> None:
        """Checks shapes, dtypes and index ranges against a cache of num_blocks blocks
        of block_size tokens; raises ValueError naming the field."""
        T, P = self.num_tokens, self.num_prefill_tokens
        _index("slot_mapping", self.slot_mapping, torch.int64, 1, device)
        if not 0 <= P <= T:
            raise ValueError(f"num_prefill_tokens must lie in [0, {T}], got {P}")
        if T and (
            int(self.slot_mapping.min()) < -1
            or int(self.slot_mapping.max()) >= num_blocks * block_size
        ):
            raise ValueError(
                f"slot_mapping values must lie in [-1, {num_blocks * block_size}), got "
                f"{int(self.slot_mapping.min())}..{int(self.slot_mapping.max())}"
            )
        if P:
            qsl = _index(
                "prefill_query_start_loc", self.prefill_query_start_loc, torch.int32, 1, device
            )
            num_seqs = qsl.shape[0] - 1
            seq_lens = self._seq_tables("prefill", num_seqs, num_blocks, block_size, device)
            q_lens = qsl[1:] - qsl[:-1]
            if num_seqs < 1 or int(qsl[0]) != 0 or int(qsl[-1]) != P or int(q_lens.min()) < 1:
                raise ValueError(
                    f"prefill_query_start_loc must rise from 0 to num_prefill_tokens ({P}), "
                    f"got {qsl.tolist()}"
                )
            if int(q_lens.max()) > self.max_query_len or bool((q_lens > seq_lens).any()):
                raise ValueError(
                    f"each prefill query length must be <= max_query_len ({self.max_query_len}) "
                    "and <= its prefill_seq_lens entry"
                )
        if T - P:
            seq_lens = self._seq_tables("decode", T - P, num_blocks, block_size, device)
            if int(seq_lens.min()) < 1 or int(seq_lens.max()) > self.max_decode_seq_len:
                raise ValueError(
                    f"decode_seq_lens must lie in [1, max_decode_seq_len="
                    f"{self.max_decode_seq_len}], got {int(seq_lens.min())}..{int(seq_lens.max())}"
                )

    def validate_contiguous(self, num_slots: int, slot_capacity: int, device) -> None:
        """The contiguous cache's checks: slots in [0, num_slots) (-1 skips a token),
        sequence lengths within a slot's capacity, query lengths as in validate()."""
        T, P = self.num_tokens, self.num_prefill_tokens
        _index("slot_mapping", self.slot_mapping, torch.int64, 1, device)
        if not 0 <= P <= T:
            raise ValueError(f"num_prefill_tokens must lie in [0, {T}], got {P}")
        if T and (int(self.slot_mapping.min()) < -1 or int(self.slot_mapping.max()) >= num_slots):
            raise ValueError(f"slot_mapping (token slots) must lie in [-1, {num_slots})")
        for part, count in (("prefill", P and self.prefill_query_start_loc.shape[0] - 1),
                            ("decode", T - P)):  # fmt: skip
            if not count:
                continue
            slots = _index(f"{part}_seq_slots", getattr(self, f"{part}_seq_slots"),
                           torch.int32, 1, device)  # fmt: skip
            lens = _index(f"{part}_seq_lens", getattr(self, f"{part}_seq_lens"),
                          torch.int32, 1, device)  # fmt: skip
            if slots.shape[0] != count or lens.shape[0] != count:
                raise ValueError(f"{part}_seq_slots and {part}_seq_lens need {count} entries")
            if int(slots.min()) < 0 or int(slots.max()) >= num_slots:
                raise ValueError(f"{part}_seq_slots must lie in [0, {num_slots})")
            if int(lens.min()) < 1 or int(lens.max()) > slot_capacity:
                raise ValueError(f"{part}_seq_lens must lie in [1, {slot_capacity}]")

    def _seq_tables(
        self, part: str, num_seqs: int, num_blocks: int, block_size: int, device: torch.device
    ) -> torch.Tensor:
        seq_lens = _index(
            f"{part}_seq_lens", getattr(self, f"{part}_seq_lens"), torch.int32, 1, device
        )
        tables = _index(
            f"{part}_block_tables", getattr(self, f"{part}_block_tables"), torch.int32, 2, device
        )
        if seq_lens.shape[0] != num_seqs or tables.shape[0] != num_seqs:
            raise ValueError(
                f"{part}_seq_lens {tuple(seq_lens.shape)} and {part}_block_tables "
                f"{tuple(tables.shape)} must have {num_seqs} rows (one per {part} sequence)"
            )
        capacity = tables.shape[1] * block_size
        if int(seq_lens.max()) > capacity:
            raise ValueError(
                f"{part}_seq_lens reach {int(seq_lens.max())} but {part}_block_tables holds "
                f"{tables.shape[1]} blocks of {block_size} tokens"
            )
        # Only the table entries that cover cached tokens are read.
        used = (
            torch.arange(tables.shape[1], device=device)[None, :] * block_size < seq_lens[:, None]
        )
        entries = tables[used]
        if entries.numel() and (int(entries.min()) < 0 or int(entries.max()) >= num_blocks):
            raise ValueError(
                f"{part}_block_tables holds block numbers outside [0, {num_blocks}): "
                f"{int(entries.min())}..{int(entries.max())}"
            )
        return seq_lens


def _index(
    name: str, t: torch.Tensor | None, dtype: torch.dtype, ndim: int, device: torch.device
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.dim() != ndim or t.device != device or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {ndim}-D {dtype} tensor on {device}, got "
            f"{t.dtype} {tuple(t.shape)} on {t.device}"
            + ("" if t.is_contiguous() else " (not contiguous)")
        )
    return t


class RMSNorm(nn.Module):
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
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, rope_inv_freq(config))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "longrope":
        original = scaling["original_max_position_embeddings"]
        freqs[original:] = torch.outer(positions[original:], rope_inv_freq(config, long=True))
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    if scaling.get("attention_factor", 1.0) != 1.0:
        cache = cache * scaling["attention_factor"]
    return cache.contiguous().to(device)


class Attention(nn.Module):
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
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        v2_workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        T = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q = qkv[:, : self.q_size]
        k = qkv[:, self.q_size : self.q_size + self.kv_size]
        v = qkv[:, self.q_size + self.kv_size :]
        if self.q_norm is not None:
            q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
        _C.rotary_embedding(positions, q, k, self.head_dim, cos_sin_cache, True)
        key_cache, value_cache = kv_cache
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        out = torch.empty(
            T, self.num_heads, self.head_dim, dtype=hidden.dtype, device=hidden.device
        )
        if meta.contiguous:
            self._contiguous_attention(out, q, k, v, positions, key_cache, value_cache, meta)
            return self.o_proj(out.view(T, self.q_size))
        _C.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, "auto")
        block_size = value_cache.shape[3]
        P = meta.num_prefill_tokens
        if P:
            _C.paged_attention_prefill(
                out[:P], q[:P], key_cache, value_cache, self.num_kv_heads, self.scale,
                meta.prefill_block_tables, meta.prefill_seq_lens, meta.prefill_query_start_loc,
                block_size, meta.max_query_len, None, self.sliding_window, self.sinks,
            )  # fmt: skip
        if P < T:
            if v2_workspace is None:
                _C.paged_attention_v1(
                    out[P:], q[P:], key_cache, value_cache, self.num_kv_heads, self.scale,
                    meta.decode_block_tables, meta.decode_seq_lens, block_size,
                    meta.max_decode_seq_len, None, self.sliding_window, self.sinks,
                )  # fmt: skip
            else:
                exp_sums, max_logits, tmp_out = v2_workspace
                _C.paged_attention_v2(
                    out[P:], exp_sums, max_logits, tmp_out, q[P:], key_cache, value_cache,
                    self.num_kv_heads, self.scale, meta.decode_block_tables,
                    meta.decode_seq_lens, block_size, meta.max_decode_seq_len, None,
                    self.sliding_window, self.sinks,
                )  # fmt: skip
        return self.o_proj(out.view(T, self.q_size))

    def _head_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head of x [T, H * D] (a row view of qkv): a new [T, H * D]."""
        heads = x.reshape(-1, self.head_dim)
        return norm(heads).view(x.shape[0], -1)

    def _contiguous_attention(self, out, q, k, v, positions, key_cache, value_cache, meta):
        """The same attention over the contiguous KV arena: slots instead of block tables."""
        _C.write_kv_contiguous(k, v, key_cache, value_cache, meta.slot_mapping, positions)
        P, T = meta.num_prefill_tokens, meta.num_tokens
        if P:
            _C.contiguous_attention_prefill(
                out[:P], q[:P], key_cache, value_cache, self.num_kv_heads, self.scale,
                meta.prefill_seq_slots, meta.prefill_seq_lens, meta.prefill_query_start_loc,
                meta.max_query_len, self.sliding_window, self.sinks,
            )  # fmt: skip
        if P < T:
            _C.contiguous_attention_decode(
                out[P:], q[P:], key_cache, value_cache, self.num_kv_heads, self.scale,
                meta.decode_seq_slots, meta.decode_seq_lens, meta.max_decode_seq_len,
                self.sliding_window, self.sinks,
            )  # fmt: skip


class MLP(nn.Module):
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gelu:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))
        act = torch.empty(x.shape[0], self.intermediate_size, dtype=x.dtype, device=x.device)
        _C.silu_and_mul(act, gate_up)
        return self.down_proj(act)


def v2_workspace(
    meta: AttentionMetadata, num_heads: int, head_size: int, dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The step's scratch for paged_attention_v2 (shared by all layers), or None for v1."""
    if meta.contiguous or not meta.num_decode_tokens:
        return None  # the contiguous decode op splits long contexts by itself
    if not meta.use_v2(num_heads, torch.device(device)):
        return None
    partitions = -(-meta.max_decode_seq_len // ops.PARTITION_SIZE)
    shape = (meta.num_decode_tokens, num_heads, partitions)
    return (
        torch.empty(shape, dtype=torch.float32, device=device),
        torch.empty(shape, dtype=torch.float32, device=device),
        torch.empty((*shape, head_size), dtype=dtype, device=device),
    )
