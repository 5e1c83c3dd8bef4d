"""Incremental detokenization: the text each new token adds, ready to stream.

Decoding one token at a time goes wrong two ways. A character outside ASCII can be split over
several byte-level or `<0xNN>` tokens, and its first tokens alone decode to U+FFFD. And a
SentencePiece token's leading "\u2581" is a space or not depending on what precedes it.

So we decode a short window of tokens twice: from `prefix_offset` to `read_offset` (text already
emitted) and from `prefix_offset` to the end. The new text is the second minus the first, and it is
emitted only once it does not end in U+FFFD: the bytes of a character still arriving are held back
until the token that completes it. Both decodes start at the same token, so whatever the decoder
does to the start of a sequence it does to both, and the deltas concatenate to
`tokenizer.decode(generated_ids)`.

A pyllm `Tokenizer` over a `tokenizers.Tokenizer` steps through `tokenizers.decoders.DecodeStream`
instead: the same two-decode rule run in Rust, the same deltas, two to three times cheaper per
token. Other decoders (a SentencePiece `tokenizer.model`, HF's tokenizers) and the final flush use
the Python path; both keep the same offsets, so either can take over from the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenizers.decoders import DecodeStream

from pyllm.model.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a request's generated tokens into text deltas, one `add` per token.

    The emitted text is that of the generated ids alone, as `tokenizer.decode(generated_ids)`
    prints it: with a SentencePiece model the first generated token's leading space is dropped,
    as HF's decode of the generated ids drops it. `prompt_ids` only sets where generation starts
    in `token_ids`. Call `flush()` when the request finishes to emit text held back for an
    incomplete character that never completed (it then ends in U+FFFD, as decode would).
    """

    def __init__(
        self, tokenizer: _Decoder, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = [int(i) for i in prompt_ids]
        self.num_prompt_tokens = len(self.token_ids)
        # Invariant: token_ids[prefix_offset:read_offset] decode to text already emitted, ending on
        # a whole character; the emitted text so far is output_text.
        self.prefix_offset = self.read_offset = self.num_prompt_tokens
        self.output_text = ""
        self._fast = tokenizer.fast_tokenizer if isinstance(tokenizer, Tokenizer) else None
        self._stream = None
        if self._fast is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            self._vocab_size = tokenizer.vocab_size

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (often "", never a partial
        character)."""
        token_id = int(token_id)
        self.token_ids.append(token_id)
        if self._stream is not None and 0 <= token_id < self._vocab_size:
            return self._step_stream(token_id)
        # Out-of-range ids reach decode, which raises; the stream has not seen this id.
        self._stream = None
        return self._advance(hold_incomplete=True)

    def flush(self) -> str:
        """Emit whatever is held back; for a finished request."""
        return self._advance(hold_incomplete=False)

    def _step_stream(self, token_id: int) -> str:
        try:
            delta = self._stream.step(self._fast, token_id)
        except Exception:  # a window whose text rewrote emitted text; decode() takes it as is
            self._stream = None
            return self._advance(hold_incomplete=True)
        if delta is None:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.output_text += delta
        return delta

    def _advance(self, hold_incomplete: bool) -> str:
        emitted = self._decode(self.prefix_offset, self.read_offset)
        window = self._decode(self.prefix_offset, len(self.token_ids))
        if len(window) <= len(emitted):
            return ""
        if hold_incomplete and window.endswith(REPLACEMENT_CHAR):
            return ""
        delta = window[len(emitted) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.output_text += delta
        return delta

    def _decode(self, start: int, stop: int) -> str:
        if start == stop:
            return ""
        return self.tokenizer.decode(
            self.token_ids[start:stop], skip_special_tokens=self.skip_special_tokens
        )
