"""A client that goes away mid-request has its request aborted: its KV blocks are freed
and the engine stops generating for it (checked through /metrics)."""

from __future__ import annotations

import json
import socket
import time

import httpx

from tests.server.conftest import read_metrics, wait_for

MAX_TOKENS = 400  # far more than the engine makes before it notices the client is gone


def _idle(base_url: str):
    m = read_metrics(base_url)
    idle = (
        m["pyllm:num_requests_running"] == 0
        and m["pyllm:num_requests_waiting"] == 0
        and m["pyllm:num_free_kv_blocks"] == m["pyllm:num_kv_blocks"]
    )
    return m if idle else None


def _generated(base_url: str) -> float:
    return read_metrics(base_url)["pyllm:generation_tokens_total"]


def _assert_abandoned_request_cleaned_up(server, before: float) -> None:
    metrics = wait_for(lambda: _idle(server.base_url), timeout=30)
    assert metrics, f"engine not idle after the client left: {read_metrics(server.base_url)}"
    settled = _generated(server.base_url)
    time.sleep(0.5)
    assert _generated(server.base_url) == settled  # nothing is computing for it any more
    assert settled - before < MAX_TOKENS  # and it stopped well before max_tokens


def test_stream_dropped_after_3_chunks(server):
    assert _idle(server.base_url)
    before = _generated(server.base_url)
    body = {
        "model": server.model,
        "prompt": "Tell me a long story about a dragon.",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {server.api_key}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            # Kept referenced: closing this iterator would close the connection early.
            lines = response.iter_lines()
            chunks = []
            while len(chunks) < 3:
                line = next(lines)
                if line.startswith("data: "):
                    chunks.append(json.loads(line.removeprefix("data: ")))
            # While the stream is open, its blocks are held.
            m = read_metrics(server.base_url)
            assert m["pyllm:num_free_kv_blocks"] < m["pyllm:num_kv_blocks"]
            assert m["pyllm:num_requests_running"] == 1
        # Leaving the block closes the connection mid-stream.
    assert all(c["object"] == "text_completion" for c in chunks)
    _assert_abandoned_request_cleaned_up(server, before)


def test_non_streaming_client_disconnects(server):
    assert _idle(server.base_url)
    before = _generated(server.base_url)
    body = json.dumps(
        {
            "model": server.model,
            "prompt": "Tell me a long story about a dragon.",
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
    ).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + b"Content-Type: application/json\r\n"
            + f"Authorization: Bearer {server.api_key}\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        started = wait_for(
            lambda: read_metrics(server.base_url)["pyllm:generation_tokens_total"] > before + 2,
            timeout=30,
        )
        assert started, "the request never started generating"
    _assert_abandoned_request_cleaned_up(server, before)


def test_responses_stream_dropped_after_3_events(server):
    """/v1/responses: a JSON schema of 1000 items keeps the reply going past MAX_TOKENS
    unless the request is aborted."""
    assert _idle(server.base_url)
    before = _generated(server.base_url)
    long = {"type": "array", "items": {"type": "integer"}, "minItems": 1000}
    body = {
        "model": server.model,
        "input": "Count.",
        "max_output_tokens": MAX_TOKENS,
        "text": {"format": {"type": "json_schema", "name": "long", "schema": long}},
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {server.api_key}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as http:
        with http.stream("POST", "/v1/responses", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept referenced, as above
            deltas = 0
            while deltas < 3:
                deltas += next(lines) == "event: response.output_text.delta"
            assert read_metrics(server.base_url)["pyllm:num_requests_running"] == 1
    _assert_abandoned_request_cleaned_up(server, before)
