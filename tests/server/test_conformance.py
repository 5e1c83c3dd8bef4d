"""Where the server follows OpenAI's API beyond its happy path, against the shared server."""

from __future__ import annotations

MESSAGES = [{"role": "user", "content": "Name a color."}]
PROMPT = "The sky is"

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
