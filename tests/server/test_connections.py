"""What a client may hold: a request's headers and body must arrive within
--read-timeout (else 408 and the connection closed), past --limit-concurrency open
connections a request gets 503, and a client that leaves mid-upload is no error in the
log. Against a real server with a 2 s read timeout."""

from __future__ import annotations

import json
import selectors
import socket
import time

import httpx
import pytest

from tests.server.conftest import start_server, stop_server

READ_TIMEOUT_S = 2
LIMIT = 256
HALF_SENT = 200
SLACK_S = 6  # the loop's own delays on a loaded machine


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    extra = ["--read-timeout", str(READ_TIMEOUT_S), "--limit-concurrency", str(LIMIT)]
    started = start_server(tmp_path_factory.mktemp("connections"), extra)
    try:
        yield started
    finally:
        stop_server(started.process)


def _connect(server) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _headers(server, length: int) -> bytes:
    return (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _wait_closed(socks: list[socket.socket], timeout: float) -> dict[socket.socket, bytes]:
    """What each socket received, once the server has closed all (or the timeout)."""
    received = {sock: b"" for sock in socks}
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.5):
                chunk = key.fileobj.recv(65536)
                received[key.fileobj] += chunk
                if not chunk:
                    selector.unregister(key.fileobj)
        assert not selector.get_map(), f"{len(selector.get_map())} connections still open"
    return received


def _assert_serving(server) -> None:
    headers = {"Authorization": f"Bearer {server.api_key}"}
    assert httpx.get(server.base_url + "/v1/models", headers=headers).status_code == 200


def test_half_sent_requests_are_closed_within_the_read_timeout(guarded):
    socks = [_connect(guarded) for _ in range(HALF_SENT)]
    try:
        start = time.monotonic()
        for sock in socks:
            sock.sendall(b"POST /v1/compl")  # half a request line, then nothing
        received = _wait_closed(socks, READ_TIMEOUT_S + SLACK_S)
        elapsed = time.monotonic() - start
    finally:
        for sock in socks:
            sock.close()
    assert elapsed < READ_TIMEOUT_S + SLACK_S
    assert all(data.startswith(b"HTTP/1.1 408 ") for data in received.values())
    body = json.loads(next(iter(received.values())).split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_timeout"
    _assert_serving(guarded)


def test_headers_sent_a_byte_at_a_time_are_cut_at_the_deadline(guarded):
    request = _headers(guarded, 2) + b"{}"
    with _connect(guarded) as sock:
        start = time.monotonic()
        with pytest.raises(OSError):  # reset or broken pipe, once the server has closed it
            for byte in request:
                sock.sendall(bytes([byte]))
                time.sleep(0.25)
        elapsed = time.monotonic() - start
    assert READ_TIMEOUT_S - 0.5 < elapsed < READ_TIMEOUT_S + SLACK_S


def test_a_body_that_stops_short_is_a_408_and_closed(guarded):
    with _connect(guarded) as sock:
        sock.sendall(_headers(guarded, 100) + b'{"prompt": "Hi"')
        start = time.monotonic()
        response = _read_until_closed(sock, READ_TIMEOUT_S + SLACK_S)
        elapsed = time.monotonic() - start
    head, body = response.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert elapsed < READ_TIMEOUT_S + SLACK_S


def test_a_body_sent_slowly_within_the_timeout_is_served(guarded):
    body = json.dumps({"model": guarded.model, "prompt": "Hi", "max_tokens": 1}).encode()
    with _connect(guarded) as sock:
        sock.sendall(_headers(guarded, len(body)))
        for i in range(0, len(body), 20):
            time.sleep(0.1)
            sock.sendall(body[i : i + 20])
        sock.settimeout(60)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_a_client_leaving_mid_upload_is_no_error_in_the_log(guarded):
    logged = len(guarded.log_path.read_text(errors="replace"))
    for _ in range(3):
        with _connect(guarded) as sock:
            sock.sendall(_headers(guarded, 1000) + b'{"prompt": "x')
            time.sleep(0.3)
    time.sleep(1)
    _assert_serving(guarded)
    log = guarded.log_path.read_text(errors="replace")[logged:]
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def test_past_the_concurrency_limit_a_request_gets_503(guarded):
    idle = [_connect(guarded) for _ in range(LIMIT)]
    try:
        headers = {"Authorization": f"Bearer {guarded.api_key}"}
        response = httpx.get(guarded.base_url + "/v1/models", headers=headers, timeout=30)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "server_busy"
        assert response.headers["retry-after"] == "1"
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.5)
    _assert_serving(guarded)


@pytest.mark.parametrize(
    "option, value",
    [("--read-timeout", "0"), ("--read-timeout", "nan"), ("--limit-concurrency", "0")],
)
def test_bad_connection_options_are_refused(option, value):
    from pyllm.cli import main

    assert main(["serve", option, value, "--port", "1"]) == 2
