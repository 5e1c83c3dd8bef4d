"""Load test for a running `pyllm serve`: N concurrent streaming clients.

    PYTHONPATH=. python benchmarks/serve_load.py --start-server --num-requests 16 --concurrency 8
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --num-requests 200 --concurrency 32

Prompts and output lengths are ShareGPT-like but generated from --seed (nothing is
downloaded): lognormal prompt and output lengths (in words, roughly tokens), prompts made of
random words. Every request streams POST /v1/completions with ignore_eos, so it makes exactly
its output length; its token count comes from the stream's usage chunk.

Reported: request throughput, output tokens/s (over the whole run), time to first token
(TTFT: from sending the request to the first streamed text) and time per output token
(TPOT: (end - first token) / (output tokens - 1)), median and p99.

--mixed measures head-of-line blocking instead: --long-prompts requests of
--long-words words (and, with --fan-out-prompts, one request of that many prompts x
--fan-out-n) start at once, and short chats arrive every --short-interval seconds
while they run; reported: the short chats' TTFT median and p99, and when the long
ones finished.

    PYTHONPATH=. python benchmarks/serve_load.py --start-server --mixed --long-prompts 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point government company number group problem fact water story music river light "
    "quiet small green ancient market bridge careful travel letter bright summer language"
).split()


@dataclass
class Result:
    ok: bool
    prompt_words: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    error: str = ""


def make_requests(count: int, seed: int, max_prompt: int, max_output: int) -> list[tuple]:
    """(prompt, output tokens) pairs. Lognormal lengths with ShareGPT-like medians (prompt
    ~ 100 words, output ~ 120 tokens) and long tails, clipped to fit a small model's context."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        prompt_len = min(max_prompt, max(4, int(rng.lognormvariate(math.log(100), 0.8))))
        output_len = min(max_output, max(4, int(rng.lognormvariate(math.log(120), 0.7))))
        prompt = " ".join(rng.choice(WORDS) for _ in range(prompt_len))
        requests.append((prompt, output_len))
    return requests


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, out: int):
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": out,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = Result(ok=False, prompt_words=len(prompt.split()))
    start = time.perf_counter()
    first = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return result
                if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                    first = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    end = time.perf_counter()
    result.ttft = (first or end) - start
    result.latency = end - start
    result.ok = result.output_tokens > 0
    if not result.ok:
        result.error = "no usage chunk or no tokens in the stream"
    return result


async def run_load(url: str, requests: list[tuple], concurrency: int) -> tuple[list, float]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        queue = list(enumerate(requests))
        results: list[Result | None] = [None] * len(requests)

        async def worker():
            while queue:
                index, (prompt, out) = queue.pop(0)
                results[index] = await one_request(client, url, model, prompt, out)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - start


