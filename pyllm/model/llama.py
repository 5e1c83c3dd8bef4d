"""The Llama block (Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3, and with sparse MLPs
Qwen3-MoE and Mixtral) over pyllm's ops; other families subclass it (gemma3.py).

``LlamaForCausalLM(input_ids [T], positions [T], attn_metadata, kv_cache) -> hidden
[T, hidden_size]`` runs one step of a flat batch (see pyllm.attention: the metadata's
backend runs attention over the cache), and ``compute_logits(hidden, logits_indices)``
projects only the rows asked for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import pyllm.ops as ops
from pyllm import _C  # the per-layer ops, bound directly (csrc/torch_bindings.cpp)
from pyllm.attention.backend import MAIN_CACHE, AttentionBackend, CacheSpec, KVCache
from pyllm.attention.metadata import AttentionMetadata
from pyllm.model.config import ModelConfig, local_rope_config, resolve_max_model_len
from pyllm.model.layers import MLP, Attention, RMSNorm, RotaryTable, step_buffers
from pyllm.model.linear import (
    Linear,
    QuantPart,
    can_pack_linear_weights,
    can_pack_weight_words,
    dequantize_parts,
    empty_param,
    linear_forward,
    pack_linear_weight,
    plain_copy_fits,
)
from pyllm.model.module import Module
from pyllm.model.moe import SparseMoeBlock
from pyllm.model.shard import Shard, set_reductions, shard_config


def input_norm(norm: RMSNorm, hidden, residual):
    """A layer's first norm: before the first layer the stream starts as the embeddings;
    after it, the norm fuses the previous layer's residual add."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual), residual


def _layer_metadata(meta: AttentionMetadata, kv_cache: KVCache) -> list[AttentionMetadata]:
    """Each layer's view of the step: its KV group's."""
    if not kv_cache.layer_groups:
        return [meta] * len(kv_cache.layers)
    return [meta.group(g) for g in kv_cache.layer_groups]


def make_mlp(config: ModelConfig, dtype, device, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: dense, or a router and experts where the config makes it sparse."""
    if config.is_moe_layer(layer):
        return SparseMoeBlock(config, dtype, device)
    return MLP(config, dtype, device)


class DecoderLayer(Module):
    def __init__(self, config: ModelConfig, dtype, device, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, dtype, device, config.layer_window(layer))
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, device
        )
        self.mlp = make_mlp(config, dtype, device, layer)

    def forward(self, positions, hidden, residual, cos_sin_cache, kv_cache, meta, step):
        """Pre-norm block. `residual` carries the stream between layers, so each norm
        fuses the previous layer's residual add (None before the first layer). step: the
        step's buffers (layers.StepBuffers)."""
        hidden, residual = input_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden, cos_sin_cache, kv_cache, meta, step)
        hidden = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, step), residual


