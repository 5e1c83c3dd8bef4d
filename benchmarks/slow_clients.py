"""How a `pyllm serve` treats clients that do not finish their requests.

    python benchmarks/slow_clients.py                          # 200 sockets, --read-timeout 30
    python benchmarks/slow_clients.py --sockets 1000 --read-timeout 5 --wait 60

Starts a server, opens --sockets connections that each send half a request line, and
prints how many the server has closed after each second, up to --wait seconds; then
sends three requests that stop mid-body and close, and prints how many lines the server
logged for them (and how many tracebacks).
"""

from __future__ import annotations

import argparse
import selectors
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from serve_load import free_port

SERVER_ARGS = ["--kv-cache-memory", "0.1", "--max-model-len", "512"]


def wait_ready(server: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    raise RuntimeError("pyllm serve did not become ready")


def count_closed(socks: list[socket.socket], wait: float) -> None:
    selector = selectors.DefaultSelector()
    for sock in socks:
        selector.register(sock, selectors.EVENT_READ)
    start, report = time.monotonic(), 1.0
    while selector.get_map() and time.monotonic() - start < wait:
        for key, _ in selector.select(timeout=0.1):
            try:
                chunk = key.fileobj.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                selector.unregister(key.fileobj)
        if time.monotonic() - start >= report or not selector.get_map():
            closed = len(socks) - len(selector.get_map())
            print(f"{time.monotonic() - start:5.1f} s: {closed}/{len(socks)} closed", flush=True)
            report += 1.0
    selector.close()


def aborted_uploads(port: int, log_path: str) -> None:
    before = open(log_path, errors="replace").read().count("\n")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                b'{"prompt": "x'
            )
            time.sleep(0.3)
    time.sleep(1)
    lines = open(log_path, errors="replace").read().splitlines()[before:]
    tracebacks = sum("Traceback" in line for line in lines)
    print(f"3 uploads cut short: {len(lines)} log lines, {tracebacks} tracebacks")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sockets", type=int, default=200)
    parser.add_argument("--read-timeout", type=float, default=30.0)
    parser.add_argument("--wait", type=float, default=45.0)
    args = parser.parse_args()
    port = free_port()
    command = [sys.executable, "-m", "pyllm", "serve", "--port", str(port), *SERVER_ARGS,
               "--read-timeout", str(args.read_timeout)]  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".log") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(server, f"http://127.0.0.1:{port}")
            socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(args.sockets)]
            for sock in socks:
                sock.sendall(b"POST /v1/compl")
            count_closed(socks, args.wait)
            for sock in socks:
                sock.close()
            aborted_uploads(port, log.name)
        finally:
            server.terminate()
            server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
