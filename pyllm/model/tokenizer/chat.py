"""Chat templates: HF-style Jinja templates rendered the way HF's apply_chat_template does."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

# Roles a message may have; anything else is a caller error, not something to pass to a template.
CHAT_ROLES = ("system", "user", "assistant", "tool")

# Used when a model ships no chat template: "role: content" lines, then the assistant's cue.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)

# Gemma's turn format, for GGUF files of the family that carry no template: turns of
# "<start_of_turn>{user|model}\n...<end_of_turn>\n"; a system message has no turn of its
# own and opens the first user turn, followed by a blank line; the reply is cued with
# "<start_of_turn>model\n".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] ~ '\n\n' if messages and "
    "messages[0]['role'] == 'system' else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' ~ role ~ '\n' ~ (system if loop.first else '') "
    "~ message['content'] | trim ~ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# general.architecture -> the template a GGUF file of that family gets when it has none.
BUILTIN_CHAT_TEMPLATES = {"gemma3": GEMMA_CHAT_TEMPLATE}
# Token texts that end a turn, used as stop tokens when a GGUF file names no EOT id.
END_OF_TURN_TOKENS = ("<end_of_turn>",)
# gpt-oss's harmony format: a reply ends with its answer (<|return|>) or a tool call
# (<|call|>); <|end|> ends one of its messages (the reasoning, say) and must not stop it.
HARMONY_END_TOKENS = ("<|return|>", "<|call|>")
HARMONY_MESSAGE_END = "<|end|>"


def validate_messages(messages: Sequence[dict[str, Any]]) -> None:
    """Raise ValueError unless `messages` is a list of {"role": <known role>, "content": str}."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{index}] has unknown role {role!r} (allowed: {CHAT_ROLES})")
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(
                f"messages[{index}].content must be a str, got {type(content).__name__}"
            )


def render_chat_template(
    template: str,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """Render a HF-style Jinja chat template with the variables HF's apply_chat_template provides
    (messages, tools, add_generation_prompt, bos_token, eos_token, ... and any extras)."""
    import jinja2

    validate_messages(messages)
    compiled = _compile_chat_template(template)
    try:
        return compiled.render(
            messages=[dict(m) for m in messages],
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as error:  # undefined names, sandbox refusals
        raise ValueError(f"chat template failed: {type(error).__name__}: {error}") from error


@lru_cache(maxsize=16)
def _compile_chat_template(template: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; for
        inference it renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str):
        raise ValueError(f"chat template error: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes <, >, & and ' for HTML; prompts need the plain JSON.
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    # trim_blocks/lstrip_blocks: templates are written for them (HF renders with both on).
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationBlock]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template does not parse: {error}") from error
