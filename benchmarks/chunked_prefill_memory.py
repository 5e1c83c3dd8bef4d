"""Peak memory of prefilling one long prompt, with and without chunked prefill.

    python benchmarks/chunked_prefill_memory.py [--model PATH] [--dtype float32]

Each case runs in its own process. After the model is loaded and warmed up the
process's peak-RSS mark is reset (/proc/self/clear_refs), so the figure is what the
prefill itself adds: activations plus the KV cache pages it writes. The KV part grows
with the prompt in every case (it is the cache's job); with a token budget of 512
the activation part must not. On CUDA, torch.cuda.max_memory_allocated is used.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

CASES = [(1024, 512), (4096, 512), (8000, 512), (1024, 4096), (4096, 4096)]


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def run_case(args) -> dict:
    import torch

    from pyllm import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_batched_tokens=args.budget,
        enable_prefix_caching=False,
        kv_cache_memory=1.0,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=[[1000] * 64], sampling_params=params, use_tqdm=False)
    cfg = llm.engine.model_config
    kv_bytes = args.prompt * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    kv_bytes *= llm.engine.config.torch_dtype.itemsize
    prompt = [1000 + (i * 7919) % 20000 for i in range(args.prompt)]
    if llm.engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        base = _rss_kib("VmRSS") * 1024
        llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
        peak = _rss_kib("VmHWM") * 1024 - base
    return {"prompt": args.prompt, "budget": args.budget, "peak": peak, "kv": kv_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prompt is not None:  # a child process: one case
        print(json.dumps(run_case(args)))
        return

    print(f"$ python {' '.join(sys.argv)}")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus; "
        f"device {args.device}, dtype {args.dtype}"
    )
    print(
        f"{'prompt':>7} {'budget':>7} {'peak added MiB':>15} {'of it KV MiB':>13} {'other MiB':>10}"
    )
    for prompt, budget in CASES:
        command = [sys.executable, __file__, "--prompt", str(prompt), "--budget", str(budget)]
        command += ["--dtype", args.dtype, "--device", args.device]
        if args.model:
            command += ["--model", args.model]
        result = subprocess.run(command, capture_output=True, text=True, check=True)
        r = json.loads(result.stdout.strip().splitlines()[-1])
        mib = 2**20
        print(
            f"{r['prompt']:>7} {r['budget']:>7} {r['peak'] / mib:>15.1f} {r['kv'] / mib:>13.1f} "
            f"{(r['peak'] - r['kv']) / mib:>10.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
