"""Throughput of `LLM.embed` on many short texts: texts/s and prompt tokens/s, against
`LLM.generate` of one greedy token per text on the same engine (the same prefill plus
the LM head and a sampling step) as the baseline.

    PYTHONPATH=. python benchmarks/embed.py [--texts 1000] [--repeat 3] [--pooling mean]
    PYTHONPATH=. python benchmarks/embed.py --model path/to/model.gguf --dtype float32

The default model is the bundled SmolLM2-135M-Instruct (Q4_1 GGUF); prefix caching is
off so that a repeat computes what the first run did. Best of --repeat runs each, the
two taken in turn.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from bench_timing import cpu_name

WORDS = (
    "the a cat dog river city music light small quick quiet green old new house road "
    "market winter summer book paper window garden stone bridge cloud letter story"
).split()


def short_texts(count: int, seed: int = 0) -> list[str]:
    """count sentences of 4 to 16 words, the same for a given seed."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(4, 16))) + "." for _ in range(count)]


def best_times(repeat: int, *fns) -> list[float]:
    """The fastest of `repeat` calls of each fn, taken in turn (fn 1, fn 2, fn 1, ...) so
    that a busy spell on a shared machine hits all of them alike."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--pooling", default="last", choices=("last", "mean"))
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    import torch

    from pyllm import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, pooling=args.pooling, enable_prefix_caching=False)
    texts = short_texts(args.texts)
    tokens = sum(len(llm.tokenizer.encode(t)) for t in texts)
    llm.embed(texts[:32], use_tqdm=False)  # warm-up
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    embed_s, generate_s = best_times(
        args.repeat,
        lambda: llm.embed(texts, use_tqdm=False),
        lambda: llm.generate(texts, one_token, use_tqdm=False),
    )
    cfg = llm.engine.config
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads")
    print(
        f"model: {os.path.basename(cfg.model_path)}, dtype "
        f"{str(cfg.torch_dtype).removeprefix('torch.')}, pooling {args.pooling}, "
        f"{args.texts} texts, {tokens} tokens ({tokens / args.texts:.1f} per text), "
        f"best of {args.repeat}"
    )
    print(f"{'':24} {'seconds':>8} {'texts/s':>9} {'tokens/s':>9}")
    for name, seconds in (("LLM.embed", embed_s), ("LLM.generate, 1 token", generate_s)):
        print(f"{name:24} {seconds:8.2f} {args.texts / seconds:9.1f} {tokens / seconds:9.0f}")
    print(f"embed / generate throughput: {generate_s / embed_s:.2f}x")


if __name__ == "__main__":
    main()
