"""Speculative decoding with n-gram proposals against plain decoding, on the bundled
SmolLM2-135M-Instruct: tokens per second, speedup and acceptance rate per workload
and batch size, measured in one run on this machine.

    PYTHONPATH=. python benchmarks/spec_decode.py                  # batch 1 and 8
    PYTHONPATH=. python benchmarks/spec_decode.py --batches 1,2,4,8,16 --k 4

Workloads (chat prompts, greedy): `repeat` (copy a passage), `rename` (rewrite code
changing one name): answers grounded in the prompt, where proposals looked up in it
are often right; `free` (open questions): little to look up. Each cell is the best of
--repeats runs of one generate call of `batch` prompts (prefill included); `same`
says whether both engines gave the same tokens (in bfloat16 the verification pass may
round differently from one-token decodes, so a few may differ).
"""

from __future__ import annotations

import argparse
import os
import time

from bench_timing import cpu_name

from pyllm import LLM, SamplingParams

PASSAGES = [
    "The lighthouse stood at the end of the causeway, its white paint peeling in long "
    "strips. Every evening the keeper climbed the one hundred and twelve steps, trimmed "
    "the wick, polished the great lens and wrote the weather in a leather book. Ships "
    "passed far out, their lights small as sparks, and none of them knew his name.",
    "Bread needs four things: flour, water, salt and time. Mix the flour and water and "
    "let them rest for half an hour. Add the salt and the yeast, then knead until the "
    "dough is smooth. Let it rise until doubled, shape it, let it rise again, and bake "
    "it in a hot oven until the crust is deep brown and the loaf sounds hollow.",
    "Rivers carve valleys over thousands of years. Fast water carries sand and stones "
    "that grind the riverbed deeper, while slow water drops what it carries and builds "
    "wide plains. Where a river meets the sea it slows and spreads, leaving a delta of "
    "mud and channels that shift with every flood.",
    "The meeting is moved to Thursday at ten in the small room on the third floor. "
    "Please bring the quarterly figures, the draft budget and your notes on the new "
    "hiring plan. If you cannot attend, send your comments to the team by Wednesday "
    "evening so that they can be discussed.",
]
CODES = [
    "def total(values):\n    result = 0\n    for value in values:\n        result += value\n"
    "    return result\n\n\nprint(total([1, 2, 3]))\n",
    "def largest(items):\n    best = items[0]\n    for item in items[1:]:\n"
    "        if item > best:\n            best = item\n    return best\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "def is_even(number):\n    if number % 2 == 0:\n        return True\n"
    "    return False\n\n\nfor n in range(5):\n    print(n, is_even(n))\n",
]
FREE = [
    "Write a short story about a lighthouse keeper.",
    "What are three good habits for staying healthy?",
    "Explain how a bicycle works to a child.",
    "Describe a walk through a forest in autumn.",
]
WORKLOADS = {
    "repeat": [f"Repeat the following passage exactly:\n\n{p}" for p in PASSAGES],
    "rename": [
        f"Rewrite this code changing only the function name to `run`:\n\n{c}" for c in CODES
    ],
    "free": FREE,
}


def run(llm: LLM, prompts: list[str], params: SamplingParams, repeats: int):
    """(best tok/s, output token ids, spec counters of the best run) of one chat batch."""
    best = None
    for _ in range(repeats):
        before = llm.engine.stats()
        start = time.perf_counter()
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                           use_tqdm=False)  # fmt: skip
        elapsed = time.perf_counter() - start
        after = llm.engine.stats()
        tokens = [o.outputs[0].token_ids for o in outputs]
        rate = sum(map(len, tokens)) / elapsed
        drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        if best is None or rate > best[0]:
            best = (rate, tokens, drafted, accepted)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--dtype", default="auto", help="activations and KV cache")
    parser.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=1 << 30,
        help="the config's threshold (default: never, to measure every batch size)",
    )
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
        "disable_by_batch_size": args.disable_by_batch_size,
    }
    plain = LLM(None, dtype=args.dtype)
    ngram = LLM(None, dtype=args.dtype, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    dtype = str(plain.engine.config.torch_dtype).removeprefix("torch.")
    print(f"machine: {cpu_name()}, {os.cpu_count()} cpus; model: bundled SmolLM2-135M, {dtype}")
    print(f"speculative_config: {spec}; greedy, max_tokens {args.max_tokens}")
    print(f"{'workload':>8} {'batch':>5} | {'plain tok/s':>11} {'ngram tok/s':>11} "
          f"{'speedup':>7} | {'accepted':>8} {'same':>5}")  # fmt: skip
    for name in args.workloads.split(","):
        for batch in batches:
            prompts = [WORKLOADS[name][i % len(WORKLOADS[name])] for i in range(batch)]
            base, base_tokens, _, _ = run(plain, prompts, params, args.repeats)
            rate, tokens, drafted, accepted = run(ngram, prompts, params, args.repeats)
            share = f"{accepted / drafted:.0%}" if drafted else "-"
            same = sum(a == b for a, b in zip(base_tokens, tokens, strict=True))
            print(f"{name:>8} {batch:>5} | {base:>11.1f} {rate:>11.1f} {rate / base:>6.2f}x |"
                  f" {share:>8} {same:>2}/{batch:<2}")  # fmt: skip


if __name__ == "__main__":
    main()
