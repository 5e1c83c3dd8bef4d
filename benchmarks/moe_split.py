"""The two ways to split a mixture-of-experts layer over ranks, timed in one process.

A step's MoE layer ends in an all-reduce, so it takes as long as its slowest rank. For
each split (tensor: every expert's share of the intermediate rows on every rank;
expert: whole experts per rank) this builds each rank's pyllm.model.moe.SparseMoeBlock,
runs them one after another on one thread over the same random batches, and reports
the mean over steps of the slowest rank's time (and the one-process layer's, for
scale). One thread per rank, as `pyllm bench -tp 2` runs on 2 cores; timing the ranks
in turn keeps the machine's other load from one rank's wait on the other.

    python benchmarks/moe_split.py --tokens 1,8,64 --quantization q8_0
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pyllm.model.config import ModelConfig
from pyllm.model.moe import SparseMoeBlock
from pyllm.model.quantize import QUANT_TYPES_BY_NAME, quantize_weight
from pyllm.model.shard import Shard, shard_config


def make_config(args) -> ModelConfig:
    return ModelConfig(
        architecture="qwen3moe", vocab_size=1024, hidden_size=args.hidden,
        intermediate_size=args.inter, num_hidden_layers=1, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_theta=1e6, num_experts=args.experts, num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.inter, norm_topk_prob=True,
    )  # fmt: skip


def build(config: ModelConfig, weights: dict, shard: Shard, dtype, qtype: str | None):
    """The rank's block, its weights cut from the whole layer's (as the loaders cut)."""
    local = shard_config(config, shard)
    block = SparseMoeBlock(local, dtype, "cpu")
    held = local.expert_range
    rows = shard.split(config.moe_intermediate_size) if local.local_experts is None else None
    with torch.no_grad():
        block.gate.weight.copy_(weights["router"])
        for name, proj in zip(("gate", "up", "down"), block.projections(), strict=True):
            w = weights[name][held.start : held.stop]
            if rows is not None:
                w = (
                    w[:, :, rows.start : rows.stop]
                    if name == "down"
                    else w[:, rows.start : rows.stop]
                )
            if qtype is None:
                proj.weight.copy_(w)
            else:
                blocks = torch.stack([quantize_weight(w[e], qtype) for e in range(w.shape[0])])
                proj.set_quantized(blocks, QUANT_TYPES_BY_NAME[qtype])
    return block


def time_steps(blocks, batches) -> list[float]:
    """Per step, the slowest block's seconds."""
    steps = []
    for x in batches:
        times = []
        for block in blocks:
            start = time.perf_counter()
            block(x)
            times.append(time.perf_counter() - start)
        steps.append(max(times))
    return steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=512, help="moe_intermediate_size")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", default="1,8,64", help="tokens per step, comma-separated")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="q8_0", help="q8_0, q4_0, q4_k or none")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    qtype = None if args.quantization == "none" else args.quantization
    config = make_config(args)
    gen = torch.Generator().manual_seed(0)
    E, H, inter = args.experts, args.hidden, args.inter
    weights = {
        "router": torch.randn(E, H, generator=gen).to(dtype) / H**0.5 * 4,
        "gate": torch.randn(E, inter, H, generator=gen).to(dtype) / H**0.5,
        "up": torch.randn(E, inter, H, generator=gen).to(dtype) / H**0.5,
        "down": torch.randn(E, H, inter, generator=gen).to(dtype) / inter**0.5,
    }
    splits = {
        "one process": [build(config, weights, Shard(), dtype, qtype)],
        **{
            name: [
                build(config, weights, Shard(r, args.ranks, ep), dtype, qtype)
                for r in range(args.ranks)
            ]  # fmt: skip
            for name, ep in (("tensor", False), ("expert", True))
        },
    }
    print(
        f"{E} experts, top {args.top_k}, hidden {H}, moe_intermediate_size {inter}, "
        f"{args.dtype}, experts {args.quantization}, {args.ranks} ranks, 1 thread each"
    )
    print("tokens | " + " | ".join(f"{name} ms" for name in splits))
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            batches = [torch.randn(tokens, H, generator=gen).to(dtype) for _ in range(args.steps)]
            for blocks in splits.values():  # warm up
                time_steps(blocks, batches[:5])
            means = {}
            for _ in range(3):  # interleaved rounds: the machine's load hits each split alike
                for name, blocks in splits.items():
                    means.setdefault(name, []).append(statistics.fmean(time_steps(blocks, batches)))
            cells = [f"{1e3 * statistics.median(m):.3f}" for m in means.values()]
            print(f"{tokens} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
