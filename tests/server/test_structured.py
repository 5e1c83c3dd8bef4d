"""Structured output and tools through the HTTP API, driven by the official `openai`
client: `chat.completions.parse` with pydantic models, vLLM's guided fields,
tool_choice "required" and named, and hostile specs refused with a 400."""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, Field

jsonschema = pytest.importorskip("jsonschema")

Short = Annotated[str, Field(max_length=16)]


class Address(BaseModel):
    city: Short
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: Short
    age: int = Field(ge=0, le=120)
    mood: Literal["happy", "sad", "calm"]
    address: Address
    nickname: Short | None = None


class Book(BaseModel):
    title: Short
    year: int = Field(ge=1450, le=2030)
    rating: float = Field(ge=0, le=5)
    tags: list[Short] = Field(max_length=3)


class Inventory(BaseModel):
    items: list[Book] = Field(max_length=2)
    shelf: Literal["A", "B", "C"]


MODELS = {Person: "Invent a person.", Book: "Describe a book.", Inventory: "List some books."}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def _messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("model", list(MODELS), ids=lambda m: m.__name__)
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 7)])
def test_parse_returns_valid_objects(client, server, model, temperature, seed):
    response = client.chat.completions.parse(
        model=server.model,
        messages=_messages(MODELS[model]),
        response_format=model,
        temperature=temperature,
        seed=seed,
        max_tokens=200,
    )
    message = response.choices[0].message
    assert isinstance(message.parsed, model), message.content
    jsonschema.validate(json.loads(message.content), model.model_json_schema())


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 11)])
def test_parse_streaming(client, server, temperature, seed):
    with client.chat.completions.stream(
        model=server.model,
        messages=_messages(MODELS[Inventory]),
        response_format=Inventory,
        temperature=temperature,
        seed=seed,
        max_tokens=200,
    ) as stream:
        deltas = sum(1 for event in stream if event.type == "content.delta")
        final = stream.get_final_completion()
    assert deltas > 1  # streamed, not sent at the end
    assert isinstance(final.choices[0].message.parsed, Inventory)


def test_json_object(client, server):
    response = client.chat.completions.create(
        model=server.model,
        messages=_messages("Return a JSON object with keys name and age for a cat."),
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=64,
    )
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_guided_choice_and_regex(client, server):
    choices = ["red", "green", "light blue"]
    for seed in range(4):
        chat = client.chat.completions.create(
            model=server.model, messages=_messages("Pick a colour."), temperature=1.0,
            seed=seed, max_tokens=8, extra_body={"guided_choice": choices},
        )  # fmt: skip
        assert chat.choices[0].message.content in choices
        completion = client.completions.create(
            model=server.model, prompt="My number is", temperature=1.0, seed=seed,
            max_tokens=16, extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
        )  # fmt: skip
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", completion.choices[0].text)


def test_tool_choice_required_returns_valid_calls(client, server):
    response = client.chat.completions.create(
        model=server.model, messages=_messages("What is the weather in Paris?"),
        tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=100,
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])


def test_named_tool_choice_streams_one_call(client, server):
    stream = client.chat.completions.create(
        model=server.model, messages=_messages("Weather in Oslo?"), tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0, seed=3, max_tokens=100, stream=True,
    )  # fmt: skip
    chunks = list(stream)
    deltas = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert len(deltas) > 1  # the name first, then the arguments as they are made
    ((name, arguments),) = _accumulated(deltas)
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def _accumulated(deltas) -> list[tuple[str, str]]:
    """(name, arguments) of each streamed call: its first delta names it, the others
    add argument text."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.function.name is not None:
            assert delta.index not in calls and delta.id and delta.type == "function"
            calls[delta.index] = [delta.function.name, ""]
        calls[delta.index][1] += delta.function.arguments or ""
    return [tuple(calls[i]) for i in range(len(calls))]


def test_tool_choice_none_answers_in_text(client, server):
    response = client.chat.completions.create(
        model=server.model, messages=_messages("Hi"), tools=[WEATHER], tool_choice="none",
        temperature=0, max_tokens=8,
    )  # fmt: skip
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].message.content


def test_tool_results_in_the_conversation_are_accepted(client, server):
    messages = [
        *_messages("Weather in Paris?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "c"}',
                    },
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    response = client.chat.completions.create(
        model=server.model, messages=messages, tools=[WEATHER], temperature=0, max_tokens=16
    )
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")


HOSTILE = {
    "malformed schema": {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}},
    "unsupported keyword": {"guided_json": {"type": "string", "not": {"maxLength": 3}}},
    "megabyte schema": {
        "guided_json": {
            "type": "object",
            "properties": {f"p{i}": {"description": "x" * 90} for i in range(10_000)},
        }
    },
    "invalid regex": {"guided_regex": "(a"},
    "invalid grammar": {"guided_grammar": "start: nowhere"},
}


@pytest.mark.parametrize("fields", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_specs_are_400s(client, server, fields):
    start = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=server.model, messages=_messages("Hi"), max_tokens=4, extra_body=fields
        )
    assert time.perf_counter() - start < 10
    assert error.value.body["param"] == next(iter(fields))


def test_schema_error_names_response_format(client, server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=server.model, messages=_messages("Hi"), max_tokens=4, response_format=bad
        )
    assert error.value.body["param"] == "response_format"
    assert error.value.body["message"].startswith("response_format")


def test_catastrophic_regex_is_served_in_bounded_time(client, server):
    start = time.perf_counter()
    completion = client.completions.create(
        model=server.model, prompt="aaa", max_tokens=16, temperature=1.0, seed=1,
        extra_body={"guided_regex": "(a|aa)*b"},
    )  # fmt: skip
    assert time.perf_counter() - start < 30
    text = completion.choices[0].text
    assert re.fullmatch("(a|aa)*b", text) or completion.choices[0].finish_reason == "length"


# With tool_choice "auto" the model writes calls in its own format. SmolLM2 has none,
# so a regex makes it write a Hermes-style call: what a model like Qwen2 writes itself.
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "c"\}\}</tool_call>'  # noqa: E501


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_models_own_tool_calls(client, server, stream):
    response = client.chat.completions.create(
        model=server.model, messages=_messages("Weather in Paris?"), tools=[WEATHER, TIME],
        temperature=0, max_tokens=64, stream=stream, extra_body={"guided_regex": HERMES_CALL},
    )  # fmt: skip
    if stream:
        chunks = list(response)
        deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
        assert not "".join(d.content or "" for d in deltas)  # held back, never sent as text
        calls = _accumulated([c for d in deltas for c in d.tool_calls or []])
        finish = chunks[-1].choices[0].finish_reason
    else:
        message = response.choices[0].message
        assert message.content is None
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        finish = response.choices[0].finish_reason
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0][0] == "get_weather"
    assert json.loads(calls[0][1]) == {"city": "Paris", "unit": "c"}


def test_auto_streams_plain_answers_as_text(client, server):
    stream = client.chat.completions.create(
        model=server.model, messages=_messages("Say hello."), tools=[WEATHER],
        temperature=0, max_tokens=16, stream=True,
    )  # fmt: skip
    texts = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(texts) > 1  # streamed as it came, once clearly not a tool call
