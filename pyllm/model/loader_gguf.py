"""GGUF files (llama.cpp's format) into a LlamaForCausalLM, through the `gguf` package.

Each tensor is dequantized to float32 on its own, renamed from llama.cpp's names
(``blk.3.attn_k.weight``) to HF's (``model.layers.3.self_attn.k_proj.weight``), and
copied into its slot. llama.cpp's converter reorders the rows of the Llama q/k
projections (per head, it interleaves the two rotary halves for its GPT-J-style
rope); we undo that so the neox-style rotary kernel sees HF's layout.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import torch

from pyllm.model.config import ModelConfig
from pyllm.model.dtype import resolve_dtype
from pyllm.model.llama import LlamaForCausalLM
from pyllm.model.loader import WeightFiller

# The tensor types we dequantize (each tested in tests/model/test_gguf.py).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors that are not weights of ours: rope_freqs goes into the config.
_NOT_WEIGHTS = ("rope_freqs.weight",)


def _open(path: str):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"GGUF file {path} not found") from None
    except (ValueError, KeyError, IndexError, OSError) as error:
        raise ValueError(f"{path} is not a readable GGUF file: {error}") from None


def _metadata(reader) -> dict:
    """Scalar and string fields by key; of arrays only tokenizer.ggml.tokens (whose
    length is the vocabulary size) is kept, as a list."""
    import gguf

    out = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            if key == "tokenizer.ggml.tokens":
                out[key] = range(len(field.data))  # only the length is needed
            continue
        out[key] = field.contents()
    return out


def _config(reader, path: str) -> ModelConfig:
    tensors = {t.name: t for t in reader.tensors}
    freq_factors = None
    if "rope_freqs.weight" in tensors:
        freq_factors = tuple(
            float(x) for x in dequantize(tensors["rope_freqs.weight"], path).reshape(-1)
        )
    return ModelConfig.from_gguf_metadata(_metadata(reader), set(tensors), path, freq_factors)


def read_gguf_config(path: str) -> ModelConfig:
    return _config(_open(path), path)


def dequantize(tensor, path: str) -> np.ndarray:
    """One GGUF tensor as float32 [rows, cols] (numpy order: GGUF lists dims reversed)."""
    import gguf.quants

    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_TYPES:
        raise ValueError(
            f"{path}: tensor {tensor.name!r} has quantization type {type_name}, which is not "
            f"supported; supported: {', '.join(SUPPORTED_TYPES)}"
        )
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(values, dtype=np.float32).reshape(shape)


def hf_name(gguf_name: str) -> str | None:
    """llama.cpp tensor name -> HF name, None for names we do not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row order. Within each head of D rows, HF keeps the
    rotary halves apart (row r pairs with r + D/2); llama.cpp stores them interleaved
    (pair i at rows 2i, 2i+1). Row 2i+j of a head goes back to row j*D/2 + i."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(
    path: str,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    max_model_len: int | None = None,
) -> LlamaForCausalLM:
    reader = _open(path)
    config = _config(reader, path)
    model = LlamaForCausalLM(config, resolve_dtype(dtype, device), device, max_model_len)
    filler = WeightFiller(model, path)
    for tensor in reader.tensors:
        if tensor.name in _NOT_WEIGHTS:
            continue
        name = hf_name(tensor.name)
        if name is None or not filler.wants(name):
            raise ValueError(f"{path}: unexpected tensor {tensor.name!r} (not part of this model)")
        values = dequantize(tensor, path)
        if config.architecture == "llama" and ".attn_q." in tensor.name:
            values = unpermute_rows(values, config.num_attention_heads)
        elif config.architecture == "llama" and ".attn_k." in tensor.name:
            values = unpermute_rows(values, config.num_key_value_heads)
        with warnings.catch_warnings():
            # F32 tensors come back as read-only views of the memory-mapped file; they
            # are only read (copied into the parameter), never written.
            warnings.simplefilter("ignore", UserWarning)
            tensor_values = torch.from_numpy(values)
        filler.fill(name, tensor_values, where=f"{path} ({tensor.name})")
        del tensor_values
        del values
    filler.finish()
    return model