async def one_chat(client: httpx.AsyncClient, url: str, model: str, text: str, out: int):
    """A short streaming chat; its TTFT is to the first streamed content."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": out,
        "temperature": 0.0,
        "stream": True,
    }
    result = Result(ok=False, prompt_words=len(text.split()))
    start = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return result
                deltas = [c.get("delta", {}).get("content") for c in chunk.get("choices", [])]
                if not result.ttft and any(deltas):
                    result.ttft = time.perf_counter() - start
                    result.output_tokens += 1
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = result.ttft > 0
    return result


async def long_request(client, url: str, model: str, body: dict) -> float:
    """A non-streaming completion; returns seconds to its end (nan if it failed)."""
    start = time.perf_counter()
    response = await client.post(url + "/v1/completions", json={"model": model, **body})
    return time.perf_counter() - start if response.status_code == 200 else float("nan")


async def run_mixed(url: str, args) -> tuple[list[Result], list[float]]:
    rng = random.Random(args.seed)

    def words(count: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(count))

    longs = [
        {"prompt": words(args.long_words), "max_tokens": 16, "ignore_eos": True}
        for _ in range(args.long_prompts)
    ]
    if args.fan_out_prompts:
        prompts = [words(32) for _ in range(args.fan_out_prompts)]
        longs.append({"prompt": prompts, "n": args.fan_out_n, "max_tokens": 64, "seed": 0})
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        long_tasks = [asyncio.create_task(long_request(client, url, model, b)) for b in longs]
        await asyncio.sleep(args.short_interval)  # the long ones are under way
        short_tasks = []
        for _ in range(args.short_requests):
            short_tasks.append(asyncio.create_task(one_chat(client, url, model, words(12), 8)))
            await asyncio.sleep(args.short_interval)
        shorts = await asyncio.gather(*short_tasks)
        long_seconds = await asyncio.gather(*long_tasks)
    return shorts, long_seconds


def report_mixed(shorts: list[Result], long_seconds: list[float]) -> dict:
    ttft = [r.ttft * 1000 for r in shorts if r.ok]
    summary = {
        "short_requests": len(shorts),
        "short_failed": len(shorts) - len(ttft),
        "short_ttft_ms_median": statistics.median(ttft) if ttft else float("nan"),
        "short_ttft_ms_p99": percentile(ttft, 99),
        "long_seconds": long_seconds,
    }
    print(f"short chats: {len(ttft)} ok, {summary['short_failed']} failed")
    for r in [r for r in shorts if not r.ok][:5]:
        print(f"  failed: {r.error}")
    print(
        f"short TTFT ms:   median {summary['short_ttft_ms_median']:.0f}   "
        f"p99 {summary['short_ttft_ms_p99']:.0f}"
    )
    print("long requests done after s: " + " ".join(f"{s:.1f}" for s in long_seconds))
    return summary


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = q / 100 * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def report(results: list[Result], seconds: float, concurrency: int) -> dict:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    ttft = [r.ttft * 1000 for r in done]
    tpot = [
        (r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in done if r.output_tokens > 1
    ]
    output_tokens = sum(r.output_tokens for r in done)
    summary = {
        "concurrency": concurrency,
        "requests": len(results),
        "failed": len(failed),
        "seconds": seconds,
        "request_throughput": len(done) / seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "output_tokens": output_tokens,
        "prompt_words": sum(r.prompt_words for r in done),
        "ttft_ms_median": statistics.median(ttft) if ttft else float("nan"),
        "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_median": statistics.median(tpot) if tpot else float("nan"),
        "tpot_ms_p99": percentile(tpot, 99),
    }
    print(
        f"requests: {len(done)} ok, {len(failed)} failed, concurrency {concurrency}, "
        f"{seconds:.1f} s"
    )
    for r in failed[:5]:
        print(f"  failed: {r.error}")
    print(f"request throughput:  {summary['request_throughput']:.2f} req/s")
    print(
        f"output tokens/s:     {summary['output_tokens_per_s']:.1f} "
        f"({output_tokens} tokens; {summary['prompt_words']} prompt words)"
    )
    print(f"TTFT ms:   median {summary['ttft_ms_median']:.0f}   p99 {summary['ttft_ms_p99']:.0f}")
    print(f"TPOT ms:   median {summary['tpot_ms_median']:.1f}   p99 {summary['tpot_ms_p99']:.1f}")
    return summary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "pyllm",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *extra,
    ]
    print("starting: " + " ".join(shlex.quote(c) for c in command), flush=True)
    server = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"pyllm serve exited with {server.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(server)
    raise RuntimeError("pyllm serve was not ready after 300 s")


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-words", type=int, default=1024)
    parser.add_argument("--max-output-tokens", type=int, default=512)
    parser.add_argument(
        "--start-server",
        action="store_true",
        help="launch `python -m pyllm serve` on a free port, stop it at the end",
    )
    parser.add_argument(
        "--server-args",
        default="",
        help="extra arguments for the started server, e.g. '--dtype bfloat16'",
    )
    parser.add_argument("--json", default=None, help="write the summary to this file")
    mixed = parser.add_argument_group("mixed workload (--mixed)")
    mixed.add_argument("--mixed", action="store_true", help="short chats among long prompts")
    mixed.add_argument("--long-prompts", type=int, default=1)
    mixed.add_argument("--long-words", type=int, default=2048)
    mixed.add_argument("--fan-out-prompts", type=int, default=0)
    mixed.add_argument("--fan-out-n", type=int, default=8)
    mixed.add_argument("--short-requests", type=int, default=16)
    mixed.add_argument("--short-interval", type=float, default=0.5)
    args = parser.parse_args()
    if args.concurrency < 1 or args.num_requests < 1:
        raise ValueError("--concurrency and --num-requests must be positive")
    print("$ " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"machine: {os.cpu_count()} cpus")
    requests = make_requests(
        args.num_requests, args.seed, args.max_prompt_words, args.max_output_tokens
    )
    server, url = None, args.url
    if args.start_server:
        server, url = start_server(shlex.split(args.server_args))
    try:
        if args.mixed:
            shorts, long_seconds = asyncio.run(run_mixed(url, args))
        else:
            results, seconds = asyncio.run(run_load(url, requests, args.concurrency))
    finally:
        if server is not None:
            stop_server(server)
    if args.mixed:
        summary = report_mixed(shorts, long_seconds)
        summary["failed"] = summary["short_failed"] + sum(math.isnan(s) for s in long_seconds)
    else:
        summary = report(results, seconds, args.concurrency)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
