"""Timing shared by the benchmark scripts: repeated calls, synchronized on CUDA; the
CPU's name for their reports."""

from __future__ import annotations

import platform
import subprocess
import time
from collections.abc import Callable

import torch


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def call_times(
    fn: Callable[[], object],
    device: str,
    min_time: float = 0.3,
    min_repeats: int = 3,
    max_repeats: int = 200,
    warmup: int = 1,
) -> list[float]:
    """Seconds of each timed call of fn: after `warmup` calls and one call that sizes the
    run, enough repeats to fill min_time, within [min_repeats, max_repeats]."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    once = max(time.perf_counter() - start, 1e-6)
    samples = []
    for _ in range(max(min_repeats, min(max_repeats, int(min_time / once)))):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return samples


def best_of(repeats: int, fn: Callable[[], object], device: str = "cpu") -> float:
    """The fastest of `repeats` calls."""
    return min(call_times(fn, device, min_time=0.0, min_repeats=repeats, max_repeats=repeats))


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))  # fmt: skip
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"
