"""Step 3 of sampling, the draw: one uniform number per sequence picks a token by inverse
CDF over the kept probabilities in token-id order, so ties cannot reorder it.

Reproducibility: a request with a seed draws from its own CPU torch.Generator, advanced
once per sampled step of that sequence only, and its row is computed row-wise, so its
tokens are the same whatever else is in the batch and in whatever order requests arrive.
Unseeded requests share one generator seeded from the OS.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from pyllm.sampling.batch import SamplingBatch, SamplingRow

# Chunk length of the two-level inverse CDF (see inverse_cdf). About sqrt(vocab), and
# small enough that the per-chunk work of up to 128 rows stays below torch's 32768-element
# grain (one thread, no wake-up cost).
CHUNK = 256


class Generators:
    """The uniforms' sources: one shared generator, and one per seeded sequence (by its
    row's key) until forget()."""

    def __init__(self, seed: int | None = None) -> None:
        # Unseeded requests share this generator; seed it from the OS unless told otherwise.
        self.shared = torch.Generator()
        if seed is None:
            self.shared.seed()
        else:
            self.shared.manual_seed(seed)
        self.seeded: dict[Hashable, torch.Generator] = {}

    def forget(self, key: Hashable) -> None:
        self.seeded.pop(key, None)

    def uniforms(self, batch: SamplingBatch) -> torch.Tensor:
        """One uniform in [0, 1) per row (float64, on the CPU): from the sequence's own
        generator when it has a seed, else from the shared one."""
        uniforms = torch.empty(len(batch), dtype=torch.float64)
        unseeded = [i for i, row in enumerate(batch) if row.params.seed is None]
        if unseeded:
            draws = torch.rand(len(unseeded), generator=self.shared, dtype=torch.float64)
            uniforms[unseeded] = draws
        for i, row in enumerate(batch):
            if row.params.seed is not None:
                uniforms[i] = torch.rand(1, generator=self._seeded(row), dtype=torch.float64)
        return uniforms

    def _seeded(self, row: SamplingRow) -> torch.Generator:
        generator = self.seeded.get(row.key)
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(row.params.seed)
            self.seeded[row.key] = generator
        return generator


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative weight exceeds uniform * total weight: a draw
    proportional to the weights, in token-id order, so ties cannot reorder it.

    weights: [rows, vocab] >= 0, each row with a positive entry; uniforms: [rows] float64 in
    [0, 1). Two levels, chunk masses then the prefix sums of one chunk, so the row is read
    once rather than prefix-summed whole; sums are float64. Targets are clamped below each
    total so rounding can never land past the last positive weight: the chosen token always
    has a positive weight.
    """
    num_rows, vocab = weights.shape
    chunk_cdf = chunk_mass(weights).double().cumsum(-1)  # [rows, chunks]
    target = (uniforms * chunk_cdf[:, -1])[:, None]
    target = torch.minimum(target, _below(chunk_cdf[:, -1:]))
    chunk = torch.searchsorted(chunk_cdf, target, right=True)  # [rows, 1]
    mass_before = chunk_cdf.gather(1, (chunk - 1).clamp(min=0))
    target = target - torch.where(chunk > 0, mass_before, torch.zeros_like(mass_before))
    columns = chunk * CHUNK + torch.arange(CHUNK, device=weights.device)  # [rows, CHUNK]
    local = weights.gather(1, columns.clamp(max=vocab - 1)).double()
    local_cdf = torch.where(columns < vocab, local, torch.zeros_like(local)).cumsum(-1)
    target = torch.minimum(target, _below(local_cdf[:, -1:]))
    offset = torch.searchsorted(local_cdf, target, right=True)
    return (chunk * CHUNK + offset).squeeze(1)


def inverse_cdf_exact(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """inverse_cdf for narrow float64 weights [rows, C], as [rows, 1] indices: one
    sequential prefix sum per row. Zero weights add exactly nothing to it, so the pick does
    not depend on how many zero columns surround the kept tokens (how many blocks the
    batch gathered)."""
    cdf = weights.cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None] * total, _below(total))
    return torch.searchsorted(cdf, target, right=True)


def chunk_mass(weights: torch.Tensor) -> torch.Tensor:
    """[rows, ceil(vocab / CHUNK)]: the sum of each chunk of CHUNK columns (the last one
    possibly partial). Each chunk is one reduction of its own, so a row's sums are the same
    whatever other rows the tensor holds (a whole-row sum may be split across threads when
    there is a single row, and round differently)."""
    whole = weights.shape[1] // CHUNK * CHUNK
    mass = weights[:, :whole].unflatten(1, (-1, CHUNK)).sum(-1)
    if whole < weights.shape[1]:
        mass = torch.cat([mass, weights[:, whole:].sum(-1, keepdim=True)], dim=1)
    return mass


def _below(x: torch.Tensor) -> torch.Tensor:
    """The largest float64 below x (x > 0)."""
    return torch.nextafter(x, torch.zeros_like(x))
