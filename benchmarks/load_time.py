"""Cold start: how long building an engine takes, the first one-token step after it, and peak
RSS, for pyllm (strip cache on and off) and llama.cpp, each load in a fresh process.

    PYTHONPATH=. python benchmarks/load_time.py A.gguf,B.gguf [--engines pyllm,llama.cpp]

The library is imported before the clock starts (torch's import is not the model's). pyllm's
first load of a file writes its strip cache, so run it once before comparing (or read the
first figure as the writing load). llama.cpp: llama-cpp-python, n_ctx 2048, on PYTHONPATH
or in --llama-cpp-site (a site-packages folder), built without AMX where AMX crashes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

WORKER = r"""
import json, os, sys, time
engine, path = sys.argv[1], sys.argv[2]
if engine == "llama.cpp":
    import llama_cpp
    start = time.perf_counter()
    llm = llama_cpp.Llama(path, n_threads=os.cpu_count(), n_ctx=2048, verbose=False)
    load = time.perf_counter() - start
    start = time.perf_counter()
    llm("Hello", max_tokens=1)
else:
    import torch
    from pyllm import LLM, SamplingParams
    start = time.perf_counter()
    llm = LLM(path)
    load = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(["Hello"], SamplingParams(max_tokens=1))
first = time.perf_counter() - start
with open("/proc/self/status") as status:
    hwm = next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))
print("@@" + json.dumps({"load_s": load, "first_s": first, "peak_rss_mib": hwm / 1024}))
"""
ENGINES = ("pyllm", "pyllm-nocache", "llama.cpp")


def run_once(engine: str, path: str, llama_cpp_site: str | None) -> dict | None:
    env = dict(os.environ)
    if engine == "pyllm-nocache":
        env["PYLLM_STRIP_CACHE"] = "0"
    if engine == "llama.cpp" and llama_cpp_site:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [llama_cpp_site, env.get("PYTHONPATH")]))
    name = "llama.cpp" if engine == "llama.cpp" else "pyllm"
    done = subprocess.run(
        [sys.executable, "-c", WORKER, name, path], capture_output=True, text=True, env=env
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("@@")]
    if done.returncode or not lines:
        print(f"  {engine} failed:\n{done.stderr[-1500:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1][2:])


def cell(runs: list[dict], key: str, digits: int) -> str:
    return "/".join(f"{r[key]:.{digits}f}" for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", help="comma-separated GGUF files")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-cpp-site", help="site-packages holding llama_cpp")
    args = parser.parse_args()
    engines = args.engines.split(",")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        parser.error(f"--engines: unknown {unknown} (known: {', '.join(ENGINES)})")
    print(
        f"{'file':32s} {'engine':14s} {'load s':>18s} {'first step s':>18s} {'peak RSS MiB':>20s}"
    )
    for path in args.files.split(","):
        for engine in engines:
            runs = [run_once(engine, path, args.llama_cpp_site) for _ in range(args.repeats)]
            runs = [r for r in runs if r]
            if not runs:
                continue

            name = os.path.basename(path)[:32]
            print(
                f"{name:32s} {engine:14s} {cell(runs, 'load_s', 2):>18s} "
                f"{cell(runs, 'first_s', 2):>18s} {cell(runs, 'peak_rss_mib', 0):>20s}",
                flush=True,
            )


if __name__ == "__main__":
    main()
