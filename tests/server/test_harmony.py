"""gpt-oss's harmony format: a reply's reasoning (analysis channel), answer (final) and
tool calls (to=functions.NAME) read apart, by the parser alone and through a real server
whose tiny gpt-oss model is made to write harmony by a grammar over its special tokens."""

from __future__ import annotations

import json

import httpx
import pytest

from pyllm.entrypoints.harmony import HarmonyStream, parse
from pyllm.model.tokenizer import Tokenizer
from tests.engine.test_moe_models import byte_level_tokenizer
from tests.model.conftest import make_hf_model
from tests.model.test_gguf import write_hf_as_gguf
from tests.server.conftest import start_server, stop_server

SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
            "<|constrain|>"]  # fmt: skip
# Enough of harmony's chat format for the tests: turns, then the reply's cue.
TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
REPLY = (
    "<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello there!"
)


def test_parse_parts_reasoning_answer_and_calls():
    reply = parse(REPLY + "<|return|>")
    assert (reply.reasoning, reply.content, reply.calls) == (
        "The user greets; answer briefly.", "Hello there!", [],
    )  # fmt: skip
    call = (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
    )
    reply = parse(call)
    assert reply.reasoning == "Need the weather." and reply.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    # The recipient in the role's header, as harmony also allows.
    other = "<|start|>assistant to=functions.f<|channel|>commentary<|message|>{}<|call|>"
    assert [c.name for c in parse(other).calls] == ["f"]
    # A model that ignored the format: all of it is the answer, markers dropped.
    assert parse("plain words<|return|>").content == "plain words"


def test_stream_deltas_add_up_to_the_parse():
    stream, reasoning, content = HarmonyStream(), "", ""
    tokens = [REPLY[:i] for i in range(0, len(REPLY) + 1, 7)] + [REPLY]
    for text in tokens:
        r, c = stream.delta(text)
        reasoning, content = reasoning + r, content + c
    assert (reasoning, content) == ("The user greets; answer briefly.", "Hello there!")


def harmony_tokenizer(vocab_size: int) -> dict:
    """A byte-level vocabulary (at most 512 tokens) whose last tokens are harmony's
    markers (control tokens)."""
    meta = byte_level_tokenizer(vocab_size - len(SPECIALS))
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + SPECIALS
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [3] * len(SPECIALS)
    meta["tokenizer.ggml.eos_token_id"] = vocab_size - len(SPECIALS) + SPECIALS.index("<|end|>")
    meta["tokenizer.chat_template"] = TEMPLATE
    return meta


@pytest.fixture(scope="module")
def gpt_oss_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-oss")
    hf = make_hf_model("gpt_oss", path / "hf", vocab_size=519)
    write_hf_as_gguf(hf, path / "tiny.gguf", "gpt-oss", tokenizer=harmony_tokenizer(519))
    return path / "tiny.gguf"


def test_gguf_stops_on_return_and_call_not_end(gpt_oss_gguf):
    tokenizer = Tokenizer.from_pretrained(str(gpt_oss_gguf))
    stops = {tokenizer.convert_ids_to_tokens([i])[0] for i in tokenizer.eos_token_ids}
    assert stops == {"<|return|>", "<|call|>"}


def _lark(text: str) -> str:
    """A grammar that makes the model write exactly `text` (markers as special tokens)."""
    parts = []
    for piece in text.replace("<|", "\0<|").replace("|>", "|>\0").split("\0"):
        if piece:
            parts.append(piece if piece in SPECIALS else json.dumps(piece))
    return "start: " + " ".join(parts)


def test_server_returns_reasoning_apart_from_the_answer(gpt_oss_gguf, tmp_path):
    server = start_server(
        tmp_path, ["--model", str(gpt_oss_gguf), "--max-model-len", "256"], api_key=None
    )
    try:
        body = {
            "model": server.model,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 200,
            "guided_grammar": _lark(REPLY + "<|return|>"),
        }
        url = f"{server.base_url}/v1/chat/completions"
        choice = httpx.post(url, json=body, timeout=120).json()["choices"][0]
        assert choice["message"]["reasoning_content"] == "The user greets; answer briefly."
        assert choice["message"]["content"] == "Hello there!"
        assert choice["finish_reason"] == "stop"
        # Streamed: the same parts, in deltas of their own.
        reasoning = content = ""
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
        assert (reasoning, content) == ("The user greets; answer briefly.", "Hello there!")
        # A tool call in harmony's commentary channel.
        call = (
            "<|channel|>commentary to=functions.get_weather <|constrain|>json"
            '<|message|>{"city": "Paris"}<|call|>'
        )
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
        body = {**body, "guided_grammar": _lark(call), "tools": tools}
        choice = httpx.post(url, json=body, timeout=120).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (called,) = choice["message"]["tool_calls"]
        assert called["function"]["name"] == "get_weather"
        assert json.loads(called["function"]["arguments"]) == {"city": "Paris"}
        _check_responses_route(server)
    finally:
        stop_server(server.process)


def _check_responses_route(server) -> None:
    """/v1/responses over a harmony model (unforced: the Responses API has no grammar
    field): the streamed deltas add up to what the same greedy request returns whole."""
    body = {"model": server.model, "input": "Hi", "max_output_tokens": 40, "temperature": 0}
    url = f"{server.base_url}/v1/responses"
    whole = httpx.post(url, json=body, timeout=120).json()
    texts = {"reasoning": "", "message": ""}
    for item in whole["output"]:
        if item["type"] in texts:
            texts[item["type"]] += "".join(part["text"] for part in item["content"])
    streamed = {"reasoning": "", "message": ""}
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line[:6] == "data: "]
    for event in events:
        if event["type"] == "response.reasoning_text.delta":
            streamed["reasoning"] += event["delta"]
        elif event["type"] == "response.output_text.delta":
            streamed["message"] += event["delta"]
    assert streamed == texts and events[-1]["type"] == f"response.{whole['status']}"
