"""Which part of the model a rank holds (Megatron-style): the split rules the model
and its loaders follow. The collectives that join the parts live in pyllm.distributed.

Column-parallel (each rank a range of output features): q/k/v and gate/up, the
embedding and the LM head (vocabulary rows). Row-parallel (a range of input features,
outputs summed by one all-reduce): o_proj and down_proj. Norms are replicated. With
fewer KV heads than ranks each rank keeps the one KV head its query heads read, so
KV heads are replicated (vLLM's rule: the rank count must then be a multiple of them).

Experts (pyllm.model.moe): by default split as the MLP is, each rank holding every
expert's share of moe_intermediate_size (gate/up column-parallel, down row-parallel),
the router replicated. With expert_parallel each rank holds num_experts / size whole
experts instead; either way the layer's output meets in one all-reduce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from pyllm.model.linear import Linear
from pyllm.model.moe import SparseMoeBlock

# The projections whose ranks hold a range of input features: their outputs are summed.
ROW_PARALLEL = (".o_proj", ".down_proj")


@dataclass(frozen=True)
class Shard:
    """This process's part of the model: rank `rank` of `size` (size 1: all of it)."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # whole experts per rank instead of a share of each

    def split(self, n: int) -> range:
        """The rank's even range of n (n divisible by size)."""
        per = n // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def padded_split(self, n: int) -> tuple[range, int]:
        """(the rank's range of n, rows it allocates): ceil(n / size) rows each, the last
        rank's range cut at n (vocabularies need not divide)."""
        per = -(-n // self.size)
        start = min(n, self.rank * per)
        return range(start, min(n, start + per)), per

    def kv_heads(self, num_kv_heads: int) -> range:
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        head = self.rank * num_kv_heads // self.size
        return range(head, head + 1)


def check_tensor_parallel(config, size: int, expert_parallel: bool = False) -> None:
    """Raises ValueError if the model cannot be split over `size` ranks."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    inter = config.intermediate_size
    problems = []
    if heads % size:
        problems.append(f"num_attention_heads ({heads})")
    if kv % size and size % kv:
        problems.append(f"num_key_value_heads ({kv}; or a multiple of it)")
    if inter % size and (not config.num_experts or config.has_dense_layers):
        problems.append(f"intermediate_size ({inter})")
    if config.num_experts and expert_parallel and config.num_experts % size:
        problems.append(f"num_experts ({config.num_experts}, expert parallel)")
    moe_inter = config.moe_intermediate_size
    if config.num_experts and not expert_parallel and moe_inter % size:
        problems.append(f"moe_intermediate_size ({moe_inter})")
    if problems:
        raise ValueError(
            f"tensor_parallel_size {size} must divide {', '.join(problems)} of "
            f"{config.source or 'the model'}"
        )


def shard_config(config, shard: Shard):
    """The per-rank shapes of the attention and MLP layers."""
    if shard.size == 1:
        return config
    experts = {}
    if config.num_experts and shard.expert_parallel:
        held = shard.split(config.num_experts)
        experts = {"local_experts": (held.start, held.stop)}
    elif config.num_experts:
        experts = {"moe_intermediate_size": config.moe_intermediate_size // shard.size}
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // shard.size,
        num_key_value_heads=len(shard.kv_heads(config.num_key_value_heads)),
        intermediate_size=config.intermediate_size // shard.size,
        **experts,
    )


def set_reductions(model: nn.Module, all_reduce: Callable) -> None:
    """Gives every module whose ranks' outputs are partial sums (row-parallel
    projections, sparse MLPs) the all-reduce that completes them."""
    for name, module in model.named_modules():
        row_parallel = isinstance(module, Linear) and name.endswith(ROW_PARALLEL)
        if row_parallel or isinstance(module, SparseMoeBlock):
            module.reduce = all_reduce
