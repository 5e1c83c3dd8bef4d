"""Chat templates: rendered as HF's apply_chat_template renders them, a plain fallback for models
without one, and messages checked before any template sees them."""

import json
from datetime import datetime

import pytest

from pyllm.model.tokenizer import FALLBACK_CHAT_TEMPLATE, Tokenizer
from tests.tokenizer import hf_smollm, pyllm_smollm, train_sentencepiece, write_sentencepiece_gguf

CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is 2+2?"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi in Chinese: 你好?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi there 😀"},
        {"role": "user", "content": "  spaces  and\nnewlines\t"},
    ],
    "tool": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "calling"},
        {"role": "tool", "content": '{"temp": 21}'},
    ],
}

# Exercises what HF's renderer offers templates: loop controls, namespace, tojson with arguments
# and without HTML escaping, the tools list, special-token variables, {% generation %}, and
# trim_blocks/lstrip_blocks whitespace handling.
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(turns=0) %}
{% if tools %}
Tools: {{ tools | tojson(indent=2) }}
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% if ns.turns >= 3 %}{% break %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {% generation %}[{{ loop.index }}/{{ loop.length }} {{ message.role }}] {{ message.content | trim }}{% endgeneration %}

{% endfor %}
turns={{ ns.turns }} json={{ messages[-1] | tojson }} sorted={{ {'b': 1, 'a': '<&>'} | tojson(sort_keys=True) }}
{% if messages[0].role == 'system' %}system={{ messages[0].content }} eos={{ eos_token }}{% endif %}
{% if add_generation_prompt %}<assistant>{% endif %}"""  # noqa: E501

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather at a place, e.g. 'Zürich' <city>",
            "parameters": {"type": "object", "properties": {"place": {"type": "string"}}},
        },
    }
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_smollm_template_matches_hf(name, add_generation_prompt):
    ours, hf = pyllm_smollm(), hf_smollm()
    messages = CONVERSATIONS[name]
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == expected
    ids = ours.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    expected_ids = hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )["input_ids"]
    assert ids == expected_ids
    assert ids[0] == ours.token_to_id("<|im_start|>")
    if name == "user":  # SmolLM2's template supplies its own system prompt
        assert "You are a helpful AI assistant named SmolLM" in text
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_rich_template_matches_hf(name, add_generation_prompt):
    ours, hf = pyllm_smollm(), hf_smollm()
    messages = CONVERSATIONS[name] + [{"role": "user", "content": "<b>&'\"你好"}]
    kwargs = dict(
        chat_template=RICH_TEMPLATE, add_generation_prompt=add_generation_prompt, tools=TOOLS
    )
    text = ours.apply_chat_template(messages, **kwargs)
    assert text == hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert '"<b>&\'\\"你好"' in text  # tojson: no HTML escaping, no ASCII escaping


def test_template_helpers():
    tok = pyllm_smollm()
    messages = CONVERSATIONS["user"]
    years = {str(datetime.now().year)}
    text = tok.apply_chat_template(messages, chat_template="{{ strftime_now('%Y') }}")
    years.add(str(datetime.now().year))
    assert text in years
    extra = tok.apply_chat_template(messages, chat_template="{{ custom }}", custom="value")
    assert extra == "value"
    with pytest.raises(ValueError, match="only user turns, please"):
        tok.apply_chat_template(
            CONVERSATIONS["system"],
            chat_template="{% if messages[0].role == 'system' %}"
            "{{ raise_exception('only user turns, please') }}{% endif %}",
        )
    with pytest.raises(ValueError, match="does not parse"):
        tok.apply_chat_template(messages, chat_template="{% for m in messages %}")


def test_template_is_sandboxed():
    tok = pyllm_smollm()
    with pytest.raises(ValueError, match="SecurityError.*unsafe"):
        tok.apply_chat_template(
            CONVERSATIONS["user"],
            chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}",
        )
    with pytest.raises(ValueError, match="SecurityError"):
        tok.apply_chat_template(
            CONVERSATIONS["user"], chat_template="{{ messages.append({'role': 'x'}) }}"
        )


@pytest.fixture(scope="module")
def no_template_tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("no_template")
    train_sentencepiece(str(directory / "tiny.model"))
    write_sentencepiece_gguf(
        str(directory / "tiny.model"), str(directory / "tiny.gguf"), add_space_prefix=True
    )
    tok = Tokenizer.from_gguf(directory / "tiny.gguf")
    assert tok.chat_template is None
    return tok


def test_fallback_template(no_template_tokenizer):
    tok = no_template_tokenizer
    messages = CONVERSATIONS["multi_turn"]
    expected_body = (
        "system: Be kind.\nuser: Hello!\nassistant: Hi there 😀\nuser:   spaces  and\nnewlines\t\n"
    )
    assert tok.apply_chat_template(messages) == expected_body + "assistant:"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected_body
    ids = tok.apply_chat_template(messages, tokenize=True)
    assert ids == tok.encode(expected_body + "assistant:", add_special_tokens=False)
    assert tok.bos_token_id not in ids


def test_template_from_gguf_and_hf_dir(tmp_path):
    """The GGUF's tokenizer.chat_template, and a tokenizer_config.json holding named templates."""
    hf = hf_smollm()
    assert pyllm_smollm().chat_template == hf.chat_template
    hf.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS {{ messages | length }}"},
            {"name": "default", "template": FALLBACK_CHAT_TEMPLATE},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.chat_template == FALLBACK_CHAT_TEMPLATE
    assert tok.apply_chat_template(CONVERSATIONS["user"]) == "user: What is 2+2?\nassistant:"


BAD_MESSAGES = [
    ({"role": "user", "content": "not in a list"}, "must be a list"),
    ("just a string", "must be a list"),
    (["not a dict"], r"messages\[0\] must be a dict"),
    ([{"role": "wizard", "content": "hi"}], "'wizard'"),
    ([{"role": "user", "content": "ok"}, {"content": "no role"}], r"messages\[1\].*None"),
    ([{"role": "User", "content": "case matters"}], "'User'"),
    ([{"role": "user"}], r"messages\[0\]\.content must be a str, got NoneType"),
    ([{"role": "user", "content": 42}], "got int"),
    ([{"role": "user", "content": ["a", "list"]}], "got list"),
]


@pytest.mark.parametrize("messages, error", BAD_MESSAGES)
def test_bad_messages_are_rejected(messages, error, no_template_tokenizer):
    for tok in (pyllm_smollm(), no_template_tokenizer):
        with pytest.raises(ValueError, match=error):
            tok.apply_chat_template(messages)


def test_all_known_roles_are_accepted(no_template_tokenizer):
    messages = [{"role": r, "content": r.upper()} for r in ("system", "user", "assistant", "tool")]
    text = no_template_tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert text == "system: SYSTEM\nuser: USER\nassistant: ASSISTANT\ntool: TOOL\n"
