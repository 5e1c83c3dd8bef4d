"""Time to first token of a long prompt in a fresh process: without a prefix cache on
disk, with a cold prefix_cache_dir (the prompt's blocks get written), and with the
prompt's blocks already on disk (read back instead of recomputed).

    PYTHONPATH=. python benchmarks/prefix_cache_dir.py [--tokens 3000] [--repeat 2]

Each run is its own process (python benchmarks/prefix_cache_dir.py --child ...): the
model loads, then one request of `--tokens` random token ids is timed from its arrival
to its first token. The default model is the bundled SmolLM2, float32, unquantized.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time


def child(args: argparse.Namespace) -> None:
    from pyllm import LLM, SamplingParams

    options = dict(dtype="float32", quantization="none")
    if args.dir:
        options["prefix_cache_dir"] = args.dir
    start = time.perf_counter()
    llm = LLM(args.model, **options)
    load_s = time.perf_counter() - start
    vocab = llm.engine.model_config.vocab_size
    prompt = [random.Random(0).randrange(100, vocab) for _ in range(args.tokens)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    start = time.perf_counter()
    llm.engine.close()  # writes what is still queued for the disk
    stats = llm.engine.stats()
    result = {
        "ttft_s": out.metrics["first_token_time"] - out.metrics["arrival_time"],
        "load_s": load_s,
        "close_s": time.perf_counter() - start,
        "cached_tokens": out.num_cached_tokens,
        "disk_writes": stats.prefix_cache_disk_writes,
        "tokens": out.outputs[0].token_ids,
    }
    print(json.dumps(result))


def run(args: argparse.Namespace, folder: str | None) -> dict:
    command = [sys.executable, __file__, "--child", "--tokens", str(args.tokens)]
    command += ["--dir", folder] if folder else []
    command += ["--model", args.model] if args.model else []
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    for _ in range(args.repeat):
        folder = tempfile.mkdtemp(prefix="prefix-cache-dir-")
        try:
            rows = {"none": run(args, None), "cold": run(args, folder), "warm": run(args, folder)}
        finally:
            shutil.rmtree(folder)
        same = rows["none"]["tokens"] == rows["cold"]["tokens"] == rows["warm"]["tokens"]
        for name, row in rows.items():
            print(
                f"{name:5} ttft {row['ttft_s']:6.3f} s  load {row['load_s']:5.2f} s  close "
                f"{row['close_s']:5.2f} s  cached {row['cached_tokens']:5}  written "
                f"{row['disk_writes']:4}"
            )
        ratio = rows["warm"]["ttft_s"] / rows["cold"]["ttft_s"]
        print(f"warm / cold ttft: {ratio:.3f}; same tokens: {same}", flush=True)
    print(f"cpus: {os.cpu_count()}")


if __name__ == "__main__":
    main()
