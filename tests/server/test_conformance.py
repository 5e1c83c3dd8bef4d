"""Where the server follows OpenAI's API beyond its happy path: system_fingerprint, null
request fields, unknown models, the OpenAPI document, CORS and the per-request limit on
sequences. Most against the shared server; CORS and a non-default limit against an app
built in process over a stand-in engine (nothing there reaches a model).
"""

from __future__ import annotations

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from pyllm import cli
from pyllm.engine.async_engine import AsyncEngine
from pyllm.entrypoints import server as server_module
from pyllm.entrypoints.app import create_app
from pyllm.entrypoints.server_config import ServerConfig

MESSAGES = [{"role": "user", "content": "Name a color."}]
PROMPT = "The sky is"
ORIGIN = "https://app.example"

# ------------------------------------------------------------- system_fingerprint


def test_system_fingerprint_is_one_string_everywhere(client, server):
    chat = dict(model=server.model, messages=MESSAGES, max_tokens=2)
    text = dict(model=server.model, prompt=PROMPT, max_tokens=2)
    fingerprint = client.chat.completions.create(**chat).system_fingerprint
    assert isinstance(fingerprint, str) and fingerprint.startswith("pyllm-")
    assert client.completions.create(**text).system_fingerprint == fingerprint
    chunks = [
        *client.chat.completions.create(stream=True, **chat),
        *client.completions.create(stream=True, stream_options={"include_usage": True}, **text),
    ]
    assert {c.system_fingerprint for c in chunks} == {fingerprint}


# ------------------------------------------------------------------ null fields

# Fields OpenAI's spec marks nullable (tool_choice: accepted and ignored).
CHAT_NULLABLE = [
    "n", "presence_penalty", "frequency_penalty", "stream", "logprobs", "temperature",
    "top_p", "stop", "seed", "top_logprobs", "user", "stream_options", "logit_bias",
    "max_completion_tokens", "response_format", "tools", "tool_choice", "priority",
]  # fmt: skip
COMPLETION_NULLABLE = [
    "n", "presence_penalty", "frequency_penalty", "stream", "logprobs", "echo",
    "temperature", "top_p", "stop", "seed", "user", "stream_options", "logit_bias",
    "best_of", "suffix", "priority",
]  # fmt: skip


def _base(path: str, model: str) -> dict:
    # Seeded: a null temperature samples, and must sample as when it is left out.
    body = {"model": model, "max_tokens": 4, "temperature": 0, "seed": 7}
    return {**body, "messages": MESSAGES} if "chat" in path else {**body, "prompt": PROMPT}


def _texts(response) -> list[str]:
    assert response.status_code == 200, response.text[:500]
    choices = response.json()["choices"]
    return [c["message"]["content"] if "message" in c else c["text"] for c in choices]


@pytest.mark.parametrize(
    "path, field",
    [("/v1/chat/completions", f) for f in CHAT_NULLABLE]
    + [("/v1/completions", f) for f in COMPLETION_NULLABLE],
)
def test_null_means_the_default(http, server, path, field):
    base = _base(path, server.model)
    with_null = {**base, field: None}
    reference = {k: v for k, v in base.items() if k != field}
    assert _texts(http.post(path, json=with_null)) == _texts(http.post(path, json=reference))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_every_default_sent_as_null(http, server, path):
    """A client that serializes every unset field as null."""
    fields = CHAT_NULLABLE if "chat" in path else COMPLETION_NULLABLE
    body = {**_base(path, server.model), **dict.fromkeys(fields)}
    body["temperature"] = 0
    (text,) = _texts(http.post(path, json=body))
    assert text


def test_max_tokens_null_means_the_default(http, server):
    body = {**_base("/v1/chat/completions", server.model), "max_completion_tokens": 3}
    r = http.post("/v1/chat/completions", json={**body, "max_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


def test_null_keeps_other_types_strict(http, server):
    body = {**_base("/v1/chat/completions", server.model), "n": "2"}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


# ---------------------------------------------------------------- unknown model


def _assert_model_not_found(error: openai.NotFoundError) -> None:
    assert error.status_code == 404
    body = error.response.json()["error"]
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert body["type"] == "invalid_request_error" and "gpt-9" in body["message"]


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as chat:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=2)
    _assert_model_not_found(chat.value)
    with pytest.raises(openai.NotFoundError) as completion:
        client.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2)
    _assert_model_not_found(completion.value)
    with pytest.raises(openai.NotFoundError) as retrieve:
        client.models.retrieve("gpt-9")
    _assert_model_not_found(retrieve.value)


# ------------------------------------------------------------------------ OpenAPI


def _resolve(document: dict, schema: dict) -> dict:
    while "$ref" in schema:
        name = schema["$ref"].removeprefix("#/components/schemas/")
        schema = document["components"]["schemas"][name]
    return schema


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


@pytest.fixture(scope="module")
def openapi(server) -> dict:
    response = httpx.get(f"{server.base_url}/openapi.json", timeout=10)
    assert response.status_code == 200
    return response.json()


