"""vLLM's /tokenize, /detokenize and /version, and /v1/models' max_model_len."""

from __future__ import annotations

import httpx
import pytest

import pyllm

PROMPT = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
]


def test_tokenize_a_prompt_as_hf_does(http, hf_tokenizer):
    body = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    expected = hf_tokenizer.encode(PROMPT)
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(expected)
    plain = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert plain["tokens"] == hf_tokenizer.encode(PROMPT, add_special_tokens=False)
    assert plain["token_strs"] is None


def test_tokenize_messages_gives_the_chat_prompt(http, server):
    body = http.post("/tokenize", json={"model": server.model, "messages": MESSAGES}).json()
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert body["count"] == chat["usage"]["prompt_tokens"] == len(body["tokens"])
    assert body["max_model_len"] == server.max_model_len


def test_detokenize_inverts_tokenize(http):
    tokens = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    response = http.post("/detokenize", json={"tokens": tokens["tokens"]})
    assert response.json() == {"prompt": PROMPT}


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
        ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
    ],
)
def test_bad_tokenizer_requests(http, path, body, status, param):
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_tokenizer_routes_need_the_api_key(server, path):
    response = httpx.post(server.base_url + path, json={"prompt": "a", "tokens": [1]})
    assert response.status_code == 401


def test_version_and_models(http, server):
    assert httpx.get(server.base_url + "/version").json() == {"version": pyllm.__version__}
    card = http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == server.max_model_len == 2048
