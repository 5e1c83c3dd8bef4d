"""Logprobs as the API spells them: tokens as text and bytes, chat's and completions'
shapes, the prompt's under echo, and vLLM's prompt_logprobs."""

from __future__ import annotations

from pyllm.entrypoints import openai_protocol as api

# JSON cannot carry -inf: a logprob of -inf (a token masked out) is sent as this.
MIN_LOGPROB = -9999.0

Logprobs = list[tuple[float, dict[int, float]]]  # (chosen token's, {top token: its}) each


def finite(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB


def _ranked(top: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda kv: -kv[1])


class TokenText:
    """Token ids as the API shows them: their text (decoded once each) and bytes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._strings: dict[int, str] = {}
        self._byte_decoder = byte_level_decoder(tokenizer)

    def string(self, token_id: int) -> str:
        text = self._strings.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._strings[token_id] = text
        return text

    def bytes(self, token_id: int) -> list[int]:
        if self._byte_decoder is not None:
            spelling = self.tokenizer.convert_ids_to_tokens([token_id])[0]
            if spelling is not None and all(ch in self._byte_decoder for ch in spelling):
                return [self._byte_decoder[ch] for ch in spelling]
        return list(self.string(token_id).encode("utf-8"))

    def chat_logprobs(self, token_ids: list[int], logprobs: Logprobs) -> api.ChatLogprobs:
        content = []
        for token_id, (chosen, top) in zip(token_ids, logprobs, strict=True):
            top_logprobs = [
                api.TopLogprob(token=self.string(t), logprob=finite(lp), bytes=self.bytes(t))
                for t, lp in _ranked(top)
            ]
            content.append(
                api.ChatTokenLogprob(
                    token=self.string(token_id),
                    logprob=finite(chosen),
                    bytes=self.bytes(token_id),
                    top_logprobs=top_logprobs,
                )
            )
        return api.ChatLogprobs(content=content)

    def completion_logprobs(
        self, token_ids: list[int], logprobs: Logprobs, text_offset: int
    ) -> api.CompletionLogprobs:
        result = api.CompletionLogprobs()
        for token_id, (chosen, top) in zip(token_ids, logprobs, strict=True):
            token = self.string(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(finite(chosen))
            result.top_logprobs.append({self.string(t): finite(lp) for t, lp in _ranked(top)})
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result

    def echo_logprobs(
        self, prompt_token_ids: list[int], prompt_logprobs: list | None, k: int
    ) -> api.CompletionLogprobs:
        """The prompt tokens in the legacy completions format (offsets from 0): no logprob
        for the first token, the top k for the others."""
        result = api.CompletionLogprobs()
        text_offset = 0
        for token_id, entry in zip(prompt_token_ids, prompt_logprobs, strict=True):
            token = self.string(token_id)
            result.tokens.append(token)
            result.text_offset.append(text_offset)
            text_offset += len(token)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            chosen, top = entry
            ranked = _ranked(top)[:k]
            result.token_logprobs.append(finite(chosen))
            result.top_logprobs.append({self.string(t): finite(lp) for t, lp in ranked})
        return result

    def prompt_logprobs(
        self, prompt_token_ids: list[int], prompt_logprobs: list | None, k: int
    ) -> list[dict[int, api.PromptLogprob] | None]:
        """vLLM's prompt_logprobs: per token, the prompt token's logprob and the top k."""
        result: list[dict[int, api.PromptLogprob] | None] = []
        for token_id, entry in zip(prompt_token_ids, prompt_logprobs, strict=True):
            if entry is None:
                result.append(None)
                continue
            chosen, top = entry
            ranked = _ranked(top)[:k]
            rank_of = {t: rank for rank, (t, _) in enumerate(ranked, start=1)}
            found = {
                t: api.PromptLogprob(
                    logprob=finite(lp), rank=rank_of[t], decoded_token=self.string(t)
                )
                for t, lp in ranked
            }
            found[token_id] = api.PromptLogprob(
                logprob=finite(chosen),
                rank=rank_of.get(token_id),
                decoded_token=self.string(token_id),
            )
            result.append(found)
        return result


def byte_level_decoder(tokenizer) -> dict[str, int] | None:
    """GPT-2's map from a byte-level BPE token's characters back to bytes, if the
    vocabulary is byte-level (a space is spelled 'Ġ'); else None."""
    try:
        spelling = tokenizer.convert_ids_to_tokens(tokenizer.encode(" ", add_special_tokens=False))
    except Exception:
        return None
    if spelling != ["Ġ"]:
        return None
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    decoder, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            decoder[chr(256 + extra)] = b
            extra += 1
    return decoder
