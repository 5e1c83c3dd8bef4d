"""Where each named checkpoint tensor goes in the model, shared by the safetensors and
GGUF loaders. A tensor-parallel rank takes its range of each split tensor
(pyllm.distributed.parallel says which)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from pyllm.model.llama import LlamaForCausalLM

# Checkpoint tensors that carry no weights of ours (rotary tables some exporters save).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


@dataclass
class Slot:
    """The view a checkpoint tensor of shape `full_shape` fills: all of it, or (split)
    the rows `take` of its dimension `dim`; `zero`: filled with zeros instead (the bias
    of a row-parallel layer, which the ranks' sum must add once)."""

    view: torch.Tensor
    full_shape: tuple[int, ...]
    dim: int | None = None
    take: range | None = None
    zero: bool = False

    def index(self) -> tuple[slice, ...] | None:
        """The part of the checkpoint tensor this slot takes, as an index (None: all)."""
        if self.dim is None:
            return None
        index = [slice(None)] * len(self.full_shape)
        index[self.dim] = slice(self.take.start, self.take.stop)
        return tuple(index)

    def part_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = len(self.take)
        return tuple(shape)


def shard_rows(model: LlamaForCausalLM) -> tuple[range, range, range]:
    """The rank's rows of a q, a k (or v), and a gate (or up) projection."""
    config, shard, d = model.config, model.shard, model.config.head_dim
    q_heads = shard.split(config.num_attention_heads)
    kv_heads = shard.kv_heads(config.num_key_value_heads)
    return (
        range(q_heads.start * d, q_heads.stop * d),
        range(kv_heads.start * d, kv_heads.stop * d),
        shard.split(config.intermediate_size),
    )


def weight_slots(model: LlamaForCausalLM) -> tuple[dict[str, Slot], dict[str, list[str]]]:
    """HF tensor name -> its Slot, and each fused parameter's name -> the names of its
    parts. The model's module names are HF's; q/k/v are row ranges of qkv_proj, gate/up
    of gate_up_proj, and a checkpoint may hold either the parts (most) or the fused
    tensor (Phi-3)."""
    config, shard = model.config, model.shard
    local = model.local_config
    q_rows, kv_rows, inter_rows = shard_rows(model)
    split = shard.size > 1
    slots: dict[str, Slot] = {}
    fused: dict[str, list[str]] = {}
    for name, param in model.named_parameters():
        prefix, _, kind = name.rpartition(".")
        if prefix.endswith((".qkv_proj", ".gate_up_proj")):
            if prefix.endswith(".qkv_proj"):
                q, kv = local.q_size, local.kv_size
                parts = {
                    "q_proj": (param[:q], config.q_size, q_rows),
                    "k_proj": (param[q : q + kv], config.kv_size, kv_rows),
                    "v_proj": (param[q + kv :], config.kv_size, kv_rows),
                }
            else:
                inter = local.intermediate_size
                parts = {
                    "gate_proj": (param[:inter], config.intermediate_size, inter_rows),
                    "up_proj": (param[inter:], config.intermediate_size, inter_rows),
                }
            base = prefix.rpartition(".")[0] + "."
            fused[name] = [f"{base}{part}.{kind}" for part in parts]
            for part, (view, rows, take) in parts.items():
                shape = (rows, *view.shape[1:])
                slots[f"{base}{part}.{kind}"] = Slot(view, shape, 0 if split else None, take)
            full = sum(rows for _, rows, _ in parts.values())
            slots[name] = Slot(param, (full, *param.shape[1:]))
        elif prefix.endswith((".o_proj", ".down_proj")) and split:
            if kind == "bias":
                slots[name] = Slot(param, tuple(param.shape), zero=shard.rank > 0)
            else:
                take = q_rows if prefix.endswith(".o_proj") else inter_rows
                full = (param.shape[0], config.q_size if prefix.endswith(".o_proj") else
                        config.intermediate_size)  # fmt: skip
                slots[name] = Slot(param, full, 1, take)
        elif name in ("model.embed_tokens.weight", "lm_head.weight") and split:
            slots[name] = Slot(param, (config.vocab_size, param.shape[1]), 0, model.vocab_range)
        else:
            slots[name] = Slot(param, tuple(param.shape))
    return slots, fused


class WeightFiller:
    """Copies named tensors into their slots and, at the end, names any slot left empty."""

    def __init__(self, model: LlamaForCausalLM, source: str) -> None:
        self.slots, self.fused = weight_slots(model)
        self.filled: set[str] = set()
        self.source = source
        self.tied = model.config.tie_word_embeddings
        self.norm_offset = model.config.norm_weight_offset

    def part_to_read(self, name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        """For a reader that can read part of a tensor: the index of the part of
        checkpoint tensor `name` (of `shape`) this model takes, to pass to
        fill(..., part=True); None: read all of it."""
        slot = self.slots.get(name)
        if slot is None or name in self.fused or slot.full_shape != tuple(shape):
            return None
        return slot.index()

    def fill(
        self,
        name: str,
        tensor: torch.Tensor,
        where: str | None = None,
        hf: bool = False,
        part: bool = False,
    ) -> None:
        """hf: the tensor comes from an HF checkpoint, whose norm weights some families
        store offset (ModelConfig.norm_weight_offset). part: tensor is the part that
        part_to_read named, not the whole tensor."""
        where = where or self.source
        if name not in self.slots:
            if _IGNORED.fullmatch(name) or (self.tied and name == "lm_head.weight"):
                return
            raise ValueError(f"{where}: unexpected tensor {name!r} (not part of this model)")
        slot = self.slots[name]
        expected = slot.part_shape() if part else slot.full_shape
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{expected}"
            )
        if not tensor.is_floating_point():
            raise ValueError(
                f"{where}: tensor {name!r} has dtype {tensor.dtype}, expected a float type"
            )
        if name in self.fused and slot.view.shape != slot.full_shape:
            # A fused checkpoint tensor on a split model: each part takes its rows.
            offset = 0
            for part in self.fused[name]:
                rows = self.slots[part].full_shape[0]
                self.fill(part, tensor[offset : offset + rows], where, hf)
                offset += rows
            self.mark(name)
            return
        if hf and self.norm_offset and name.endswith("norm.weight"):
            tensor = tensor.float() + self.norm_offset
        with torch.no_grad():
            if slot.zero:
                slot.view.zero_()
            elif slot.dim is None:
                slot.view.copy_(tensor)
            else:
                piece = tensor if part else tensor[slot.index()]
                slot.view.narrow(slot.dim, 0, len(slot.take)).copy_(piece)
                slot.view.narrow(slot.dim, len(slot.take),
                                 slot.view.shape[slot.dim] - len(slot.take)).zero_()  # fmt: skip
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
