"""The model families pyllm runs: architecture name -> model class and config fields.

An HF folder names its family in config.json (``architectures[0]``, or ``model_type``),
a GGUF file in ``general.architecture``. Each family lists the fields of ModelConfig
that differ from the Llama defaults, read from either source; the model class is
named by path and imported when a model is built, so that reading a config needs no
kernels. Adding a family is one model file (or none, when the Llama block with a
switch of ModelConfig is that family) and one entry below.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Fields = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # GGUF general.architecture
    hf_classes: tuple[str, ...]  # HF config.json architectures
    hf_model_types: tuple[str, ...]  # HF config.json model_type (without architectures)
    model_class: str  # "module:Class"
    # Extra ModelConfig fields from an HF config dict / from GGUF metadata.
    hf_fields: Callable[[dict[str, Any]], Fields] = lambda raw: {}
    gguf_fields: Callable[[Callable[..., Any], dict[str, Any]], Fields] = lambda key, meta: {}


def _silu(raw: dict[str, Any]) -> str:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act {act!r} is not supported (only 'silu')")
    return act


def _llama_hf(raw: dict[str, Any]) -> Fields:
    bias = bool(raw.get("attention_bias", False))
    return {
        "hidden_act": _silu(raw),
        "qkv_bias": bias,
        "o_bias": bias,
        "sliding_window": raw.get("sliding_window"),
    }


def _qwen2_hf(raw: dict[str, Any]) -> Fields:
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    return {"hidden_act": _silu(raw), "qkv_bias": True, "sliding_window": window}


def _qwen3_hf(raw: dict[str, Any]) -> Fields:
    return {**_llama_hf(raw), "qk_norm": True, "sliding_window": _qwen2_hf(raw)["sliding_window"]}


def _experts(raw: dict[str, Any]) -> int:
    """Checkpoints on the hub name it num_experts (Qwen) or num_local_experts (Mixtral,
    and transformers 5's Qwen3-MoE config)."""
    return int(raw.get("num_experts") or raw.get("num_local_experts") or 0)


def _qwen3moe_hf(raw: dict[str, Any]) -> Fields:
    """Qwen3's attention; experts of moe_intermediate_size in every decoder_sparse_step-th
    layer but mlp_only_layers, whose dense MLPs are of intermediate_size."""
    return {
        **_qwen3_hf(raw),
        "num_experts": _experts(raw),
        "num_experts_per_tok": raw.get("num_experts_per_tok"),
        "moe_intermediate_size": raw.get("moe_intermediate_size"),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),  # HF's default
        "decoder_sparse_step": raw.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(raw.get("mlp_only_layers") or ()),
    }


def _mixtral_hf(raw: dict[str, Any]) -> Fields:
    """Mistral's attention; every layer sparse, experts of intermediate_size, the chosen
    experts' weights always renormalized."""
    return {
        **_llama_hf(raw),
        "num_experts": _experts(raw),
        "num_experts_per_tok": raw.get("num_experts_per_tok"),
        "moe_intermediate_size": raw.get("intermediate_size"),
        "norm_topk_prob": True,
    }


# gpt-oss: layers alternate between a sliding window (even layers) and the whole
# sequence, attention has biases and sinks, and every MLP is experts with biases
# behind a router with a bias, top-k then softmax (softmax and renormalize, the same),
# and a clamped SwiGLU.
def _gpt_oss_layer_types(num_layers: int) -> tuple[str, ...]:
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers))


def _gpt_oss_common() -> Fields:
    return {
        "qkv_bias": True,
        "o_bias": True,
        "attn_sinks": True,
        "norm_topk_prob": True,
        "router_bias": True,
        "expert_bias": True,
        "moe_activation": "swigluoai",
    }


def _gpt_oss_hf(raw: dict[str, Any]) -> Fields:
    layers = raw.get("layer_types") or _gpt_oss_layer_types(raw["num_hidden_layers"])
    return {
        **_gpt_oss_common(),
        "qkv_bias": bool(raw.get("attention_bias", True)),
        "o_bias": bool(raw.get("attention_bias", True)),
        "layer_types": tuple(layers),
        "sliding_window": raw.get("sliding_window"),
        "num_experts": _experts(raw),
        "num_experts_per_tok": raw.get("num_experts_per_tok"),
        "moe_intermediate_size": raw.get("intermediate_size"),
        "moe_alpha": float(raw.get("swiglu_alpha", 1.702)),
        "moe_limit": float(raw.get("swiglu_limit", 7.0)),
    }


def _gpt_oss_gguf(key: Callable[..., Any], meta: dict[str, Any]) -> Fields:
    # llama.cpp's gpt-oss graph fixes the SwiGLU's alpha and limit (1.702, 7.0).
    return {
        **_gpt_oss_common(),
        "layer_types": _gpt_oss_layer_types(int(key("block_count"))),
        "sliding_window": int(key("attention.sliding_window")),
    }


