"""fused_moe on random blocks in real MoE layer shapes, beside quant_linear on a dense
layer of the same bytes (the rate at which this machine streams quantized weights).

    PYTHONPATH=. python benchmarks/bench_moe.py                          # every case
    PYTHONPATH=. python benchmarks/bench_moe.py --shapes qwen3-30b-a3b --types Q4_K_M \\
        --tokens 1,512 --dtypes bfloat16
    PYTHONPATH=. python benchmarks/bench_moe.py --device cuda

Shapes: qwen3-30b-a3b (hidden 2048, expert FFN 768, 128 experts, top 8, silu) and
gpt-oss-20b (hidden 2880, expert FFN 2880, 32 experts, top 4, swigluoai with biases).
Types: Q4_K_M (llama.cpp's mix for experts: Q4_K gate/up, Q6_K down), Q8_0, Q4_0, and
MXFP4 where ops.QUANT_TYPES has it; --strips packs the types with strips
(ops.pack_strips) on both sides, as the GGUF loader does on AVX2 and AVX-512 builds.

Per case: the time per call over several routings (at 1 token each routing picks
top_k experts no neighbouring call uses, so their weights come from memory, not the
caches): each call's fastest of --passes passes, averaged over the routings, in ms;
the bytes of expert weights a call must read (the union of the experts its tokens
chose, averaged over the routings) and the rate that makes, against the rate of a sum
over a 1 GiB tensor (a plain stream, without the quantized kernels' prefetching) and
against quant_linear on the dense equivalent, the rate this machine streams quantized
weights at: gate/up [2 top_k I, H] and down [H, top_k I] of the same types at the same
rows (top_k experts' bytes, the same rows x weights), also cycled through copies
larger than the caches. On the CPU, the share of each phase (fused_moe's own timer,
PYLLM_MOE_PROFILE): routing, grouping with the activations' quantization, gate/up
products (with the activation), down products, combine.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_timing import call_times, sync  # noqa: E402

import pyllm.ops as ops  # noqa: E402


@dataclass(frozen=True)
class MoeShape:
    hidden: int
    inter: int
    experts: int
    top_k: int
    activation: str
    biases: bool


SHAPES = {
    "qwen3-30b-a3b": MoeShape(2048, 768, 128, 8, "silu", False),
    "gpt-oss-20b": MoeShape(2880, 2880, 32, 4, "swigluoai", True),
}
# --types -> (gate/up type, down type)
TYPE_MIXES = {
    "Q4_K_M": ("Q4_K", "Q6_K"),
    "Q8_0": ("Q8_0", "Q8_0"),
    "Q4_0": ("Q4_0", "Q4_0"),
    "MXFP4": ("MXFP4", "MXFP4"),
}
PHASES = ("routing", "group+quant", "gate/up", "down", "combine")
CACHE_BYTES = 256 << 20  # cycled weights span at least this much (far past any L3)


def random_blocks(type_name: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """uint8 [rows, row bytes] of valid random blocks (make_gguf's generator where it
    has one, else random quants under a small scale)."""
    import make_gguf

    type_id, block, nbytes = ops.QUANT_TYPES[type_name]
    n_blocks = rows * cols // block
    rng = np.random.default_rng(seed)
    try:
        blocks = make_gguf.RandomBlocks(make_gguf.Q(type_id), seed)(rng, n_blocks)
    except ValueError:
        blocks = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
        if type_name == "MXFP4":
            blocks[:, 0] = rng.integers(118, 122, n_blocks)  # E8M0 exponents near 2^-7
        else:
            raise
    return torch.from_numpy(np.ascontiguousarray(blocks).reshape(rows, -1))


def expert_weights(shape: MoeShape, mix: str, device: str, seed: int = 0, strips=False):
    """(w_gate, w_up, w_down), (gate/up type id, down type id); strips: the types with
    strips packed (ops.pack_strips), as the GGUF loader packs them."""
    gate_type, down_type = TYPE_MIXES[mix]
    E, H, inter = shape.experts, shape.hidden, shape.inter
    w_gate = random_blocks(gate_type, E * inter, H, seed).view(E, inter, -1)
    w_up = random_blocks(gate_type, E * inter, H, seed + 1).view(E, inter, -1)
    w_down = random_blocks(down_type, E * H, inter, seed + 2).view(E, H, -1)
    ids = (ops.QUANT_TYPES[gate_type][0], ops.QUANT_TYPES[down_type][0])
    weights = [w_gate, w_up, w_down]
    if strips:
        weights = [packed(w, i) for w, i in zip(weights, (ids[0], ids[0], ids[1]), strict=True)]
        ids = tuple(ops.STRIPS_TYPES.get(i, i) for i in ids)
    return [w.to(device) for w in weights], ids


def packed(weight: torch.Tensor, type_id: int) -> torch.Tensor:
    """The weight in strips where its type has them."""
    return ops.pack_strips(weight, type_id) if type_id in ops.STRIPS_TYPES else weight


def routings(shape: MoeShape, tokens: int, count: int, device: str) -> list[torch.Tensor]:
    """Router logits for `count` calls. One token: each call's top_k experts are ones
    no call among the previous E / top_k - 1 chose (a fresh permutation in turn)."""
    E, k = shape.experts, shape.top_k
    logits = []
    gen = torch.Generator().manual_seed(tokens)
    if tokens == 1:
        order = torch.cat([torch.randperm(E, generator=gen) for _ in range(-(-count * k // E))])
        for i in range(count):
            row = torch.randn(1, E, generator=gen)
            row[0, order[i * k : (i + 1) * k]] += 20.0
            logits.append(row)
    else:
        logits = [torch.randn(tokens, E, generator=gen) for _ in range(count)]
    return [x.to(device) for x in logits]


def touched_bytes(shape: MoeShape, weights, logits: list[torch.Tensor]) -> float:
    """Mean bytes of the experts the calls' tokens chose (each read once per call)."""
    per_expert = sum(w[0].numel() * w.element_size() for w in weights)
    counts = [
        torch.unique(x.float().cpu().topk(shape.top_k, dim=-1).indices).numel() for x in logits
    ]
    return per_expert * statistics.mean(counts)


