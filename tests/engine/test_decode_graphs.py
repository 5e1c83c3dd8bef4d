"""Decode steps replayed from recorded kernel graphs: the same tokens and logits as the
steps run op by op, in both KV layouts, as batch sizes change and past the longest
context a recording covers; recordings refused where a step computes outside the
kernels."""

from __future__ import annotations

import random

import pytest
import torch

import pyllm.ops as ops
from pyllm import _C, LLM, SamplingParams
from pyllm.engine import decode_graphs
from pyllm.model.step_graph import record
from tests.engine.test_engine import _write_byte_tokenizer
from tests.model.conftest import make_hf_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 20000) for _ in range(rng.randint(3, 60))] for _ in range(count)]


def _decodes(batch: int) -> tuple[int, int, int, int]:
    """The step shape of a batch of plain decodes."""
    return (batch, 0, 0, 0)


def _generate(llm: LLM, prompts, params=PARAMS):
    outs = llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_replayed_steps_give_the_tokens_and_logprobs_of_steps_run_op_by_op(kv_cache):
    options = dict(kv_cache=kv_cache, kv_cache_memory=0.1, quantization=None, dtype="float32")
    eager, graphs = LLM(None, enforce_eager=True, **options), LLM(None, **options)
    assert eager.engine.runner.graphs is None
    # Lengths differ, so sequences finish apart and the batch shrinks step by step.
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 5 * i, ignore_eos=True, logprobs=2)
              for i in range(6)]  # fmt: skip
    prompts = _prompts(6)
    want, got = (
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        for outs in (
            llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
            for llm in (eager, graphs)
        )
    )
    assert got == want  # logprobs too: a replay computes what the op-by-op step does
    # Batches of 6 down to 1 ran; float weights take oneDNN's GEMM (a torch op: refused)
    # above small_batch_linear's 4 rows where the build has no packed_linear (AVX2).
    recorded = graphs.engine.runner.graphs
    assert len([s for s, g in recorded.graphs.items() if g is not None]) >= 4


