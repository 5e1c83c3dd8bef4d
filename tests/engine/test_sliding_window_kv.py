"""Sliding-window layers on a block pool of their own (HybridBlockManager): a tiny random
Gemma 3 (two window layers of 16 tokens, one global layer) generates the same greedy
tokens as with every layer keeping every token (disable_hybrid_kv_cache_manager),
while its window layers hold only their window."""

from __future__ import annotations

import random

import pytest

from pyllm import LLM, SamplingParams
from pyllm.attention.paged import window_blocks
from pyllm.engine.block_manager import BlockManager
from pyllm.engine.config import ConfigError
from pyllm.engine.hybrid_block_manager import NULL_BLOCK, HybridBlockManager
from pyllm.engine.sequence import Sequence
from tests.engine.test_engine import _write_byte_tokenizer
from tests.engine.test_spec_decode import NGRAM
from tests.engine.test_spec_decode import _prompts as spec_prompts
from tests.model.conftest import make_hf_model

WINDOW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
LAYERS = ["sliding_attention", "sliding_attention", "full_attention"]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3")
    make_hf_model("gemma3", path, max_position_embeddings=1024, num_hidden_layers=3,
                  sliding_window=WINDOW, layer_types=LAYERS)  # fmt: skip
    _write_byte_tokenizer(path, vocab_size=512)
    return str(path)


def _prompts(seed: int = 0) -> list[list[int]]:
    """Mixed lengths: shorter than the window, a block, and many windows long."""
    rng = random.Random(seed)
    return [[rng.randint(2, 511) for _ in range(n)] for n in (1, 15, 16, 17, 40, 100, 170, 300)]


def _generate(llm: LLM, prompts) -> list[list[int]]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _engine(gemma_dir, **options) -> LLM:
    options.setdefault("kv_cache_memory", 0.02)
    return LLM(gemma_dir, dtype="float32", **options)


@pytest.fixture(scope="module")
def reference(gemma_dir):
    """Every layer keeps every token (one pool)."""
    llm = _engine(gemma_dir, disable_hybrid_kv_cache_manager=True)
    assert not isinstance(llm.engine.kv_manager, HybridBlockManager)
    return _generate(llm, _prompts())


def _assert_all_free(llm: LLM) -> None:
    manager = llm.engine.kv_manager
    full, window = manager.full, manager.window
    assert full.num_free_blocks == full.num_blocks
    assert window.num_free_blocks == window.num_blocks - 1  # all but the null block
    assert all(b.ref_count == 0 for b in full.blocks)
    assert [b.block_id for b in window.blocks if b.ref_count] == [NULL_BLOCK]
    assert not llm.engine.scheduler.has_unfinished


