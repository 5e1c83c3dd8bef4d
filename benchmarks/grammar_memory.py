"""A `pyllm serve` process's resident memory over distinct explosive regexes.

    python benchmarks/grammar_memory.py              # starts a server, 12 patterns
    python benchmarks/grammar_memory.py --count 17

Each pattern is a{N}{N+1} with a fresh N: 15 bytes that ask llguidance's lexer for about
a million states. Prints each request's status, what it returned and took, and the
server's RSS (from /proc) after it, then the growth over all of them. The first request
(guided_regex "[a-z]+") sets up the tokenizer's grammar tables and is not counted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx
from serve_load import start_server, stop_server

SERVER_ARGS = ["--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "0.25",
               "--max-model-len", "2048"]  # fmt: skip


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no VmRSS in /proc")


def ask(url: str, model: str, regex: str) -> tuple[int, str, float]:
    body = {"model": model, "prompt": "Say it:", "max_tokens": 2, "guided_regex": regex}
    start = time.perf_counter()
    response = httpx.post(url + "/v1/completions", json=body, timeout=300)
    seconds = time.perf_counter() - start
    reply = response.json()
    if response.status_code == 200:
        choice = reply["choices"][0]
        return response.status_code, f"{choice['text']!r} {choice['finish_reason']}", seconds
    return response.status_code, str(reply["error"]["code"]), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=12)
    args = parser.parse_args()
    server, url = start_server(SERVER_ARGS)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        status, _, _ = ask(url, model, "[a-z]+")
        start = rss_mib(server.pid)
        print(f"warm-up: {status}, RSS {start} MiB")
        for i in range(args.count):
            regex = f"a{{{1000 + i}}}{{{1001 + i}}}"
            status, what, seconds = ask(url, model, regex)
            rss = rss_mib(server.pid)
            print(f"{regex:16s} {status} {what:24s} {seconds:5.2f} s  RSS {rss} MiB")
        print(f"growth over {args.count}: {rss_mib(server.pid) - start} MiB")
    finally:
        stop_server(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