def test_kept_quantized_weights_replay_bit_for_bit():
    eager, graphs = LLM(None, enforce_eager=True), LLM(None)
    prompts = _prompts(4, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    assert _generate(graphs, prompts, params) == _generate(eager, prompts, params)
    assert _generate(graphs, prompts[:1], params) == _generate(eager, prompts[:1], params)
    assert sorted(s for s, g in graphs.engine.runner.graphs.graphs.items() if g) == [
        _decodes(1), _decodes(4),
    ]  # fmt: skip


def test_steps_verifying_drafts_are_recorded_and_replay_exactly():
    """Speculative decoding's verifying steps (1 + k tokens a sequence, through the
    prefill attention path) record one graph per shape and replay it: the tokens and
    logprobs are the steps' run op by op, for one sequence and for two."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "adaptive_length": False}  # fmt: skip
    options = dict(quantization=None, dtype="float32", speculative_config=spec)
    eager, graphs = LLM(None, enforce_eager=True, **options), LLM(None, **options)
    # Repeating prompts: the n-gram proposer finds drafts, some accepted, some not.
    prompts = [[7, 8, 9, 10, 11] * 6, [300, 301, 302, 303] * 8]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    for batch in (prompts[:1], prompts):
        assert _generate(graphs, batch, params) == _generate(eager, batch, params)
    recorded = graphs.engine.runner.graphs
    verifying = [s for s, g in recorded.graphs.items() if g is not None and s[1]]
    assert verifying
    if ops.packed_linear_vectorized(torch.float32):
        assert not recorded.refused
    else:
        # Float32 weights without a word-packed kernel (AVX2 builds) take oneDNN's packed
        # copy past SMALL_BATCH_MAX_ROWS rows, which a recording refuses: those steps
        # run op by op (and equal the eager ones, above).
        assert all(s[0] > ops.SMALL_BATCH_MAX_ROWS for s in recorded.refused), recorded.refused
    assert all(s[2] in (1, 2) and s[1] >= 2 * s[2] for s in verifying)
    stats = graphs.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0


def test_contexts_past_the_recorded_length_run_op_by_op():
    eager, graphs = LLM(None, enforce_eager=True), LLM(None)
    recorded = graphs.engine.runner.graphs
    recorded.max_seq_len = 40  # as if the recordings covered 40 tokens
    prompts = [p[:10] for p in _prompts(3, seed=2)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    replays: list[bool] = []
    recorded.run = _counting(recorded, replays)
    assert _generate(graphs, prompts, params) == _generate(eager, prompts, params)
    assert True in replays and False in replays


def _counting(recorded, calls: list):
    original = recorded.run

    def run(*args):
        out = original(*args)
        calls.append(out is not None)
        return out

    return run


def test_a_step_that_computes_outside_the_kernels_is_not_recorded():
    x, weight = torch.randn(2, 64), torch.ones(64)

    def norm_then_add():
        out = torch.empty_like(x)
        _C.rms_norm(out, x, weight, 1e-6)
        return out + 1  # an aten op a replay would not repeat

    out, graph, refused = record(norm_then_add)
    assert graph is None and "add" in refused
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (64,), weight, 1e-6) + 1)


def test_a_reshape_that_copies_is_not_recorded():
    x, weight = torch.randn(4, 8)[:, :4], torch.ones(2)

    def head_norm():
        heads = x.reshape(-1, 2)  # x's rows are strided: a copy, not a view
        out = torch.empty_like(heads)
        _C.rms_norm(out, heads, weight, 1e-6)
        return out

    _, graph, refused = record(head_norm)
    assert graph is None and "reshape" in refused


def test_reading_a_value_or_writing_in_place_is_not_recorded():
    x = torch.randn(4, 8)

    def add_in_place():
        y = x[0]
        y += 1

    in_place = (lambda: x.mul_(2), lambda: x[0].copy_(x[1]), add_in_place,
                lambda: torch.nn.functional.relu(x, inplace=True),
                lambda: torch.add(x, 1, out=torch.empty_like(x)))  # fmt: skip
    for step in (lambda: x.sum().item(), *in_place):
        assert record(step)[1] is None


def test_views_allocations_and_metadata_are_recorded():
    x = torch.randn(4, 8)

    def step():
        a, b = x.split([3, 5], dim=1)
        out = torch.empty(x.shape[0], 3, dtype=x.dtype, device=x.device)
        return a.view(4, 1, 3), b[1:], x.reshape(2, 16), out, x.dim(), x.size(0)

    assert record(step)[1] is not None


def test_a_replay_reads_its_inputs_anew():
    x, weight = torch.randn(3, 64), torch.randn(64)
    out = torch.empty_like(x)
    _, graph, refused = record(lambda: _C.rms_norm(out, x, weight, 1e-6))
    assert refused is None and len(graph) == 1
    x.copy_(torch.randn(3, 64))
    out.zero_()
    graph.replay()
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (64,), weight, 1e-6))


def test_a_graph_records_cpu_tensors_only():
    graph = _C.KernelGraph()
    meta = torch.empty(2, 64, device="meta")
    with pytest.raises(RuntimeError, match="CPU tensors only"):
        graph.rms_norm(meta, meta, torch.ones(64, device="meta"), 1e-6)


def test_enforce_eager_must_be_a_bool():
    with pytest.raises(ValueError, match="enforce_eager"):
        LLM(None, enforce_eager="yes")


@pytest.mark.parametrize("kind", ["qwen3", "qwen3moe", "gpt_oss", "gemma3"])
def test_families_record_their_decode_steps_and_replay_them_exactly(tmp_path, kind):
    make_hf_model(kind, tmp_path, max_position_embeddings=1024)
    _write_byte_tokenizer(tmp_path, vocab_size=512)
    options = dict(dtype="float32", kv_cache_memory=0.05)
    eager = LLM(str(tmp_path), enforce_eager=True, **options)
    graphs = LLM(str(tmp_path), **options)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    assert _generate(graphs, prompts) == _generate(eager, prompts)
    recorded = graphs.engine.runner.graphs
    assert not recorded.refused and recorded.graphs[_decodes(3)] is not None


def test_only_the_graphs_used_last_are_kept(monkeypatch):
    monkeypatch.setattr(decode_graphs, "MAX_GRAPHS", 2)
    monkeypatch.setattr(decode_graphs, "MAX_GRAPH_BATCH", 3)
    eager, graphs = LLM(None, enforce_eager=True), LLM(None)
    prompts = _prompts(4, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=2 + 3 * i, ignore_eos=True)
              for i in range(4)]  # fmt: skip
    want = eager.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
    got = graphs.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # Batches of 4 (not recorded), 3, 2 and 1 ran: the last two are kept.
    assert list(graphs.engine.runner.graphs.graphs) == [_decodes(2), _decodes(1)]
