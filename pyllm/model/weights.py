"""Where each named checkpoint tensor goes in the model, shared by the safetensors and
GGUF loaders."""

from __future__ import annotations

import re

import torch

from pyllm.model.llama import LlamaForCausalLM

# Checkpoint tensors that carry no weights of ours (rotary tables some exporters save).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def weight_slots(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """HF tensor name -> the view of the model's parameter it fills."""
    config = model.config
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    slots = {
        "model.embed_tokens.weight": model.model.embed_tokens.weight,
        "model.norm.weight": model.model.norm.weight,
    }
    if not config.tie_word_embeddings:
        slots["lm_head.weight"] = model.lm_head.weight  # (before pack_weights)
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        slots[prefix + "input_layernorm.weight"] = layer.input_layernorm.weight
        slots[prefix + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        kinds = ["weight"] + (["bias"] if config.qkv_bias else [])
        for kind in kinds:
            fused = getattr(attn.qkv_proj, kind)
            slots[prefix + f"self_attn.q_proj.{kind}"] = fused[:q]
            slots[prefix + f"self_attn.k_proj.{kind}"] = fused[q : q + kv]
            slots[prefix + f"self_attn.v_proj.{kind}"] = fused[q + kv :]
        for kind in ["weight"] + (["bias"] if config.o_bias else []):
            slots[prefix + f"self_attn.o_proj.{kind}"] = getattr(attn.o_proj, kind)
        for kind in ["weight"] + (["bias"] if config.mlp_bias else []):
            fused = getattr(mlp.gate_up_proj, kind)
            slots[prefix + f"mlp.gate_proj.{kind}"] = fused[:inter]
            slots[prefix + f"mlp.up_proj.{kind}"] = fused[inter:]
            slots[prefix + f"mlp.down_proj.{kind}"] = getattr(mlp.down_proj, kind)
    return slots


class WeightFiller:
    """Copies named tensors into their slots and, at the end, names any slot left empty."""

    def __init__(self, model: LlamaForCausalLM, source: str) -> None:
        self.slots = weight_slots(model)
        self.filled: set[str] = set()
        self.source = source
        self.tied = model.config.tie_word_embeddings

    def wants(self, name: str) -> bool:
        return name in self.slots

    def fill(self, name: str, tensor: torch.Tensor, where: str | None = None) -> None:
        where = where or self.source
        if name not in self.slots:
            if _IGNORED.fullmatch(name) or (self.tied and name == "lm_head.weight"):
                return
            raise ValueError(f"{where}: unexpected tensor {name!r} (not part of this model)")
        slot = self.slots[name]
        if tuple(tensor.shape) != tuple(slot.shape):
            raise ValueError(
                f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(slot.shape)}"
            )
        if not tensor.is_floating_point():
            raise ValueError(
                f"{where}: tensor {name!r} has dtype {tensor.dtype}, expected a float type"
            )
        with torch.no_grad():
            slot.copy_(tensor)
        self.filled.add(name)

    def finish(self) -> None:
        missing = [name for name in self.slots if name not in self.filled]
        if missing:
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise ValueError(f"{self.source}: missing tensor(s) {shown}")