def read_bandwidth(device: str) -> float:
    """Bytes per second of a sum over a 1 GiB float32 tensor (the best of 5)."""
    x = torch.ones(1 << 28, device=device)
    seconds = min(call_times(lambda: x.sum(), device, min_time=0, min_repeats=5, max_repeats=5))
    return x.numel() * 4 / seconds


def cycled(calls, device: str, passes: int, clock=time.perf_counter) -> float:
    """Seconds per call: passes in turn over `calls` (each a no-argument fn, its weights
    last read a whole pass before), each call's fastest pass, averaged over the calls.
    The fastest of several passes keeps what other processes on the machine cost out;
    so does clock=time.process_time (this process's CPU time, all its threads)."""
    for fn in calls:  # warm-up pass
        fn()
    sync(device)
    best = [math.inf] * len(calls)
    for _ in range(passes):
        for i, fn in enumerate(calls):
            start = clock()
            fn()
            sync(device)
            best[i] = min(best[i], clock() - start)
    return statistics.mean(best)


def dense_calls(shape: MoeShape, weights, ids, tokens: int, dtype, device: str):
    """quant_linear over the dense equivalent of top_k experts, in copies that together
    exceed CACHE_BYTES, one copy per call."""
    k, H, inter = shape.top_k, shape.hidden, shape.inter
    w_gate, _, w_down = weights
    gate_up = torch.cat([w_gate[:k].reshape(k * inter, -1)] * 2)
    plain = {strips: i for i, strips in ops.STRIPS_TYPES.items()}.get(ids[1], ids[1])
    down_name = next(name for name, (i, _, _) in ops.QUANT_TYPES.items() if i == plain)
    down = random_blocks(down_name, H, k * inter, 7)
    down = (packed(down, plain) if plain != ids[1] else down).to(device)
    copy_bytes = gate_up.numel() + down.numel()
    copies = [(gate_up, down)] + [
        (gate_up.clone(), down.clone()) for _ in range(max(1, CACHE_BYTES // copy_bytes))
    ]
    x = torch.randn(tokens, H, device=device).to(dtype)
    mid = torch.randn(tokens, k * inter, device=device).to(dtype)
    y_mid = torch.empty(tokens, 2 * k * inter, device=device, dtype=dtype)
    y = torch.empty(tokens, H, device=device, dtype=dtype)

    def call(gu, dn):
        return lambda: (
            torch.ops.pyllm.quant_linear(y_mid, x, gu, ids[0], None),
            torch.ops.pyllm.quant_linear(y, mid, dn, ids[1], None),
        )

    return [call(gu, dn) for gu, dn in copies], copy_bytes


def moe_calls(shape: MoeShape, weights, ids, logits, dtype, device: str):
    w_gate, w_up, w_down = weights
    E, H = shape.experts, shape.hidden
    biases = (None, None, None)
    if shape.biases:
        biases = tuple(
            torch.randn(E, n, device=device).to(dtype) / 10 for n in (shape.inter,) * 2 + (H,)
        )
    tokens = logits[0].shape[0]
    x = torch.randn(tokens, H, device=device).to(dtype)
    out = torch.empty(tokens, H, device=device, dtype=dtype)

    def call(lg):
        return lambda: torch.ops.pyllm.fused_moe(
            out, x, lg, shape.top_k, True, w_gate, w_up, w_down, ids[0], ids[0], ids[1],
            *biases, shape.activation, 1.702, 7.0, 0,
        )  # fmt: skip

    return [call(lg) for lg in logits]


def phase_shares(calls, repeats: int) -> list[float] | None:
    """Each phase's share of fused_moe's time over `repeats` passes of `calls`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "phases.txt")
        os.environ["PYLLM_MOE_PROFILE"] = path
        try:
            for _ in range(repeats):
                for fn in calls:
                    fn()
        finally:
            del os.environ["PYLLM_MOE_PROFILE"]
        if not os.path.exists(path):
            return None
        rows = np.loadtxt(path, ndmin=2)
    totals = rows.sum(axis=0)
    return list(totals / totals.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b,gpt-oss-20b")
    parser.add_argument("--types", default=None, help="default: Q4_K_M,Q8_0 / MXFP4 or Q8_0,Q4_0")
    parser.add_argument("--tokens", default="1,8,32,512")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--routings", type=int, default=16, help="routings cycled per case")
    parser.add_argument("--passes", type=int, default=5, help="timed passes over the routings")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU time (with one thread, robust on a shared machine)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-dense", action="store_true", help="skip the quant_linear side")
    parser.add_argument(
        "--strips", action="store_true", help="weights in strips where they have them"
    )
    args = parser.parse_args()
    device = args.device
    bandwidth = read_bandwidth(device)
    cpu = platform.processor() or platform.machine()
    print(f"# {cpu}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"device {device}, clock {args.clock}, "
          f"1 GiB tensor sum {bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        if args.types:
            mixes = args.types.split(",")
        elif shape_name == "gpt-oss-20b":
            mixes = ["MXFP4"] if "MXFP4" in ops.QUANT_TYPES else ["Q8_0", "Q4_0"]
        else:
            mixes = ["Q4_K_M", "Q8_0"]
        for mix in mixes:
            blocks = [ops.QUANT_TYPES[t][1] for t in TYPE_MIXES[mix] if t in ops.QUANT_TYPES]
            if len(blocks) < 2 or any(shape.hidden % b or shape.inter % b for b in blocks):
                print(f"## {shape_name} {mix}: skipped (a type this build lacks, or a block "
                      f"that does not divide the layer's sizes)")  # fmt: skip
                continue
            weights, ids = expert_weights(shape, mix, device, strips=args.strips)
            layer_bytes = sum(w.numel() for w in weights)
            print(f"## {shape_name} {mix}: {shape.experts} experts, top {shape.top_k}, "
                  f"{layer_bytes / 2**20:.0f} MiB per layer")  # fmt: skip
            for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
                for tokens in [int(t) for t in args.tokens.split(",")]:
                    bench_case(shape, weights, ids, tokens, dtype, device, args, bandwidth)
            del weights


def bench_case(shape, weights, ids, tokens, dtype, device, args, bandwidth) -> None:
    # Many tokens touch every expert: a few routings suffice.
    count = args.routings if tokens <= 32 else 4
    if tokens == 1:
        count = max(count, shape.experts // shape.top_k)
    logits = routings(shape, tokens, count, device)
    nbytes = touched_bytes(shape, weights, logits)
    calls = moe_calls(shape, weights, ids, logits, dtype, device)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    seconds = cycled(calls, device, args.passes, clock)
    line = (
        f"{str(dtype).removeprefix('torch.'):8} T {tokens:4}: fused_moe {seconds * 1e3:8.3f} ms"
        f" {nbytes / 2**20:6.1f} MiB {nbytes / seconds / 1e9:5.1f} GB/s"
        f" ({nbytes / seconds / bandwidth:4.0%} of sum)"
    )
    if not args.no_dense:
        dense, dense_bytes = dense_calls(shape, weights, ids, tokens, dtype, device)
        dense_seconds = cycled(dense, device, args.passes, clock)
        line += (
            f" | dense quant_linear {dense_seconds * 1e3:8.3f} ms"
            f" {dense_bytes / dense_seconds / 1e9:5.1f} GB/s;"
            f" moe/dense time {seconds / dense_seconds:4.2f}x,"
            f" rate {nbytes / seconds / (dense_bytes / dense_seconds):4.0%}"
        )
        del dense
    if device == "cpu":
        shares = phase_shares(calls, max(1, math.ceil(0.3 / seconds / len(calls))))
        if shares is not None:
            line += " | " + " ".join(f"{p} {s:4.0%}" for p, s in zip(PHASES, shares, strict=True))
    print(line, flush=True)


if __name__ == "__main__":
    main()
