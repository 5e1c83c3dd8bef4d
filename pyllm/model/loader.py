"""Weights into a LlamaForCausalLM: HF safetensors folders and GGUF files.

Both formats end in the same place: each checkpoint tensor, named as in HF
(``model.layers.3.self_attn.k_proj.weight``), is copied into its slot of the model's
parameters -- a row range of the fused qkv_proj / gate_up_proj for q/k/v and
gate/up -- and freed. The parameters are allocated once; no second copy of the
model exists at any time.
"""

from __future__ import annotations

import json
import os
import re

import torch

from pyllm.model.config import ModelConfig
from pyllm.model.dtype import resolve_dtype
from pyllm.model.llama import LlamaForCausalLM

# Checkpoint tensors that carry no weights of ours (rotary tables some exporters save).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def load_model(
    path: str | os.PathLike,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    max_model_len: int | None = None,
    pack_weights: bool = True,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Builds and fills a model from an HF folder (config.json + *.safetensors) or a
    .gguf file; returns it and its config. pack_weights: on the CPU, hand the
    projection weights to oneDNN in its packed layout (LlamaForCausalLM.pack_weights)."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from pyllm.model.loader_gguf import load_gguf

        model = load_gguf(path, dtype, device, max_model_len)
    elif os.path.isdir(path):
        config = ModelConfig.from_hf_dir(path)
        model = LlamaForCausalLM(config, resolve_dtype(dtype, device), device, max_model_len)
        load_safetensors(model, path)
    elif not os.path.exists(path):
        raise FileNotFoundError(f"model path {path} does not exist")
    else:
        raise ValueError(f"{path} is neither an HF model folder nor a .gguf file")
    if pack_weights:
        model.pack_weights()
    return model, model.config


def load_config(path: str | os.PathLike) -> ModelConfig:
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from pyllm.model.loader_gguf import read_gguf_config

        return read_gguf_config(path)
    return ModelConfig.from_hf_dir(path)


# ---------------------------------------------------------------------------
# Where each checkpoint tensor goes.


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


# ---------------------------------------------------------------------------
# HF safetensors.


def safetensors_files(folder: str) -> list[str]:
    """The checkpoint's files: the shards listed in model.safetensors.index.json, or
    model.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{index} is not a valid safetensors index ({error!r})") from None
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
    else:
        single = os.path.join(folder, "model.safetensors")
        if not os.path.isfile(single):
            raise FileNotFoundError(
                f"{folder} holds neither model.safetensors nor model.safetensors.index.json"
            )
        files = [single]
    for file in files:
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file} (listed in {index}) is missing")
    return files


def load_safetensors(model: LlamaForCausalLM, folder: str) -> None:
    from safetensors import SafetensorError, safe_open

    filler = WeightFiller(model, folder)
    for file in safetensors_files(folder):
        try:
            with safe_open(file, framework="pt") as f:
                names = list(f.keys())
            for name in names:
                # safe_open maps the whole file, and every page read stays resident
                # (and counted) while it is open. Reopening it per tensor releases each
                # tensor's pages after its copy, so loading peaks near the model's size
                # plus one tensor instead of twice the model's size.
                with safe_open(file, framework="pt") as f:
                    tensor = f.get_tensor(name)
                filler.fill(name, tensor, where=file)
                del tensor
        except SafetensorError as error:
            raise ValueError(f"{file} is not a valid safetensors file: {error}") from None
    filler.finish()