class LlamaModel(Module):
    def __init__(
        self, config: ModelConfig, dtype, device, layer_cls: type[nn.Module], vocab_rows: int
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = empty_param(
            vocab_rows, config.hidden_size, dtype=dtype, device=device
        )
        # A quantized token table (GGUF) replaces the weight: rows dequantized on lookup.
        self.embed_tokens.qpart: QuantPart | None = None
        self.layers = nn.ModuleList(
            layer_cls(config, dtype, device, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class LlamaForCausalLM(Module):
    layer_cls: type[nn.Module] = DecoderLayer

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_model_len: int | None = None,
        tp=None,
    ) -> None:
        """max_model_len bounds the positions (and the rotary table); it defaults to
        and may not exceed config.max_position_embeddings. tp: the rank's group (a
        TensorParallelGroup: its shard, all_reduce and gather_columns), to build this
        rank's shard."""
        super().__init__()
        if dtype not in ops.SUPPORTED_DTYPES:
            raise ValueError(f"dtype {dtype} is not supported; supported: {ops.SUPPORTED_DTYPES}")
        if config.head_dim not in ops.SUPPORTED_HEAD_SIZES:
            raise ValueError(
                f"head_dim {config.head_dim} ({config.source}) is not supported by pyllm's "
                f"attention kernels; supported: {ops.SUPPORTED_HEAD_SIZES}"
            )
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_model_len = resolve_max_model_len(config, max_model_len)
        # The KV cache's element type (KV_CACHE_DTYPES); the engine sets it after loading.
        self.kv_cache_dtype = "auto"
        self.tp = tp
        self.shard = tp.shard if tp is not None else Shard()
        # Attention and MLP shapes of this rank (the whole model's without tp).
        self.local_config = shard_config(config, self.shard)
        # The vocabulary rows this rank holds (embedding and LM head), padded to an even
        # share: rows past the vocabulary stay zero and their logits are cut.
        self.vocab_range, vocab_rows = self.shard.padded_split(config.vocab_size)
        self.model = LlamaModel(self.local_config, dtype, device, self.layer_cls, vocab_rows)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, vocab_rows, False, dtype, device)
        if tp is not None:
            set_reductions(self, tp.all_reduce)
        # Tied: the embedding is read by row for lookups, so packing it for the LM head
        # takes a separate copy (vocab x hidden, e.g. 57 MB in bf16 for SmolLM2), in
        # the layout of the projections (linear.Linear.pack).
        self.tied_lm_head_words: torch.Tensor | None = None
        self.tied_lm_head_packed: torch.Tensor | None = None
        self._register_rotary_tables(config, device)
        self.embed_scale = None
        if config.embed_scale is not None:
            # Rounded to the model's dtype first, as HF does.
            self.embed_scale = float(torch.tensor(config.embed_scale, dtype=dtype))

    def _register_rotary_tables(self, config: ModelConfig, device) -> None:
        tables = [RotaryTable(config, self.max_model_len, device)]
        # Sliding-window layers of a model with two kinds (Gemma 3) rotate by their own base.
        if "sliding_attention" in config.layer_types and config.rope_local_theta:
            tables.append(RotaryTable(local_rope_config(config), self.max_model_len, device))
        self.rotary_tables = tables
        self.register_buffer("cos_sin_cache", tables[0].table, persistent=False)
        local = tables[1].table if len(tables) > 1 else None
        self.register_buffer("local_cos_sin_cache", local, persistent=False)

    def ensure_rotary(self, positions: torch.Tensor) -> None:
        """The rotary tables' rows up to the step's last position, computed (RotaryTable):
        before a step, outside what a kernel graph records."""
        if self.rotary_tables[0].filled >= self.max_model_len or positions.numel() == 0:
            return
        top = int(positions.max()) + 1
        for table in self.rotary_tables:
            table.ensure(top)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab_size, hidden_size]: the embedding itself when the two are tied."""
        if self.config.tie_word_embeddings:
            embed = self.model.embed_tokens
            if embed.qpart is not None:
                return dequantize_parts([embed.qpart], self.config.hidden_size, self.dtype)
            return embed.weight
        return self.lm_head.dense_weight()

    def set_quantized_embedding(self, part: QuantPart) -> None:
        """Keeps the token table quantized (the float table goes); a tied LM head reads
        the same blocks through linear_quantized."""
        self.model.embed_tokens.qpart = part
        self.model.embed_tokens.weight = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._scale(self._lookup(input_ids))
        # Vocabulary-parallel: each rank looks up the ids in its range, zeros the rest,
        # and the sum over ranks is every row.
        local = input_ids - self.vocab_range.start
        outside = (local < 0) | (local >= len(self.vocab_range))
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside[:, None], 0)
        return self._scale(self.tp.all_reduce(out))

    def _scale(self, out: torch.Tensor) -> torch.Tensor:
        if self.embed_scale is not None:
            out.mul_(self.embed_scale)
        return out

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        part = self.model.embed_tokens.qpart
        if part is None:
            out = F.embedding(input_ids, self.model.embed_tokens.weight)
        else:
            out = torch.empty(
                input_ids.shape[0], self.config.hidden_size, dtype=self.dtype, device=self.device
            )
            _C.dequantize_rows(out, part.qweight, part.qtype, input_ids)
        return out

    def pack_weights(self, keep_plain: bool | None = None) -> bool:
        """Lays every projection's weight out for the CPU's faster kernel: word-packed
        for pyllm's packed_linear, or oneDNN's packed layout (CPU only; see
        linear.Linear). Call after loading; returns whether it packed. keep_plain keeps
        the plain weights too; by default it does only beside oneDNN's copy (for the
        small-batch path) and when that second copy fits (layers.plain_copy_fits)."""
        linears = [
            m
            for m in self.modules()
            if isinstance(m, Linear)
            and m.weight is not None
            and m.packed_weight is None
            and m.word_weight is None
        ]
        words = self.device.type == "cpu" and all(can_pack_weight_words(m.weight) for m in linears)
        if not words and not can_pack_linear_weights(self.device, self.dtype):
            return False
        if keep_plain is None:
            nbytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
            keep_plain = not words and plain_copy_fits(nbytes)
        for module in linears:
            module.pack(keep_plain)
        embedding = self.model.embed_tokens.weight
        if self.config.tie_word_embeddings and embedding is not None:
            if can_pack_weight_words(embedding):
                self.tied_lm_head_words = ops.pack_weight_words(embedding)
            elif can_pack_linear_weights(self.device, self.dtype):
                self.tied_lm_head_packed = pack_linear_weight(embedding)
        return True

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_cache: KVCache,
        validate: bool = True,
    ) -> torch.Tensor:
        """One step; returns the final-normed hidden states [T, hidden_size].
        validate=False skips the per-step index checks (for callers that built the
        metadata themselves and checked it)."""
        if validate:
            self.validate_step(input_ids, positions, attn_metadata, kv_cache)
        self.ensure_rotary(positions)
        return self.run_layers(self.embed(input_ids), positions, attn_metadata, kv_cache)

    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """The layers and the final norm over the step's embeddings hidden [T,
        hidden_size] (the part of a step that model.step_graph records)."""
        T = hidden.shape[0]
        config, dtype, device = self.local_config, self.dtype, self.device
        workspace = attn_metadata.backend.workspace(
            attn_metadata, config.num_attention_heads, config.head_dim, dtype, device
        )
        step = step_buffers(config, T, dtype, device, workspace, attn_metadata.num_prompt_tokens)
        residual = None
        metas = _layer_metadata(attn_metadata, kv_cache)
        layers = zip(self.model.layers, kv_cache.layers, self._layer_cos_sin(), metas, strict=True)
        for layer, layer_cache, cos_sin, meta in layers:
            hidden, residual = layer(positions, hidden, residual, cos_sin, layer_cache, meta, step)
        return self.model.norm(hidden, residual)

    def _layer_cos_sin(self) -> list[torch.Tensor]:
        if self.local_cos_sin_cache is None:
            return [self.cos_sin_cache] * len(self.model.layers)
        return [self.layer_cos_sin(i) for i in range(len(self.model.layers))]

    def layer_cos_sin(self, i: int) -> torch.Tensor:
        if self.local_cos_sin_cache is not None and self.config.layer_types[i] != "full_attention":
            return self.local_cos_sin_cache
        return self.cos_sin_cache

    @torch.inference_mode()
    def compute_logits(
        self, hidden: torch.Tensor, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Float32 logits [N, vocab_size] for hidden[logits_indices] (all rows if None).
        Tensor-parallel: gathered on rank 0; other ranks get None."""
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        logits = self._local_logits(hidden)
        if self.tp is None:
            return logits
        return self.tp.gather_columns(logits, self.config.vocab_size)

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of this rank's vocabulary rows."""
        if not self.config.tie_word_embeddings:
            return self.lm_head(hidden).float()
        embed = self.model.embed_tokens
        qparts = None if embed.qpart is None else [embed.qpart]
        words, onednn = self.tied_lm_head_words, self.tied_lm_head_packed
        return linear_forward(hidden, embed.weight, None, qparts, words, onednn).float()

    def validate_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_cache: KVCache,
    ) -> None:
        """The checks pyllm.ops would make per op, made once for the whole step."""
        backend, layers = kv_cache.backend, kv_cache.layers
        if attn_metadata.backend is not backend:
            raise ValueError(
                f"attn_metadata is {attn_metadata.backend.name} metadata but kv_cache is a "
                f"{backend.name} cache"
            )
        self._check_cache(backend, layers)
        T = attn_metadata.num_tokens
        for name, t in (("input_ids", input_ids), ("positions", positions)):
            if t.dtype != torch.int64 or t.shape != (T,) or t.device != self.device:
                raise ValueError(
                    f"{name} must be int64 [{T}] (one per slot_mapping entry) on {self.device}, "
                    f"got {t.dtype} {tuple(t.shape)} on {t.device}"
                )
        if T and (int(positions.min()) < 0 or int(positions.max()) >= self.max_model_len):
            raise ValueError(
                f"positions must lie in [0, max_model_len={self.max_model_len}), got "
                f"{int(positions.min())}..{int(positions.max())}"
            )
        vocab_size = self.local_config.vocab_size
        if T and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
            raise ValueError(
                f"input_ids must lie in [0, {vocab_size}), got "
                f"{int(input_ids.min())}..{int(input_ids.max())}"
            )
        backend.validate_cache(attn_metadata, kv_cache, self.device)

    def _check_cache(self, backend: AttentionBackend, layers: list) -> None:
        """Every layer's cache: this model's layer count, kv heads, head size and dtype."""
        config = self.local_config
        if len(layers) != config.num_hidden_layers:
            raise ValueError(
                f"kv_caches has {len(layers)} layers, the model {config.num_hidden_layers}"
            )
        key_cache, value_cache = layers[0][:2]
        num_kv_heads, head_size = backend.cache_heads(layers[0])
        if (num_kv_heads, head_size) != (config.num_key_value_heads, config.head_dim):
            raise ValueError(
                f"kv_caches hold {num_kv_heads} kv heads of size {head_size}; the model needs "
                f"{config.num_key_value_heads} of size {config.head_dim}"
            )
        dtype, scales = self.cache_spec.cache_dtype, 2 if self.kv_cache_dtype == "int8" else 0
        for i, (k, v, *rest) in enumerate(layers):
            if k.shape[1:] != key_cache.shape[1:] or v.shape[1:] != value_cache.shape[1:]:
                raise ValueError(f"kv_caches[{i}] differs in shape from kv_caches[0]")
            if k.dtype != dtype:
                raise ValueError(f"kv_caches[{i}] holds {k.dtype}, the cache {dtype}")
            if len(rest) != scales:
                raise ValueError(
                    f"kv_caches[{i}] must hold {2 + scales} tensors, got {2 + len(rest)}"
                )

    @property
    def cache_spec(self) -> CacheSpec:
        """This rank's KV cache geometry."""
        config = self.local_config
        windows = tuple(config.layer_window(i) or 0 for i in range(config.num_hidden_layers))
        return CacheSpec(
            config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
            self.dtype, self.device, self.max_model_len, windows, self.kv_cache_dtype,
        )  # fmt: skip

    def allocate_kv_cache(
        self, backend: AttentionBackend, count: int, block_size: int = 16,
        cache_id: int = MAIN_CACHE, grouped: bool = False,
    ) -> KVCache:  # fmt: skip
        """A KV cache in backend's layout of count units (blocks of block_size tokens, or
        sequence slots), in the model's dtype and device; grouped: the layers in KV
        groups sharing one pool of blocks."""
        return backend.allocate(self.cache_spec, count, block_size, cache_id, grouped)
