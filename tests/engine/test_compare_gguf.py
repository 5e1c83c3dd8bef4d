"""benchmarks/compare.py's GGUF mode without llama.cpp: a pyllm worker on the bundled GGUF
answers with every field the parent reads, a bad --pyllm-arg is refused by name, and the
watchdog kills a worker past its RSS limit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pyllm.model.default_model import default_model_path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compare.py"
CASES = ("prefill", "decode_b1", "batch8", "batch32")


def _compare(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def gguf_file() -> str:
    return str(default_model_path())


def test_pyllm_worker_reports_every_field(gguf_file, tmp_path):
    workload = {
        "prefill": {"prompts": [list(range(100, 116))], "max_tokens": 1},
        "decode_b1": {"prompts": [list(range(200, 208))], "max_tokens": 4},
        "batch8": {"prompts": [list(range(300 + i, 307 + i)) for i in range(2)], "max_tokens": 3},
        "batch32": {"prompts": [list(range(400 + i, 405 + i)) for i in range(3)], "max_tokens": 2},
    }
    path = tmp_path / "workload.json"
    path.write_text(json.dumps(workload))
    run = _compare(
        "--worker", "pyllm", gguf_file, "--workload", str(path),
        "--pyllm-arg", "dtype=float32", "--pyllm-arg", "kv_cache_memory=0.05",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    answers = [line for line in run.stdout.splitlines() if line.startswith("@@")]
    assert len(answers) == 1, run.stdout[-2000:]
    result = json.loads(answers[0][2:])
    assert result["engine"] == "pyllm"
    assert result["dtype"].startswith("float32")
    assert result["load_s"] > 0
    for key in ("rss_after_load_bytes", "vm_hwm_bytes"):
        assert result[key] > 50 * 2**20, key  # at least the interpreter, torch and the weights
    assert result["vm_hwm_bytes"] >= result["rss_after_load_bytes"]
    assert set(result["rates"]) == set(CASES) and set(result["seconds"]) == set(CASES)
    for case in CASES:
        assert result["rates"][case] > 0 and result["seconds"][case] > 0
    # prefill: prompt tokens / time; the others: every output token / time
    assert result["rates"]["prefill"] * result["seconds"]["prefill"] == pytest.approx(16)
    assert result["rates"]["batch32"] * result["seconds"]["batch32"] == pytest.approx(3 * 2)
    assert len(result["decode_b1_tokens"]) == 4


def test_bad_pyllm_arg_is_refused_by_name(gguf_file):
    run = _compare("--gguf", gguf_file, "--pyllm-arg", "no_such_option=1", timeout=120)
    assert run.returncode != 0
    assert "--pyllm-arg no_such_option" in run.stderr
    run = _compare("--gguf", gguf_file, "--pyllm-arg", "dtype", timeout=120)
    assert run.returncode != 0 and "--pyllm-arg takes key=value" in run.stderr


def test_missing_gguf_file_is_refused_by_name(tmp_path):
    run = _compare("--gguf", str(tmp_path / "absent.gguf"), timeout=60)
    assert run.returncode != 0 and "--gguf" in run.stderr and "absent.gguf" in run.stderr


def test_watchdog_kills_a_worker_past_its_rss_limit(gguf_file, tmp_path):
    out = tmp_path / "rows.json"
    run = _compare(
        "--gguf", gguf_file, "--engines", "pyllm", "--quick", "--max-rss-gib", "0.15",
        "--json", str(out),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "killed: its anonymous RSS passed the limit 0.15 GiB" in run.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["engine"] == "pyllm" and row["status"] == "killed"
    (record,) = row["runs"]
    assert record["peak_anon_bytes"] > 0.15 * 2**30
