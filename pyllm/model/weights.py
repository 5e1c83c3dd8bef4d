"""Where each named checkpoint tensor goes in the model, shared by the safetensors and
GGUF loaders. A tensor-parallel rank takes its range of each split tensor
(pyllm.model.shard says which).

Experts (pyllm.model.moe): each 3-D parameter ``mlp.experts.gate_proj.weight [E, I, H]``
has a slot per expert, ``mlp.experts.{j}.gate_proj.weight [I, H]`` (the form HF's
save_pretrained writes); Mixtral's original names (``block_sparse_moe``, ``w1/w3/w2``)
are read as those, and the fused 3-D tensors of transformers' models
(``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) are split into them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

import pyllm.ops as ops
from pyllm.model.llama import LlamaForCausalLM
from pyllm.model.moe import SparseMoeBlock

# Checkpoint tensors that carry no weights of ours (rotary tables some exporters save).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# One expert's checkpoint tensor, e.g. model.layers.3.mlp.experts.17.up_proj.weight.
_ONE_EXPERT = re.compile(r".*\.experts\.(\d+)\..*")

# Other names of our tensors in checkpoints: Mixtral's original ones, gpt-oss's router.
_RENAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.mlp\.router\."), ".mlp.gate."),
    (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
    (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."),
    (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj."),
)

# A fused checkpoint tensor of all experts: the names of our tensors it holds, and how
# to cut it into them (each piece shaped as its tensor's slot).
FusedExperts = tuple[list[str], Callable[[torch.Tensor], tuple[torch.Tensor, ...]]]


def fused_expert_forms(base: str, architecture: str) -> dict[str, FusedExperts]:
    """transformers' layout of a layer's experts (``base``: its
    ``model.layers.N.mlp.experts``): gate_up_proj [E, 2I, H], gate rows first, and
    down_proj [E, H, I]; gpt-oss's checkpoints instead hold them as x @ W (gate_up_proj
    [E, H, 2I] with gate and up interleaved, down_proj [E, I, H]) with their biases."""
    if architecture == "gpt-oss":
        return {
            f"{base}.gate_up_proj": (
                [f"{base}.gate_proj.weight", f"{base}.up_proj.weight"],
                lambda t: (t[..., ::2].transpose(1, 2), t[..., 1::2].transpose(1, 2)),
            ),
            f"{base}.gate_up_proj_bias": (
                [f"{base}.gate_proj.bias", f"{base}.up_proj.bias"],
                lambda t: (t[:, ::2], t[:, 1::2]),
            ),
            f"{base}.down_proj": ([f"{base}.down_proj.weight"], lambda t: (t.transpose(1, 2),)),
            f"{base}.down_proj_bias": ([f"{base}.down_proj.bias"], lambda t: (t,)),
        }
    return {
        f"{base}.gate_up_proj": (
            [f"{base}.gate_proj.weight", f"{base}.up_proj.weight"],
            lambda t: t.chunk(2, dim=1),
        ),
        f"{base}.down_proj": ([f"{base}.down_proj.weight"], lambda t: (t,)),
    }


def per_expert_name(name: str, expert: int) -> str:
    """``...mlp.experts.gate_proj.weight`` -> ``...mlp.experts.{expert}.gate_proj.weight``."""
    return name.replace(".experts.", f".experts.{expert}.", 1)


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


def _fused_parts(model: LlamaForCausalLM, prefix: str, param) -> dict:
    """A fused projection's parts: name -> (its rows of param, the checkpoint's rows,
    the rows this rank takes)."""
    config, local = model.config, model.local_config
    q_rows, kv_rows, inter_rows = shard_rows(model)
    if prefix.endswith(".qkv_proj"):
        q, kv = local.q_size, local.kv_size
        return {
            "q_proj": (param[:q], config.q_size, q_rows),
            "k_proj": (param[q : q + kv], config.kv_size, kv_rows),
            "v_proj": (param[q + kv :], config.kv_size, kv_rows),
        }
    inter = local.intermediate_size
    return {
        "gate_proj": (param[:inter], config.intermediate_size, inter_rows),
        "up_proj": (param[inter:], config.intermediate_size, inter_rows),
    }


def weight_slots(model: LlamaForCausalLM) -> tuple[dict[str, Slot], dict[str, list[str]]]:
    """HF tensor name -> its Slot, and each fused parameter's name -> the names of its
    parts. The model's module names are HF's; q/k/v are row ranges of qkv_proj, gate/up
    of gate_up_proj, and a checkpoint may hold either the parts (most) or the fused
    tensor (Phi-3)."""
    config, shard = model.config, model.shard
    q_rows, _, inter_rows = shard_rows(model)
    split = shard.size > 1
    slots: dict[str, Slot] = {}
    fused: dict[str, list[str]] = {}
    for name, param in model.named_parameters():
        prefix, _, kind = name.rpartition(".")
        if ".mlp.experts." in name:
            _expert_slots(model, name, param, slots, fused)
        elif prefix.endswith((".qkv_proj", ".gate_up_proj")):
            parts = _fused_parts(model, prefix, param)
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
        elif name.endswith(".self_attn.sinks") and split:
            heads = shard.split(config.num_attention_heads)
            slots[name] = Slot(param, (config.num_attention_heads,), 0, heads)
        elif name in ("model.embed_tokens.weight", "lm_head.weight") and split:
            slots[name] = Slot(param, (config.vocab_size, param.shape[1]), 0, model.vocab_range)
        else:
            slots[name] = Slot(param, tuple(param.shape))
    return slots, fused


def _expert_slots(model: LlamaForCausalLM, name: str, param, slots: dict, fused: dict) -> None:
    """The 3-D slot of one projection (or bias) of every expert, and one slot per expert
    held. Tensor parallelism: each rank takes its share of I (gate/up rows, down columns;
    down's bias counts once: rank 0's); expert parallelism: whole experts."""
    config, shard = model.config, model.shard
    held = model.local_config.expert_range
    inter = config.moe_intermediate_size
    down = ".down_proj." in name
    rows, cols = (config.hidden_size, inter) if down else (inter, config.hidden_size)
    full = (config.num_experts, rows, cols) if param.dim() == 3 else (config.num_experts, rows)
    dim, take, zero = None, None, False
    if shard.size > 1 and model.local_config.local_experts is not None:
        dim, take = 0, held
    elif shard.size > 1 and down and param.dim() == 2:
        zero = shard.rank > 0
    elif shard.size > 1:
        dim, take = (2 if down else 1), shard.split(inter)
    slots[name] = Slot(param, full, dim, take, zero)
    # An expert's own slot: the same split, one dimension down (none for whole experts).
    one_dim, one_take = (dim - 1, take) if dim else (None, None)
    fused[name] = []
    for j in held:
        part = per_expert_name(name, j)
        slots[part] = Slot(param[j - held.start], full[1:], one_dim, one_take, zero)
        fused[name].append(part)


def expert_block_ranges(model: LlamaForCausalLM, module, rows: int, row_bytes: int, qtype: int):
    """Which blocks of a checkpoint's quantized experts [E, rows, row_bytes] (of qtype)
    this rank keeps for `module` (an ExpertProjection): (experts, rows, byte columns of
    a row). All of them unsplit; under tensor parallelism each expert's share of
    gate/up rows or of down's columns (a row-parallel rank's share is whole blocks);
    under expert parallelism its experts."""
    shard = model.shard
    mine = shard.split(rows) if module.out_features != rows else range(rows)
    kept = ops.quant_row_bytes(qtype, module.in_features)
    first = shard.rank if kept != row_bytes else 0
    return model.local_config.expert_range, mine, range(first * kept, (first + 1) * kept)


def expert_share(model: LlamaForCausalLM, module, qweight: torch.Tensor, qtype: int):
    """The part of a checkpoint's quantized experts uint8 [E, rows, row bytes] (of
    qtype) this rank keeps for `module`, as a contiguous tensor on the model's device."""
    _, rows, row_bytes = qweight.shape
    held, mine, cut = expert_block_ranges(model, module, rows, row_bytes, qtype)
    part = qweight[held.start : held.stop, mine.start : mine.stop, cut.start : cut.stop]
    return part.contiguous().to(model.device)


