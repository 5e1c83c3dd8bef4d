"""OpenAI's Responses API (/v1/responses) on a real `pyllm serve`, driven by the official
`openai` SDK: replies whole and streamed (typed events in order), function calls and
their outputs, structured text, previous_response_id, and errors naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from pyllm.entrypoints.responses_protocol import ResponsesRequest
from pyllm.entrypoints.responses_store import ResponseStore

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
QUESTION = "What is the capital of France?"


def _create(client, server, **kwargs):
    """Greedy and short unless told otherwise."""
    args = dict(model=server.model, input=QUESTION, max_output_tokens=12, temperature=0)
    return client.responses.create(**{**args, **kwargs})


def test_create(client, server):
    response = _create(
        client, server, instructions="You are a geography teacher.", metadata={"k": "v"}
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == server.model and response.status in ("completed", "incomplete")
    assert [item.type for item in response.output] == ["message"]
    message = response.output[0]
    assert message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    assert response.output_text == message.content[0].text and response.output_text.strip()
    usage = response.usage
    assert 0 < usage.output_tokens <= 12 and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    # The request's settings, echoed.
    assert response.instructions == "You are a geography teacher."
    assert response.metadata == {"k": "v"} and response.temperature == 0
    assert response.max_output_tokens == 12 and response.tool_choice == "auto"
    assert response.tools == [] and response.parallel_tool_calls is True


def test_max_output_tokens_makes_it_incomplete(client, server):
    response = _create(client, server, max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2 and response.output[0].status == "incomplete"


def test_input_items_are_the_same_prompt_as_a_string(client, server):
    text = _create(client, server)
    items = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    listed = _create(client, server, input=items)
    assert listed.output_text == text.output_text
    assert listed.usage.input_tokens == text.usage.input_tokens


def _events(client, server, **kwargs) -> list:
    with _create(client, server, stream=True, **kwargs) as stream:
        return list(stream)


def test_stream_events_in_order(client, server):
    whole = _create(client, server)
    events = _events(client, server)
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", f"response.{whole.status}",
    ]  # fmt: skip
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    assert events[-3].part.text == text and events[-2].item.content[0].text == text
    item_id = events[2].item.id
    assert {e.item_id for e in events[3:-2]} == {item_id} and final.output[0].id == item_id
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_function_call_then_its_output(client, server):
    question = "What is the weather in Oslo?"
    response = _create(
        client, server, input=question, tools=[WEATHER], tool_choice="required",
        max_output_tokens=60,
    )  # fmt: skip
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert response.output_text == ""
    # The next turn: the call sent back with its output, as the SDK's items.
    turn = [
        {"role": "user", "content": question},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"},
    ]
    answer = _create(client, server, input=turn, tools=[WEATHER])
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
    # The call and its output reach the prompt.
    bare = _create(client, server, input=question, tools=[WEATHER])
    assert answer.usage.input_tokens > bare.usage.input_tokens + 10


def test_named_function_streams_its_arguments(client, server):
    events = _events(
        client, server, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
    )  # fmt: skip
    kinds = [event.type for event in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas > 1, kinds  # the arguments stream as they are written
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * deltas,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    arguments = events[-3].arguments
    joined = "".join(event.delta for event in events[3 : 3 + deltas])
    assert joined == arguments == events[-2].item.arguments
    jsonschema.validate(json.loads(arguments), WEATHER["parameters"])
    (call,) = events[-1].response.output
    assert (call.id, call.arguments) == (events[-2].item.id, arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_text_format(client, server, stream):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    fields = dict(input="Describe a person.", text={"format": fmt}, max_output_tokens=40)
    if stream:
        response = _events(client, server, **fields)[-1].response
    else:
        response = _create(client, server, **fields)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"


def test_json_object_text_format(client, server):
    fields = dict(input="Return a JSON object with keys name and age for a cat.")
    response = _create(
        client, server, text={"format": {"type": "json_object"}}, max_output_tokens=64, **fields
    )
    assert response.status == "completed"
    assert isinstance(json.loads(response.output_text), dict)


def test_previous_response_id_continues_the_conversation(client, server):
    first = _create(client, server, instructions="Answer in one sentence.")
    follow_up = "And of Germany?"
    second = _create(client, server, input=follow_up, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # The same as sending the conversation itself (instructions are not inherited).
    turns = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": follow_up},
    ]
    explicit = _create(client, server, input=turns)
    assert second.usage.input_tokens == explicit.usage.input_tokens
    assert second.output_text == explicit.output_text
    # A chain: the third turn sees both earlier ones.
    third = _create(client, server, input="Thanks.", previous_response_id=second.id)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_store_false_is_not_kept(client, server):
    unstored = _create(client, server, store=False)
    with pytest.raises(openai.NotFoundError):
        _create(client, server, input="More.", previous_response_id=unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_retrieve_and_delete_a_stored_response(client, server):
    created = _create(client, server)
    assert client.responses.retrieve(created.id) == created
    streamed = _create(client, server, stream=True)
    final = [event for event in streamed if event.type == "response.completed"][0].response
    assert client.responses.retrieve(final.id) == final
    deleted = client.responses.delete(created.id)  # the SDK returns None for it
    assert deleted is None
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(created.id)
    assert caught.value.body["param"] == "response_id"
    assert caught.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        _create(client, server, input="More.", previous_response_id=created.id)


def test_delete_replies_as_openai(http, server):
    created = http.post("/v1/responses", json={"model": server.model, "input": "Hi",
                                               "max_output_tokens": 2}).json()  # fmt: skip
    response = http.delete(f"/v1/responses/{created['id']}")
    assert response.status_code == 200
    assert response.json() == {"id": created["id"], "object": "response", "deleted": True}
    missing = http.get(f"/v1/responses/{created['id']}")
    assert missing.status_code == 404
    assert set(missing.json()["error"]) == {"message", "type", "param", "code"}


def _error(client, server, **kwargs) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        _create(client, server, **kwargs)
    return caught.value


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": [{"type": "web_search_call"}]}, "input"),
        ({"input": []}, "input"),
        ({"background": True}, "background"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ],
)
def test_bad_fields_are_400s_naming_them(client, server, fields, param):
    error = _error(client, server, **fields)
    assert error.status_code == 400, error.body
    assert error.body["param"] == param and error.body["type"] == "invalid_request_error"
    assert error.body["message"]


def test_harmless_unknown_fields_are_ignored(client, server):
    extra = {"service_tier": "auto", "truncation": "auto", "prompt_cache_key": "k",
             "include": ["reasoning.encrypted_content"], "safety_identifier": "u1",
             "reasoning": {"effort": "low"}}  # fmt: skip
    response = _create(client, server, extra_body=extra)
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.reasoning.effort == "low"


def test_unknown_previous_response_and_model_are_404s(client, server):
    error = _error(client, server, previous_response_id="resp_unknown")
    assert isinstance(error, openai.NotFoundError)
    assert error.body["param"] == "previous_response_id"
    assert error.body["code"] == "previous_response_not_found"
    error = _error(client, server, model="no-such-model")
    assert isinstance(error, openai.NotFoundError) and error.body["param"] == "model"


def test_error_body_in_openais_shape(http, server):
    body = {"model": server.model, "input": "Hi", "tools": [{"type": "file_search"}]}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == "tools[0].type"


def test_openapi_declares_the_route(server):
    document = httpx.get(f"{server.base_url}/openapi.json", timeout=10).json()
    operation = document["paths"]["/v1/responses"]["post"]
    ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    request = document["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert request["required"] == ["input"]
    assert {"instructions", "tools", "text", "previous_response_id"} <= set(request["properties"])
    ok = operation["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/ResponseObject")
    assert ok["text/event-stream"]["schema"]["required"] == ["data"]
    stored = document["paths"]["/v1/responses/{response_id}"]
    for method, body in (("get", "ResponseObject"), ("delete", "DeletedResponse")):
        [parameter] = stored[method]["parameters"]
        assert parameter["in"] == "path" and parameter["name"] == "response_id"
        ok = stored[method]["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok["$ref"].endswith(f"/{body}") and "404" in stored[method]["responses"]


def test_output_items_sent_back_are_taken():
    """A client may send a whole earlier output back as input: the reasoning item is
    left out of the prompt, the message and the call become the assistant's turn."""
    output = [
        {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
         "content": [{"type": "reasoning_text", "text": "Think."}], "encrypted_content": None},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": [],
                      "logprobs": None}], "phase": None},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f",
         "arguments": "{}", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
    ]  # fmt: skip
    request = ResponsesRequest.model_validate(
        {"input": [{"role": "user", "content": "Hi"}, *output]}
    )
    assert request.input_messages() == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]  # fmt: skip


