"""A server without an API key (the default) refuses what only a web page on another
site would send: a body that is not JSON (415), a foreign Origin (403), and, while it
listens on loopback, a foreign Host (421, DNS rebinding); curl, SDKs and the chat page
still get through. Against real servers: one on loopback, one exposed on 0.0.0.0.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, start_server, stop_server

APP_ORIGIN = "https://app.example"  # in --allowed-origins
LAN_NAME = "box.lan"  # in --allowed-hosts
BODY = {"prompt": "Hi", "max_tokens": 1}


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    """No API key, as `pyllm serve` runs by default."""
    extra = ["--allowed-origins", APP_ORIGIN, "--allowed-hosts", LAN_NAME]
    started = start_server(tmp_path_factory.mktemp("open-server"), extra, api_key=None)
    try:
        yield started
    finally:
        stop_server(started.process)


@pytest.fixture(scope="module")
def exposed_server(tmp_path_factory):
    """Listening on every address: the user exposed it on purpose."""
    started = start_server(tmp_path_factory.mktemp("exposed"), ["--host", "0.0.0.0"], api_key=None)
    try:
        yield started
    finally:
        stop_server(started.process)


def _post(server, headers: dict, path: str = "/v1/completions", content: bytes | None = None):
    body = json.dumps({**BODY, "model": server.model}).encode() if content is None else content
    return httpx.post(server.base_url + path, content=body, headers=headers, timeout=60)


def _error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error", error
    assert "access-control-allow-origin" not in response.headers
    return error


def _port(server) -> str:
    return server.base_url.rsplit(":", 1)[1]


# ------------------------------------------------------------------ Content-Type


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
     "multipart/form-data; boundary=x", "application/jsonx", "text/json"],
)  # fmt: skip
def test_a_body_that_is_not_json_is_a_415(open_server, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    error = _error(_post(open_server, headers), 415, "unsupported_media_type")
    assert "application/json" in error["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/detokenize"])
def test_every_api_route_wants_json(open_server, path):
    _error(_post(open_server, {"Content-Type": "text/plain"}, path), 415, "unsupported_media_type")


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"]
)
def test_json_bodies_are_served(open_server, content_type):
    assert _post(open_server, {"Content-Type": content_type}).status_code == 200


# ------------------------------------------------------------------------ Origin


@pytest.mark.parametrize(
    "origin", ["https://evil.example", "null", "http://127.0.0.1", "http://localhost:1"]
)
def test_a_foreign_origin_is_a_403(open_server, origin):
    headers = {"Content-Type": "application/json", "Origin": origin}
    error = _error(_post(open_server, headers), 403, "origin_not_allowed")
    assert "--allowed-origins" in error["message"]
    get = httpx.get(open_server.base_url + "/v1/models", headers={"Origin": origin})
    _error(get, 403, "origin_not_allowed")


def test_the_servers_own_origin_and_allowed_origins_are_served(open_server):
    for origin in (open_server.base_url, f"http://localhost:{_port(open_server)}"):
        # Same-origin: the origin a page served by this server (under that name) sends.
        host = origin.removeprefix("http://")
        headers = {"Content-Type": "application/json", "Origin": origin, "Host": host}
        assert _post(open_server, headers).status_code == 200
    headers = {"Content-Type": "application/json", "Origin": APP_ORIGIN}
    response = _post(open_server, headers)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == APP_ORIGIN


def test_a_preflight_from_a_foreign_origin_gets_no_cors_headers(open_server):
    headers = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    response = httpx.options(open_server.base_url + "/v1/completions", headers=headers)
    assert response.status_code >= 400 and "access-control-allow-origin" not in response.headers


# -------------------------------------------------------------------------- Host


@pytest.mark.parametrize(
    "host", ["attacker.example", "attacker.example:{port}", "localhost.attacker.example",
             "10.0.0.5:{port}", "127.0.0.1.nip.io"],
)  # fmt: skip
def test_a_foreign_host_is_a_421_on_loopback(open_server, host):
    host = host.format(port=_port(open_server))
    headers = {"Content-Type": "application/json", "Host": host}
    error = _error(_post(open_server, headers), 421, "host_not_allowed")
    assert "--allowed-hosts" in error["message"]
    # The chat page too: a rebound page must not load it from this server either.
    _error(httpx.get(open_server.base_url + "/", headers={"Host": host}), 421, "host_not_allowed")


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:{port}", "LOCALHOST.", "127.0.0.1:{port}", "127.1.2.3",
             "[::1]:{port}", "app.localhost:{port}", LAN_NAME, f"{LAN_NAME}:{{port}}"],
)  # fmt: skip
def test_loopback_and_allowed_hosts_are_served(open_server, host):
    host = host.format(port=_port(open_server))
    response = _post(open_server, {"Content-Type": "application/json", "Host": host})
    assert response.status_code == 200, response.text


def test_an_exposed_server_checks_origin_but_not_host(exposed_server):
    headers = {"Content-Type": "application/json", "Host": "box.example:8000"}
    assert _post(exposed_server, headers).status_code == 200
    headers["Origin"] = "https://evil.example"
    _error(_post(exposed_server, headers), 403, "origin_not_allowed")
    headers = {"Content-Type": "text/plain", "Host": "box.example:8000"}
    _error(_post(exposed_server, headers), 415, "unsupported_media_type")


# --------------------------------------------------------- what still gets through


def test_the_chat_page_and_its_assets_are_served(open_server):
    page = httpx.get(open_server.base_url + "/")
    assert page.status_code == 200 and "<html" in page.text.lower()
    for asset in ("/ui/app.js", "/ui/style.css"):
        assert httpx.get(open_server.base_url + asset).status_code == 200
    health = httpx.get(open_server.base_url + "/health", headers={"Host": "localhost"})
    assert health.json() == {"status": "ok"}


def test_the_openai_client_is_served(open_server):
    with openai.OpenAI(base_url=open_server.base_url + "/v1", api_key="unused") as client:
        reply = client.completions.create(model=open_server.model, prompt="Hi", max_tokens=1)
    assert reply.usage.completion_tokens == 1


def test_the_bearer_scheme_is_case_insensitive(server):
    """The shared server has an API key."""
    for scheme in ("Bearer", "bearer", "BEARER"):
        headers = {"Authorization": f"{scheme} {API_KEY}"}
        response = httpx.get(server.base_url + "/v1/models", headers=headers)
        assert response.status_code == 200, (scheme, response.text)
    for wrong in (f"Basic {API_KEY}", f"Bearer{API_KEY}", API_KEY, f"Bearer {API_KEY}x"):
        response = httpx.get(server.base_url + "/v1/models", headers={"Authorization": wrong})
        _error(response, 401, "invalid_api_key")
