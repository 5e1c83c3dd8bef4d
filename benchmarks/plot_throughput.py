"""Draw output throughput against concurrency from benchmarks/compare.py's JSON.

    PYTHONPATH=. python benchmarks/compare.py --json compare.json
    python benchmarks/plot_throughput.py compare.json -o docs/throughput.png

Concurrency 1 is compare.py's batch-1 decode case, 8 and 32 its batched cases: each point is
generated tokens over the wall time of one generate call (all sequences together).
Needs matplotlib (`pip install matplotlib`, or the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
import os

CONCURRENCY_CASES = ("decode_b1", "batch8", "batch32")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json_path", help="the file compare.py --json wrote")
    parser.add_argument("-o", "--output", default="docs/throughput.png")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    with open(args.json_path) as f:
        data = json.load(f)
    meta, rows = data["meta"], data["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        points = [(row["batch_sizes"][c], row[c]) for c in CONCURRENCY_CASES if row.get(c)]
        if not points:
            continue
        xs, ys = zip(*sorted(points), strict=True)
        label = f"{row['engine']} {row['dtype']}"
        if row.get("note"):
            label += f" ({row['note']})"
        style = "-" if row["engine"] == "pyllm" else "--"
        ax.plot(xs, ys, style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 8, 32], labels=["1", "8", "32"])
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("output tokens/s (all sequences)")
    tokens = rows[0]["max_tokens"]
    ax.set_title(
        f"SmolLM2-135M-Instruct, {meta['cpus']} CPUs, {meta['torch_threads']} threads\n"
        f"{tokens['batch8']} tokens per request (batch 1: {tokens['decode_b1']}), greedy",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
