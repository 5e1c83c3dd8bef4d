"""Decode steps replayed from recorded kernel graphs: the same tokens and logits as the
steps run op by op, in both KV layouts, as batch sizes change and past the longest
context a recording covers; recordings refused where a step computes outside the
kernels."""

from __future__ import annotations

import random

import pytest
import torch

from pyllm import _C, LLM, SamplingParams
from pyllm.model.step_graph import record

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 20000) for _ in range(rng.randint(3, 60))] for _ in range(count)]


def _generate(llm: LLM, prompts, params=PARAMS):
    outs = llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_replayed_steps_give_the_tokens_and_logprobs_of_steps_run_op_by_op(kv_cache):
    # Weights widened: the kept quantized ones' products depend on the rows per step,
    # and each request's batch sizes differ between the runs of ragged lengths below.
    options = dict(kv_cache=kv_cache, kv_cache_memory=0.1, quantization=None, dtype="float32")
    eager, graphs = LLM(None, enforce_eager=True, **options), LLM(None, **options)
    assert eager.engine.runner.graphs is None
    # Lengths differ, so sequences finish apart and the batch shrinks step by step.
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 5 * i, ignore_eos=True, logprobs=2)
              for i in range(6)]  # fmt: skip
    prompts = _prompts(6)
    want = [_generate(eager, [p], s)[0] for p, s in zip(prompts, params, strict=True)]
    outs = graphs.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert [g[0] for g in got] == [w[0] for w in want]
    assert got == want  # logprobs too: a replay computes what the op-by-op step does
    recorded = graphs.engine.runner.graphs
    assert not recorded.refused
    assert len([b for b, g in recorded.graphs.items() if g is not None]) >= 3


def test_kept_quantized_weights_replay_bit_for_bit():
    eager, graphs = LLM(None, enforce_eager=True), LLM(None)
    prompts = _prompts(4, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    assert _generate(graphs, prompts, params) == _generate(eager, prompts, params)
    assert _generate(graphs, prompts[:1], params) == _generate(eager, prompts[:1], params)
    assert sorted(b for b, g in graphs.engine.runner.graphs.graphs.items() if g) == [1, 4]


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
    assert graph is None and refused == "aten.add.Tensor"
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (64,), weight, 1e-6) + 1)


def test_a_reshape_that_copies_is_not_recorded():
    x, weight = torch.randn(4, 8)[:, :4], torch.ones(2)

    def head_norm():
        heads = x.reshape(-1, 2)  # x's rows are strided: a copy, not a view
        out = torch.empty_like(heads)
        _C.rms_norm(out, heads, weight, 1e-6)
        return out

    with torch.inference_mode():  # as the engine records (elsewhere reshape is a clone)
        _, graph, refused = record(head_norm)
    assert graph is None and refused == "aten.reshape.default"


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
