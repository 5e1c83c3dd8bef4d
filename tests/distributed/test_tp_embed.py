"""Tensor-parallel embeddings (gloo, CPU): LLM.embed with tensor_parallel_size=2 pools
the same vectors as one process, float32, both poolings, with chunked prefill, in both
KV-cache modes; the same engine then generates as one process does."""

from __future__ import annotations

import random

import pytest
import torch

from pyllm import LLM, PoolingParams, SamplingParams
from tests.distributed.conftest import child_pids

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# One token, under a block, a block and one, several chunks of 16.
LENGTHS = [1, 5, 17, 40]


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(2, 511) for _ in range(n)] for n in LENGTHS]


def _embed(model: str, tp: int, pooling: str, kv_cache: str, prompts) -> tuple:
    """The raw vectors; the tokens generated after them by the same engine."""
    before = set(child_pids())  # other tests' servers may still be going
    llm = LLM(model, dtype="float32", pooling=pooling, kv_cache=kv_cache, kv_cache_memory=0.02,
              tensor_parallel_size=tp, max_num_batched_tokens=16)  # fmt: skip
    try:
        assert len(set(child_pids()) - before) == tp - 1  # a worker per extra rank
        outputs = llm.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
        again = llm.embed(prompts[-1], PoolingParams(normalize=False), use_tqdm=False)[0]
        cached = torch.tensor(again.outputs.embedding)  # `last`: from the prefix cache
        torch.testing.assert_close(cached, torch.tensor(outputs[-1].outputs.embedding))
        generated = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    finally:
        llm.engine.close()
    vectors = torch.tensor([out.outputs.embedding for out in outputs])
    return vectors, [out.outputs[0].token_ids for out in generated]


@pytest.mark.parametrize(
    "pooling, kv_cache", [("last", "paged"), ("mean", "paged"), ("mean", "contiguous")]
)
def test_tp2_embeds_what_tp1_does(tiny_llama, pooling, kv_cache):
    prompts = _prompts()
    before = set(child_pids())
    one, generated = _embed(tiny_llama, 1, pooling, kv_cache, prompts)
    two, generated_tp2 = _embed(tiny_llama, 2, pooling, kv_cache, prompts)
    assert two.shape == one.shape and one.norm(dim=1).min() > 0
    torch.testing.assert_close(two, one, atol=1e-4, rtol=1e-4)
    assert generated_tp2 == generated  # the same engine still generates as one rank
    assert not set(child_pids()) - before, "worker processes outlived the engine"
