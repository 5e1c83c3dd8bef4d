"""Times pyllm's kernels and prints a table; decode attention is reported as bandwidth.

    python benchmarks/bench_ops.py                  # CPU, all threads torch uses
    python benchmarks/bench_ops.py --device cuda    # on a GPU build

Decode attention is memory bound: every step reads each sequence's whole KV cache
once. Its figure is bytes moved (KV read once + query + output) per second, printed
next to the copy bandwidth this machine reached in the same run (a large tensor copy,
counting read + write), so the ratio survives a noisy machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from collections.abc import Callable

import torch
from bench_timing import call_times

import pyllm.ops as ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Published peak HBM3e bandwidth of one H200.
H200_PEAK_GBS = 4800.0


def time_call(fn: Callable[[], None], device: str, min_time: float = 0.3, warmup: int = 2) -> float:
    """Median seconds per call over enough repeats to fill min_time."""
    return statistics.median(call_times(fn, device, min_time, warmup=warmup))


def copy_bandwidth(device: str, megabytes: int = 512) -> float:
    """GB/s of a large tensor copy, counting bytes read plus bytes written."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, min_time=0.5)
    return 2 * src.numel() * 4 / seconds / 1e9


def make_decode_case(args, batch: int, context: int):
    """Random paged KV for `batch` sequences of `context` tokens, blocks shuffled."""
    dtype, device = DTYPES[args.dtype], args.device
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    key_cache, value_cache = ops.allocate_kv_cache(
        num_blocks, args.num_kv_heads, args.head_size, args.block_size, dtype, device
    )
    key_cache.uniform_(-1, 1)
    value_cache.uniform_(-1, 1)
    block_tables = torch.randperm(num_blocks, device=device, dtype=torch.int64)
    block_tables = block_tables.to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, args.num_heads, args.head_size, dtype=dtype, device=device)
    out = torch.empty_like(query)
    return key_cache, value_cache, block_tables, seq_lens, query, out


def bench_decode_case(args, batch: int, context: int, copy_gbs: float) -> list[dict]:
    """Times v1 and v2 on one (batch, context) case."""
    element = DTYPES[args.dtype].itemsize
    kc, vc, tables, lens, q, out = make_decode_case(args, batch, context)
    kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_size * element
    moved = kv_bytes + 2 * q.numel() * element
    exp_sums, max_logits, tmp_out = ops.paged_attention_v2_workspace(q, context)
    scale = args.head_size**-0.5
    common = (kc, vc, args.num_kv_heads, scale, tables, lens, args.block_size, context, None)
    variants = {
        "v1": lambda: torch.ops.pyllm.paged_attention_v1(out, q, *common),
        "v2": lambda: torch.ops.pyllm.paged_attention_v2(
            out, exp_sums, max_logits, tmp_out, q, *common
        ),
    }
    if args.sinks:
        # The same calls with attention sinks (one logit per head, folded into the
        # final normalization).
        sinks = torch.randn(args.num_heads, dtype=torch.float32, device=args.device)
        variants["v1 sinks"] = lambda: torch.ops.pyllm.paged_attention_v1(out, q, *common, 0, sinks)
        variants["v2 sinks"] = lambda: torch.ops.pyllm.paged_attention_v2(
            out, exp_sums, max_logits, tmp_out, q, *common, 0, sinks
        )
    window = args.sliding_window
    if window:
        # The same calls within a sliding window: they read only the blocks from the one
        # that holds the window's start (GB/s counts those).
        variants[f"v1 window {window}"] = lambda: torch.ops.pyllm.paged_attention_v1(
            out, q, *common, window
        )
        variants[f"v2 window {window}"] = lambda: torch.ops.pyllm.paged_attention_v2(
            out, exp_sums, max_logits, tmp_out, q, *common, window
        )
    rows = []
    for name, fn in variants.items():
        seconds = time_call(fn, args.device)
        read = context
        if "window" in name:
            read = context - max(0, context - window) // args.block_size * args.block_size
        gbs = (moved - kv_bytes * (1 - read / context)) / seconds / 1e9
        rows.append(
            dict(
                op=f"paged_attention_{name}",
                batch=batch,
                context=context,
                us=seconds * 1e6,
                gbs=gbs,
                frac=gbs / copy_gbs,
            )
        )
    return rows


