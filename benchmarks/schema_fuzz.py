"""Fuzzes a `pyllm serve`'s request models; counts server errors (5xx), which must be 0.

    python benchmarks/schema_fuzz.py                       # starts a small server itself
    python benchmarks/schema_fuzz.py --url http://127.0.0.1:8000 --api-key KEY
    python benchmarks/schema_fuzz.py --max-examples 40 --mutations 3000 --seed 1
    python benchmarks/schema_fuzz.py --paths /v1/messages /v1/responses /v1/embeddings
    python benchmarks/schema_fuzz.py --paths "/v1/responses/{response_id}"

Two stages, one report:
1. schemathesis against the server's own /openapi.json, positive and negative data
   (--mode all), phases examples, coverage and fuzzing, bounded by --max-examples per
   operation. Checks: no 5xx (not_a_server_error), every response valid against the
   route's declared schema, declared status codes and content types. Schemathesis's data
   rarely gets past the first field check (a random `model` is a 404), so:
2. mutations (hypothesis): a valid request to each body route, with the real model name,
   then one to three of its fields, top-level or nested (messages[0].tool_calls,
   tools[0].function.parameters, response_format.json_schema.schema, ...), replaced by
   any JSON value (deep, huge, empty, of the wrong type) or by a JSON string of one.
   Checks: no 5xx, and every 4xx in the API's error shape (OpenAI's, or Anthropic's on
   /v1/messages).

The started server keeps generated requests cheap: a short context and few sequences per
request. Prints the cases and server errors of each stage and in all; exits 1 if any
request failed a check. Needs `pip install schemathesis` (which brings hypothesis).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from serve_load import start_server, stop_server

CHECKS = (
    "not_a_server_error",
    "response_schema_conformance",
    "status_code_conformance",
    "content_type_conformance",
)
SERVER_ARGS = ["--max-model-len", "128", "--max-seqs-per-request", "4", "--api-key"]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "1", "type": "function",
                     "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
    {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "2"}]},
    {"role": "user", "content": "Hi"},
]  # fmt: skip
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}  # fmt: skip
SCHEMA = {"type": "object", "properties": {"x": {"type": "string", "maxLength": 4}}}
# A valid body per route (the model's name is added), and the paths the mutations replace.
BASES = {
    "/v1/chat/completions": (
        {"messages": MESSAGES, "max_tokens": 2, "tools": [TOOL],
         "response_format": {"type": "json_schema",
                             "json_schema": {"name": "s", "schema": SCHEMA}}},
        ["messages", "messages.0", "messages.0.role", "messages.1.tool_calls",
         "messages.1.tool_calls.0", "messages.1.tool_calls.0.function",
         "messages.1.tool_calls.0.function.arguments", "messages.2.content",
         "messages.2.content.0", "messages.3.content", "tools", "tools.0.function",
         "tools.0.function.parameters", "tool_choice", "response_format",
         "response_format.json_schema.schema", "max_tokens", "max_completion_tokens", "n",
         "temperature", "top_p", "top_k", "min_p", "seed", "stop", "logit_bias",
         "logprobs", "top_logprobs", "stream", "stream_options", "guided_json",
         "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
         "presence_penalty", "repetition_penalty", "stop_token_ids", "priority", "model",
         "parallel_tool_calls", "add_generation_prompt"],
    ),
    "/v1/completions": (
        {"prompt": "Hi", "max_tokens": 2},
        ["prompt", "max_tokens", "n", "best_of", "echo", "logprobs", "prompt_logprobs",
         "suffix", "stop", "seed", "temperature", "logit_bias", "guided_json",
         "guided_regex", "guided_choice", "guided_grammar", "stream", "stream_options",
         "min_tokens", "ignore_eos", "model"],
    ),
    "/tokenize": (
        {"messages": MESSAGES, "return_token_strs": True},
        ["messages", "messages.1.tool_calls.0.function", "prompt", "add_special_tokens",
         "add_generation_prompt", "return_token_strs", "model"],
    ),
    "/detokenize": ({"tokens": [1, 2, 3]}, ["tokens", "tokens.0", "model"]),
    "/v1/responses": (
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                   {"type": "function_call", "call_id": "1", "name": "f",
                    "arguments": "{\"a\": 1}"},
                   {"type": "function_call_output", "call_id": "1", "output": "2"}],
         "instructions": "Be brief.", "max_output_tokens": 2,
         "tools": [{"type": "function", "name": "f", **TOOL["function"]}],
         "text": {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA}}},
        ["input", "input.0", "input.0.role", "input.0.content", "input.0.content.0",
         "input.1", "input.1.arguments", "input.2", "input.2.output", "instructions",
         "max_output_tokens", "temperature", "top_p", "tools", "tools.0",
         "tools.0.parameters", "tool_choice", "text", "text.format", "text.format.schema",
         "stream", "store", "previous_response_id", "metadata", "parallel_tool_calls",
         "reasoning", "top_logprobs", "background", "model"],
    ),
    "/v1/embeddings": (
        {"input": ["Hi", "there"], "dimensions": 8, "encoding_format": "base64"},
        ["input", "input.0", "input.1", "dimensions", "encoding_format", "user", "model"],
    ),
}  # fmt: skip
# Anthropic's Messages API: a conversation with thinking, a tool call and its result.
CLAUDE_MESSAGES = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Hm.", "signature": "s"},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "2"}]},
        {"type": "text", "text": "So?"}]},
]  # fmt: skip
CLAUDE_TOOL = {"name": "f", "description": "d", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}  # fmt: skip
CLAUDE_PATHS = [
    "messages", "messages.0", "messages.0.role", "messages.0.content", "messages.1.content",
    "messages.1.content.0", "messages.1.content.0.type", "messages.1.content.1",
    "messages.1.content.2", "messages.1.content.2.input", "messages.1.content.2.name",
    "messages.1.content.2.id", "messages.2.content", "messages.2.content.0",
    "messages.2.content.0.content", "messages.2.content.0.content.0",
    "messages.2.content.0.tool_use_id", "messages.2.content.0.is_error", "system", "tools",
    "tools.0", "tools.0.name", "tools.0.input_schema", "tools.0.type", "tool_choice",
    "thinking", "thinking.type", "thinking.budget_tokens", "model",
]  # fmt: skip
BASES["/v1/messages"] = (
    {"messages": CLAUDE_MESSAGES, "max_tokens": 2, "system": "Be brief.",
     "tools": [CLAUDE_TOOL], "tool_choice": {"type": "auto"}, "thinking": {"type": "disabled"},
     "stop_sequences": ["x"], "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stream": False,
     "metadata": {"user_id": "u"}},
    [*CLAUDE_PATHS, "max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream",
     "metadata", "guided_regex", "guided_json", "tool_choice.type", "tool_choice.name"],
)  # fmt: skip
BASES["/v1/messages/count_tokens"] = (
    {"messages": CLAUDE_MESSAGES, "system": [{"type": "text", "text": "Be brief."}],
     "tools": [CLAUDE_TOOL], "thinking": {"type": "enabled", "budget_tokens": 1024}},
    CLAUDE_PATHS,
)  # fmt: skip


# Routes without a JSON body, fuzzed by schemathesis only (their path parameter).
BODILESS = ("/v1/responses/{response_id}",)


def run_schemathesis(url: str, args) -> tuple[int, int, int]:
    """(cases, cases failing a check, server errors) of one schemathesis run."""
    with tempfile.TemporaryDirectory() as reports:
        paths = [option for path in args.paths or () for option in ("--include-path", path)]
        command = [
            "schemathesis", "run", f"{url}/openapi.json", *paths,
            "--mode", "all",
            "--phases", "examples,coverage,fuzzing",
            "--checks", ",".join(CHECKS),
            "--max-examples", str(args.max_examples),
            "--seed", str(args.seed),
            "--header", f"Authorization: Bearer {args.api_key}",
            "--request-timeout", "120",
            "--workers", "2",
            "--report", "json",
            "--report-dir", reports,
        ]  # fmt: skip
        print("$ " + " ".join(command), flush=True)
        subprocess.run(command, cwd=reports)  # its caches go there, not into the tree
        (report,) = Path(reports).glob("*.json")
        data = json.loads(report.read_text())
    cases = data["test_cases"]["generated"]
    # Failures come grouped by kind; ST101 is schemathesis's code for a 5xx.
    server_errors = sum(group["count"] for group in data["failures"] if group["code"] == "ST101")
    return cases, data["test_cases"]["with_failures"], server_errors


def json_values():
    """Any JSON value: scalars at their edges, strings with odd characters, and
    containers up to a few levels deep."""
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.none(), st.booleans(),
        st.integers(), st.sampled_from([0, -1, 2**31, 2**63, -(2**63) - 1, 10**30]),
        st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e308, -0.0, 5e-324]),
        st.text(max_size=40), st.sampled_from(["", "\x00", "\ud7ff", "a" * 5000, "{", "[[[["]),
    )  # fmt: skip
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    )


def values_like(value):
    """Values of the JSON type of `value` (integers for an integer, and so on): these get
    past the type checks, to the checks of each field's meaning."""
    from hypothesis import strategies as st

    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.one_of(st.integers(-3, 300), st.integers(-3, 300), st.integers())
    if isinstance(value, float):
        return st.one_of(st.floats(-1, 3), st.floats(allow_nan=False, allow_infinity=False))
    if isinstance(value, str):
        return st.one_of(st.text(max_size=40), st.from_regex(r"[a-z0-9 .*+?()|\[\]{}^$]{1,24}"))
    if isinstance(value, list):
        return (
            st.lists(st.one_of(*(values_like(v) for v in value[:2])), max_size=5)
            if value
            else json_values()
        )
    if isinstance(value, dict):
        return st.fixed_dictionaries({k: values_like(v) for k, v in value.items()})
    return json_values()


