"""The CPU linear kernels side by side on SmolLM2-135M's 120 projections (30 layers of
qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576), for a range of rows.

    PYTHONPATH=. python benchmarks/bench_linear.py                     # bf16 and float32
    PYTHONPATH=. python benchmarks/bench_linear.py --dtypes bfloat16 --rows 1,32

Per row count and kernel: the best of --repeats passes over all 120 weights (each
weight read once per pass; together they are far larger than the caches, as in a
decode step) and the GFLOP/s that makes. Kernels: pyllm's packed_linear on word-packed
weights, oneDNN on its packed layout (torch.ops.mkldnn._linear_pointwise, what
Linear ran before), and pyllm's small_batch_linear on plain weights (up to
SMALL_BATCH_MAX_ROWS rows).
"""

from __future__ import annotations

import argparse

import torch
from bench_timing import best_of

import pyllm.ops as ops
from pyllm.model.linear import can_pack_linear_weights, pack_linear_weight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # (out, in) features


def packed_linear(x, weight, out):
    torch.ops.pyllm.packed_linear(out, x, weight, None)


def onednn(x, weight, out):
    torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def small_batch_linear(x, weight, out):
    torch.ops.pyllm.small_batch_linear(out, x, weight, None)


def bench_dtype(dtype: torch.dtype, row_counts: list[int], repeats: int) -> None:
    plain = [torch.randn(n, k, dtype=dtype) / k**0.5 for n, k in SHAPES]
    # (name, kernel, its weights, most rows it takes)
    kernels = []
    if ops.packed_linear_vectorized(dtype):
        words = [ops.pack_weight_words(w) for w in plain]
        kernels.append(("packed_linear", packed_linear, words, None))
    else:
        print(f"{dtype}: packed_linear has no vector kernel in this build")
    if can_pack_linear_weights("cpu", dtype):
        kernels.append(("oneDNN", onednn, [pack_linear_weight(w) for w in plain], None))
    kernels.append(("small_batch_linear", small_batch_linear, plain, ops.SMALL_BATCH_MAX_ROWS))
    for rows in row_counts:
        inputs = {k: torch.randn(rows, k, dtype=dtype) for k in {k for _, k in SHAPES}}
        outs = [torch.empty(rows, n, dtype=dtype) for n, _ in SHAPES]
        flops = sum(2 * rows * n * k for n, k in SHAPES)
        cells = []
        for name, kernel, weights, max_rows in kernels:
            if max_rows is not None and rows > max_rows:
                continue

            def one_pass(kernel=kernel, weights=weights, inputs=inputs, outs=outs):
                for (_, k), weight, out in zip(SHAPES, weights, outs, strict=True):
                    kernel(inputs[k], weight, out)

            seconds = best_of(repeats, one_pass)
            cells.append(f"{name} {seconds * 1e3:7.2f} ms {flops / seconds / 1e9:5.0f} GFLOP/s")
        print(f"{str(dtype).removeprefix('torch.'):9s} rows {rows:4d}: " + " | ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rows", default="1,4,8,16,32,64,128,512")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.dtypes.split(","):
        bench_dtype(getattr(torch, name), [int(r) for r in args.rows.split(",")], args.repeats)


if __name__ == "__main__":
    main()
