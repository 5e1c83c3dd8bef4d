"""pyllm: a fast, small LLM inference engine.

from pyllm import LLM, SamplingParams
llm = LLM()  # the bundled SmolLM2-135M-Instruct
print(llm.generate("The capital of France is")[0].outputs[0].text)
"""

import os

# How long an idle OpenMP thread spins before it sleeps. A decode step runs ~120 small
# ops back to back, microseconds apart: a thread that sleeps at once (PASSIVE) pays a
# wake-up per op, ~40% of decode throughput here. One that spins long (libgomp's
# default, ~300k spins) burns whole time slices waiting for a descheduled peer when the
# cores are shared: batch-1 decode fell to 2-3 tok/s on this 2-core machine under load.
# Measured (batch-1 fp32 decode, SmolLM2, 2 cores; quiet / both cores busy with `yes`):
# 3000 spins 33-35 / 11.7 tok/s, 30000 36-37 / 14-17, 300000 37 / 3.3-15. 30000 covers
# the gaps inside a step and still gives the core up soon when it is shared.
# libgomp reads these when it loads (at `import torch`), so import pyllm first or set
# them in the environment; a GOMP_SPINCOUNT would override an OMP_WAIT_POLICY you set.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")

__version__ = "0.1.0"
__all__ = ["LLM", "PoolingParams", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Imported on first use, so `import pyllm.ops` stays light.
    if name == "LLM":
        from pyllm.entrypoints.llm import LLM

        return LLM
    if name == "PoolingParams":
        from pyllm.engine.pooling import PoolingParams

        return PoolingParams
    if name == "SamplingParams":
        from pyllm.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pyllm' has no attribute {name!r}")
