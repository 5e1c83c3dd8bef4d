"""What the int8 KV cache costs in quality: the float cache and the int8 cache side by
side in one run, on the same model and inputs.

    PYTHONPATH=. python benchmarks/kv_quality.py               # SmolLM2, float32
    PYTHONPATH=. python benchmarks/kv_quality.py --kv-cache contiguous

1. Perplexity of a fixed English text (benchmarks/data/lighthouse_keeper.txt, about
   2,250 tokens) from the prompt logprobs of one request: every token's logprob given
   the ones before it, their keys and values read back from the cache (prefill writes
   a chunk's K/V, then attends over the cache).
2. Greedy agreement: each of a set of prompts generated greedily with both caches;
   a prompt agrees when every token is the same, and the first diverging position is
   printed where they differ.

The model is loaded widened to float32 (quantization=None), so that the KV cache's
precision is the only difference between the two runs.
"""

from __future__ import annotations

import argparse
import math
import os
import platform

import torch

from pyllm import LLM, SamplingParams

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "lighthouse_keeper.txt")
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "Write a short poem about the moon.",
    "Explain how a refrigerator keeps food cold.",
    "The three primary colors are",
    "List five fruits that are red.",
    "In computer science, a hash table is",
    "The best way to learn a new language is",
    "What is the boiling point of water at sea level?",
    "Photosynthesis is the process by which",
    "Give me three tips for sleeping better.",
    "The history of the printing press begins",
    "A healthy breakfast should include",
    "Describe a busy train station in the morning.",
    "The main difference between a virus and a bacterium is",
    "To bake bread at home, you first need to",
    "Summarize the plot of a detective story in two sentences.",
    "The largest planet in our solar system is",
    "Why do leaves change color in autumn?",
    "A good manager is someone who",
]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate(prompt_token_ids=[token_ids], sampling_params=params, use_tqdm=False)[0]
    logprobs = [chosen for chosen, _ in out.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy(llm: LLM, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(PROMPTS, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--kv-cache", default="paged", choices=["paged", "contiguous"])
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    args = parser.parse_args()
    print(f"command: python benchmarks/kv_quality.py --kv-cache {args.kv_cache}")
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}")

    results = {}
    for kv_dtype in ("auto", "int8"):
        llm = LLM(
            args.model, quantization=None, dtype=torch.float32, kv_cache=args.kv_cache,
            kv_cache_dtype=kv_dtype, kv_cache_memory=0.25,
        )  # fmt: skip
        text_ids = llm.tokenizer.encode(open(TEXT).read())
        results[kv_dtype] = (perplexity(llm, text_ids), greedy(llm, args.max_tokens))
        del llm
    (ppl_float, out_float), (ppl_int8, out_int8) = results["auto"], results["int8"]
    change = 100 * (ppl_int8 / ppl_float - 1)
    print(f"text: {os.path.relpath(TEXT)} ({len(text_ids)} tokens)")
    print(f"perplexity  float32 KV {ppl_float:.4f}   int8 KV {ppl_int8:.4f}   ({change:+.3f}%)")
    agree = sum(a == b for a, b in zip(out_float, out_int8, strict=True))
    print(f"greedy agreement ({args.max_tokens} tokens each): {agree}/{len(PROMPTS)} prompts")
    for prompt, a, b in zip(PROMPTS, out_float, out_int8, strict=True):
        if (i := first_difference(a, b)) is not None:
            print(f"  differs from token {i}: {prompt!r}")


if __name__ == "__main__":
    main()
