"""The collectives a rank's part of the model needs (which part it holds:
pyllm.model.shard), and the error of a lost rank."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from pyllm.model.shard import Shard


class WorkerLostError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot go on."""


class TensorParallelGroup:
    """The ranks of one model. `group` carries the step's data with a bounded timeout;
    `control` carries the command that starts a step, with none to speak of, since a
    worker waits on it for as long as the engine is idle."""

    def __init__(self, shard: Shard, group, control, device: torch.device) -> None:
        self.shard, self.group, self.control, self.device = shard, group, control, device

    @property
    def rank(self) -> int:
        return self.shard.rank

    def split_experts(self, expert_parallel: bool) -> None:
        """Whole experts per rank (expert parallelism), or every expert's share (the
        default): set from the engine's options before the model is built."""
        self.shard = dataclasses.replace(self.shard, expert_parallel=expert_parallel)

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def gather_columns(self, local: torch.Tensor, width: int) -> torch.Tensor | None:
        """Rank 0: the ranks' [N, per] pieces side by side, cut to `width` columns;
        other ranks: None."""
        local = local.contiguous()
        if self.rank:
            dist.gather(local, None, dst=0, group=self.group)
            return None
        pieces = [torch.empty_like(local) for _ in range(self.size)]
        dist.gather(local, pieces, dst=0, group=self.group)
        return torch.cat(pieces, dim=1)[:, :width]
