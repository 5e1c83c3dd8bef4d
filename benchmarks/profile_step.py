"""Where a decode step's time goes: the largest ops per step, and the time outside ops.

    PYTHONPATH=. python benchmarks/profile_step.py                  # bf16, batch 1 and 32
    PYTHONPATH=. python benchmarks/profile_step.py --dtype float32 --batches 8
    PYTHONPATH=. python benchmarks/profile_step.py --model file.gguf --top 10

Runs greedy generation of --tokens tokens per sequence from ~30-token prompts (the short
prompts' prefill is included, as in compare.py) under torch.profiler and prints, per step,
the wall time, the ops' own time, the time outside every op (Python: engine, scheduler,
model runner, sampler, detokenizer; the profiler adds a little of its own) and the
--top largest ops.
"""

from __future__ import annotations

import argparse
import random
import time

from torch.profiler import ProfilerActivity, profile

from pyllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: bundled SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, max_num_seqs=max(batches))
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(30)] for _ in range(max(batches))]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    steps = args.tokens
    for batch in batches:
        llm.generate(None, params, prompt_token_ids=prompts[:batch], use_tqdm=False)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            llm.generate(None, params, prompt_token_ids=prompts[:batch], use_tqdm=False)
            wall = time.perf_counter() - start
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        in_ops = sum(e.self_cpu_time_total for e in events) / 1e6
        print(
            f"{args.dtype} batch {batch} x {steps} tokens: {batch * steps / wall:.1f} tok/s "
            f"(profiled); per step {wall / steps * 1e3:.1f} ms = ops {in_ops / steps * 1e3:.1f} "
            f"ms + outside ops {(wall - in_ops) / steps * 1e3:.1f} ms"
        )
        for e in events[: args.top]:
            seconds = e.self_cpu_time_total / 1e6
            print(f"   {e.key:34s} {seconds / steps * 1e3:7.2f} ms/step {seconds / wall:6.1%}")


if __name__ == "__main__":
    main()
