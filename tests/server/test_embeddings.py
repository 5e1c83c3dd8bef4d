"""POST /v1/embeddings on a real `pyllm serve` (the bundled model in float32), through
the official `openai` SDK: floats and base64 the same vector, `dimensions` cut and
normalized again, text and its token ids the same, an input the same alone or in a
batch; and every bad request a 400 naming its field."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

TEXTS = ["The capital of France is Paris.", "a cat", "Embeddings map text to vectors."]


def _matrix(reply) -> np.ndarray:
    return np.array([d.embedding for d in reply.data], dtype=np.float64)


def test_float_and_base64_are_the_same_unit_vectors(client, server):
    floats = client.embeddings.create(model=server.model, input=TEXTS, encoding_format="float")
    encoded = client.embeddings.create(model=server.model, input=TEXTS)  # the SDK asks base64
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert floats.model == server.model and floats.object == "list"
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)
    vectors = _matrix(floats)
    assert vectors.shape[1] == 576  # SmolLM2-135M's hidden size
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    # base64 carries the same float32 values.
    np.testing.assert_allclose(_matrix(encoded), vectors, atol=1e-7)
    assert len({tuple(np.round(v, 4)) for v in vectors}) == 3  # three different texts


def test_dimensions_cut_and_renormalize(client, server):
    full = _matrix(client.embeddings.create(model=server.model, input=TEXTS[0]))[0]
    cut = client.embeddings.create(model=server.model, input=TEXTS[0], dimensions=64)
    expected = full[:64] / np.linalg.norm(full[:64])
    np.testing.assert_allclose(_matrix(cut)[0], expected, atol=1e-5)


def test_token_ids_and_batching_change_nothing(client, server, http):
    alone = [_matrix(client.embeddings.create(model=server.model, input=t))[0] for t in TEXTS]
    batch = _matrix(client.embeddings.create(model=server.model, input=TEXTS))
    np.testing.assert_allclose(batch, np.array(alone), atol=1e-5)
    ids = [http.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    by_ids = _matrix(client.embeddings.create(model=server.model, input=ids))
    np.testing.assert_allclose(by_ids, batch, atol=1e-5)
    one = client.embeddings.create(model=server.model, input=ids[1])  # one list of ids
    np.testing.assert_allclose(_matrix(one)[0], batch[1], atol=1e-5)
    assert one.usage.prompt_tokens == len(ids[1])


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": True}, "input"),
        ({"input": [[10**9]]}, "input"),  # outside the vocabulary
        ({"input": [[5] * 3000]}, "input"),  # past the context
        ({"input": ["a"] * 257}, "input"),  # more inputs than --max-seqs-per-request
        ({"input": [[5] * 2000] * 151}, "input"),  # more tokens than --max-embedding-tokens
        ({"input": "a", "dimensions": 577}, "dimensions"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": "8"}, "dimensions"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ({}, "input"),
    ],
)
def test_bad_requests_name_the_field(http, body, param):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_sdk_raises_bad_request(client, server):
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=server.model, input="a", dimensions=10_000)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="a")


def test_openapi_declares_the_route(server):
    document = httpx.get(f"{server.base_url}/openapi.json", timeout=10).json()
    operation = document["paths"]["/v1/embeddings"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/EmbeddingRequest")
    request = document["components"]["schemas"]["EmbeddingRequest"]
    assert request["required"] == ["input"]
    assert {"model", "encoding_format", "dimensions", "user"} <= set(request["properties"])
    ok = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok["$ref"].endswith("/EmbeddingResponse")
    assert {"400", "401", "404", "413", "503"} <= set(operation["responses"])