def _copy_into(slot: Slot, tensor: torch.Tensor, part: bool) -> None:
    """The slot's range of tensor (all of it where part) into its parameter view, the
    rest of a padded split zeroed."""
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


class WeightFiller:
    """Copies named tensors into their slots and, at the end, names any slot left empty."""

    def __init__(self, model: LlamaForCausalLM, source: str) -> None:
        self.slots, self.fused = weight_slots(model)
        self.expert_forms: dict[str, FusedExperts] = {}
        for layer, module in model.named_modules():
            if isinstance(module, SparseMoeBlock):
                forms = fused_expert_forms(f"{layer}.experts", model.config.architecture)
                self.expert_forms.update(forms)
        self.num_experts = model.config.num_experts
        self.held = model.local_config.expert_range  # the others: expert parallelism
        self.filled: set[str] = set()
        self.source = source
        self.tied = model.config.tie_word_embeddings
        self.norm_offset = model.config.norm_weight_offset

    def part_to_read(self, name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        """For a reader that can read part of a tensor: the index of the part of
        checkpoint tensor `name` (of `shape`) this model takes, to pass to
        fill(..., part=True); None: read all of it."""
        name = self.canonical(name)
        slot = self.slots.get(name)
        if slot is None or slot.full_shape != tuple(shape):
            return None
        if name in self.fused and slot.dim is None:
            return None
        return slot.index()

    def canonical(self, name: str) -> str:
        """The name of our tensor that checkpoint tensor `name` is (see _RENAMES)."""
        if name in self.slots:
            return name
        for pattern, replacement in _RENAMES:
            name = pattern.sub(replacement, name)
        return name

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
        given, name = name, self.canonical(name)
        if name in self.expert_forms:
            self._fill_fused_experts(given, name, tensor, where)
            return
        if name not in self.slots:
            if _IGNORED.fullmatch(name) or (self.tied and name == "lm_head.weight"):
                return
            if self._held_elsewhere(name):
                return
            raise ValueError(f"{where}: unexpected tensor {given!r} (not part of this model)")
        slot = self.slots[name]
        expected = slot.part_shape() if part else slot.full_shape
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{where}: tensor {given!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{expected}"
            )
        if not tensor.is_floating_point():
            raise ValueError(
                f"{where}: tensor {given!r} has dtype {tensor.dtype}, expected a float type"
            )
        if name in self.fused and slot.dim is None and slot.view.shape != slot.full_shape:
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
        _copy_into(slot, tensor, part)
        self.mark(name)

    def _held_elsewhere(self, name: str) -> bool:
        """One expert's tensor, of an expert another rank holds."""
        match = _ONE_EXPERT.fullmatch(name)
        expert = int(match.group(1)) if match else -1
        return 0 <= expert < self.num_experts and expert not in self.held

    def _fill_fused_experts(self, given: str, name: str, tensor, where: str) -> None:
        """A checkpoint tensor of several of our expert tensors: cut, each piece filled."""
        targets, cut = self.expert_forms[name]
        expected = [self.slots[t].full_shape for t in targets]
        pieces = cut(tensor) if tensor.dim() in (2, 3) else ()
        if [tuple(p.shape) for p in pieces] != expected:
            raise ValueError(
                f"{where}: tensor {given!r} has shape {tuple(tensor.shape)}; the model expects "
                f"it to hold {' and '.join(str(e) for e in expected)} ({', '.join(targets)})"
            )
        for target, piece in zip(targets, pieces, strict=True):
            self.fill(target, piece, where)

    def mark(self, name: str) -> None:
        """name counts as filled (by fill, or by a loader that set its module itself)."""
        self.filled.add(name)
        self.filled.update(self.fused.get(name, ()))

    def finish(self) -> None:
        missing = [n for n in self.slots if n not in self.filled and n not in self.fused]
        # A projection whose every expert is missing is named once.
        absent = set(missing)
        for name, parts in self.fused.items():
            if ".experts." in name and parts and absent.issuperset(parts):
                absent.difference_update(parts)
                missing = [n for n in missing if n in absent] + [f"{name} (every expert)"]
        if missing:
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise ValueError(f"{self.source}: missing tensor(s) {shown}")
