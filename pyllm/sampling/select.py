"""Exact argmax and small top-k over long rows, by block maxima.

torch's CPU argmax and topk do scalar work per element (several times slower than a max
reduction over a [64, 49152] row set). Block maxima, a fast vectorized reduction, narrow
the search to a few blocks first; the answers are exactly those of the whole rows.
"""

from __future__ import annotations

import torch

# Rows are read in blocks of BLOCK for argmax and small top-k: block maxima first.
BLOCK = 128


def block_maxima(x: torch.Tensor) -> torch.Tensor:
    """[rows, ceil(n / BLOCK)]: the max of each block of BLOCK columns (the last one
    possibly partial)."""
    whole = x.shape[1] // BLOCK * BLOCK
    maxima = x[:, :whole].unflatten(1, (-1, BLOCK)).amax(-1)
    if whole < x.shape[1]:
        maxima = torch.cat([maxima, x[:, whole:].amax(-1, keepdim=True)], dim=1)
    return maxima


def gather_blocks(x: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The columns of the given blocks [rows, b] and x's values there, -inf past the row."""
    columns = (blocks[:, :, None] * BLOCK + torch.arange(BLOCK, device=x.device)).flatten(1)
    values = x.gather(1, columns.clamp(max=x.shape[1] - 1))
    return columns, torch.where(columns < x.shape[1], values, float("-inf"))


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) (the first index of each row's max): the first block holding the row
    max, then the first max inside it. A row or two take torch's argmax: one op costs
    less than the block search's ten where a step's weights have just flushed the
    caches (SmolLM2 decode, 2 cores: 0.08 against 0.14 ms a step)."""
    rows, n = x.shape
    if n < 4 * BLOCK or rows <= 2:
        return x.argmax(-1)
    if n % BLOCK or not x.is_contiguous():
        block = block_maxima(x).argmax(-1)
        columns, values = gather_blocks(x, block[:, None])
        return columns.gather(1, values.argmax(-1, keepdim=True)).squeeze(1)
    # Whole blocks: each row's first max block, picked out of the [rows * blocks, BLOCK] view.
    per_row = n // BLOCK
    block = x.view(rows, per_row, BLOCK).amax(-1).argmax(-1)
    starts = torch.arange(0, rows * per_row, per_row, device=x.device)
    inner = x.view(-1, BLOCK).index_select(0, block + starts).argmax(-1)
    return block * BLOCK + inner


def small_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x.topk(k, -1) for small k: the k largest values lie in the k blocks with the largest
    maxima (a block holding one of them has a max at least that large), so only those
    blocks are searched. Values are exactly topk's; among tied values the ids may differ."""
    if x.shape[1] < 8 * BLOCK * k:
        return x.topk(k, dim=-1)
    columns, values = gather_blocks(x, block_maxima(x).topk(k, dim=-1).indices)
    top_values, where = values.topk(k, dim=-1)
    if bool((top_values[:, -1] == float("-inf")).any()):
        # Fewer than k finite values: a -inf padding column past the row could be picked.
        return x.topk(k, dim=-1)
    return top_values, columns.gather(1, where)
