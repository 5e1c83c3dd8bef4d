"""Serves one model split over two "machines" launched by torchrun, here on one machine.

    python benchmarks/torchrun_two_nodes.py --model MODEL

Starts the two launches that two machines would run, each with its node rank:

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --rdzv-endpoint 127.0.0.1:PORT \\
        -m pyllm serve --model MODEL --tensor-parallel-size 2 --port HTTP_PORT

Node 0's process is rank 0: it serves the OpenAI API; node 1's process is a worker.
(On real machines the endpoint is node 0's address, and MODEL a path every machine
has.) The script waits for /health, sends one completion request, prints the answer,
then sends SIGTERM to the server process (as a supervisor stopping it would) and waits
for both launches to end. Exits 0 when the request was answered and both exited 0.

The model must split over 2 ranks (even attention heads, e.g. TinyLlama's shapes from
`python benchmarks/make_gguf.py --shape tinyllama-1.1b --type Q4_K_M --layers 2`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(node_rank: int, rdzv_port: int, http_port: int, model: str, extra: list[str]):
    torchrun = shutil.which("torchrun")
    runner = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    command = [
        *runner, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank),
        "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}",
        "-m", "pyllm", "serve", "--model", model, "--tensor-parallel-size", "2",
        "--port", str(http_port), "--log-level", "warning", *extra,
    ]  # fmt: skip
    print(f"node {node_rank}: " + " ".join(command), flush=True)
    return subprocess.Popen(command, start_new_session=True)


def children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def wait_healthy(url: str, nodes: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in nodes):
            raise RuntimeError(f"a launch ended early: {[p.poll() for p in nodes]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy after {timeout} s")


def run(model: str, extra: list[str], prompt: str, max_tokens: int, timeout: float) -> dict:
    """Runs the two launches and one request; returns what happened."""
    rdzv_port, http_port = free_port(), free_port()
    url = f"http://127.0.0.1:{http_port}"
    nodes = [launch(rank, rdzv_port, http_port, model, extra) for rank in (1, 0)][::-1]
    result = {"status": None, "answer": None, "exit_codes": None}
    try:
        wait_healthy(url, nodes, timeout)
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
            name = json.load(response)["data"][0]["id"]
        status, body = post(
            url + "/v1/completions",
            {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        )
        result["status"] = status
        result["answer"] = body["choices"][0]["text"] if status == 200 else body
        for pid in children(nodes[0].pid):  # the server, under node 0's torchrun agent
            os.kill(pid, signal.SIGTERM)
        result["exit_codes"] = [p.wait(timeout) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file or HF folder")
    parser.add_argument("--prompt", default="The three primary colours are")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--server-args", default="", help="more `pyllm serve` arguments")
    args = parser.parse_args()
    result = run(args.model, args.server_args.split(), args.prompt, args.max_tokens, args.timeout)
    print(f"HTTP {result['status']}: {result['answer']!r}")
    print(f"exit codes (node 0, node 1): {result['exit_codes']}")
    return 0 if result["status"] == 200 and result["exit_codes"] == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
