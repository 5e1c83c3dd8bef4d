"""How many tokens to propose to a sequence this step: the length that makes the most
tokens per unit of step cost, from what the sequence accepted of its own proposals.

If each proposed token is accepted with probability a until the first rejection, a
proposal of k tokens emits (1 - a^(k+1)) / (1 - a) tokens, in a step that costs about
1 + ROW_COST * k plain decode steps. The best k grows with a: on the CPU's costs, k = 0
(no proposal) below a ~ 0.25, 1 up to ~0.55, 2 up to ~0.7, 4 from ~0.85. a is estimated per sequence
from its recent proposals (each accepted token a success, a rejection a failure),
pulled toward a hopeful prior so that a new sequence speculates at once and one that
stopped tries again after a while.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a verified row adds to a batch-1 decode step, as a share of the step: 5 rows of
# kept quantized weights cost ~2x one row on the CPU (benchmarks/quant_linear.py).
ROW_COST = 0.25
# The prior: 1.5 accepted of 2 tries (a = 0.75), worth two proposals of evidence.
PRIOR_ACCEPTED, PRIOR_TRIES = 1.5, 2.0
# Each observation (or step without a proposal) keeps this share of the older evidence.
DECAY = 0.9


def emitted_per_cost(a: float, k: int) -> float:
    """Expected tokens a step emits per plain step's cost, proposing k tokens."""
    emitted = k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
    return emitted / (1.0 + ROW_COST * k)


def best_length(a: float, most: int) -> int:
    """The k in [0, most] with the most tokens per cost (0: propose nothing)."""
    return max(range(most + 1), key=lambda k: (emitted_per_cost(a, k), -k))


@dataclass(slots=True)
class AcceptanceRecord:
    """A sequence's decayed counts of accepted tokens and of tries (accepted tokens plus
    rejections), and the proposal it is waiting to hear about."""

    accepted: float = 0.0
    tries: float = 0.0
    proposed: list[int] | None = None  # the last proposal
    position: int = 0  # the position of its first token

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_ACCEPTED) / (self.tries + PRIOR_TRIES)

    def observe(self, token_ids: list[int]) -> None:
        """Counts the last proposal against the tokens the sequence now holds."""
        proposed, self.proposed = self.proposed, None
        if not proposed:
            return
        emitted = token_ids[self.position : self.position + len(proposed)]
        accepted = 0
        while accepted < len(emitted) and emitted[accepted] == proposed[accepted]:
            accepted += 1
        rejected = 1 if accepted < len(proposed) and accepted < len(emitted) else 0
        self.accepted = DECAY * self.accepted + accepted
        self.tries = DECAY * self.tries + accepted + rejected

    def idle(self) -> None:
        """A step without a proposal: older evidence fades, toward trying again."""
        self.accepted *= DECAY
        self.tries *= DECAY
