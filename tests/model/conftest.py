"""Shared pieces of the model tests: tiny random HF models saved to disk, and a small
driver that runs a batch of sequences through a LlamaForCausalLM step by step (prompt,
optionally in chunks, then one token per decode step) with a trivially simple block
allocation. The real scheduler and block manager live in pyllm/engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import transformers  # a test-only dependency: the reference implementation

from pyllm.attention.paged import PAGED, PagedMetadata
from pyllm.model import LlamaForCausalLM

# Small enough for 2 shared cores, large enough to exercise GQA and several heads;
# head_dim must be one the attention kernels support (64).
TINY = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


# A router's logits of order ROUTER_SCALE: far enough apart that float rounding (ours
# against HF's) does not flip a token's choice of experts, close enough that the
# second expert's weight still counts (with 8 experts, the gap between the first two
# is about one unit).
ROUTER_SCALE = 4.0


# 8 experts of 128, each token's best 2 (Mixtral's experts are intermediate_size wide).
MOE = {
    "qwen3moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=128,
                    sliding_window=None),
    # gpt-oss: layers alternate between a window of 12 (shorter than the test sequences)
    # and the whole sequence.
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=128,
                    sliding_window=12),
}  # fmt: skip


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """HF initialises norms to one and biases to zero, which would hide a norm weight
    or a bias that never reaches its slot; and its std-0.02 weights make logits tiny.
    Give every tensor values of order one instead."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # experts' router
                p.copy_(ROUTER_SCALE * noise / math.sqrt(p.shape[-1]))
            elif name.endswith("self_attn.sinks"):  # gpt-oss: logits of order one
                p.copy_(noise)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def make_hf_model(kind: str, path, max_shard_size: str | None = None, **overrides):
    """Creates a tiny random float32 HF model of one family, saves it (config.json +
    safetensors) to path and returns it in eval mode."""
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "qwen3moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[kind]
    kwargs = dict(TINY, **MOE.get(kind, {}))
    if kind == "mistral":
        kwargs["sliding_window"] = None
    if kind == "phi3":  # its defaults name ids past the tiny vocabulary
        kwargs.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32).eval()
    randomize_(model)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


# ---------------------------------------------------------------------------
# The step driver.


@dataclass
class _Seq:
    tokens: list[int]  # known tokens: the prompt, then forced or generated ones
    prompt_len: int
    target_len: int
    blocks: list[int]
    num_computed: int = 0  # tokens whose keys/values are in the cache
    logits: list[torch.Tensor] = field(default_factory=list)  # one [vocab] per position


@dataclass
class RunResult:
    logits: list[torch.Tensor]  # per sequence [num_computed, vocab] float32
    generated: list[list[int]]  # per sequence, the tokens after its prompt
    num_steps: int
    mixed_steps: int  # steps with both prefill and decode tokens


def run_sequences(
    model: LlamaForCausalLM,
    tokens: list[list[int]],
    prompt_lens: list[int] | None = None,
    max_new_tokens: int = 0,
    chunk_size: int | None = None,
    block_size: int = 16,
    seed: int = 0,
) -> RunResult:
    """Runs a batch of sequences through the model until each is done.

    Teacher forcing (max_new_tokens == 0): each sequence's tokens are given in full;
    its first prompt_lens[i] go through prefill (in chunks of chunk_size if set), the
    rest through decode steps, one token per step. Greedy (max_new_tokens > 0): tokens
    are the prompts, and each decode step feeds the argmax of the previous logits.
    Sequences own disjoint blocks in a shuffled order; the cache starts as NaN, so a
    read of a slot nobody wrote poisons the logits.
    """
    prompt_lens = prompt_lens or [len(t) for t in tokens]
    targets = [len(t) if max_new_tokens == 0 else len(t) + max_new_tokens for t in tokens]
    seqs, num_blocks = _sequences(tokens, prompt_lens, targets, block_size, seed)
    kv_caches = _nan_cache(model, num_blocks, block_size)
    steps = mixed = 0
    while True:
        prefill = [(s, _next_chunk(s, chunk_size)) for s in seqs if s.num_computed < s.prompt_len]
        decode = [
            (s, 1) for s in seqs if s.prompt_len <= s.num_computed < _feed_len(s, max_new_tokens)
        ]
        if not prefill and not decode:
            break
        steps += 1
        mixed += bool(prefill and decode)
        logits = _step(model, kv_caches, prefill, decode, block_size, device=model.device)
        row = 0
        for s, n in prefill + decode:
            s.logits.extend(logits[row : row + n])
            s.num_computed += n
            row += n
            if max_new_tokens and s.num_computed == len(s.tokens) and len(s.tokens) < s.target_len:
                s.tokens.append(int(s.logits[-1].argmax()))
    return RunResult(
        logits=[torch.stack(s.logits) for s in seqs],
        generated=[s.tokens[s.prompt_len :] for s in seqs],
        num_steps=steps,
        mixed_steps=mixed,
    )


