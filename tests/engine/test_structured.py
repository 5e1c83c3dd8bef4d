"""Structured output through the engine, on the real SmolLM2 widened to float32: outputs
fit their JSON schema, regex, choice or grammar at any temperature; free requests in
the same batch are unchanged; bad and hostile specs are refused in bounded time."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from pyllm import LLM, SamplingParams
from pyllm.sampling.params import ParamError
from pyllm.sampling.structured import (
    MAX_SPEC_CHARS,
    StructuredOutput,
    allowed_prefix,
    mask_draft_logits,
    mask_logits,
)
from tests.tokenizer import smollm_gguf

jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "height": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "mood", "address"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@pytest.fixture(scope="module")
def llm():
    return LLM(smollm_gguf(), dtype="float32", quantization="none", kv_cache_memory=0.25)


def _chat(llm, prompts, **params):
    messages = [[{"role": "user", "content": p}] for p in prompts]
    outputs = llm.chat(messages, SamplingParams(**params), use_tqdm=False)
    return [o.outputs[0] for o in outputs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm, temperature):
    spec = {"json": PERSON}
    outs = _chat(
        llm, ["Invent a person.", "Describe your neighbour as JSON."] * 2,
        temperature=temperature, seed=3, max_tokens=160, structured_output=spec,
    )  # fmt: skip
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)


def test_json_object_is_any_object(llm):
    prompt = "Return a JSON object with keys name and age for a cat."
    (out,) = _chat(llm, [prompt], temperature=0.0, max_tokens=64,
                   structured_output={"json_object": True})  # fmt: skip
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)


def test_choice_is_always_one_of_them(llm):
    choices = ["yes", "no", 'it "depends"', "peut-être ✓"]
    outs = _chat(llm, ["Is the sky green?"] * 8, temperature=1.0, seed=0, max_tokens=16,
                 structured_output={"choice": choices})  # fmt: skip
    assert all(out.text in choices and out.finish_reason == "stop" for out in outs)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_regex_outputs_full_match(llm, seed):
    outs = _chat(llm, ["Give a phone number.", "Call me at"], temperature=1.0, seed=seed,
                 max_tokens=24, structured_output={"regex": PHONE})  # fmt: skip
    assert all(re.fullmatch(PHONE, out.text) for out in outs), [o.text for o in outs]


@pytest.mark.parametrize(
    "grammar",
    [
        'start: expr\nexpr: NUM | NUM OP expr\nNUM: /[0-9]{1,3}/\nOP: "+" | "-"',  # Lark
        'root ::= num (op num)*\nnum ::= [0-9] [0-9]? [0-9]?\nop ::= "+" | "-"',  # GBNF
    ],
    ids=["lark", "gbnf"],
)
def test_grammar_outputs_parse(llm, grammar):
    outs = _chat(llm, ["Write a sum."] * 3, temperature=1.0, seed=5, max_tokens=24,
                 structured_output={"grammar": grammar})  # fmt: skip
    for out in outs:
        if out.finish_reason == "stop":
            assert re.fullmatch(r"[0-9]{1,3}([+-][0-9]{1,3})*", out.text), out.text
        else:  # cut by max_tokens: a prefix of a sentence of the grammar
            assert re.fullmatch(r"[0-9]{1,3}([+-][0-9]{1,3})*[+-]?", out.text), out.text


def test_unsatisfiable_within_max_tokens_finishes_with_length(llm):
    schema = {"type": "string", "minLength": 200}
    (out,) = _chat(llm, ["Say something."], temperature=0.0, max_tokens=8,
                   structured_output={"json": schema})  # fmt: skip
    assert out.finish_reason == "length" and out.text.startswith('"')


def test_free_requests_are_unchanged_by_constrained_neighbours(llm):
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = llm.generate(prompts, free, use_tqdm=False)
    constrained = SamplingParams(temperature=0.0, max_tokens=24,
                                 structured_output={"json": PERSON})  # fmt: skip
    mixed = llm.generate(prompts * 2, [free] * 3 + [constrained] * 3, use_tqdm=False)
    for a, b in zip(alone, mixed[:3], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for out in mixed[3:]:
        assert out.outputs[0].text.startswith("{")


def test_end_of_sequence_only_where_the_grammar_may_end(llm):
    engine = llm.engine
    spec = StructuredOutput(choice=["yes", "yes please"])
    matcher = engine.grammars.matcher(spec)
    eos = sorted(engine.eos_token_ids)
    vocab = engine.model_config.vocab_size
    logits = torch.zeros(1, vocab)
    mask_logits(logits, [0], [matcher], eos)
    assert torch.isinf(logits[0, eos]).all()  # nothing written yet
    for token in engine.tokenizer.encode("yes", add_special_tokens=False):
        assert matcher.consume_token(token)
    logits = torch.zeros(1, vocab)
    mask_logits(logits, [0], [matcher], eos)
    assert not torch.isinf(logits[0, eos]).any()  # "yes" is whole: it may end here
    allowed = (~torch.isinf(logits[0])).nonzero().flatten().tolist()
    assert set(eos) < set(allowed) and len(allowed) < 20  # or go on to " please"


# ------------------------------------------------------------ bad and hostile specs

BAD_SPECS = [
    ({}, "structured_output"),
    ({"json": PERSON, "regex": "a"}, "structured_output"),
    ({"json": "{not json"}, "structured_output.json"),
    ({"json": 5}, "structured_output.json"),
    ({"choice": []}, "structured_output.choice"),
    ({"choice": ["a", 3]}, "structured_output.choice"),
    ({"regex": ""}, "structured_output.regex"),
    ({"json_object": "yes"}, "structured_output.json_object"),
    ({"nonsense": 1}, "structured_output"),
]


@pytest.mark.parametrize("spec, param", BAD_SPECS)
def test_bad_specs_name_the_field(spec, param):
    with pytest.raises(ParamError) as error:
        SamplingParams(structured_output=spec)
    assert error.value.param == param


def test_structured_output_excludes_ignore_eos_and_min_tokens():
    for extra in ({"ignore_eos": True}, {"min_tokens": 2}):
        with pytest.raises(ParamError) as error:
            SamplingParams(structured_output={"regex": "a+"}, **extra)
        assert error.value.param == next(iter(extra))


HOSTILE = {
    "malformed schema": {"json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}},
    "unknown type": {"json": {"type": "nonsense"}},
    "unsupported keyword": {"json": {"type": "string", "not": {"maxLength": 3}}},
    "unknown format": {"json": {"type": "string", "format": "no-such-format"}},
    "invalid regex": {"regex": "(a"},
    "invalid grammar": {"grammar": "start: undefined_rule"},
}


@pytest.mark.parametrize("spec", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_specs_are_refused_quickly(llm, spec):
    start = time.perf_counter()
    with pytest.raises(ParamError) as error:
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_output=spec), use_tqdm=False)
    assert error.value.param.startswith("structured_output")
    assert time.perf_counter() - start < 5
    assert not llm.engine.has_unfinished_requests()


def test_a_megabyte_schema_is_refused_before_compiling():
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "description": "x" * 80} for i in range(10_000)},
    }
    assert len(json.dumps(schema)) > 2**20
    start = time.perf_counter()
    with pytest.raises(ParamError, match=str(MAX_SPEC_CHARS)):
        SamplingParams(structured_output={"json": schema})
    assert time.perf_counter() - start < 2


@pytest.mark.parametrize("regex", [r"(a+)+$", r"(a|aa)*b", r"((a{1,50}){1,50}){1,50}"])
def test_catastrophic_regexes_run_in_bounded_time(llm, regex):
    start = time.perf_counter()
    (out,) = _chat(llm, ["Write some letters."], temperature=1.0, seed=0, max_tokens=16,
                   structured_output={"regex": regex})  # fmt: skip
    assert time.perf_counter() - start < 30
    if out.finish_reason == "stop":
        assert re.fullmatch(regex, out.text)


# ------------------------------------------------------------ speculative decoding

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "disable_by_batch_size": 64}  # fmt: skip
ANN = {"name": "Ann", "age": 31, "mood": "calm", "address": {"city": "Oslo", "zip": "01234"}}
ANN_TEXT = json.dumps(ANN, separators=(",", ":"))  # the grammar's own spacing


def test_draft_masks_are_the_masks_after_each_draft_token(llm):
    engine = llm.engine
    spec = StructuredOutput(json=PERSON)
    walker, follower = engine.grammars.matcher(spec), engine.grammars.matcher(spec)
    eos = sorted(engine.eos_token_ids)
    vocab = engine.model_config.vocab_size
    valid = engine.tokenizer.encode(ANN_TEXT[:40], add_special_tokens=False)
    bad = engine.tokenizer.encode("}}", add_special_tokens=False)
    draft = allowed_prefix(walker, valid + bad)
    assert draft == valid  # cut where the grammar refuses
    logits = torch.randn(2 + len(draft), vocab)
    expected = logits.clone()
    mask_draft_logits(logits, [1], [walker], [draft], eos)
    for i in range(len(draft) + 1):
        mask_logits(expected, [1 + i], [follower], eos)
        if i < len(draft):
            assert follower.consume_token(draft[i])
    assert torch.equal(logits, expected)  # row 0 and the last row untouched too
    assert allowed_prefix(walker, draft) == draft  # rolled back to where it stood


def test_speculation_under_a_grammar_follows_the_plain_engine(llm):
    spec_llm = LLM(smollm_gguf(), dtype="float32", quantization="none",
                   kv_cache_memory=0.25, speculative_config=NGRAM)  # fmt: skip
    prompts = [f"Copy this JSON exactly: {ANN_TEXT}", "Invent a person."]
    params = dict(temperature=0.0, max_tokens=80, structured_output={"json": PERSON})
    plain = _chat(llm, prompts, **params)
    spec = _chat(spec_llm, prompts, **params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert json.loads(spec[0].text) == ANN
    stats = spec_llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 10
    sampled = _chat(spec_llm, prompts * 2, **{**params, "temperature": 1.0})
    for out in sampled:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), PERSON)
        else:  # cut by max_tokens (at temperature 1 a number may run on): on the grammar
            assert out.finish_reason == "length", out.text
            matcher = spec_llm.engine.grammars.matcher(StructuredOutput(json=PERSON))
            assert allowed_prefix(matcher, list(out.token_ids)) == list(out.token_ids)
    assert any(out.finish_reason == "stop" for out in sampled)
    assert (
        spec_llm.engine.stats().spec_decode_num_accepted_tokens
        > stats.spec_decode_num_accepted_tokens
    )
