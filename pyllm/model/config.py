"""One description of a decoder-only model, read from an HF config.json or from GGUF metadata.

Every family pyllm runs (pyllm.model.registry) is this block with switches: token
embedding (optionally scaled), N pre-norm decoder layers (RMSNorm, grouped-query
attention with neox-style rotary embeddings and optional per-head q/k RMSNorm,
RMSNorm, gated MLP), a final RMSNorm and an LM head (optionally tied to the
embedding). Llama 2/3, Mistral, SmolLM2, Qwen2 and Qwen3 differ only in the fields
below; Gemma 3 adds norms after attention and MLP, GELU gating and layers of two kinds
(sliding window and global, each with its rope base). Mixture-of-experts families
(Qwen3-MoE, Mixtral) replace the MLP of their sparse layers by a router and
num_experts gated MLPs (pyllm.model.moe).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from pyllm.model import registry

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_tanh")
# The experts' activations ops.fused_moe runs: silu(gate) * up, or gpt-oss's clamped
# (up + 1) * gate * sigmoid(alpha * gate).
SUPPORTED_MOE_ACTIVATIONS = ("silu", "swigluoai")


@dataclass(slots=True)
class ModelConfig:
    architecture: str  # a name of registry.FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    # None, or {"rope_type": "linear", "factor": f} or {"rope_type": "llama3", "factor",
    # "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}.
    rope_scaling: dict[str, Any] | None = None
    # GGUF files of Llama 3.1+ store the llama3 scaling as per-frequency divisors
    # (tensor rope_freqs.weight, head_dim / 2 values) instead of parameters.
    rope_freq_factors: tuple[float, ...] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias sets this and o_bias
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    source: str = ""  # the file this config came from, for error messages
    hidden_act: str = "silu"  # the MLP's gate: silu or gelu_tanh (GeGLU)
    qk_norm: bool = False  # RMSNorm over each q and k head before rope (Qwen3, Gemma 3)
    # Rope rotates each head's pairs (2i, 2i + 1) rather than (i, i + D/2): GGUF files of
    # Llama keep q/k rows in that order (llama.cpp's), read where they lie.
    rope_interleaved: bool = False
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    # Layers marked "sliding_attention" attend to the last sliding_window positions
    # only and use rope_local_theta, unscaled; () means every layer is global. A window
    # with no layer types applies to every layer (Mistral).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    # Added to every RMSNorm weight at load: HF's Gemma stores w for a scale of 1 + w.
    norm_weight_offset: float = 0.0
    # A learned logit per query head in every attention softmax, with no value (gpt-oss).
    attn_sinks: bool = False
    # Mixture of experts (num_experts 0: every MLP is dense). A sparse layer's router
    # scores num_experts experts (gated MLPs of moe_intermediate_size) per token and
    # sums the outputs of the best num_experts_per_tok, weighted by the softmax of their
    # scores, renormalized over the chosen ones if norm_topk_prob. Qwen's rule for which
    # layers are sparse: every decoder_sparse_step-th one, except mlp_only_layers.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    expert_bias: bool = False  # biases on each expert's gate, up and down (gpt-oss)
    moe_activation: str = "silu"  # SUPPORTED_MOE_ACTIVATIONS; alpha and limit: swigluoai's
    moe_alpha: float = 1.702
    moe_limit: float = 7.0
    # Under expert parallelism (pyllm.model.shard.shard_config) the experts
    # [start, stop) of num_experts that this rank holds; None: all of them.
    local_experts: tuple[int, int] | None = None

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is sparse (a router and experts)."""
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def expert_range(self) -> range:
        """The experts this model (or rank) holds."""
        start, stop = self.local_experts or (0, self.num_experts)
        return range(start, stop)

    @property
    def has_dense_layers(self) -> bool:
        return not all(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window (None: it attends to the whole sequence)."""
        if not self.sliding_window:
            return None
        if self.layer_types and self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def __post_init__(self) -> None:
        where = f" in {self.source}" if self.source else ""
        registry.family_of_gguf(self.architecture, self.source or "the config")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {SUPPORTED_ACTIVATIONS}{where}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries{where}; expected one per "
                f"layer ({self.num_hidden_layers})"
            )
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int{where}, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads}){where}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim must be even for rotary embeddings{where}, got {self.head_dim}"
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type == "longrope":
                for key in ("short_factor", "long_factor"):
                    if len(self.rope_scaling[key]) != self.head_dim // 2:
                        raise ValueError(f"longrope {key} needs head_dim / 2 values{where}")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise NotImplementedError(
                    f"rope scaling type {rope_type!r}{where} is not supported; supported: "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)}"
                )
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freq_factors has {len(self.rope_freq_factors)} values{where}; "
                f"expected head_dim / 2 = {self.head_dim // 2}"
            )
        if self.num_experts:
            self._check_moe(where)

    def _check_moe(self, where: str) -> None:
        for name in ("num_experts", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int{where}, got {value!r}")
        top_k = self.num_experts_per_tok
        if not isinstance(top_k, int) or not 1 <= top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must lie in [1, num_experts={self.num_experts}]{where}, "
                f"got {top_k!r}"
            )
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if outside:
            raise ValueError(
                f"mlp_only_layers names layers {outside} outside [0, "
                f"{self.num_hidden_layers}){where}"
            )
        if self.moe_activation not in SUPPORTED_MOE_ACTIVATIONS:
            raise NotImplementedError(
                f"the experts' activation {self.moe_activation!r}{where} is not supported; "
                f"supported: {', '.join(SUPPORTED_MOE_ACTIVATIONS)}"
            )

    # -- HF config.json -------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> ModelConfig:
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise FileNotFoundError(
                f"{config_file} not found (an HF model folder needs config.json)"
            )
        try:
            with open(config_file, encoding="utf-8") as f:
                raw = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{config_file} is not valid JSON: {error}") from None
        return cls.from_hf_dict(raw, source=config_file)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        family = registry.family_of_hf(raw, source)
        arch = family.name

        def need(key: str) -> Any:
            if key not in raw:
                raise ValueError(f"{source} lacks {key!r}, which a {arch} model needs")
            return raw[key]

        num_heads = need("num_attention_heads")
        hidden_size = need("hidden_size")
        rope_theta, rope_scaling = _hf_rope(raw, source)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        try:
            fields = family.hf_fields(raw)
        except NotImplementedError as error:
            raise NotImplementedError(f"{source}: {error}") from None
        base = dict(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden_size // num_heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            source=source,
        )
        return cls(**{**base, **fields})

    # -- GGUF metadata --------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(
        cls,
        metadata: dict[str, Any],
        tensor_names: set[str],
        source: str,
        rope_factors: dict[str, tuple[float, ...]] | None = None,
    ) -> ModelConfig:
        """metadata: the file's key/value pairs (``llama.block_count`` ...);
        tensor_names: the names of its tensors (a missing ``output.weight`` means the
        LM head is tied to ``token_embd.weight``); rope_factors: the values of the
        file's rope_freqs / rope_factors_short / rope_factors_long tensors."""
        rope_factors = rope_factors or {}
        family = registry.family_of_gguf(metadata.get("general.architecture"), source)
        arch = family.name

        def key(name: str, default: Any = None) -> Any:
            full = f"{arch}.{name}"
            if full in metadata:
                return metadata[full]
            if default is None:
                raise ValueError(f"{source} lacks the GGUF metadata key {full!r}")
            return default

        hidden_size = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        tokens = metadata.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens) if tokens is not None else int(key("vocab_size"))
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        base = dict(
            architecture=arch,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=int(key("attention.key_length", hidden_size // num_heads)),
            max_position_embeddings=int(key("context_length")),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(metadata, arch, source, rope_factors),
            rope_freq_factors=rope_factors.get("rope_freqs"),
            **_gguf_tensor_flags(tensor_names),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            source=source,
            **_gguf_moe(key, metadata, tensor_names, source),
        )
        return cls(**{**base, **family.gguf_fields(key, metadata)})


def _gguf_tensor_flags(tensor_names: set[str]) -> dict:
    """What the file's tensor names say: a tied LM head (no output.weight), biases."""
    return {
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "qkv_bias": "blk.0.attn_q.bias" in tensor_names,
        "o_bias": "blk.0.attn_output.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_down.bias" in tensor_names,
    }


def _gguf_moe(key, metadata: dict[str, Any], tensor_names: set[str], source: str) -> dict:
    """The expert fields of any architecture's file (Mixtral's is llama's with
    expert_count). A layer is sparse if it has a router (ffn_gate_inp). llama.cpp
    renormalizes the chosen experts' weights for qwen3moe and llama; a file may say
    otherwise with expert_weights_norm."""
    experts = int(key("expert_count", 0))
    if not experts:
        return {}
    arch = metadata["general.architecture"]
    # Keys of routing schemes the op does not run, and the values that mean "not used"
    # (gating 0 is llama.cpp's "the architecture's default", softmax for these).
    for name, allowed, what in (
        ("expert_shared_count", (0,), "shared experts"),
        ("expert_weights_scale", (1.0,), "scaled expert weights"),
        ("expert_gating_func", (0, 1), "expert gating other than softmax"),
        ("expert_group_count", (0,), "expert groups"),
    ):
        value = metadata.get(f"{arch}.{name}", allowed[0])
        if value not in allowed:
            raise NotImplementedError(
                f"{source}: {what} ({arch}.{name} = {value!r}) are not supported"
            )
    layers = int(key("block_count"))
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names]
    first = f"blk.{sparse[0]}." if sparse else "blk.0."
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(key("expert_used_count")),
        moe_intermediate_size=int(key("expert_feed_forward_length", key("feed_forward_length"))),
        norm_topk_prob=bool(metadata.get(f"{arch}.expert_weights_norm", True)),
        mlp_only_layers=tuple(i for i in range(layers) if i not in sparse),
        router_bias=first + "ffn_gate_inp.bias" in tensor_names,
        expert_bias=first + "ffn_gate_exps.bias" in tensor_names,
    )