def assert_strips_follow_widened(strips, rows, widened) -> None:
    """A model with weights in strips holds to the widened weights' logits at least as
    closely as with those weights in GGUF rows (the int8 inputs' rounding makes logits
    jump with any change of float rounding, so both are held to the widened ones)."""
    tokens = [list(range(5, 30)), list(range(200, 209))]
    logits = {
        name: torch.cat(run_sequences(model, tokens, [2, 2], chunk_size=8).logits)
        for name, model in (("strips", strips), ("rows", rows), ("widened", widened))
    }
    error = {k: float((logits[k] - logits["widened"]).abs().mean()) for k in ("strips", "rows")}
    assert error["strips"] <= 1.25 * error["rows"], error
    top1 = {k: int((logits[k].argmax(-1) == logits["widened"].argmax(-1)).sum()) for k in error}
    assert top1["strips"] >= top1["rows"] - 1, top1


def _sequences(tokens, prompt_lens, targets, block_size: int, seed: int):
    """One _Seq per prompt, each owning its blocks, all in a shuffled order; and the
    number of blocks they own together."""
    blocks_per_seq = -(-max(targets) // block_size)
    num_blocks = len(tokens) * blocks_per_seq
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    seqs = [
        _Seq(list(t), p, n, order[i * blocks_per_seq : (i + 1) * blocks_per_seq].tolist())
        for i, (t, p, n) in enumerate(zip(tokens, prompt_lens, targets, strict=True))
    ]
    return seqs, num_blocks


def _nan_cache(model: LlamaForCausalLM, num_blocks: int, block_size: int):
    """A paged cache of NaNs: a read of a slot nobody wrote poisons the logits."""
    kv_cache = model.allocate_kv_cache(PAGED, num_blocks, block_size)
    for key_cache, value_cache in kv_cache.layers:
        key_cache.fill_(float("nan"))
        value_cache.fill_(float("nan"))
    return kv_cache


def _next_chunk(s: _Seq, chunk_size: int | None) -> int:
    remaining = s.prompt_len - s.num_computed
    return remaining if chunk_size is None else min(chunk_size, remaining)


def _feed_len(s: _Seq, max_new_tokens: int) -> int:
    """How many tokens this sequence feeds in all: with greedy generation the last
    generated token is never fed back."""
    return len(s.tokens) if max_new_tokens == 0 else min(len(s.tokens), s.target_len - 1)


def _step(model, kv_caches, prefill, decode, block_size, device) -> torch.Tensor:
    """One forward over prefill chunks then decode tokens; logits for every token."""
    input_ids, positions, slots = [], [], []
    for s, n in prefill + decode:
        for pos in range(s.num_computed, s.num_computed + n):
            input_ids.append(s.tokens[pos])
            positions.append(pos)
            slots.append(s.blocks[pos // block_size] * block_size + pos % block_size)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    num_prefill_tokens = sum(n for _, n in prefill)
    meta = PagedMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_prefill_tokens=num_prefill_tokens,
    )
    if prefill:
        q_lens = [n for _, n in prefill]
        meta.prefill_query_start_loc = i32([0] + list(torch.tensor(q_lens).cumsum(0).tolist()))
        meta.prefill_seq_lens = i32([s.num_computed + n for s, n in prefill])
        meta.prefill_block_tables = i32([s.blocks for s, _ in prefill])
        meta.max_query_len = max(q_lens)
    if decode:
        meta.decode_seq_lens = i32([s.num_computed + 1 for s, _ in decode])
        meta.decode_block_tables = i32([s.blocks for s, _ in decode])
        meta.max_decode_seq_len = max(s.num_computed + 1 for s, _ in decode)
    hidden = model(
        torch.tensor(input_ids, device=device),
        torch.tensor(positions, device=device),
        meta,
        kv_caches,
    )
    return model.compute_logits(hidden).cpu()
