"""Graceful shutdown: on SIGTERM a server refuses new requests with 503, lets running ones
go on for --shutdown-timeout, ends the rest with an error event, and exits 0.

Each test starts its own server, since it ends it.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import start_server, stop_server, wait_for

PROMPT = "Once upon a time"


class _Stream(threading.Thread):
    """One streamed request, read to its end in a thread: its data payloads in order."""

    def __init__(self, server, kind: str, max_tokens: int):
        super().__init__(daemon=True)
        self.server, self.kind, self.max_tokens = server, kind, max_tokens
        self.events: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0}
        body.update(stream=True, stream_options={"include_usage": True})
        if self.kind == "chat":
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": PROMPT}]
        else:
            path, body["prompt"] = "/v1/completions", PROMPT
        headers = {"Authorization": f"Bearer {self.server.api_key}"}
        try:
            with httpx.stream(
                "POST", self.server.base_url + path, json=body, headers=headers, timeout=120
            ) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
        except BaseException as error:  # reported by the test
            self.error = error

    def chunks(self) -> list[dict]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    def completion_tokens(self) -> int:
        return next(c["usage"]["completion_tokens"] for c in self.chunks() if c.get("usage"))

    def num_tokens(self) -> int:
        """Chunks with text so far."""
        total = 0
        for chunk in self.chunks():
            for choice in chunk.get("choices", []):
                total += bool(choice.get("text") or (choice.get("delta") or {}).get("content"))
        return total


def _start_streams(server, max_tokens: int) -> list[_Stream]:
    streams = [_Stream(server, kind, max_tokens) for kind in ("chat", "completion") * 2]
    for stream in streams:
        stream.start()
    assert wait_for(lambda: all(s.num_tokens() for s in streams), timeout=120), [
        s.error for s in streams
    ]
    return streams


def _assert_clean_exit(server) -> None:
    assert server.process.wait(timeout=90) == 0, server.log_tail()
    log = server.log_tail(200_000)
    assert "Traceback" not in log and "CancelledError" not in log, log[-4000:]


def test_sigterm_lets_running_streams_finish_and_refuses_new_requests(tmp_path):
    server = start_server(tmp_path, ["--shutdown-timeout", "120"])
    try:
        streams = _start_streams(server, max_tokens=160)
        server.process.send_signal(signal.SIGTERM)
        headers = {"Authorization": f"Bearer {server.api_key}"}
        refused = wait_for(
            lambda: httpx.post(
                f"{server.base_url}/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 4},
                headers=headers,
                timeout=30,
            ),
            timeout=0,
        )
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"].isdigit()
        assert refused.json()["error"]["code"] == "server_shutting_down"
        health = httpx.get(f"{server.base_url}/health", timeout=30)
        assert health.status_code == 503 and health.json() == {"status": "shutting down"}
        assert any(s.is_alive() for s in streams), "streams ended before the checks"
        for stream in streams:
            stream.join(timeout=120)
            assert stream.error is None, stream.error
            assert stream.events[-1] == "[DONE]"
            finals = [c["choices"][0]["finish_reason"] for c in stream.chunks() if c["choices"]]
            assert finals[-1] == "length"
            assert stream.completion_tokens() == 160
        _assert_clean_exit(server)
    finally:
        stop_server(server.process)


def test_sigterm_past_the_timeout_ends_streams_with_an_error_event(tmp_path):
    server = start_server(tmp_path, ["--shutdown-timeout", "1"])
    try:
        streams = _start_streams(server, max_tokens=1500)
        headers = {"Authorization": f"Bearer {server.api_key}"}
        waiting: dict = {}

        def unstreamed() -> None:
            body = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True}
            waiting["response"] = httpx.post(
                f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=120
            )

        thread = threading.Thread(target=unstreamed, daemon=True)
        thread.start()
        time.sleep(0.5)
        sent = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        for stream in streams:
            stream.join(timeout=60)
            assert stream.error is None, stream.error
            assert stream.events[-1] == "[DONE]"
            last = json.loads(stream.events[-2])
            assert last["error"]["code"] == "server_shutting_down", last
            assert 0 < stream.num_tokens() < 1500
        thread.join(timeout=60)
        assert waiting["response"].status_code == 503
        error = waiting["response"].json()["error"]
        assert error["type"] == "server_error" and error["code"] == "server_shutting_down", error
        _assert_clean_exit(server)
        assert time.monotonic() - sent < 30
    finally:
        stop_server(server.process)


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_bad_shutdown_timeout_is_refused(value):
    from pyllm.cli import main

    assert main(["serve", "--shutdown-timeout", value, "--port", "1"]) == 2
