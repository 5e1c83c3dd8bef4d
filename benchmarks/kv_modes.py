"""Paged vs contiguous KV cache, side by side in one run: attention speed and memory.

    PYTHONPATH=. python benchmarks/kv_modes.py                 # CPU, SmolLM2's shape
    PYTHONPATH=. python benchmarks/kv_modes.py --device cuda   # on a GPU build
    PYTHONPATH=. python benchmarks/kv_modes.py --engine        # + end to end, real model

Part 1, the ops, for batch 1/8/32 x context 512..8192 (SmolLM2-135M's attention shape
by default: 9 query heads, 3 kv heads, head size 64, bf16):
  decode   one query token per sequence attending over `context` cached tokens
           (paged_attention_v1 vs contiguous_attention_decode), as GB/s of KV read;
  prefill  a chunk of --chunk new tokens per sequence at the end of `context` cached
           ones (paged_attention_prefill vs contiguous_attention_prefill), as tokens/s;
  memory   what each mode holds for these tokens: the paged cache's blocks, and the
           arena's committed bytes (its virtual reservation is printed too).
The paged cache's blocks are shuffled, as in a server whose free list has churned; a
fresh engine hands out nearly sequential blocks, which reads faster.

Part 2, float vs int8 KV (kv_cache_dtype "int8"): decode attention at --int8-contexts
(8k and 32k tokens, batch --int8-batch) in both layouts, the --dtype cache against the
int8 one, as GB/s of KV read (int8 rows plus their float16 scales) and decode tok/s of
the attention op alone (sequences per second of one layer's call). The caches are
sized first against MemAvailable: a run that would not fit is refused.

Part 3 (--engine), the real model through LLM.generate in both modes: prefill and
decode throughput (decode = the extra time of --engine-decode more tokens per
sequence) and the most KV memory committed at any step of the run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from functools import partial

import torch

import pyllm.ops as ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ops import DTYPES, copy_bandwidth, time_call  # noqa: E402


def fill_(t: torch.Tensor) -> None:
    """Random cache contents: floats in [-1, 1], int8 over its range."""
    t.random_(-127, 128) if t.dtype == torch.int8 else t.uniform_(-1, 1)


def paged_case(args, batch: int, context: int, dtype=None):
    dtype, device = dtype or DTYPES[args.dtype], args.device
    blocks_per_seq = -(-(context + args.chunk) // args.block_size)
    num_blocks = batch * blocks_per_seq
    key_cache, value_cache = ops.allocate_kv_cache(
        num_blocks, args.num_kv_heads, args.head_size, args.block_size, dtype, device
    )
    fill_(key_cache)
    fill_(value_cache)
    tables = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = tables.view(batch, blocks_per_seq)
    return key_cache, value_cache, tables, key_cache.nbytes + value_cache.nbytes


def contiguous_case(args, batch: int, context: int, dtype=None):
    dtype, device = dtype or DTYPES[args.dtype], args.device
    arena = ops.KVArena(
        1, batch, context + args.chunk, args.num_kv_heads, args.head_size, dtype, device
    )
    for slot in range(batch):
        arena.commit(slot, context + args.chunk)
    key_cache, value_cache = arena.key_cache(0), arena.value_cache(0)
    for slot in range(batch):
        fill_(key_cache[slot])
        fill_(value_cache[slot])
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    return arena, key_cache, value_cache, slots


def ops_table(args) -> None:
    hq, hkv, d = args.num_heads, args.num_kv_heads, args.head_size
    print(
        f"copy bandwidth (read + write, large tensor copy): {copy_bandwidth(args.device):.1f} GB/s"
    )
    print(
        f"shape: {hq} query heads, {hkv} kv heads, head size {d}, {args.dtype}; paged "
        f"block {args.block_size}, contiguous tile {ops.TOKEN_TILE}; prefill chunk {args.chunk}"
    )
    header = (
        f"{'batch':>5} {'context':>7} | {'decode GB/s':>11} {'contig':>7} {'ratio':>6} | "
        f"{'prefill tok/s':>13} {'contig':>8} {'ratio':>6} | {'paged MiB':>9} "
        f"{'committed':>9} {'reserved':>9}"
    )
    print(header)
    print("-" * len(header))
    for batch in args.batches:
        for context in args.contexts:
            print(ops_row(args, batch, context), flush=True)


def ops_row(args, batch: int, context: int) -> str:
    """One table row: both modes on the same shapes (fresh random K/V in each)."""
    dtype, device = DTYPES[args.dtype], args.device
    hq, hkv, d, chunk = args.num_heads, args.num_kv_heads, args.head_size, args.chunk
    scale = d**-0.5
    element = dtype.itemsize
    key_cache, value_cache, tables, paged_bytes = paged_case(args, batch, context)
    arena, ckey, cvalue, slots = contiguous_case(args, batch, context)
    query = torch.randn(batch, hq, d, dtype=dtype, device=device)
    out = torch.empty_like(query)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    decode_paged = partial(
        ops.paged_attention_v1, out, query, key_cache, value_cache, hkv, scale, tables, lens,
        args.block_size, context,
    )  # fmt: skip
    decode_contig = partial(
        ops.contiguous_attention_decode, out, query, ckey, cvalue, hkv, scale, slots, lens,
        context,
    )  # fmt: skip
    # Prefill: a chunk of new tokens at the end of each sequence.
    pq = torch.randn(batch * chunk, hq, d, dtype=dtype, device=device)
    pout = torch.empty_like(pq)
    plens = torch.full((batch,), context + chunk, dtype=torch.int32, device=device)
    qsl = torch.arange(0, (batch + 1) * chunk, chunk, dtype=torch.int32, device=device)
    prefill_paged = partial(
        ops.paged_attention_prefill, pout, pq, key_cache, value_cache, hkv, scale, tables,
        plens, qsl, args.block_size, chunk,
    )  # fmt: skip
    prefill_contig = partial(
        ops.contiguous_attention_prefill, pout, pq, ckey, cvalue, hkv, scale, slots, plens,
        qsl, chunk,
    )  # fmt: skip
    kv_bytes = 2 * batch * context * hkv * d * element
    dec = kv_bytes / time_call(decode_paged, device) / 1e9
    cdec = kv_bytes / time_call(decode_contig, device) / 1e9
    pre = batch * chunk / time_call(prefill_paged, device, min_time=0.2, warmup=1)
    cpre = batch * chunk / time_call(prefill_contig, device, min_time=0.2, warmup=1)
    return (
        f"{batch:>5} {context:>7} | {dec:>11.1f} {cdec:>7.1f} {cdec / dec:>5.2f}x | "
        f"{pre:>13.0f} {cpre:>8.0f} {cpre / pre:>5.2f}x | "
        f"{paged_bytes / 2**20:>9.1f} {arena.committed_bytes / 2**20:>9.1f} "
        f"{arena.reserved_bytes / 2**20:>9.1f}"
    )


def mem_available() -> int | None:
    """Bytes the kernel says can be allocated without swapping (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def decode_call(args, layout: str, dtype, batch: int, context: int):
    """(decode call, bytes of KV it reads) over a fresh random cache of one layout."""
    hq, hkv, d = args.num_heads, args.num_kv_heads, args.head_size
    query = torch.randn(batch, hq, d, dtype=DTYPES[args.dtype], device=args.device)
    out, lens = torch.empty_like(query), torch.full((batch,), context, dtype=torch.int32)
    quantized = dtype == torch.int8
    if layout == "paged":
        key_cache, value_cache, tables, _ = paged_case(args, batch, context, dtype)
        shape = (key_cache.shape[0], hkv, args.block_size)
        scales = ops.allocate_kv_scales(shape, args.device) if quantized else (None, None)
        for s in scales if quantized else ():
            s.uniform_(1e-3, 1e-2)
        call = partial(
            ops.paged_attention_v1, out, query, key_cache, value_cache, hkv, d**-0.5, tables,
            lens.to(args.device), args.block_size, context, None, None, None, *scales,
        )  # fmt: skip
    else:
        arena, key_cache, value_cache, slots = contiguous_case(args, batch, context, dtype)
        scales = arena.kv_caches[0][2:] if quantized else (None, None)
        for s in scales if quantized else ():
            s.uniform_(1e-3, 1e-2)
        call = partial(
            ops.contiguous_attention_decode, out, query, key_cache, value_cache, hkv, d**-0.5,
            slots, lens.to(args.device), context, None, None, *scales,
        )  # fmt: skip
        call.arena = arena  # keeps the views' memory alive with the call
    row = d + 2 if quantized else d * dtype.itemsize  # bytes per token and head
    return call, 2 * batch * context * hkv * row


def kv_dtype_table(args) -> None:
    dtype, batch, hkv, d = DTYPES[args.dtype], args.int8_batch, args.num_kv_heads, args.head_size
    print()
    print(f"decode attention, {args.dtype} KV vs int8 KV (batch {batch}, one layer's op):")
    header = (
        f"{'layout':>10} {'context':>7} | {'GB/s':>6} {'int8':>6} | "
        f"{'tok/s':>7} {'int8':>7} {'ratio':>6} | {'KV MiB':>7} {'int8':>6}"
    )
    print(header)
    print("-" * len(header))
    for context in args.int8_contexts:
        # Both layouts' caches of both types, never alive at once: the largest pair.
        need = 2 * batch * (context + args.chunk) * hkv * d * (dtype.itemsize + 1)
        available = mem_available()
        if args.device == "cpu" and available is not None and need > 0.8 * available:
            print(
                f"{'':>10} {context:>7} | refused: needs {need / 2**30:.2f} GiB, "
                f"MemAvailable {available / 2**30:.2f} GiB"
            )
            continue
        for layout in ("paged", "contiguous"):
            cells = []
            for kv_dtype in (dtype, torch.int8):
                call, kv_bytes = decode_call(args, layout, kv_dtype, batch, context)
                seconds = time_call(call, args.device)
                cells.append((kv_bytes / seconds / 1e9, batch / seconds, kv_bytes))
                del call
            (gbs, tps, kvb), (gbs8, tps8, kvb8) = cells
            print(
                f"{layout:>10} {context:>7} | {gbs:>6.1f} {gbs8:>6.1f} | {tps:>7.0f} "
                f"{tps8:>7.0f} {tps8 / tps:>5.2f}x | {kvb / 2**20:>7.1f} {kvb8 / 2**20:>6.1f}",
                flush=True,
            )


def timed_generate(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """(seconds, peak KV bytes committed) to run every prompt to max_tokens tokens."""
    from pyllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv_cache_committed_bytes())
    return time.perf_counter() - start, peak


def engine_table(args) -> None:
    from pyllm.engine.config import EngineConfig
    from pyllm.engine.llm_engine import LLMEngine

    print()
    print("end to end (LLM.generate, the bundled SmolLM2-135M-Instruct, greedy, EOS ignored):")
    header = (
        f"{'mode':>10} {'batch':>5} {'prompt':>6} | {'prefill tok/s':>13} "
        f"{'decode tok/s':>12} | {'peak KV MiB':>11}"
    )
    print(header)
    print("-" * len(header))
    for mode in ("paged", "contiguous"):
        engine = LLMEngine(EngineConfig(
            dtype=args.dtype,
            kv_cache=mode,
            enable_prefix_caching=False,
            max_num_seqs=max(args.batches),
            max_model_len=max(args.engine_prompts) + args.engine_decode + 1,
        ))  # fmt: skip
        vocab = engine.model_config.vocab_size
        gen = torch.Generator().manual_seed(0)
        for batch in args.batches:
            for prompt_len in args.engine_prompts:
                prompts = [
                    torch.randint(100, vocab, (prompt_len,), generator=gen).tolist()
                    for _ in range(batch)
                ]

                timed_generate(engine, prompts, 1)  # warm-up
                prefill, _ = timed_generate(engine, prompts, 1)
                total, committed = timed_generate(engine, prompts, args.engine_decode + 1)
                decode = batch * args.engine_decode / max(total - prefill, 1e-9)
                print(
                    f"{mode:>10} {batch:>5} {prompt_len:>6} | "
                    f"{batch * prompt_len / prefill:>13.0f} {decode:>12.1f} | "
                    f"{committed / 2**20:>11.1f}",
                    flush=True,
                )
        del engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=128, help="prefill tokens per sequence")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--int8-contexts", default="8192,32768")
    parser.add_argument("--int8-batch", type=int, default=8)
    parser.add_argument("--skip-layouts", action="store_true", help="only the int8 table")
    parser.add_argument("--engine", action="store_true", help="also run the real model")
    parser.add_argument("--engine-prompts", default="512")
    parser.add_argument("--engine-decode", type=int, default=32)
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.engine_prompts = [int(p) for p in args.engine_prompts.split(",")]
    args.int8_contexts = [int(c) for c in args.int8_contexts.split(",")]
    print("$ python " + " ".join(sys.argv))
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), device {args.device}"
    )
    if not args.skip_layouts:
        ops_table(args)
    kv_dtype_table(args)
    if args.engine:
        engine_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