def _run_watching_windows(
    llm: LLM, prompts, table: str = "window_block_table"
) -> tuple[list[list[int]], int]:
    """Steps the engine by hand; returns the outputs and the most window blocks any
    sequence held after a step."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), None, GREEDY, prompt_token_ids=prompt)
    outputs: dict[str, list[int]] = {}
    most = 0
    while engine.scheduler.has_unfinished:
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        for seq in engine.scheduler.running:
            held = [b for b in getattr(seq, table) if b != NULL_BLOCK]
            most = max(most, len(held))
            assert len(getattr(seq, table)) == -(-seq.num_computed_tokens // 16)
    return [outputs[str(i)] for i in range(len(prompts))], most


@pytest.mark.parametrize("budget", [7, 32, 512])
def test_window_layers_keep_only_their_window(gemma_dir, reference, budget):
    """Chunked prefill (chunks shorter and longer than the window), a batch of mixed
    lengths: the same tokens, each sequence holding at most its chunk and window."""
    llm = _engine(gemma_dir, max_num_batched_tokens=budget)
    manager = llm.engine.kv_manager
    assert isinstance(manager, HybridBlockManager)
    assert llm.engine.kv_cache.window_layers == (0, 1)
    outputs, most = _run_watching_windows(llm, _prompts())
    assert outputs == reference
    # After a step a sequence keeps the window before its next token, and a decode's
    # own block: never the 300-token prompt's 19 blocks.
    assert most <= window_blocks(WINDOW, 1, 16)
    _assert_all_free(llm)


def test_preemption_recomputes_exactly(gemma_dir, reference):
    """Pools of 26 global blocks and 14 window blocks (a 64-token chunk with its window,
    and 4 sequences' windows) for 8 prompts of up to 324 tokens, 4 at once: the engine
    preempts and recomputes."""
    global_block = 2 * 2 * 64 * 16 * 4  # one layer, 2 kv heads of 64, float32
    llm = _engine(gemma_dir, kv_cache_memory=56 * global_block / 2**30, max_num_seqs=4,
                  max_num_batched_tokens=64)  # fmt: skip
    manager = llm.engine.kv_manager
    assert (manager.full.num_blocks, manager.num_window_blocks) == (26, 14)
    assert _generate(llm, _prompts()) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_all_free(llm)


def test_prefix_hit_needs_the_window_before_it(gemma_dir):
    """A hit is taken whole while the window pool still holds the blocks of the window
    before it; once other prompts have cycled those out, it is shortened (here to
    nothing) and the prompt recomputed: the same tokens either way."""
    rng = random.Random(1)
    prefix = [rng.randint(2, 511) for _ in range(160)]
    first, second = prefix + [3, 4, 5], prefix + [6, 7]
    plain = _engine(gemma_dir, enable_prefix_caching=False)
    expected = _generate(plain, [second])[0]

    llm = _engine(gemma_dir, max_num_seqs=4)  # a window pool of 4 windows and a chunk
    manager = llm.engine.kv_manager
    _generate(llm, [first])
    out = llm.generate(prompt_token_ids=[second], sampling_params=GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 160
    assert out.outputs[0].token_ids == expected

    # Other prompts take every window block since (the global pool keeps the prefix).
    window_tokens = manager.num_window_blocks * 16
    _generate(llm, [[rng.randint(2, 511) for _ in range(300)] for _ in range(window_tokens // 250)])
    assert all(manager.full.cached_blocks.get(b.hash) == b.block_id
               for b in manager.full.blocks if b.hash is not None)  # fmt: skip
    out = llm.generate(prompt_token_ids=[second], sampling_params=GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens < 160
    assert out.outputs[0].token_ids == expected
    _assert_all_free(llm)


@pytest.mark.parametrize("max_num_seqs", [1, 8, 256])
def test_pools_count_what_each_group_holds(gemma_dir, max_num_seqs):
    """Neither group holds fewer tokens than one pool for every layer would; what the
    window layers cannot use (max_num_seqs windows and a chunk) goes to the global pool."""
    plain = _engine(gemma_dir, disable_hybrid_kv_cache_manager=True).engine.kv_manager
    hybrid = _engine(gemma_dir, max_num_seqs=max_num_seqs).engine.kv_manager
    assert hybrid.full.num_blocks >= plain.num_blocks
    usable = window_blocks(WINDOW, 512, 16) + 1 + window_blocks(WINDOW, 1, 16) * max_num_seqs
    assert hybrid.window.num_blocks == min(usable, plain.num_blocks)
    if usable < plain.num_blocks:
        assert hybrid.full.num_blocks > 2 * plain.num_blocks
    assert plain.committed_bytes() <= hybrid.committed_bytes() <= 0.02 * 2**30
    assert "window kv_blocks=" in hybrid.describe()


def test_prefix_cache_dir_is_refused_with_windows(gemma_dir, tmp_path):
    with pytest.raises(ConfigError, match="disable_hybrid_kv_cache_manager"):
        _engine(gemma_dir, prefix_cache_dir=str(tmp_path / "kv"))
    llm = _engine(gemma_dir, prefix_cache_dir=str(tmp_path / "kv"),
                  disable_hybrid_kv_cache_manager=True)  # fmt: skip
    llm.engine.close()


def test_speculative_decoding_matches_one_pool(gemma_dir):
    """Prompt lookup's proposals are verified as prefill chunks over both pools: the
    same tokens as with one pool, and every block back."""
    prompts = spec_prompts(6, seed=5)
    options = {"speculative_config": NGRAM, "max_num_batched_tokens": 32}
    plain = _engine(gemma_dir, disable_hybrid_kv_cache_manager=True, **options)
    llm = _engine(gemma_dir, **options)
    assert _generate(llm, prompts) == _generate(plain, prompts)
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
    _assert_all_free(llm)


def test_trim_and_release_in_both_pools():
    """The bookkeeping alone: a window of 16 in blocks of 16. Blocks behind the window
    leave the window table after a step; rejected proposals' blocks leave both."""
    full = BlockManager(64, 16)
    window = BlockManager(16, 16, table="window_block_table")
    manager = HybridBlockManager(full, window, sliding_window=16)
    seq = Sequence("s", list(range(2, 102)), SamplingParams(max_tokens=40))
    manager.match_prefix(seq)
    manager.append_slots(seq, 100)  # the prompt in one chunk: 7 blocks in each pool
    assert (len(seq.block_table), window.num_free_blocks) == (7, 15 - 7)
    seq.num_computed_tokens = 100
    manager.register_computed_blocks(seq)  # the next query (100) sees keys 85..100
    assert seq.window_block_table[:5] == [NULL_BLOCK] * 5
    assert window.num_free_blocks == 15 - 2
    seq.token_ids.append(7)
    manager.append_slots(seq, 1 + 30)  # a decode with 30 proposed tokens
    assert len(seq.block_table) == len(seq.window_block_table) == 9
    seq.num_computed_tokens = 102  # one accepted: the rest rolled back
    manager.trim(seq)
    assert len(seq.block_table) == len(seq.window_block_table) == 7
    assert (full.num_free_blocks, window.num_free_blocks) == (64 - 7, 15 - 2)
    manager.free(seq)
    assert (full.num_free_blocks, window.num_free_blocks) == (64, 15)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    """Every layer with a window (Mistral v0.1's kind): one pool, freed behind it."""
    path = tmp_path_factory.mktemp("tiny-mistral")
    make_hf_model("mistral", path, max_position_embeddings=1024, sliding_window=WINDOW)
    _write_byte_tokenizer(path, vocab_size=512)
    return str(path)


@pytest.mark.parametrize("budget", [7, 512])
def test_every_layer_windowed_keeps_one_window(mistral_dir, budget):
    plain = _engine(mistral_dir, disable_hybrid_kv_cache_manager=True)
    expected = _generate(plain, _prompts())
    llm = _engine(mistral_dir, max_num_batched_tokens=budget)
    manager = llm.engine.kv_manager
    assert manager.full is None and "every layer" in manager.describe()
    outputs, most = _run_watching_windows(llm, _prompts(), table="block_table")
    assert outputs == expected
    assert most <= window_blocks(WINDOW, 1, 16)
    window = manager.window
    assert window.num_free_blocks == window.num_blocks - 1
    assert [b.block_id for b in window.blocks if b.ref_count] == [NULL_BLOCK]


def test_every_layer_windowed_prefix_hit_needs_only_the_window(mistral_dir):
    """With no global layer, a hit needs only the window's blocks before it."""
    rng = random.Random(3)
    prefix = [rng.randint(2, 511) for _ in range(160)]
    plain = _engine(mistral_dir, enable_prefix_caching=False)
    expected = _generate(plain, [prefix + [6, 7]])[0]
    llm = _engine(mistral_dir)
    _generate(llm, [prefix + [3, 4, 5]])
    out = llm.generate(prompt_token_ids=[prefix + [6, 7]], sampling_params=GREEDY,
                       use_tqdm=False)[0]  # fmt: skip
    assert out.num_cached_tokens == 160
    assert out.outputs[0].token_ids == expected
    assert llm.engine.kv_manager.prefix_cache_hits == 160


def test_samples_share_the_prompts_window_blocks(gemma_dir):
    """n=3 seeded samples: the siblings take the first one's prompt blocks from the
    prefix cache (window blocks held by several sequences, released by each)."""
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)
    prompts = _prompts()[5:]

    def samples(llm: LLM) -> list[list[list[int]]]:
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outputs]

    llm = _engine(gemma_dir)
    assert samples(llm) == samples(_engine(gemma_dir, disable_hybrid_kv_cache_manager=True))
    assert llm.engine.kv_manager.prefix_cache_hits > 0
    _assert_all_free(llm)
