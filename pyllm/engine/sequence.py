"""One request's state as the engine sees it: tokens, progress through the KV cache,
sampling parameters and output so far."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyllm.sampling.batch import SamplingRow
from pyllm.sampling.params import SamplingParams

if TYPE_CHECKING:
    from pyllm.engine.pooling import PoolingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not scheduled yet, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """A prompt and the tokens generated after it.

    `num_computed_tokens` tokens have their keys/values in the cache (in the blocks of
    `block_table`, and of the other KV groups in `group_block_tables` where the layers
    are grouped (HybridBlockManager), or in arena slot `kv_slot` with the contiguous
    cache); the
    rest are pending. A decode step has one pending token (the last one sampled); a
    prompt has all its tokens pending and may be fed over several steps (chunked
    prefill). After preemption everything is pending again and recomputed.

    With speculative decoding a decode may also carry `spec_token_ids`: tokens proposed
    to follow, not yet part of the sequence. The step computes them after its pending
    token; the engine then keeps the accepted ones and rolls the rest back.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Scheduling: lower priority values run first; sequences of one group (an API
    # request, or a generate call; by default the sequence's own request) share the
    # engine fairly with other groups.
    priority: int = 0
    group: str = ""
    # Order of arrival; unique, so it is also the sequence's key in the sampler.
    arrival: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # served from the prefix cache on first schedule
    block_table: list[int] = field(default_factory=list)
    # With the layers in KV groups (HybridBlockManager): groups 1.. (block_table is 0's).
    group_block_tables: list[list[int]] = field(default_factory=list)
    kv_slot: int | None = None  # contiguous KV cache only
    spec_token_ids: list[int] = field(default_factory=list)  # proposed, for this step only
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_text: str = ""
    # Per generated token: (chosen logprob, {token: logprob} of the top k) when asked.
    logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    # Sum of the generated tokens' logprobs, kept when best_of ranks the samples.
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    # Per prompt position: (logprob of the prompt token there, {token: logprob} of the top
    # k) given the tokens before it; None at position 0 and until computed. The engine sets
    # a list (of len(prompt) Nones) on the one sequence of a request that computes them.
    prompt_logprobs: list[tuple[float, dict[int, float]] | None] | None = None
    # Structured output: the grammar matcher that has seen the output so far.
    matcher: object = None
    error: str | None = None  # why it ended, when finish_reason is "error"
    # An embedding request: prompt only, pooled instead of sampled (engine/pooling.py).
    pooling_params: PoolingParams | None = None
    # False where every prompt token's hidden state is needed (mean pooling): then no
    # prompt token is served from the prefix cache.
    reuse_prefix: bool = True

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.group = self.group or self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        """What a step may compute of it: the rest of its prompt, else its pending tokens
        and any proposed ones. A recomputation (after preemption) computes its output
        tokens in a step of their own: prompt rows and output rows take different
        kernels (ScheduledBatch.add), and each must meet the one it met the first time."""
        if self.num_computed_tokens < self.num_prompt_tokens:
            return self.num_prompt_tokens - self.num_computed_tokens
        return self.num_pending_tokens + len(self.spec_token_ids)

    def step_token_ids(self, start: int, n: int) -> list[int]:
        """The n tokens from position start, proposed ones after the sequence's own."""
        tokens = self.token_ids[start : start + n]
        if len(tokens) < n:
            tokens += self.spec_token_ids[: n - len(tokens)]
        return tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def sampling_row(self) -> SamplingRow:
        """What the sampler needs of this sequence for this step."""
        return SamplingRow(
            self.sampling_params, self.token_ids, self.num_output_tokens, self.arrival, self.matcher
        )
