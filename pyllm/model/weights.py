"""Where each named checkpoint tensor goes in the model, shared by the safetensors and
GGUF loaders."""

from __future__ import annotations

import re

import torch

from pyllm.model.llama import LlamaForCausalLM

# Checkpoint tensors that carry no weights of ours (rotary tables some exporters save).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def weight_slots(model: LlamaForCausalLM) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """HF tensor name -> the view of the model's parameter it fills, and each fused
    parameter's name -> the names of its parts. The model's module names are HF's; q/k/v
    are row ranges of qkv_proj, gate/up of gate_up_proj, and a checkpoint may hold
    either the parts (most) or the fused tensor (Phi-3)."""
    config = model.config
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    slots, fused = {}, {}
    for name, param in model.named_parameters():
        prefix, _, kind = name.rpartition(".")
        if prefix.endswith(".qkv_proj"):
            base = prefix.removesuffix("qkv_proj")
            parts = {"q_proj": param[:q], "k_proj": param[q : q + kv], "v_proj": param[q + kv :]}
        elif prefix.endswith(".gate_up_proj"):
            base = prefix.removesuffix("gate_up_proj")
            parts = {"gate_proj": param[:inter], "up_proj": param[inter:]}
        else:
            slots[name] = param
            continue
        fused[name] = [f"{base}{part}.{kind}" for part in parts]
        slots.update({f"{base}{part}.{kind}": view for part, view in parts.items()})
        slots[name] = param
    return slots, fused


class WeightFiller:
    """Copies named tensors into their slots and, at the end, names any slot left empty."""

    def __init__(self, model: LlamaForCausalLM, source: str) -> None:
        self.slots, self.fused = weight_slots(model)
        self.filled: set[str] = set()
        self.source = source
        self.tied = model.config.tie_word_embeddings
        self.norm_offset = model.config.norm_weight_offset

    def fill(
        self, name: str, tensor: torch.Tensor, where: str | None = None, hf: bool = False
    ) -> None:
        """hf: the tensor comes from an HF checkpoint, whose norm weights some families
        store offset (ModelConfig.norm_weight_offset)."""
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
        if hf and self.norm_offset and name.endswith("norm.weight"):
            tensor = tensor.float() + self.norm_offset
        with torch.no_grad():
            slot.copy_(tensor)
        self.mark(name)

    def mark(self, name: str) -> None:
        """name counts as filled (by fill, or by a loader that set its module itself)."""
        self.filled.add(name)
        self.filled.update(self.fused.get(name, ()))

    def finish(self) -> None:
        missing = [n for n in self.slots if n not in self.filled and n not in self.fused]
        if missing:
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise ValueError(f"{self.source}: missing tensor(s) {shown}")
