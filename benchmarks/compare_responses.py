"""Do two source trees' servers answer a fixed set of requests byte for byte alike?

    python benchmarks/compare_responses.py OLD_TREE NEW_TREE [--save-dir DIR]

Each tree (a checkout holding a built `pyllm/`, e.g. a `git worktree` of another commit
with the compiled extension copied in) runs `python -m pyllm serve` in turn, on the
bundled model widened to float32, with an API key; the same requests go to each:
completions and chats (greedy, seeded samples, logprobs, echo, prompt logprobs, n,
best_of, stops), streams, tools, structured output, /tokenize, /detokenize, the model
list, the OpenAPI document, and every malformed request of tests/server/test_bad_requests.py
plus cross-site refusals. Bodies are compared as bytes after masking what is random or a
clock (response and tool call ids, `created`). A stream is compared event by event; since
the engine may merge outputs when a client reads slowly, a stream whose events differ but
whose merged text, logprobs and finish reasons agree is reported apart, as a split.
Exit status 0 when every body agrees.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server.test_bad_requests import CASES  # noqa: E402

API_KEY = "compare-key"
SERVER_ARGS = ["--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "0.25",
               "--max-model-len", "2048"]  # fmt: skip
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
_MASKS = [
    (re.compile(rb'"id":"(chatcmpl|cmpl)-[0-9a-f]{32}'), rb'"id":"\1-ID'),
    (re.compile(rb'"id":"call_[0-9a-f]{24}"'), rb'"id":"call_ID"'),
    (re.compile(rb'"created":\d+'), rb'"created":0'),
]


CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
C = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0}
T = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
TOOLS = {**C, "tools": [WEATHER], "messages": [{"role": "user", "content": "Weather in Paris?"}]}
# (name, method, path, JSON body) of the requests that succeed (and a few that do not).
REQUESTS = [
    ("health", "GET", "/health", None),
    ("version", "GET", "/version", None),
    ("models", "GET", "/v1/models", None),
    ("model", "GET", "/v1/models/{model}", None),
    ("openapi", "GET", "/openapi.json", None),
    ("completion", "POST", TEXT, T),
    ("completion token ids", "POST", TEXT, {**T, "prompt": [504, 3575, 282, 4649, 314]}),
    ("completion batch", "POST", TEXT, {**T, "prompt": ["One, two,", "Hello"]}),
    ("completion logprobs", "POST", TEXT, {**T, "logprobs": 3}),
    ("completion echo logprobs", "POST", TEXT, {**T, "echo": True, "logprobs": 2}),
    ("completion prompt_logprobs", "POST", TEXT, {**T, "prompt_logprobs": 2}),
    ("completion stop", "POST", TEXT, {**T, "stop": [" Paris"], "max_tokens": 32}),
    ("completion seeded n", "POST", TEXT, {**T, "temperature": 0.8, "seed": 3, "n": 2}),
    ("completion best_of", "POST", TEXT, {**T, "temperature": 0.8, "seed": 5, "best_of": 3}),
    ("completion penalties", "POST", TEXT,
     {**T, "presence_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": {"7042": -50}}),
    ("completion stream", "POST", TEXT,
     {**T, "stream": True, "stream_options": {"include_usage": True}}),
    ("completion stream echo logprobs", "POST", TEXT,
     {**T, "stream": True, "echo": True, "logprobs": 1, "n": 2, "seed": 1,
      "temperature": 0.5}),
    ("chat", "POST", CHAT, C),
    ("chat max_completion_tokens", "POST", CHAT,
     {**C, "max_tokens": None, "max_completion_tokens": 8}),
    ("chat logprobs", "POST", CHAT, {**C, "logprobs": True, "top_logprobs": 2}),
    ("chat system and history", "POST", CHAT,
     {**C, "messages": [{"role": "developer", "content": "Answer in one word."},
                        *MESSAGES, {"role": "assistant", "content": "Paris."},
                        {"role": "user", "content": [{"type": "text", "text": "Spain?"}]}]}),
    ("chat seeded n", "POST", CHAT, {**C, "temperature": 1.0, "seed": 11, "n": 2}),
    ("chat stream", "POST", CHAT,
     {**C, "stream": True, "stream_options": {"include_usage": True}}),
    ("chat stream logprobs", "POST", CHAT,
     {**C, "stream": True, "logprobs": True, "top_logprobs": 1}),
    ("chat tools auto", "POST", CHAT, TOOLS),
    ("chat tools auto stream", "POST", CHAT, {**TOOLS, "stream": True}),
    ("chat tools required", "POST", CHAT, {**TOOLS, "tool_choice": "required"}),
    ("chat tools required stream", "POST", CHAT,
     {**TOOLS, "tool_choice": "required", "stream": True}),
    ("chat tools named", "POST", CHAT,
     {**TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    ("chat tools none", "POST", CHAT, {**TOOLS, "tool_choice": "none"}),
    ("chat earlier tool call", "POST", CHAT,
     {**C, "tools": [WEATHER], "messages": [
         {"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]}),
    ("chat json_schema", "POST", CHAT,
     {**C, "max_tokens": 40, "response_format": {
         "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}),
    ("chat json_object", "POST", CHAT,
     {**C, "max_tokens": 20, "response_format": {"type": "json_object"}}),
    ("chat regex", "POST", CHAT, {**C, "structured_outputs": {"regex": "[A-Z][a-z]+"}}),
    ("chat choice", "POST", CHAT, {**C, "guided_choice": ["Paris", "Lyon"]}),
    ("chat grammar", "POST", CHAT,
     {**C, "structured_outputs": {"grammar": 'start: "yes" | "no"'}}),
    ("completion guided_json stream", "POST", TEXT,
     {**T, "max_tokens": 30, "guided_json": SCHEMA, "stream": True}),
    ("chat bad grammar", "POST", CHAT, {**C, "structured_outputs": {"grammar": "start: ("}}),
    ("chat bad schema", "POST", CHAT, {**C, "guided_json": {"type": "nonsense"}}),
    ("tokenize", "POST", "/tokenize", {"prompt": "Hello world", "return_token_strs": True}),
    ("tokenize messages", "POST", "/tokenize", {"messages": MESSAGES}),
    ("detokenize", "POST", "/detokenize", {"tokens": [19556, 905]}),
    ("detokenize bad id", "POST", "/detokenize", {"tokens": [10**9]}),
    ("tokenize neither", "POST", "/tokenize", {}),
    ("unknown model card", "GET", "/v1/models/nope", None),
]  # fmt: skip


def _refusals() -> list[tuple[str, dict, str, str, bytes]]:
    """(name, headers, method, path, body) of cross-site and media type refusals."""
    body = json.dumps({"messages": MESSAGES, "max_tokens": 2}).encode()
    json_type = {"Content-Type": "application/json"}
    return [
        ("text/plain body", {"Content-Type": "text/plain"}, "POST", "/v1/chat/completions", body),
        ("form body", {"Content-Type": "application/x-www-form-urlencoded"}, "POST",
         "/v1/completions", body),
        ("foreign origin", {**json_type, "Origin": "https://evil.example"}, "POST",
         "/v1/chat/completions", body),
        ("rebinding host", {**json_type, "Host": "evil.example"}, "GET", "/v1/models", b""),
        ("chat page", {}, "GET", "/", b""),
        ("chat page script", {}, "GET", "/ui/app.js", b""),
    ]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(tree: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    command = [sys.executable, "-m", "pyllm", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--api-key", API_KEY, *SERVER_ARGS]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server in {tree} exited:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"the server in {tree} did not start")


def _mask(body: bytes) -> bytes:
    for pattern, replacement in _MASKS:
        body = pattern.sub(replacement, body)
    return body


def _record(tree: Path, log_path: Path) -> dict[str, bytes]:
    """Every response of the fixed set: 'status\\nheaders that matter\\nbody', masked."""
    process, url = _start(tree, log_path)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    answers = {}
    try:
        with httpx.Client(base_url=url, timeout=300) as http:
            model = http.get("/v1/models", headers=auth).json()["data"][0]["id"]
            for name, method, path, body in REQUESTS:
                if body is not None:
                    body = {"model": model, **{k: v for k, v in body.items() if v is not None}}
                headers = {**auth, "Content-Type": "application/json"}
                response = http.request(method, path.format(model=model), json=body,
                                        headers=headers)  # fmt: skip
                answers[name] = _answer(response)
            for case in CASES:
                answers[f"bad: {case.name}"] = _answer(_bad(http, model, case, auth))
            for name, headers, method, path, body in _refusals():
                response = http.request(method, path, content=body, headers={**auth, **headers})
                answers[f"refused: {name}"] = _answer(response)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    return answers


def _bad(http: httpx.Client, model: str, case, auth: dict) -> httpx.Response:
    headers = {**auth, "Content-Type": "application/json", **case.headers}
    if headers.get("Authorization") == "":
        del headers["Authorization"]
    if case.raw is not None:
        content = case.raw
    else:
        body = case.body if case.body is not None else {"messages": MESSAGES, "max_tokens": 4}
        content = json.dumps({"model": model, **body}).encode()
    if case.method == "GET":
        return http.request("GET", case.path, headers=headers)
    return http.request(case.method, case.path, content=content, headers=headers)


def _answer(response: httpx.Response) -> bytes:
    kept = ("content-type", "retry-after", "allow", "access-control-allow-origin")
    headers = "; ".join(f"{k}: {response.headers[k]}" for k in kept if k in response.headers)
    return f"{response.status_code}\n{headers}\n".encode() + _mask(response.content)


def _merged(answer: bytes) -> object:
    """A stream's events merged per choice: text, logprobs and finish reasons in order."""
    choices: dict[int, dict] = {}
    others = []
    for line in answer.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if not event.get("choices"):
            others.append(event)
            continue
        for choice in event["choices"]:
            merged = choices.setdefault(choice["index"], {"parts": [], "finish": []})
            delta = choice.get("delta", {"content": choice.get("text")})
            merged["parts"].append(json.dumps([delta.get("content"), delta.get("tool_calls")]))
            merged["finish"].append(choice.get("finish_reason"))
            merged.setdefault("logprobs", []).append(choice.get("logprobs"))
    texts = {i: "".join(json.loads(p)[0] or "" for p in c["parts"]) for i, c in choices.items()}
    finishes = {i: [f for f in c["finish"] if f] for i, c in choices.items()}
    return texts, finishes, others


