"""A decode step unprofiled, split three ways: the real step, its kernels alone (every
pyllm op call of one step recorded, then replayed back to back), and its Python alone
(the same step with every pyllm kernel a no-op).

    PYTHONPATH=. python benchmarks/step_split.py                   # bundled SmolLM2, bf16
    PYTHONPATH=. python benchmarks/step_split.py --dtype float32 --model file.gguf

The real step runs twice: as the engine runs it (decode steps replayed from recorded
kernel graphs, engine/decode_graphs.py) and op by op (enforce_eager). real - kernels is
the step's time outside its kernels: the Python, the small torch ops, and what running
them between kernels costs (the weights a step streams evict the interpreter's code and
data from the caches, so a small op costs several times its cost in a tight loop). The
four alternate over --rounds rounds of --steps steps each; the medians are printed.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from pyllm import _C as direct
from pyllm import LLM, SamplingParams

OPS = (
    "quant_linear", "packed_linear", "small_batch_linear", "paged_attention_v1",
    "paged_attention_v2", "fused_add_rms_norm", "rms_norm", "reshape_and_cache",
    "silu_and_mul", "gelu_tanh_and_mul", "rotary_embedding", "dequantize_rows", "fused_moe",
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: bundled SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)
    engine, namespace = llm.engine, direct  # what the model calls (csrc/torch_bindings.cpp)
    kernels = {name: getattr(namespace, name) for name in OPS}
    budget = 16 + args.rounds * 3 * args.steps
    params = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
    engine.add_request("split", None, params, prompt_token_ids=list(range(1000, 1030)))
    for _ in range(10):  # the prompt, then warm decodes
        engine.step()
    calls = _record(engine, namespace, kernels)
    real, eager, replay, python = [], [], [], []
    for _ in range(args.rounds):
        real += [_timed(engine.step) for _ in range(args.steps)]
        engine.runner.graphs, graphs = None, engine.runner.graphs
        eager += [_timed(engine.step) for _ in range(args.steps)]
        replay += [_timed(lambda: [f(*a) for f, a in calls]) for _ in range(args.steps)]
        for name in kernels:
            setattr(namespace, name, lambda *a: None)
        python += [_timed(engine.step) for _ in range(args.steps)]
        for name, kernel in kernels.items():
            setattr(namespace, name, kernel)
        engine.runner.graphs = graphs
    r, e, k, p = (statistics.median(t) * 1e3 for t in (real, eager, replay, python))
    print(f"{args.model or 'bundled SmolLM2'} {args.dtype}, batch 1, {torch.get_num_threads()} "
          f"threads, {platform.machine()}: {len(calls)} kernel calls a step")  # fmt: skip
    print(f"real step {r:.2f} ms = kernels {k:.2f} ms + outside kernels {r - k:.2f} ms; "
          f"op by op {e:.2f} ms = kernels + {e - k:.2f} ms "
          f"(Python with no-op kernels: {p:.2f} ms)")  # fmt: skip


def _record(engine, namespace, kernels) -> list:
    """Every pyllm kernel call (the function and its arguments) of one decode step."""
    calls = []

    def recorder(kernel):
        def call(*args):
            calls.append((kernel, args))
            return kernel(*args)

        return call

    for name, kernel in kernels.items():
        setattr(namespace, name, recorder(kernel))
    engine.runner.graphs, graphs = None, engine.runner.graphs  # each call from Python
    try:
        engine.step()
    finally:
        engine.runner.graphs = graphs
        for name, kernel in kernels.items():
            setattr(namespace, name, kernel)
    return calls


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
