"""How ranks come to be: each holds about 1/N of the weights (measured resident
memory), and two torchrun launches (two "machines" on this one) serve a request."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import pyllm.ops as ops
from tests.distributed.conftest import make_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# ~45 M float32 parameters (180 MB): large enough that weights dominate a rank's memory.
WIDE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=4)  # fmt: skip
BASELINE = "import pyllm.distributed.worker, pyllm.engine.llm_engine, sys; sys.stdout.write('')"


def _baseline_rss() -> int:
    """RssAnon of a fresh interpreter that imported what a worker imports."""
    code = BASELINE + "; print(open('/proc/self/status').read())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("tp-wide"), "llama", **WIDE)


MEASURE = """
import json, sys
from pyllm import LLM
from tests.distributed.conftest import rss_anon_bytes
before = rss_anon_bytes()
llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory=0.002,
          tensor_parallel_size=int(sys.argv[2]))
procs = llm.engine.model.ranks.procs if int(sys.argv[2]) > 1 else []
print(json.dumps([rss_anon_bytes() - before, [rss_anon_bytes(p.pid) for p in procs]]))
llm.engine.close()
"""


def _engine_growth(model: str, tp: int) -> tuple[int, list[int]]:
    """In a fresh process: the RssAnon that building the engine added, and each worker's
    RssAnon."""
    out = subprocess.run([sys.executable, "-c", MEASURE, model, str(tp)], capture_output=True,
                         text=True, check=True, cwd=ROOT)  # fmt: skip
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def test_each_rank_holds_half_the_weights(wide_model):
    # Where packed_linear has no vector kernel for float32 (AVX2 builds), a rank keeps
    # the plain weights for few rows beside oneDNN's packed copy (linear.Linear).
    copies = 1 if ops.packed_linear_vectorized(torch.float32) else 2
    weights = 45_000_000 * 4 * copies
    whole, _ = _engine_growth(wide_model, 1)
    driver, (worker,) = _engine_growth(wide_model, 2)
    worker -= _baseline_rss()
    assert 0.8 * weights < whole < 1.3 * weights, whole
    for rank_bytes in (driver, worker):
        assert 0.35 < rank_bytes / whole < 0.65, (rank_bytes, whole)


@pytest.mark.skipif(
    importlib.util.find_spec("torch.distributed.run") is None, reason="torchrun missing"
)
def test_two_torchrun_launches_serve_a_request(tiny_llama):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import torchrun_two_nodes
    finally:
        sys.path.pop(0)
    result = torchrun_two_nodes.run(tiny_llama, [], "<5> <6> <7>", 6, timeout=120)
    assert result["status"] == 200, result
    assert result["answer"].count("<") == 6  # six byte-level tokens
    assert result["exit_codes"] == [0, 0]
