"""AttentionMetadata: what every KV-cache layout says of a step's flat batch, and the
checks the layouts share. Each backend subclasses it with how it addresses sequences."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token of the step lives in the KV cache.

    slot_mapping: [T] int64, where each token's key and value go (-1 skips); what a
    slot number means is the layout's.
    Prefill part (P sequences, the first num_prefill_tokens tokens):
      prefill_query_start_loc [P + 1] int32, prefill_seq_lens [P] int32 (tokens cached
      after this step, earlier chunks included), max_query_len.
    Decode part (D sequences, one token each, the remaining T - num_prefill_tokens):
      decode_seq_lens [D] int32, max_decode_seq_len.
    """

    slot_mapping: torch.Tensor
    num_prefill_tokens: int
    prefill_query_start_loc: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None
    max_query_len: int = 0
    decode_seq_lens: torch.Tensor | None = None
    max_decode_seq_len: int = 0
    # Of the prefill part, the first num_prompt_tokens tokens are prompt tokens (the
    # model computes them alike however the prompt was split: StepBuffers.prompt_rows).
    num_prompt_tokens: int = 0
    # The prefill part's other rows, [num_prompt_tokens, num_prefill_tokens): proposals
    # to verify, tokens computed again after preemption. Each attends as a decode
    # token at its position does, so that a generated token's row computes alike in
    # any step (verify_rows). Set by the backend's build: the sequences of the prompt
    # rows, each verify row's length up to itself [V] int32 (None: no such rows, or
    # the prefill kernel takes them with the prompt rows).
    num_prompt_seqs: int = 0
    verify_seq_lens: torch.Tensor | None = None

    @property
    def backend(self):
        """The AttentionBackend that runs attention in this metadata's layout (each
        layout's subclass names its own)."""
        raise NotImplementedError

    def group(self, g: int) -> AttentionMetadata:
        """The step as KV group g's layers address it (one group: this)."""
        return self

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_decode_tokens(self) -> int:
        return self.num_tokens - self.num_prefill_tokens

    @property
    def num_verify_tokens(self) -> int:
        return 0 if self.verify_seq_lens is None else self.verify_seq_lens.shape[0]

    def prompt_part(self, addressing: torch.Tensor):
        """(rows, addressing, seq_lens, query_start_loc) of the prefill kernel's call: the
        first rows and their sequences (addressing: the layout's tensor of the prefill
        sequences), every prefill row, or the prompt chunks' where verify rows follow."""
        lens, starts = self.prefill_seq_lens, self.prefill_query_start_loc
        if self.verify_seq_lens is None:
            return self.num_prefill_tokens, addressing, lens, starts
        n = self.num_prompt_seqs
        return self.num_prompt_tokens, addressing[:n], lens[:n], starts[: n + 1]

    def decode_parts(self, verify: torch.Tensor | None, decode: torch.Tensor):
        """(first row, last row, addressing, seq_lens) of each decode kernel call, the
        verify rows' and the decodes', those with rows; verify and decode: the layout's
        addressing of each."""
        P, T = self.num_prefill_tokens, self.num_tokens
        parts = [(P, T, decode, self.decode_seq_lens)]
        if self.verify_seq_lens is not None:
            parts.insert(0, (self.num_prompt_tokens, P, verify, self.verify_seq_lens))
        return [part for part in parts if part[0] < part[1]]

    def check_tokens(self, device: torch.device) -> None:
        """slot_mapping's type, num_prefill_tokens's and num_prompt_tokens's ranges
        (every layout's first checks)."""
        T, P = self.num_tokens, self.num_prefill_tokens
        index_tensor("slot_mapping", self.slot_mapping, torch.int64, 1, device)
        if not 0 <= P <= T:
            raise ValueError(f"num_prefill_tokens must lie in [0, {T}], got {P}")
        if not 0 <= self.num_prompt_tokens <= P:
            raise ValueError(
                f"num_prompt_tokens must lie in [0, {P}] (num_prefill_tokens), "
                f"got {self.num_prompt_tokens}"
            )


def index_tensor(
    name: str, t: torch.Tensor | None, dtype: torch.dtype, ndim: int, device: torch.device
) -> torch.Tensor:
    """t itself if it is a contiguous ndim-D dtype tensor on device; else ValueError."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.dim() != ndim or t.device != device or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {ndim}-D {dtype} tensor on {device}, got "
            f"{t.dtype} {tuple(t.shape)} on {t.device}"
            + ("" if t.is_contiguous() else " (not contiguous)")
        )
    return t


def verify_rows(meta: AttentionMetadata) -> torch.Tensor | None:
    """Sets meta's num_prompt_seqs and verify_seq_lens, and max_decode_seq_len to cover
    them; returns each verify row's prefill sequence (int64 [V]), from which the layout
    addresses them. None (nothing set) where every prefill row is a prompt token.

    Why decode attention: kept quantized weights quantize each row's activations to int8,
    which turns the last-bit differences between the prefill and decode kernels into
    different tokens (the bundled SmolLM2 in float32: a proposal's verified logprob
    -0.7000 against decode's -0.6924), so speculative decoding and recomputation after
    preemption would part from plain decoding."""
    A, P = meta.num_prompt_tokens, meta.num_prefill_tokens
    if A == P:
        return None
    ends = meta.prefill_query_start_loc[1:]
    rows = torch.arange(A, P, dtype=torch.int32, device=ends.device)
    seqs = torch.searchsorted(ends, rows, right=True)
    meta.num_prompt_seqs = int((ends <= A).sum())
    meta.verify_seq_lens = meta.prefill_seq_lens[seqs] - ends[seqs] + rows + 1
    meta.max_decode_seq_len = max(meta.max_decode_seq_len, int(meta.verify_seq_lens.max()))
    return seqs
