"""Loads a draft model for speculative decoding, after checking it can serve the
engine's model: the same vocabulary, a context at least the engine's, and weights and
KV cache that fit in memory beside the engine's own. Every refusal names
speculative_config['model'].

The draft's weights load as `LLM(model=...)` would with quantization "auto" (a GGUF
file's stay quantized, an HF folder's float) in the engine's dtype and device. Its KV
cache takes the engine's layout and holds at most min(max_num_seqs,
disable_by_batch_size) sequences of max_model_len tokens (no more sequences speculate
at once), and never more tokens than the engine's own cache holds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pyllm.attention.backend import CacheSpec
from pyllm.engine.config import EngineConfig
from pyllm.engine.kv_manager import allocate_kv_cache
from pyllm.engine.model_runner import ModelRunner
from pyllm.engine.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from pyllm.engine.spec_decode.draft import DraftProposer
from pyllm.kv_cache import kv_token_bytes
from pyllm.model.config import ModelConfig
from pyllm.model.loader import estimate_weight_bytes, load_config, load_model
from pyllm.model.memory import check_fits
from pyllm.model.tokenizer import Tokenizer

KEY = "model"  # the speculative_config key every refusal names


@dataclass(frozen=True, slots=True)
class Target:
    """What a draft model is checked against and sized from: the engine's model."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
    cache_spec: CacheSpec
    kv_budget: int  # bytes of the engine's KV cache
    weights_bytes: int
    available: int | None  # host memory before the engine loaded anything (CPU only)


def load_draft(spec: SpeculativeConfig, target: Target) -> DraftProposer:
    cfg = target.config
    path = spec.model
    draft_config = _refusing(load_config, path)
    limit = draft_config.max_position_embeddings
    if limit < target.max_model_len:
        raise SpeculativeConfigError(
            KEY,
            f"({path!r}) has a context of {limit} tokens, shorter than the engine's "
            f"max_model_len of {target.max_model_len}; lower max_model_len",
        )
    check_vocabulary(
        path, draft_config.vocab_size, _refusing(Tokenizer.from_pretrained, path), target
    )
    slots = min(cfg.max_num_seqs, spec.disable_by_batch_size)
    kv_budget = draft_kv_budget(draft_config, target, slots)
    _check_memory(path, kv_budget, target)
    model, _ = load_model(
        path, cfg.torch_dtype, cfg.torch_device, target.max_model_len, quantization="auto"
    )
    cache, manager = allocate_kv_cache(model, cfg.kv_cache, kv_budget, cfg.block_size, slots, False)
    runner = ModelRunner(model, cache, cfg.block_size, cfg.torch_device, cfg.max_num_batched_tokens)
    return DraftProposer(runner, manager, os.path.basename(os.path.normpath(path)))


def _refusing(load, path: str):
    """load(path), its failure named by the key."""
    try:
        return load(path)
    except (ValueError, OSError) as error:
        raise SpeculativeConfigError(KEY, f"({path!r}) cannot be loaded: {error}") from error


def check_vocabulary(path: str, vocab_size: int, tokenizer: Tokenizer, target: Target) -> None:
    """Refuses a draft whose token ids do not mean the target's: it compares the
    models' vocab_size, the tokenizers' BOS and EOS ids and every token's string."""
    theirs = target.tokenizer
    problem = None
    if vocab_size != target.model_config.vocab_size:
        problem = f"vocab_size {vocab_size}, the target's {target.model_config.vocab_size}"
    elif (tokenizer.bos_token_id, tokenizer.eos_token_ids) != (
        theirs.bos_token_id,
        theirs.eos_token_ids,
    ):
        problem = (
            f"BOS/EOS ids {tokenizer.bos_token_id}/{sorted(tokenizer.eos_token_ids)}, the "
            f"target's {theirs.bos_token_id}/{sorted(theirs.eos_token_ids)}"
        )
    elif tokenizer.vocab_size != theirs.vocab_size:
        problem = f"a tokenizer of {tokenizer.vocab_size} tokens, the target's {theirs.vocab_size}"
    else:
        ids = range(tokenizer.vocab_size)
        mine, other = tokenizer.convert_ids_to_tokens(ids), theirs.convert_ids_to_tokens(ids)
        diff = next((i for i in ids if mine[i] != other[i]), None)
        if diff is not None:
            problem = f"token {diff} is {mine[diff]!r}, the target's {other[diff]!r}"
    if problem is not None:
        raise SpeculativeConfigError(
            KEY, f"({path!r}) does not share the target model's vocabulary: {problem}"
        )


def draft_kv_budget(draft: ModelConfig, target: Target, slots: int) -> int:
    """Bytes of the draft's KV cache: room for `slots` sequences of max_model_len
    tokens, but no more tokens than the engine's cache holds; whole blocks."""
    cfg = target.config
    spec = target.cache_spec
    target_per_token = spec.num_layers * spec.num_kv_heads
    target_per_token *= kv_token_bytes(spec.head_size, spec.dtype, spec.kv_cache_dtype)
    tokens = min(slots * target.max_model_len, target.kv_budget // target_per_token)
    tokens = -(-max(tokens, 1) // cfg.block_size) * cfg.block_size
    per_token = 2 * draft.num_hidden_layers * draft.num_key_value_heads * draft.head_dim
    return tokens * per_token * cfg.torch_dtype.itemsize


def _check_memory(path: str, kv_budget: int, target: Target) -> None:
    """Refuses (InsufficientMemoryError) a draft whose weights and KV cache do not fit
    beside the engine's: both models' together, before the draft loads."""
    cfg = target.config
    weights = estimate_weight_bytes(path, cfg.torch_dtype, "auto")
    if cfg.torch_device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(cfg.torch_device)
        totals, available = (weights, kv_budget), free  # the engine's is allocated already
    else:
        totals = (target.weights_bytes + weights, target.kv_budget + kv_budget)
        available = target.available
    check_fits(
        *totals,
        f"the model with its draft {os.path.basename(os.path.normpath(path))} "
        f"(speculative_config[{KEY!r}])",
        [
            "a smaller draft model",
            "a smaller max_model_len",
            "a smaller kv_cache_memory",
            "a smaller disable_by_batch_size (fewer sequences in the draft's cache)",
        ],
        available=available,
    )
