"""Fuzzes a `pyllm serve` with schemathesis against the server's own /openapi.json.

    python benchmarks/schema_fuzz.py                       # starts a small server itself
    python benchmarks/schema_fuzz.py --url http://127.0.0.1:8000 --api-key KEY

Stateless phases only (examples, coverage, fuzzing), bounded by --max-examples per
operation (or run for --max-time seconds). The checks: no 5xx (not_a_server_error),
every response body valid against the route's declared schema
(response_schema_conformance), and declared status codes and content types. The started
server keeps generated requests cheap: a short context and few sequences per request,
so a random `n` x `max_tokens` is seconds of work, not minutes. Exits with
schemathesis's status: 0 when nothing failed.

Needs `pip install schemathesis`.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile

from serve_load import start_server, stop_server

CHECKS = (
    "not_a_server_error",
    "response_schema_conformance",
    "status_code_conformance",
    "content_type_conformance",
)
SERVER_ARGS = ["--max-model-len", "128", "--max-seqs-per-request", "4", "--api-key"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--api-key", default="fuzz-key", help="the server's API key")
    parser.add_argument("--max-examples", type=int, default=40, help="per operation")
    parser.add_argument(
        "--max-time", type=int, default=None, help="keep fuzzing for this many seconds"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if shutil.which("schemathesis") is None:
        print("schemathesis is not installed: pip install schemathesis", file=sys.stderr)
        return 2
    server = None
    url = args.url
    if url is None:
        server, url = start_server([*SERVER_ARGS, args.api_key])
    try:
        with tempfile.TemporaryDirectory() as reports:
            command = [
                "schemathesis", "run", f"{url}/openapi.json",
                "--phases", "examples,coverage,fuzzing",
                "--checks", ",".join(CHECKS),
                "--max-examples", str(args.max_examples),
                "--seed", str(args.seed),
                "--header", f"Authorization: Bearer {args.api_key}",
                "--request-timeout", "120",
                "--workers", "2",
                "--report-dir", reports,
            ]  # fmt: skip
            if args.max_time is not None:
                command += ["--max-time", str(args.max_time)]
            print("$ " + " ".join(command), flush=True)
            return subprocess.run(command).returncode
    finally:
        if server is not None:
            stop_server(server)


if __name__ == "__main__":
    sys.exit(main())
