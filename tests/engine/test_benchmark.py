"""`pyllm bench` end to end on a tiny random-weight model: the table's columns, a row per
test and concurrency, the JSON rows, and -p 0 / -g 0 skipping a phase."""

from __future__ import annotations

import json
import subprocess
import sys


def _bench(model_dir: str, tmp_path, *args: str) -> tuple[str, list[dict]]:
    out = tmp_path / "rows.json"
    run = subprocess.run(
        [sys.executable, "-m", "pyllm.cli", "bench", "--model", model_dir, "--dtype", "float32",
         "-r", "2", "--json", str(out), *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout, json.loads(out.read_text())


def test_bench_prints_a_row_per_test_and_concurrency(tiny_model_dir, tmp_path):  # noqa: F811
    table, rows = _bench(tiny_model_dir, tmp_path, "-p", "16", "-g", "4", "-c", "1,3")
    for column in ("model", "backend", "test", "t/s", "ms/t", "concurrency", "throughput/s"):
        assert column in table
    assert [(r["test"], r["concurrency"]) for r in rows] == [
        ("pp 16", 1), ("tg 4", 1), ("pp 16", 3), ("tg 4", 3),
    ]  # fmt: skip
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_std"] >= 0
        assert abs(r["ms_per_token"] * r["tokens_per_s"] - 1000.0) < 1e-6 * 1000
        assert abs(r["throughput"] - r["tokens_per_s"] * r["concurrency"]) < 1e-9 * r["throughput"]
        assert r["backend"] == "cpu float32"


def test_bench_skips_a_phase_given_zero(tiny_model_dir, tmp_path):  # noqa: F811
    _, rows = _bench(tiny_model_dir, tmp_path, "-p", "0", "-g", "4", "-c", "2")
    assert [r["test"] for r in rows] == ["tg 4"]
    _, rows = _bench(tiny_model_dir, tmp_path, "-p", "8", "-g", "0", "-c", "2")
    assert [r["test"] for r in rows] == ["pp 8"]