def _hf_rope(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """transformers 5 writes ``rope_parameters`` (theta inside); older files write
    ``rope_theta`` and ``rope_scaling`` (with ``type`` or ``rope_type``)."""
    params = dict(raw.get("rope_parameters") or {})
    # Models with layers of two kinds (Gemma 3) keep one entry per kind: the global
    # layers' is the model's rope; the family reads the other.
    params = dict(params.get("full_attention", params))
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise NotImplementedError(
            f"partial_rotary_factor in {source} is not supported (rope over the whole head only)"
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "longrope":
        return theta, _longrope(merged, raw, source)
    if rope_type == "yarn":
        return theta, _yarn(merged, raw.get("max_position_embeddings"), source)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope scaling type {rope_type!r} in {source} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    needed = {"linear": ("factor",), "llama3": _LLAMA3_KEYS}[rope_type]
    missing = [k for k in needed if k not in merged]
    if missing:
        raise ValueError(f"{source}: {rope_type} rope scaling lacks {', '.join(missing)}")
    return theta, {"rope_type": rope_type, **{k: merged[k] for k in needed}}


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _longrope(params: dict[str, Any], raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Phi-3's LongRoPE: per-frequency divisors for positions within the pretraining
    context (short_factor) and past it (long_factor), and cos/sin scaled by an attention
    factor, by default sqrt(1 + ln(f) / ln(original)) for f = context / original."""
    original = params.get(
        "original_max_position_embeddings", raw.get("original_max_position_embeddings")
    )
    missing = [k for k in ("short_factor", "long_factor") if k not in params]
    if original is None or missing:
        missing += [] if original else ["original_max_position_embeddings"]
        raise ValueError(f"{source}: longrope rope scaling lacks {', '.join(missing)}")
    factor = params.get("factor") or raw.get("max_position_embeddings", original) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return {
        "rope_type": "longrope",
        "short_factor": tuple(float(x) for x in params["short_factor"]),
        "long_factor": tuple(float(x) for x in params["long_factor"]),
        "original_max_position_embeddings": int(original),
        "attention_factor": float(attention),
    }


def _yarn(params: dict[str, Any], context: int | None, source: str) -> dict[str, Any]:
    """YaRN (gpt-oss, Qwen with long contexts): frequencies rotating fewer than
    beta_slow times over the original context are interpolated by `factor`, those
    rotating more than beta_fast times kept, a linear ramp between; cos/sin carry an
    attention factor, by default 0.1 ln(factor) + 1. truncate (HF's default True)
    rounds the ramp's ends outward to whole dimensions."""
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None and original and context:
        factor = context / original
    if not original or not factor:
        missing = [k for k, v in (("factor", factor), ("original_max_position_embeddings",
                                                       original)) if not v]  # fmt: skip
        raise ValueError(f"{source}: yarn rope scaling lacks {', '.join(missing)}")
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    return {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": int(original),
        "beta_fast": float(params.get("beta_fast") or 32.0),
        "beta_slow": float(params.get("beta_slow") or 1.0),
        "truncate": bool(params.get("truncate", True)),
        "attention_factor": float(attention),
    }


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _gguf_rope_scaling(
    metadata: dict[str, Any], arch: str, source: str, factors: dict[str, tuple[float, ...]]
) -> dict[str, Any] | None:
    if "rope_factors_short" in factors and "rope_factors_long" in factors:
        params = {
            "short_factor": factors["rope_factors_short"],
            "long_factor": factors["rope_factors_long"],
            "original_max_position_embeddings": metadata.get(
                f"{arch}.rope.scaling.original_context_length"
            ),
            "attention_factor": metadata.get(f"{arch}.rope.scaling.attn_factor"),
        }
        context = {"max_position_embeddings": metadata.get(f"{arch}.context_length")}
        return _longrope(params, context, source)
    rope_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    if rope_type == "none":
        return None
    if rope_type == "linear":
        return {"rope_type": "linear", "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    if rope_type == "yarn":
        scaling = f"{arch}.rope.scaling."
        params = {
            "factor": metadata.get(scaling + "factor"),
            "original_max_position_embeddings": metadata.get(scaling + "original_context_length"),
            "beta_fast": metadata.get(scaling + "yarn_beta_fast"),
            "beta_slow": metadata.get(scaling + "yarn_beta_slow"),
            # gpt-oss was trained without rounding the ramp's ends (its HF config says
            # truncate: false); llama.cpp rounds them for every model.
            "truncate": arch != "gpt-oss",
        }
        return _yarn(params, metadata.get(f"{arch}.context_length"), source)
    raise NotImplementedError(
        f"rope scaling type {rope_type!r} in {source} ({arch}.rope.scaling.type) is not supported"
    )


def resolve_max_model_len(config: ModelConfig, asked: int | None) -> int:
    """asked, or the model's context by default."""
    limit = config.max_position_embeddings
    if asked is not None and not 1 <= asked <= limit:
        raise ValueError(
            f"max_model_len must lie in [1, {limit}] (max_position_embeddings), got {asked}"
        )
    return asked or limit


def local_rope_config(config: ModelConfig) -> ModelConfig:
    """The config whose rope the sliding-window layers use: their own base, unscaled."""
    return replace(
        config, rope_theta=config.rope_local_theta, rope_scaling=None, rope_freq_factors=None
    )


def rope_inv_freq(config: ModelConfig, long: bool = False) -> torch.Tensor:
    """The rotary inverse frequencies [head_dim / 2] in float32, scaled as the config asks
    (long: LongRoPE's frequencies for positions past the pretraining context)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * config.rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(inv_freq, config.rope_theta, dim, scaling)
    return _llama3_inv_freq(inv_freq, scaling)


def _yarn_inv_freq(
    inv_freq: torch.Tensor, theta: float, dim: int, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN's blend (see _yarn) of the interpolated and the original frequencies."""
    original = scaling["original_max_position_embeddings"]

    def dimension(rotations: float) -> float:
        # The dimension whose frequency turns `rotations` times over the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling["beta_fast"]), dimension(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0.0, 1.0)
    # ramp = 0 for the fast (kept) dimensions, 1 for the slow (interpolated) ones.
    return inv_freq / scaling["factor"] * ramp + inv_freq * (1 - ramp)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's long-context rule: wavelengths longer than the original context /
    low_freq_factor are stretched by `factor`, those shorter than original context /
    high_freq_factor are kept, and the band between is interpolated linearly in
    (original context / wavelength)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    stretched = inv_freq / factor
    blend = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    # blend = 0 on the long side (fully stretched), 1 on the short side (unchanged).
    scaled = (1 - blend) * stretched + blend * inv_freq
    keep = wavelen < original / high
    stretch = wavelen > original / low
    return torch.where(keep, inv_freq, torch.where(stretch, stretched, scaled))