def test_store_is_bounded():
    store = ResponseStore(max_responses=2, max_bytes=200)
    message = [{"role": "user", "content": "x" * 50}]
    for name in ("a", "b", "c"):
        store.put(name, message)
    assert len(store) == 2  # "a", the least recently used, went first
    with pytest.raises(ValueError, match="previous response 'a' not found"):
        store.messages("a")
    store.messages("b")  # now the most recent: "c" goes next
    store.put("d", message)
    assert store.messages("b") == message
    with pytest.raises(ValueError):
        store.messages("c")
    store.put("huge", [{"role": "user", "content": "x" * 500}])  # over the whole budget
    assert len(store) == 2 and store.bytes <= 200
    with pytest.raises(ValueError, match="max_responses"):
        ResponseStore(max_responses=0)


def test_store_counts_the_response_object_and_deletes():
    store = ResponseStore(max_responses=4, max_bytes=200)
    store.put("a", [], "x" * 150)
    assert store.bytes == 152 and store.response("a") == "x" * 150  # "[]" and the object
    store.put("b", [], "y" * 100)  # over the bytes: "a" goes
    with pytest.raises(ValueError, match="response 'a' not found"):
        store.response("a")
    store.delete("b")
    assert len(store) == 0 and store.bytes == 0
    with pytest.raises(ValueError, match="response 'b' not found"):
        store.delete("b")