def compare(old: dict[str, bytes], new: dict[str, bytes]) -> tuple[list[str], list[str]]:
    """(names whose bodies differ, names of streams split differently only)."""
    differ, split = [], []
    for name in old.keys() | new.keys():
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if a and b and b"text/event-stream" in a and _merged(a) == _merged(b):
            split.append(name)
        else:
            differ.append(name)
    return sorted(differ), sorted(split)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old_tree", type=Path, help="source tree of the reference server")
    parser.add_argument("new_tree", type=Path, help="source tree of the server to check")
    parser.add_argument(
        "--save-dir",
        type=Path,
        default=Path("out/compare"),
        help="where the answers and server logs go (default: out/compare)",
    )
    args = parser.parse_args()
    args.save_dir.mkdir(parents=True, exist_ok=True)
    answers = []
    for label, tree in (("old", args.old_tree), ("new", args.new_tree)):
        recorded = _record(tree.resolve(), args.save_dir / f"{label}.log")
        text = {k: v.decode("utf-8", "replace") for k, v in recorded.items()}
        (args.save_dir / f"{label}.json").write_text(json.dumps(text, indent=1, sort_keys=True))
        answers.append(recorded)
    differ, split = compare(*answers)
    same = len(answers[0]) - len(differ) - len(split)
    print(f"{len(answers[0])} requests: {same} byte-identical, {len(split)} streams split "
          f"differently, {len(differ)} different")  # fmt: skip
    for name in differ:
        print(f"DIFFERENT: {name}\n  old: {answers[0].get(name, b'')[:300]!r}\n"
              f"  new: {answers[1].get(name, b'')[:300]!r}")  # fmt: skip
    for name in split:
        print(f"split differently: {name}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