@pytest.mark.parametrize(
    "path, required, response_name",
    [
        ("/v1/chat/completions", "messages", "ChatCompletionResponse"),
        ("/v1/completions", "prompt", "CompletionResponse"),
    ],
)
def test_openapi_declares_the_bodies(openapi, path, required, response_name):
    operation = openapi["paths"][path]["post"]
    body = operation["requestBody"]
    assert body["required"] is True
    request = _resolve(openapi, body["content"]["application/json"]["schema"])
    assert required in request["required"] and "n" in request["properties"]
    ok = operation["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/" + response_name)
    assert "text/event-stream" in ok
    response = _resolve(openapi, ok["application/json"]["schema"])
    assert response["properties"]["system_fingerprint"]["type"] == "string"
    for status in ("400", "401", "403", "404", "408", "413", "415", "421", "503"):
        _assert_error_schema(openapi, operation["responses"][status])


def _assert_error_schema(openapi: dict, response: dict) -> None:
    schema = _resolve(openapi, response["content"]["application/json"]["schema"])
    error = _resolve(openapi, schema["properties"]["error"])
    assert set(error["properties"]) == {"message", "type", "param", "code"}


def test_openapi_declares_reasoning_and_template_kwargs(openapi):
    schemas = openapi["components"]["schemas"]
    assert "chat_template_kwargs" in schemas["ChatCompletionRequest"]["properties"]
    assert "chat_template_kwargs" in schemas["TokenizeRequest"]["properties"]
    for name in ("AssistantMessage", "DeltaMessage"):
        assert "reasoning_content" in schemas[name]["properties"]


def test_openapi_declares_the_other_routes(openapi):
    models = openapi["paths"]["/v1/models"]["get"]["responses"]
    assert models["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ModelList")
    _assert_error_schema(openapi, models["401"])
    model = openapi["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    _assert_error_schema(openapi, model["404"])
    assert "422" not in model  # nothing here answers FastAPI's validation errors


def test_openapi_refs_all_resolve(openapi):
    names = set(openapi["components"]["schemas"])
    missing = {r for r in _refs(openapi) if r.removeprefix("#/components/schemas/") not in names}
    assert not missing


# --------------------------------------------------------------------------- CORS


class _StandInEngine:
    """Enough of LLMEngine for an app whose requests never reach the model."""

    tokenizer = None
    max_model_len = 64


def _app_client(**options) -> TestClient:
    app = create_app(AsyncEngine(_StandInEngine()), "stand-in", ServerConfig(**options))
    return TestClient(app, base_url="http://localhost")  # a loopback Host


def _preflight(client: TestClient, origin: str = ORIGIN):
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    return client.options("/v1/chat/completions", headers=headers)


def test_cors_preflight_and_responses_for_allowed_origins():
    client = _app_client(api_key="k", allowed_origins=[ORIGIN])
    preflight = _preflight(client)  # no API key: a browser's preflight carries none
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    models = client.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer k"})
    assert models.status_code == 200
    assert models.headers["access-control-allow-origin"] == ORIGIN
    refused = client.get("/v1/models", headers={"Origin": ORIGIN})  # the browser reads errors too
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
    other = client.get(
        "/v1/models", headers={"Origin": "https://other.example", "Authorization": "Bearer k"}
    )  # noqa: E501
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
    assert other.json()["error"]["code"] == "origin_not_allowed"
    assert _preflight(client, "https://other.example").status_code == 400


def test_cors_any_origin():
    client = _app_client(allowed_origins=["*"])
    assert _preflight(client, "https://any.example").headers["access-control-allow-origin"] == "*"
    models = client.get("/v1/models", headers={"Origin": "https://any.example"})
    assert models.headers["access-control-allow-origin"] == "*"


def test_no_cors_by_default(http):
    """The shared server runs without --allowed-origins: other origins are refused."""
    models = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert models.status_code == 403 and "access-control-allow-origin" not in models.headers
    preflight = http.options(
        "/v1/chat/completions",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers


# ----------------------------------------------------------- sequences per request


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 5}, "n"),
        ("/v1/completions", {"prompt": ["a"] * 5}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"], "n": 3}, "n"),
        ("/v1/completions", {"prompt": [[1, 2]] * 2, "best_of": 3}, "best_of"),
        ("/v1/embeddings", {"input": ["a"] * 5}, "input"),
    ],
)
def test_sequences_per_request_limit(path, body, param):
    client = _app_client(max_seqs_per_request=4)
    r = client.post(path, json={"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "at most 4 " in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_serve_options_reach_the_server(monkeypatch):
    seen = {}

    def run_server(engine_config, config):
        seen.update(vars(config))
        return 0

    monkeypatch.setattr(server_module, "run_server", run_server)
    origins = f"{ORIGIN}, https://b.example"
    argv = ["serve", "--allowed-origins", origins, "--max-seqs-per-request", "8"]
    assert cli.main([*argv, "--allowed-hosts", "a.lan, b.lan:8000"]) == 0
    assert seen["allowed_origins"] == [ORIGIN, "https://b.example"]
    assert seen["allowed_hosts"] == ["a.lan", "b.lan:8000"]
    assert seen["max_seqs_per_request"] == 8
    assert cli.main(["serve"]) == 0
    assert seen["allowed_origins"] is None and seen["max_seqs_per_request"] == 256
    assert seen["allowed_hosts"] is None
    seen.clear()
    assert cli.main(["serve", "--max-seqs-per-request", "0"]) == 2 and not seen


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_priority_is_accepted_and_leaves_the_output_alone(http, server, path):
    base = _base(path, server.model)
    reference = _texts(http.post(path, json=base))
    for priority in (-10, 3):
        assert _texts(http.post(path, json={**base, "priority": priority})) == reference