def bench_small_ops(args) -> list[tuple[str, float, float]]:
    """(op, pyllm us, plain torch us) for model-sized calls of the other kernels."""
    dtype, device = DTYPES[args.dtype], args.device
    tokens, hidden = args.tokens, args.num_heads * args.head_size
    hq, hkv, d = args.num_heads, args.num_kv_heads, args.head_size
    results = []

    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    w = torch.rand(hidden, dtype=dtype, device=device)
    out = torch.empty_like(x)

    def torch_rms():
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * w

    results.append(
        (
            "rms_norm",
            time_call(lambda: torch.ops.pyllm.rms_norm(out, x, w, 1e-6), device),
            time_call(torch_rms, device),
        )
    )
    residual = torch.randn_like(x)
    results.append(
        (
            "fused_add_rms_norm",
            time_call(lambda: torch.ops.pyllm.fused_add_rms_norm(x, residual, w, 1e-6), device),
            time_call(lambda: (torch_rms(), residual.add_(x)), device),
        )
    )
    inter = 4 * hidden
    gate_up = torch.randn(tokens, 2 * inter, dtype=dtype, device=device)
    act = torch.empty(tokens, inter, dtype=dtype, device=device)
    results.append(
        (
            "silu_and_mul",
            time_call(lambda: torch.ops.pyllm.silu_and_mul(act, gate_up), device),
            time_call(
                lambda: torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:], device
            ),
        )
    )

    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, dtype=dtype, device=device)
    query, key = qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d]
    positions = torch.randint(0, 4096, (tokens,), device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d))
    freqs = torch.outer(torch.arange(4096, device=device).float(), inv_freq)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)

    def torch_rope():
        cos, sin = cos_sin[positions].chunk(2, dim=-1)
        for t, heads in ((query, hq), (key, hkv)):
            v = t.view(tokens, heads, d)
            x1, x2 = v[..., : d // 2], v[..., d // 2 :]
            c, s = cos[:, None, :], sin[:, None, :]
            v.copy_(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1))

    results.append(
        (
            "rotary_embedding",
            time_call(
                lambda: torch.ops.pyllm.rotary_embedding(positions, query, key, d, cos_sin, True),
                device,
            ),
            time_call(torch_rope, device),
        )
    )

    results.append(bench_prefill(args, hq, hkv, d, tokens))
    if args.sinks:
        results.append(bench_prefill(args, hq, hkv, d, tokens, sinks=True))
    return results