def _get(body, path: str):
    node = body
    for key in path.split("."):
        node = node[int(key)] if isinstance(node, list) else node[key]
    return node


def _replace(body, path: str, value):
    """A deep copy of body with the value at path (dots, list indexes) replaced."""
    body = json.loads(json.dumps(body))
    *parents, last = path.split(".")
    node = body
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return body


def run_mutations(url: str, model: str, args) -> tuple[int, int, int]:
    """(cases, cases failing a check, server errors) of the mutation stage."""
    from hypothesis import HealthCheck, given, seed, settings
    from hypothesis import strategies as st

    totals = {"cases": 0, "failing": 0, "server_errors": 0, "2xx": 0}
    headers = {"Authorization": f"Bearer {args.api_key}"}
    routes = sorted(path for path in args.paths or BASES if path in BASES)
    if not routes:  # routes without a body: schemathesis's stage only
        return 0, 0, 0

    @st.composite
    def requests(draw):
        path = draw(st.sampled_from(routes))
        body, paths = BASES[path]
        body = {**body, "model": model}
        for _ in range(draw(st.integers(1, 3))):
            where = draw(st.sampled_from(paths))
            try:
                current = _get(body, where)
            except (KeyError, IndexError, TypeError, ValueError):
                current = None  # not in the base body (or an earlier mutation removed it)
            like = current is not None and draw(st.booleans())
            value = draw(values_like(current) if like else json_values())
            if draw(st.integers(0, 4)) == 0:
                value = json.dumps(value)  # JSON in a string, as schemas and arguments come
            try:
                body = _replace(body, where, value)
            except (KeyError, IndexError, TypeError, ValueError):
                pass  # an earlier mutation removed the parent: keep the body as it is
        return path, body

    @seed(args.seed)
    @settings(max_examples=args.mutations, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(requests())
    def probe(request) -> None:
        path, body = request
        totals["cases"] += 1
        try:
            response = client.post(path, json=body, headers=headers)
        except httpx.HTTPError as error:
            problem = f"no response: {error!r}"
        else:
            problem = _problem(response, path)
            totals["2xx"] += response.is_success
        if problem:
            totals["failing"] += 1
            totals["server_errors"] += problem.startswith("5")
            print(f"FAIL {path}: {problem}\n  body: {json.dumps(body)[:600]}", flush=True)

    with httpx.Client(base_url=url, timeout=120) as client:
        probe()
    print(f"mutations: {totals['2xx']} of {totals['cases']} accepted (2xx), the rest refused")
    return totals["cases"], totals["failing"], totals["server_errors"]


def _problem(response: httpx.Response, path: str) -> str | None:
    claude = path.startswith("/v1/messages")
    if response.status_code >= 500:
        return f"{response.status_code}: {response.text[:300]}"
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data: {") and ('"server_error"' in line or '"api_error"' in line):
                return f"500 in the stream: {line[:300]}"  # counted as a server error
    if response.status_code >= 400:
        try:
            body = response.json()
            error = body["error"]
            if claude:
                assert body["type"] == "error" and set(error) == {"type", "message"}
            else:
                assert set(error) == {"message", "type", "param", "code"}
            assert error["message"]
        except (ValueError, KeyError, TypeError, AssertionError):
            shape = "Anthropic's" if claude else "OpenAI's"
            return f"{response.status_code} not in {shape} error shape: {response.text[:300]}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--api-key", default="fuzz-key", help="the server's API key")
    parser.add_argument("--max-examples", type=int, default=20, help="schemathesis, per operation")
    parser.add_argument("--mutations", type=int, default=1500, help="mutated requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=sorted([*BASES, *BODILESS]),
        help="only these routes (default: all)",
    )
    args = parser.parse_args()
    if shutil.which("schemathesis") is None:
        print("schemathesis is not installed: pip install schemathesis", file=sys.stderr)
        return 2
    server = None
    url = args.url
    if url is None:
        server, url = start_server([*SERVER_ARGS, args.api_key])
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"}
        model = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
        stages = {
            "schemathesis": run_schemathesis(url, args),
            "mutations": run_mutations(url, model, args),
        }
    finally:
        if server is not None:
            stop_server(server)
    for name, (cases, failing, server_errors) in stages.items():
        print(f"{name}: {cases} cases, {failing} failing a check, {server_errors} server errors")
    cases, failing, server_errors = (sum(column) for column in zip(*stages.values(), strict=True))
    print(f"total: {cases} cases, {failing} failing a check, {server_errors} server errors")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
