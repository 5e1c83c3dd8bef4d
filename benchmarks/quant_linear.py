"""quant_linear on a GGUF file's own projection weights, for a range of rows, beside the
float kernels on the same weights widened (the model's path with quantization="none").

    PYTHONPATH=. python benchmarks/quant_linear.py                       # bundled SmolLM2 Q4_1
    PYTHONPATH=. python benchmarks/quant_linear.py --gguf FILE --rows 1,8,512 --dtypes bfloat16
    PYTHONPATH=. python benchmarks/quant_linear.py --device cuda
    PYTHONPATH=. python benchmarks/quant_linear.py --shape tinyllama-1.1b --type Q4_K_M
    PYTHONPATH=. python benchmarks/quant_linear.py --matrix 2880x2880 --types Q4_0,Q8_0,MXFP4
    PYTHONPATH=. python benchmarks/quant_linear.py --matrix 2048x2048 --types Q4_K,Q4_K_STRIPS

--shape and --type take random blocks of a real model's projection shapes and types
(benchmarks/make_gguf.py's, without writing a file) instead of a GGUF file's weights.
--matrix NxK takes one weight shape in each of --types: as many random [N, K] weights
of the type as make 256 MB, so that a pass streams them from memory as a model's
decode step does. The types take turns, one pass each per repeat, with a read of 1 GiB
(a float32 sum: the memory read bandwidth, the bound of the batch-1 GB/s) among them,
so that a busy spell of a shared machine hits them all alike; each keeps its best.

Per row count: the best of --repeats passes over every projection of the file's first
--layers layers (each weight read once per pass, far more bytes than the caches hold, as
in a decode step), the weight bytes read per second, and the GFLOP/s. The float side
runs the model's Linear on the dequantized weights (packed_linear or oneDNN, whichever
this CPU uses), skipped with --no-float.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_timing import best_of, sync  # noqa: E402

import pyllm.ops as ops  # noqa: E402
from pyllm.model.default_model import default_model_path  # noqa: E402
from pyllm.model.gguf_file import open_gguf  # noqa: E402
from pyllm.model.linear import Linear, can_pack_weight_words  # noqa: E402

PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def load_weights(path: str, layers: int, device: str):
    """(type id, qweight [N, row bytes], in_features) of each projection."""
    gguf_file = open_gguf(path)
    weights = []
    for i in range(layers):
        for part in PARTS:
            t = gguf_file.tensors.get(f"blk.{i}.{part}.weight")
            if t is None or t.type_name not in ops.QUANT_TYPES:
                continue
            raw = torch.from_numpy(t.raw.copy()).to(device)
            weights.append((t.type_id, raw, t.shape[1]))
    if not weights:
        sys.exit(f"{path}: no projection of a type quant_linear reads")
    return weights


def random_weights(shape_name: str, file_type: str, layers: int | None, device: str):
    """The same, from make_gguf.py's random blocks of a model shape's projections."""
    import make_gguf
    import numpy as np

    shape = make_gguf.SHAPES[shape_name]
    layers = shape.layers if layers is None else layers
    generators, weights = {}, []
    for index, plan in enumerate(make_gguf.plan_tensors(shape, file_type, pure=False)):
        parts = plan.name.split(".")
        if parts[0] != "blk" or int(parts[1]) >= layers or parts[2] not in PARTS:
            continue
        chunks = make_gguf.tensor_chunks(plan, index, 0, generators, 1 << 30)
        raw = np.concatenate(list(chunks)).reshape(plan.shape[0], -1)
        weights.append((int(plan.qtype), torch.from_numpy(raw).to(device), plan.shape[1]))
    return weights, layers


def matrix_weights(matrix: str, type_name: str, device: str, total_bytes: int = 256 << 20):
    """Random blocks of `type_name` for distinct [N, K] weights adding up to total_bytes
    (Q4_K_STRIPS and the like: Q4_K's, packed by ops.pack_strips)."""
    import make_gguf

    if type_name.endswith("_STRIPS"):
        weights = matrix_weights(matrix, type_name.removesuffix("_STRIPS"), device, total_bytes)
        return [(ops.STRIPS_TYPES[t], ops.pack_strips(w, t), k) for t, w, k in weights]
    n, k = (int(v) for v in matrix.lower().split("x"))
    type_id, block, _ = ops.QUANT_TYPES[type_name]
    blocks = make_gguf.RandomBlocks(make_gguf.Q(type_id), seed=0)
    rng = make_gguf.np.random.default_rng(type_id)
    row_bytes = ops.quant_row_bytes(type_id, k)
    copies = -(-total_bytes // (n * row_bytes))
    return [
        (type_id, torch.from_numpy(blocks(rng, n * k // block).reshape(n, row_bytes)).to(device), k)
        for _ in range(copies)
    ]


def float_linears(weights, dtype, device) -> list[Linear]:
    linears = []
    for type_id, qweight, k in weights:
        module = Linear(k, qweight.shape[0], False, dtype, device)
        ops.dequantize_rows(module.weight.data, qweight, type_id)
        if device == "cpu":
            # As the model packs them: word-packed alone, or oneDNN's beside the plain
            # weight that small_batch_linear reads.
            module.pack(keep_plain=not can_pack_weight_words(module.weight))
        linears.append(module)
    return linears


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="GGUF file (default: bundled SmolLM2)")
    parser.add_argument("--shape", default=None, help="random blocks of this model shape")
    parser.add_argument(
        "--type", default="Q4_K_M", help="with --shape: Q8_0, Q4_0, Q4_K_M or MXFP4"
    )
    parser.add_argument("--matrix", default=None, help="NxK: one weight shape, in each of --types")
    parser.add_argument("--types", default="Q4_0,Q8_0,MXFP4", help="with --matrix")
    parser.add_argument("--layers", type=int, default=None, help="first N layers (default all)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,512")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-float", action="store_true", help="skip the float kernels")
    parser.add_argument(
        "--strips", action="store_true", help="pack the weights into strips as the loader does"
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="the int8 products at every row count (ops.set_batch_invariant)",
    )
    args = parser.parse_args()
    ops.set_batch_invariant(args.batch_invariant)
    print(f"# {platform.processor() or platform.machine()}, torch threads "
          f"{torch.get_num_threads()}, device {args.device}")  # fmt: skip
    if args.matrix:
        compare_types(args)
        return
    if args.shape:
        weights, layers = random_weights(args.shape, args.type, args.layers, args.device)
        path = f"{args.shape}.{args.type} (random blocks)"
    else:
        path = args.gguf or default_model_path()
        layers = args.layers or int(
            next(v for k, v in open_gguf(path).metadata.items() if k.endswith(".block_count"))
        )
        weights = load_weights(path, layers, args.device)
    if args.strips:
        weights = [
            (ops.STRIPS_TYPES[t], ops.pack_strips(w, t), k) if t in ops.STRIPS_TYPES else (t, w, k)
            for t, w, k in weights
        ]
    measure(
        weights, f"{os.path.basename(path)}: {len(weights)} projections of {layers} layers", args
    )


def compare_types(args) -> None:
    """--matrix: each of --types and a 1 GiB read take turns, one pass each per repeat
    (after one unmeasured pass), and keep their best."""
    sets = {t: matrix_weights(args.matrix, t, args.device) for t in args.types.split(",")}
    for name, weights in sets.items():
        nbytes = sum(q.numel() for _, q, _ in weights)
        print(f"# {name}: {len(weights)} random {args.matrix} weights, {nbytes / 1e6:.1f} MB")
    stream = torch.ones(2**28, dtype=torch.float32, device=args.device)
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for rows in [int(r) for r in args.rows.split(",")]:
            passes = {"read": stream.sum}
            for name, weights in sets.items():
                xs = [torch.randn(rows, k, device=args.device).to(dtype) for _, _, k in weights]
                outs = [torch.empty(rows, q.shape[0], dtype=dtype, device=args.device)
                        for _, q, _ in weights]  # fmt: skip

                def quant(weights=weights, xs=xs, outs=outs):
                    for (type_id, q, _), x, out in zip(weights, xs, outs, strict=True):
                        torch.ops.pyllm.quant_linear(out, x, q, type_id, None)

                passes[name] = quant
            best = dict.fromkeys(passes, float("inf"))
            for repeat in range(args.repeats + 1):
                for name, fn in passes.items():
                    sync(args.device)
                    start = time.perf_counter()
                    fn()
                    sync(args.device)
                    if repeat:
                        best[name] = min(best[name], time.perf_counter() - start)
            read = stream.numel() * 4 / best.pop("read") / 1e9
            for name, seconds in best.items():
                nbytes = sum(q.numel() for _, q, _ in sets[name])
                flops = 2 * rows * sum(q.shape[0] * k for _, q, k in sets[name])
                print(f"{str(dtype).removeprefix('torch.'):9} rows {rows:4} {name:6}: "
                      f"{seconds * 1e3:8.2f} ms {nbytes / seconds / 1e9:6.1f} GB/s "
                      f"{flops / seconds / 1e9:6.0f} GFLOP/s (read {read:.1f} GB/s)",
                      flush=True)  # fmt: skip


def measure(weights, label: str, args) -> None:
    """Prints quant_linear's times over `weights` for each dtype and row count."""
    nbytes = sum(q.numel() for _, q, _ in weights)
    flops_per_row = 2 * sum(q.shape[0] * k for _, q, k in weights)
    names = {type_id: name for name, (type_id, _, _) in ops.QUANT_TYPES.items()}
    names.update({s: names[t] + "_STRIPS" for t, s in ops.STRIPS_TYPES.items()})
    types = sorted({names[t] for t, _, _ in weights})
    print(f"# {label}, {'/'.join(types)}, {nbytes / 1e6:.1f} MB quantized")  # fmt: skip
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        linears = [] if args.no_float else float_linears(weights, dtype, args.device)
        for rows in [int(r) for r in args.rows.split(",")]:
            xs = [torch.randn(rows, k, device=args.device).to(dtype) for _, _, k in weights]
            outs = [
                torch.empty(rows, q.shape[0], dtype=dtype, device=args.device)
                for _, q, _ in weights
            ]

            def quant(xs=xs, outs=outs):
                for (type_id, q, _), x, out in zip(weights, xs, outs, strict=True):
                    torch.ops.pyllm.quant_linear(out, x, q, type_id, None)

            seconds = best_of(args.repeats, quant, args.device)
            line = (
                f"{str(dtype).removeprefix('torch.'):9} rows {rows:4}: quant_linear "
                f"{seconds * 1e3:8.2f} ms {nbytes / seconds / 1e9:6.1f} GB/s "
                f"{flops_per_row * rows / seconds / 1e9:6.0f} GFLOP/s"
            )
            if linears:

                def dense(linears=linears, xs=xs):
                    for module, x in zip(linears, xs, strict=True):
                        module(x)

                dense_seconds = best_of(args.repeats, dense, args.device)
                line += (
                    f" | float weights {dense_seconds * 1e3:8.2f} ms "
                    f"{flops_per_row * rows / dense_seconds / 1e9:6.0f} GFLOP/s "
                    f"({dense_seconds / seconds:.2f}x)"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()