def bench_prefill(
    args, hq: int, hkv: int, d: int, tokens: int, sinks: bool = False
) -> tuple[str, float, float]:
    """One prompt of `tokens` tokens attending causally over itself, against torch's SDPA
    (which has no sinks: with sinks=True the torch column is the same SDPA call)."""
    dtype, device, block = DTYPES[args.dtype], args.device, args.block_size
    num_blocks = -(-tokens // block) + 1
    kc, vc = ops.allocate_kv_cache(num_blocks, hkv, d, block, dtype, device)
    k = torch.randn(tokens, hkv, d, dtype=dtype, device=device)
    v = torch.randn_like(k)
    slots = torch.arange(tokens, device=device, dtype=torch.int64)
    qp = torch.randn(tokens, hq, d, dtype=dtype, device=device)
    outp = torch.empty_like(qp)
    torch.ops.pyllm.reshape_and_cache(k, v, kc, vc, slots, "auto")
    tables = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]
    lens = torch.tensor([tokens], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    sink_values = torch.randn(hq, dtype=torch.float32, device=device) if sinks else None
    call = (outp, qp, kc, vc, hkv, d**-0.5, tables, lens, qsl, block, tokens, None, 0, sink_values)

    def torch_sdpa():
        kk = k.transpose(0, 1).repeat_interleave(hq // hkv, 0)
        vv = v.transpose(0, 1).repeat_interleave(hq // hkv, 0)
        torch.nn.functional.scaled_dot_product_attention(qp.transpose(0, 1), kk, vv, is_causal=True)

    return (
        f"paged_attention_prefill {hq}/{hkv}x{d}" + (" sinks" if sinks else ""),
        time_call(
            lambda: torch.ops.pyllm.paged_attention_prefill(*call),
            device,
        ),
        time_call(torch_sdpa, device),
    )


def bench_smollm2(args) -> list[tuple[str, float, float]]:
    """The per-layer ops of a SmolLM2-135M prefill (hidden 576, 9/3 heads of 64, MLP 1536)."""
    dtype, device, tokens = DTYPES[args.dtype], args.device, args.tokens
    hidden, inter = 576, 1536
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    w = torch.rand(hidden, dtype=dtype, device=device)
    gate_up = torch.randn(tokens, 2 * inter, dtype=dtype, device=device)
    act = torch.empty(tokens, inter, dtype=dtype, device=device)

    def torch_add_rms():
        residual.add_(x)
        rf = residual.float()
        x.copy_((rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * w)

    weight = torch.randn(2 * inter, hidden, dtype=dtype, device=device) / hidden**0.5
    one_row = torch.randn(1, hidden, dtype=dtype, device=device)
    linear_out = torch.empty(1, 2 * inter, dtype=dtype, device=device)
    return [
        bench_prefill(args, 9, 3, 64, tokens),
        (
            f"small_batch_linear 1x{hidden}->{2 * inter}",
            time_call(
                lambda: torch.ops.pyllm.small_batch_linear(linear_out, one_row, weight, None),
                device,
            ),
            time_call(lambda: torch.nn.functional.linear(one_row, weight), device),
        ),
        (
            f"silu_and_mul {tokens}x{inter}",
            time_call(lambda: torch.ops.pyllm.silu_and_mul(act, gate_up), device),
            time_call(
                lambda: torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:], device
            ),
        ),
        (
            f"fused_add_rms_norm {tokens}x{hidden}",
            time_call(lambda: torch.ops.pyllm.fused_add_rms_norm(x, residual, w, 1e-6), device),
            time_call(torch_add_rms, device),
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=None)
    parser.add_argument("--contexts", type=lambda s: [int(v) for v in s.split(",")], default=None)
    parser.add_argument("--tokens", type=int, default=512, help="tokens for the non-decode ops")
    parser.add_argument("--skip-small-ops", action="store_true")
    parser.add_argument(
        "--sliding-window", type=int, default=0, help="also time decode within this window"
    )
    parser.add_argument(
        "--sinks", action="store_true", help="also time decode and prefill with attention sinks"
    )
    args = parser.parse_args()
    if args.device == "cuda":
        args.batches = args.batches or [1, 8, 32, 64]
        args.contexts = args.contexts or [512, 2048, 4096, 8192]
    else:
        args.batches = args.batches or [1, 8, 32]
        args.contexts = args.contexts or [512, 2048, 8192]
    torch.manual_seed(0)

    print(f"$ python {' '.join(sys.argv)}")
    machine = platform.processor() or platform.machine()
    if args.device == "cuda":
        machine = torch.cuda.get_device_name()
    print(
        f"machine: {machine}, {os.cpu_count()} cpus, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), device {args.device}, dtype {args.dtype}"
    )
    print(
        f"shape: num_heads {args.num_heads}, num_kv_heads {args.num_kv_heads}, "
        f"head_size {args.head_size}, block_size {args.block_size}"
    )
    copy_gbs = copy_bandwidth(args.device)
    print(f"copy bandwidth (read + write, large tensor copy): {copy_gbs:.1f} GB/s")
    if args.device == "cuda":
        print(f"H200 peak HBM bandwidth: {H200_PEAK_GBS:.0f} GB/s")

    print()
    header = f"{'op':<20} {'batch':>5} {'context':>7} {'us/call':>10} {'GB/s':>8} {'of copy':>8}"
    if args.device == "cuda":
        header += f" {'of peak':>8}"
    print(header)
    cases = [(b, c) for b in args.batches for c in args.contexts]
    for r in (row for b, c in cases for row in bench_decode_case(args, b, c, copy_gbs)):
        line = (
            f"{r['op']:<20} {r['batch']:>5} {r['context']:>7} {r['us']:>10.1f} "
            f"{r['gbs']:>8.1f} {r['frac']:>8.0%}"
        )
        if args.device == "cuda":
            line += f" {r['gbs'] / H200_PEAK_GBS:>8.0%}"
        print(line, flush=True)

    if not args.skip_small_ops:
        print()
        print(f"other ops, {args.tokens} tokens:")
        print(f"{'op':<24} {'pyllm us':>10} {'torch us':>10} {'speedup':>8}")
        for name, ours, theirs in bench_small_ops(args):
            print(f"{name:<24} {ours * 1e6:>10.1f} {theirs * 1e6:>10.1f} {theirs / ours:>7.1f}x")
        print()
        print(f"SmolLM2-135M shapes, {args.tokens} tokens:")
        print(f"{'op':<32} {'pyllm us':>10} {'torch us':>10} {'speedup':>8}")
        for name, ours, theirs in bench_smollm2(args):
            print(f"{name:<32} {ours * 1e6:>10.1f} {theirs * 1e6:>10.1f} {theirs / ours:>7.1f}x")


if __name__ == "__main__":
    main()
