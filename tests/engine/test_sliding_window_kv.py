"""Layers in KV groups sharing one block pool (HybridBlockManager): a tiny random
Gemma 3 (two window layers of 16 tokens, one global layer: three groups of one layer)
generates the same greedy tokens as with every layer keeping every token
(disable_hybrid_kv_cache_manager), while its window groups hold only their window."""

from __future__ import annotations

import random

import pytest

from pyllm import LLM, SamplingParams
from pyllm.attention.paged import window_blocks
from pyllm.engine.block_manager import BlockManager, prefix_hashes
from pyllm.engine.config import ConfigError
from pyllm.engine.hybrid_block_manager import NULL_BLOCK, HybridBlockManager
from pyllm.engine.sequence import Sequence
from pyllm.sampling.params import ParamError
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
    pool = llm.engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1  # all but the null block
    assert [b.block_id for b in pool.blocks if b.ref_count] == [NULL_BLOCK]
    assert not llm.engine.scheduler.has_unfinished


def _window_tables(seq: Sequence) -> list[list[int]]:
    """The tiny Gemma 3's window groups' tables (groups 1 and 2)."""
    return seq.group_block_tables


def _run_watching_windows(llm: LLM, prompts, tables=_window_tables) -> tuple[list[list[int]], int]:
    """Steps the engine by hand; returns the outputs and the most blocks any sequence
    held in one window group after a step."""
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
            assert len(seq.block_table) == -(-seq.num_computed_tokens // 16)
            for table in tables(seq):
                most = max(most, len([b for b in table if b != NULL_BLOCK]))
                assert len(table) == len(seq.block_table)
    return [outputs[str(i)] for i in range(len(prompts))], most


@pytest.mark.parametrize("budget", [7, 32, 512])
def test_window_layers_keep_only_their_window(gemma_dir, reference, budget):
    """Chunked prefill (chunks shorter and longer than the window), a batch of mixed
    lengths: the same tokens, each sequence holding at most its chunk and window."""
    llm = _engine(gemma_dir, max_num_batched_tokens=budget)
    manager = llm.engine.kv_manager
    assert isinstance(manager, HybridBlockManager)
    assert llm.engine.kv_cache.layer_groups == (1, 2, 0)
    assert len({k.data_ptr() for k, _ in llm.engine.kv_cache.layers}) == 1  # one tensor pair
    outputs, most = _run_watching_windows(llm, _prompts())
    assert outputs == reference
    # After a step a sequence keeps the window before its next token, and a decode's
    # own block: never the 300-token prompt's 19 blocks.
    assert most <= window_blocks(WINDOW, 1, 16)
    _assert_all_free(llm)


def test_preemption_recomputes_exactly(gemma_dir, reference):
    """A pool of 40 blocks (39 and the null block) shared by the three groups for 8
    prompts of up to 324 tokens, 4 at once: the engine preempts and recomputes."""
    group_block = 2 * 2 * 64 * 16 * 4  # one layer, 2 kv heads of 64, float32
    llm = _engine(gemma_dir, kv_cache_memory=40 * group_block / 2**30, max_num_seqs=4,
                  max_num_batched_tokens=64)  # fmt: skip
    manager = llm.engine.kv_manager
    assert manager.num_blocks == 39
    assert _generate(llm, _prompts()) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_all_free(llm)


def test_prefix_hit_needs_the_window_before_it(gemma_dir):
    """A hit is taken whole while the window groups still hold the blocks of the window
    before it; once they are evicted, it is shortened (here to nothing) and the prompt
    recomputed: the same tokens either way."""
    rng = random.Random(1)
    prefix = [rng.randint(2, 511) for _ in range(160)]
    first, second = prefix + [3, 4, 5], prefix + [6, 7]
    plain = _engine(gemma_dir, enable_prefix_caching=False)
    expected = _generate(plain, [second])[0]

    llm = _engine(gemma_dir)
    manager = llm.engine.kv_manager
    _generate(llm, [first])
    out = llm.generate(prompt_token_ids=[second], sampling_params=GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 160
    assert out.outputs[0].token_ids == expected

    # Blocks taken from the pool in LRU order, as new prompts take them, evict the
    # window groups' copies first: they were freed before the global group's.
    pool, hashes = manager.pool, list(prefix_hashes(second, 16))
    window_keys = {h + m.salt for m in manager.window for h, _ in hashes}
    taken = []
    while window_keys & pool.cached_blocks.keys():
        taken.append(pool._take_free_block())
    assert all(pool.holds(h, chunk) for h, chunk in hashes)  # the global group's
    for block_id in taken:
        pool._give_back(pool.blocks[block_id])
    out = llm.generate(prompt_token_ids=[second], sampling_params=GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens < 160
    assert out.outputs[0].token_ids == expected
    _assert_all_free(llm)


GROUP_BLOCK = 2 * 2 * 64 * 16 * 4  # one layer's block: 2 kv heads of 64, float32


@pytest.mark.parametrize("max_num_seqs", [1, 256])
def test_one_pool_for_every_group(gemma_dir, max_num_seqs):
    """The three groups share one pool of one-layer blocks, whatever max_num_seqs: as
    many block-tokens per layer as one pool for every layer holds."""
    plain = _engine(gemma_dir, disable_hybrid_kv_cache_manager=True).engine.kv_manager
    hybrid = _engine(gemma_dir, max_num_seqs=max_num_seqs).engine.kv_manager
    assert hybrid.pool.num_blocks == int(0.02 * 2**30 // GROUP_BLOCK)
    assert hybrid.pool.num_blocks >= 3 * plain.num_blocks
    assert (len(hybrid.full), len(hybrid.window)) == (1, 2)
    assert plain.committed_bytes() <= hybrid.committed_bytes() <= 0.02 * 2**30
    assert "1 global and 2 window-16 KV groups" in hybrid.describe()


def test_pool_admits_what_one_pool_for_every_layer_cannot(gemma_dir):
    """At the default max_num_seqs, 150 one-layer blocks: every layer keeping every token
    holds 50 blocks (800 tokens) and refuses a 1000-token prompt; the shared pool serves
    it (63 global blocks and a step's window in each window group), with the same tokens
    as a cache large enough for every token."""
    prompt = [random.Random(4).randint(2, 511) for _ in range(1000)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    gib = 150 * GROUP_BLOCK / 2**30
    small = _engine(gemma_dir, kv_cache_memory=gib, disable_hybrid_kv_cache_manager=True)
    with pytest.raises(ParamError, match="kv_cache_memory"):
        small.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    llm = _engine(gemma_dir, kv_cache_memory=gib)
    assert llm.engine.config.max_num_seqs == 256
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    big = _engine(gemma_dir, disable_hybrid_kv_cache_manager=True)
    expected = big.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    _assert_all_free(llm)


def test_prefix_cache_dir_is_refused_with_windows(gemma_dir, tmp_path):
    with pytest.raises(ConfigError, match="disable_hybrid_kv_cache_manager"):
        _engine(gemma_dir, prefix_cache_dir=str(tmp_path / "kv"))
    llm = _engine(gemma_dir, prefix_cache_dir=str(tmp_path / "kv"),
                  disable_hybrid_kv_cache_manager=True)  # fmt: skip
    llm.engine.close()


def test_speculative_decoding_matches_one_pool(gemma_dir):
    """Prompt lookup's proposals are verified as prefill chunks in every group: the
    same tokens as with one pool for every layer, and every block back."""
    prompts = spec_prompts(6, seed=5)
    options = {"speculative_config": NGRAM, "max_num_batched_tokens": 32}
    plain = _engine(gemma_dir, disable_hybrid_kv_cache_manager=True, **options)
    llm = _engine(gemma_dir, **options)
    assert _generate(llm, prompts) == _generate(plain, prompts)
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
    _assert_all_free(llm)


def test_trim_and_release_in_both_groups():
    """The bookkeeping alone: a global and a window group of a window of 16 in blocks of
    16 on one pool. Blocks behind the window leave the window table after a step and go
    back to the pool; rejected proposals' blocks leave both tables."""
    pool = BlockManager(32, 16)
    manager = HybridBlockManager(pool, (False, True), sliding_window=16, max_num_batched_tokens=512)
    seq = Sequence("s", list(range(2, 102)), SamplingParams(max_tokens=40))
    manager.match_prefix(seq)
    manager.append_slots(seq, 100)  # the prompt in one chunk: 7 blocks in each group
    window = seq.group_block_tables[0]
    assert (len(seq.block_table), len(window), pool.num_free_blocks) == (7, 7, 31 - 14)
    assert not set(seq.block_table) & set(window)
    seq.num_computed_tokens = 100
    manager.register_computed_blocks(seq)  # the next query (100) sees keys 85..100
    assert window[:5] == [NULL_BLOCK] * 5
    assert pool.num_free_blocks == 31 - 7 - 2
    seq.token_ids.append(7)
    assert manager.can_append(seq, 1 + 30) and not manager.can_append(seq, 1 + 200)
    manager.append_slots(seq, 1 + 30)  # a decode with 30 proposed tokens
    assert len(seq.block_table) == len(window) == 9
    seq.num_computed_tokens = 102  # one accepted: the rest rolled back
    manager.trim(seq)
    assert len(seq.block_table) == len(window) == 7
    assert pool.num_free_blocks == 31 - 7 - 2
    manager.free(seq)
    assert pool.num_free_blocks == 31


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
    assert "0 global and 1 window-16 KV groups" in manager.describe()
    assert llm.engine.kv_cache.num_groups == 1
    outputs, most = _run_watching_windows(llm, _prompts(), tables=lambda s: [s.block_table])
    assert outputs == expected
    assert most <= window_blocks(WINDOW, 1, 16)
    _assert_all_free(llm)


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


def test_two_global_groups_and_a_window_group(tmp_path):
    """4 global and 2 window layers: KV groups of gcd(4, 2) = 2 layers (two global, one
    window), each layer on its position's tensor pair; the same tokens as one pool for
    every layer, and a second pass served from every group's prefix blocks."""
    layers = ["full_attention", "sliding_attention", "full_attention"] * 2
    make_hf_model("gemma3", tmp_path, max_position_embeddings=1024, num_hidden_layers=6,
                  sliding_window=WINDOW, layer_types=layers)  # fmt: skip
    _write_byte_tokenizer(tmp_path, vocab_size=512)
    prompts = _prompts()[4:]
    expected = _generate(_engine(str(tmp_path), disable_hybrid_kv_cache_manager=True), prompts)
    llm = _engine(str(tmp_path), max_num_batched_tokens=32)
    cache = llm.engine.kv_cache
    assert cache.layer_groups == (0, 2, 0, 1, 2, 1)
    assert len({k.data_ptr() for k, _ in cache.layers}) == 2  # pairs of positions 0 and 1
    assert "2 global and 1 window-16 KV groups" in llm.engine.kv_manager.describe()
    assert _generate(llm, prompts) == expected
    assert _generate(llm, prompts) == expected
    assert llm.engine.kv_manager.prefix_cache_hits > 0
    _assert_all_free(llm)


def test_int8_cache_in_kv_groups_matches_one_pool(gemma_dir):
    """The int8 cache's scales live beside their blocks in the shared group tensors."""
    one_pool = _engine(gemma_dir, kv_cache_dtype="int8", disable_hybrid_kv_cache_manager=True)
    grouped = _engine(gemma_dir, kv_cache_dtype="int8", max_num_batched_tokens=32)
    assert isinstance(grouped.engine.kv_manager, HybridBlockManager)
    assert _generate(grouped, _prompts()) == _generate(one_pool, _prompts())
    _assert_all_free(grouped)
