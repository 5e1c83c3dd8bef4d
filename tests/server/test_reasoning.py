"""A reasoning model's <think>...</think> apart from its answer (--reasoning-parser), and
chat_template_kwargs: by the parser alone, and through a real server over a tiny Qwen3
model with Qwen3's chat template, made to think by a regex; on /v1/messages, Anthropic's
thinking blocks and `thinking` field, with the anthropic SDK."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import pytest

from pyllm.engine.config import ConfigError
from pyllm.engine.outputs import CompletionOutput
from pyllm.entrypoints.chat_reply import ReplyReader, ReplyStream
from pyllm.entrypoints.openai_protocol import ChatCompletionRequest
from pyllm.entrypoints.reasoning import reasoning_parser
from pyllm.entrypoints.server_config import ServerConfig
from pyllm.model.tokenizer import Tokenizer
from tests.server.conftest import start_server, stop_server

DEEPSEEK, QWEN3 = reasoning_parser("deepseek_r1"), reasoning_parser("qwen3")
THOUGHT = "\nThe user greets me.\n"
REPLY = f"<think>{THOUGHT}</think>\n\nHello there!"
MESSAGES = [{"role": "user", "content": "Hi"}]


def test_split():
    assert QWEN3.split(REPLY) == (THOUGHT, "\n\nHello there!")
    assert QWEN3.split("no thinking") == ("", "no thinking")
    assert QWEN3.split("<think>cut short") == ("cut short", "")
    # deepseek_r1: the template opened <think>, so the reply begins inside it.
    assert DEEPSEEK.split(REPLY) == (THOUGHT, "\n\nHello there!")
    assert DEEPSEEK.split("thinking</think>answer") == ("thinking", "answer")
    assert DEEPSEEK.split("still thinking") == ("still thinking", "")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser("r2")
    with pytest.raises(ConfigError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="r2")


def _streamed(parser, text: str, step: int, tools=None) -> tuple[str, str, list]:
    """(reasoning, content, calls) sent by a ReplyStream fed `text` `step` chars at a time."""
    body = ChatCompletionRequest(messages=MESSAGES, tools=tools)
    stream = ReplyStream(ReplyReader(parser), body)
    reasoning = content = ""
    calls = {}
    for end in [*range(0, len(text), step), len(text)]:
        c = CompletionOutput(0, text[:end], [], "stop" if end == len(text) else None)
        delta = stream.step(c)
        assert not (content and delta.reasoning), "reasoning after content"
        reasoning, content = reasoning + delta.reasoning, content + (delta.content or "")
        for call in delta.calls:
            calls.setdefault(call.index, call.name)
    return reasoning, content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 100])
@pytest.mark.parametrize("parser", [DEEPSEEK, QWEN3], ids=["deepseek_r1", "qwen3"])
def test_stream_deltas_add_up_to_the_split(parser, step):
    assert _streamed(parser, REPLY, step)[:2] == parser.split(REPLY)


def test_tool_calls_are_read_from_the_answer_only():
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    reasoning, content, calls = _streamed(QWEN3, f"<think>I may {call}</think>{call}", 4, tools)
    assert (reasoning, content) == (f"I may {call}", "")
    assert calls == ["get_time"]
    body = ChatCompletionRequest(messages=MESSAGES, tools=tools)
    finished = CompletionOutput(0, f"<think>{call}</think>no call", [], "stop")
    assert ReplyReader(QWEN3).parts(body, finished) == (call, "no call", [])


# ---------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def qwen3_server(qwen3_dir, tmp_path_factory):
    server = start_server(
        tmp_path_factory.mktemp("qwen3-server"),
        ["--model", str(qwen3_dir), "--max-model-len", "512", "--reasoning-parser", "qwen3"],
        api_key=None,
    )
    try:
        yield server
    finally:
        stop_server(server.process)


def _chat(server, **fields) -> dict:
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 64, **fields}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)


def _stream(server, **fields) -> list[dict]:
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 64, "stream": True}
    url = f"{server.base_url}/v1/chat/completions"
    with httpx.stream("POST", url, json={**body, **fields}, timeout=120) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    return [json.loads(line)["choices"][0]["delta"] for line in lines]


def test_server_splits_reasoning_from_the_answer(qwen3_server):
    forced = {"guided_regex": re.escape(REPLY)}
    message = _chat(qwen3_server, **forced).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, "\n\nHello there!")
    deltas = _stream(qwen3_server, **forced)
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == (THOUGHT, "\n\nHello there!")
    # Reasoning deltas first, then content deltas.
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds == sorted(kinds, key=lambda k: k == "content")
    # A reply that does not think: all content, no reasoning field.
    message = _chat(qwen3_server, guided_regex="Hello!").json()["choices"][0]["message"]
    assert message["content"] == "Hello!" and "reasoning_content" not in message


def test_responses_give_reasoning_its_own_item(qwen3_server):
    """/v1/responses: the thinking is a reasoning item ahead of the message (here made by
    a JSON schema whose one value holds the tags: the Responses API has no regex)."""
    fmt = {"type": "json_schema", "name": "r", "schema": {"const": "<think>I greet.</think>Hi"}}
    body = {"model": qwen3_server.model, "input": "Hi", "max_output_tokens": 64,
            "text": {"format": fmt}}  # fmt: skip
    url = f"{qwen3_server.base_url}/v1/responses"
    response = httpx.post(url, json=body, timeout=120).json()
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["status"] == "completed"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "I greet."}]
    assert message["content"][0]["text"] == '"Hi"'  # the JSON string's quotes
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as streamed:
        lines = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line) for line in lines]
    deltas = {"response.reasoning_text.delta": "", "response.output_text.delta": ""}
    for event in events:
        if event["type"] in deltas:
            deltas[event["type"]] += event["delta"]
    assert list(deltas.values()) == ["I greet.", '"Hi"']
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]].count("reasoning") == 1


def test_enable_thinking_false_renders_qwen3s_no_think_prompt(qwen3_server, qwen3_dir):
    tokenizer = Tokenizer.from_pretrained(str(qwen3_dir))
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(MESSAGES) == prompt
    no_think = prompt + "<think>\n\n</think>\n\n"
    assert tokenizer.apply_chat_template(MESSAGES, enable_thinking=False) == no_think
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    tokens = httpx.post(
        f"{qwen3_server.base_url}/tokenize", json={"messages": MESSAGES, **kwargs}, timeout=60
    ).json()["tokens"]
    assert tokens == tokenizer.encode(no_think, add_special_tokens=False)
    usage = _chat(qwen3_server, max_tokens=1, **kwargs).json()["usage"]
    assert usage["prompt_tokens"] == len(tokens)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ([1, 2], "chat_template_kwargs"),
        ("enable_thinking", "chat_template_kwargs"),
        ({"messages": []}, "chat_template_kwargs.messages"),
        ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ],
)
def test_bad_chat_template_kwargs_are_400s_naming_the_field(qwen3_server, kwargs, param):
    response = _chat(qwen3_server, chat_template_kwargs=kwargs)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_llm_chat_splits_reasoning_and_passes_template_kwargs(qwen3_dir):
    from pyllm import LLM, SamplingParams

    llm = LLM(str(qwen3_dir), dtype="float32", max_model_len=256, kv_cache_memory=0.05)
    params = SamplingParams(max_tokens=64, structured_output={"regex": re.escape(REPLY)})
    (output,) = llm.chat(MESSAGES, params, use_tqdm=False, reasoning_parser="qwen3")
    completion = output.outputs[0]
    assert (completion.reasoning_content, completion.text) == (THOUGHT, "\n\nHello there!")
    kwargs = {"enable_thinking": False}
    (output,) = llm.chat(MESSAGES, SamplingParams(max_tokens=1), chat_template_kwargs=kwargs)
    assert llm.tokenizer.decode(output.prompt_token_ids).endswith("<think>\n\n</think>\n\n")


# ------------------------------------------------- Anthropic's thinking blocks


@pytest.fixture
def claude(qwen3_server):
    with anthropic.Anthropic(
        base_url=qwen3_server.base_url, api_key="none", max_retries=0, timeout=120
    ) as c:
        yield c


def _message_args(server, regex: str, **fields) -> dict:
    """A /v1/messages request whose output is forced to match `regex`."""
    return dict(
        model=server.model,
        max_tokens=200,
        messages=MESSAGES,
        extra_body={"guided_regex": regex},
        **fields,
    )


def _events(server, **body) -> list[dict]:
    """The data of each event of a streamed /v1/messages reply."""
    body = {"model": server.model, "max_tokens": 200, "messages": MESSAGES, **body}
    url = f"{server.base_url}/v1/messages"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines]


def _blocks(message) -> list[tuple]:
    """Each block's type and what it says (whole or the SDK's stream accumulated)."""
    fields = ("thinking", "signature", "text", "name", "input")
    return [(b.type, *(getattr(b, f, None) for f in fields)) for b in message.content]


def test_messages_thinking_block_before_the_text(claude, qwen3_server):
    args = _message_args(qwen3_server, re.escape(REPLY))
    message = claude.messages.create(**args)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[0].signature) == (THOUGHT, "")
    assert message.content[1].text == "\n\nHello there!"
    with claude.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(message) and final.stop_reason == "end_turn"
    # The events: the thinking block (ended by its signature), then the text block.
    events = _events(qwen3_server, guided_regex=re.escape(REPLY))
    blocks = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert blocks == ["thinking", "text"]
    deltas = [
        (e["index"], e["delta"]["type"]) for e in events if e["type"] == "content_block_delta"
    ]
    indexes = [index for index, _ in deltas]
    assert indexes == sorted(indexes) and indexes[-1] == 1
    thinking = [kind for index, kind in deltas if index == 0]
    assert thinking[-1] == "signature_delta" and set(thinking[:-1]) == {"thinking_delta"}
    # display "omitted": the block without its text.
    omitted = claude.messages.create(**args, thinking={"type": "adaptive", "display": "omitted"})
    assert omitted.content[0].type == "thinking" and omitted.content[0].thinking == ""


def test_messages_thinking_disabled_renders_the_no_think_prompt(claude, qwen3_server, qwen3_dir):
    tokenizer = Tokenizer.from_pretrained(str(qwen3_dir))
    prompt = tokenizer.apply_chat_template(MESSAGES)
    no_think = tokenizer.apply_chat_template(MESSAGES, enable_thinking=False)
    assert no_think == prompt + "<think>\n\n</think>\n\n"

    def counted(**fields) -> int:
        args = dict(model=qwen3_server.model, messages=MESSAGES, **fields)
        return claude.messages.count_tokens(**args).input_tokens

    assert counted(thinking={"type": "disabled"}) == len(tokenizer.encode(no_think)) > counted()
    enabled = {"type": "enabled", "budget_tokens": 1024}
    assert counted(thinking=enabled) == len(tokenizer.encode(prompt))
    message = claude.messages.create(
        **_message_args(qwen3_server, "Hello!"), thinking={"type": "disabled"}
    )
    assert message.usage.input_tokens == counted(thinking={"type": "disabled"})
    assert [block.type for block in message.content] == ["text"]


@pytest.mark.parametrize(
    "thinking, max_tokens, says",
    [
        ({"type": "enabled"}, 2000, "budget_tokens is required"),
        ({"type": "enabled", "budget_tokens": 1023}, 2000, "at least 1024"),
        ({"type": "enabled", "budget_tokens": 2000}, 2000, "less than max_tokens (2000)"),
        ({"type": "sometimes"}, 2000, "thinking.type"),
    ],
)
def test_messages_bad_thinking_is_a_400_naming_the_field(
    claude, qwen3_server, thinking, max_tokens, says
):
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(
            model=qwen3_server.model, max_tokens=max_tokens, messages=MESSAGES, thinking=thinking
        )
    error = raised.value.body["error"]
    assert error["type"] == "invalid_request_error" and "thinking" in error["message"]
    assert says in error["message"]


CITY = "Paris, the capital and most populous city of France"
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{CITY}"}}}}\n</tool_call>'
WEATHER = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def test_messages_tool_use_streams_its_input(claude, qwen3_server):
    regex = re.escape(f"<think>{THOUGHT}</think>\n\n{CALL}")
    args = _message_args(qwen3_server, regex, tools=[WEATHER])
    message = claude.messages.create(**args)
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.content[1].input == {"city": CITY} and message.stop_reason == "tool_use"
    with claude.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(message)
    assert final.stop_reason == "tool_use"
    events = _events(qwen3_server, tools=[WEATHER], guided_regex=regex)
    (start,) = [e for e in events if e.get("content_block", {}).get("type") == "tool_use"]
    assert start["content_block"]["name"] == "get_weather" and start["content_block"]["input"] == {}
    fragments = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["index"] == start["index"]
    ]
    assert len(fragments) > 3 and json.loads("".join(fragments)) == {"city": CITY}
