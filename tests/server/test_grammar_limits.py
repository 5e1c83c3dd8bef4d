"""Grammars past the server's limits (sampling/grammar_budget.py), against a real server:
a tiny explosive regex is a 400 naming the field and the limit, the memory it took is
given back, and a grammar that goes past the limits mid-generation ends its request
with an error rather than an empty answer."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

# Each asks the lexer for about a million states; 15 bytes each.
EXPLOSIVE = [f"a{{{1000 + i}}}{{{1001 + i}}}" for i in range(12)]
# What 12 refused grammars may leave behind, all together. Before the limits, each kept
# 150-340 MB in the compiled-grammar cache.
RSS_GROWTH_LIMIT = 64 * 2**20
# Cheap to compile and to probe (grammar_budget.PROBE_STEPS masks), then past the lexer's
# limits once generation reaches the repetition.
LATE_EXPLOSION = "The answer is: (yes|no) a{1000}{1001}"


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _completion(http: httpx.Client, server, **fields) -> httpx.Response:
    body = {"model": server.model, "prompt": "Say it:", "max_tokens": 2, **fields}
    return http.post("/v1/completions", json=body)


def _assert_over_limits(response: httpx.Response, field: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["code"] == "grammar_too_complex", error
    assert error["message"].startswith(f"{field}: the grammar is too complex"), error
    assert "20000 lexer states" in error["message"], error  # the limits themselves


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_explosive_regexes_are_400s_and_their_memory_is_given_back(http, server):
    # The first constrained request sets up the tokenizer's grammar tables: not counted.
    assert _completion(http, server, guided_regex="[a-z]+").status_code == 200
    before = _rss(server.process.pid)
    for pattern in EXPLOSIVE:
        _assert_over_limits(_completion(http, server, guided_regex=pattern), "guided_regex")
    growth = _rss(server.process.pid) - before
    assert growth < RSS_GROWTH_LIMIT, f"RSS grew by {growth / 2**20:.0f} MiB"


def test_an_explosive_pattern_in_a_schema_names_the_schema_field(http, server):
    schema = {"type": "string", "pattern": "^(a{1000}){1000}$"}
    _assert_over_limits(_completion(http, server, guided_json=schema), "guided_json")
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    messages = [{"role": "user", "content": "Hi"}]
    response = http.post(
        "/v1/chat/completions",
        json={"model": server.model, "messages": messages, "max_tokens": 2, "response_format": fmt},
    )
    _assert_over_limits(response, "response_format")


def test_a_grammar_past_the_limits_mid_generation_is_an_error_not_a_stop(http, server):
    response = _completion(http, server, guided_regex=LATE_EXPLOSION, max_tokens=32)
    _assert_over_limits(response, "guided_regex")
    assert "for this output" in response.json()["error"]["message"]


def test_a_streamed_grammar_past_the_limits_ends_with_an_error_event(http, server):
    body = {"model": server.model, "prompt": "Say it:", "max_tokens": 32, "stream": True}
    body["guided_regex"] = LATE_EXPLOSION
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["param"] == "guided_regex" and error["code"] == "grammar_too_complex", error
    assert all(c["finish_reason"] != "stop" for e in events[:-2] for c in json.loads(e)["choices"])


def test_a_deeply_nested_schema_string_is_a_400(http, server):
    # 10 KB: json.loads would recurse 5,000 levels.
    response = _completion(http, server, guided_json="[" * 5000 + "]" * 5000)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_json" and "the limit is 128" in error["message"], error