# Gemma 3: every sixth layer attends globally, the others within the sliding window,
# with a rope base of their own. HF stores RMSNorm weights w applied as (1 + w); GGUF
# converters store 1 + w.
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def _gemma3_layer_types(num_layers: int) -> tuple[str, ...]:
    return tuple(
        "full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
        for i in range(num_layers)
    )


def _gemma3_common(hidden_size: int) -> Fields:
    return {
        "qk_norm": True,
        "hidden_act": "gelu_tanh",
        "embed_scale": math.sqrt(hidden_size),
        "tie_word_embeddings": True,
    }


def _gemma3_hf(raw: dict[str, Any]) -> Fields:
    layers = raw.get("layer_types") or _gemma3_layer_types(raw["num_hidden_layers"])
    scalar = raw.get("query_pre_attn_scalar", 256)
    local = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
    return {
        **_gemma3_common(raw["hidden_size"]),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "layer_types": tuple(layers),
        "sliding_window": raw.get("sliding_window"),
        "attn_scale": float(scalar) ** -0.5,
        "rope_local_theta": float(
            local.get("rope_theta", raw.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA))
        ),
        "norm_weight_offset": 1.0,
        "hidden_act": _gemma3_activation(raw.get("hidden_activation", "gelu_pytorch_tanh")),
    }


def _gemma3_activation(name: str) -> str:
    if name != "gelu_pytorch_tanh":
        raise NotImplementedError(
            f"hidden_activation {name!r} is not supported for gemma3 (only 'gelu_pytorch_tanh')"
        )
    return "gelu_tanh"


def _gemma3_gguf(key: Callable[..., Any], meta: dict[str, Any]) -> Fields:
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    layers = int(key("block_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    # llama.cpp's rule: the 62-layer (27B) model scales queries by hidden / heads.
    scalar = hidden // heads if layers == 62 else head_dim
    return {
        **_gemma3_common(hidden),
        "layer_types": _gemma3_layer_types(layers),
        "sliding_window": int(key("attention.sliding_window")),
        "attn_scale": float(scalar) ** -0.5,
        "rope_local_theta": GEMMA3_LOCAL_ROPE_THETA,
    }


def _qwen3_gguf(key: Callable[..., Any], meta: dict[str, Any]) -> Fields:
    return {"qk_norm": True}


def _phi3_gguf(key: Callable[..., Any], meta: dict[str, Any]) -> Fields:
    # llama.cpp's converter keeps the checkpoint's window (2047 for Phi-3-mini-4k).
    window = meta.get("phi3.attention.sliding_window")
    return {"sliding_window": int(window) if window else None}


_LLAMA = "pyllm.model.llama:LlamaForCausalLM"
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", ("LlamaForCausalLM",), ("llama",), _LLAMA, _llama_hf),
        Family("mistral", ("MistralForCausalLM",), ("mistral",), _LLAMA, _llama_hf),
        Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), _LLAMA, _qwen2_hf),
        Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), _LLAMA, _qwen3_hf, _qwen3_gguf),
        # Mixture of experts: the Llama block with a sparse MLP (pyllm.model.moe).
        Family(
            "qwen3moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), _LLAMA, _qwen3moe_hf, _qwen3_gguf
        ),
        # Mixtral's GGUF files are llama's with llama.expert_count; "mixtral" is only HF's.
        Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), _LLAMA, _mixtral_hf),
        Family("gpt-oss", ("GptOssForCausalLM",), ("gpt_oss",), _LLAMA, _gpt_oss_hf, _gpt_oss_gguf),
        # Phi-3: q/k/v and gate/up already fused in the checkpoint, LongRoPE.
        Family("phi3", ("Phi3ForCausalLM",), ("phi3",), _LLAMA, _llama_hf, _phi3_gguf),
        Family(
            "gemma3",
            ("Gemma3ForCausalLM",),
            ("gemma3_text",),
            "pyllm.model.gemma3:Gemma3ForCausalLM",
            _gemma3_hf,
            _gemma3_gguf,
        ),
    )
}


def supported() -> str:
    return ", ".join(FAMILIES)


def family_of_hf(raw: dict[str, Any], source: str) -> Family:
    """The family an HF config.json names; ValueError naming it when pyllm has none."""
    classes = raw.get("architectures") or []
    for family in FAMILIES.values():
        if any(name in family.hf_classes for name in classes):
            return family
        if not classes and raw.get("model_type") in family.hf_model_types:
            return family
    found = ", ".join(classes) if classes else repr(raw.get("model_type"))
    hf_names = ", ".join(name for f in FAMILIES.values() for name in f.hf_classes)
    raise ValueError(f"unsupported architecture {found} in {source}; supported: {hf_names}")


def family_of_gguf(arch: object, source: str) -> Family:
    if arch not in FAMILIES:
        raise ValueError(
            f"unsupported architecture {arch!r} in {source} (general.architecture); "
            f"supported: {supported()}"
        )
    return FAMILIES[arch]


def model_class(architecture: str) -> type:
    module, name = FAMILIES[architecture].model_class.split(":")
    return getattr(importlib.import_module(module), name)
