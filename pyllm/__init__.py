"""pyllm: a fast, small LLM inference engine.

from pyllm import LLM, SamplingParams
llm = LLM()  # the bundled SmolLM2-135M-Instruct
print(llm.generate("The capital of France is")[0].outputs[0].text)
"""

import os

# OpenMP worker threads that spin between parallel regions steal the cores from
# every other thread (the server's event loop, other processes): measured here, a
# decode step on a busy 2-core machine went from ~300 ms to ~19 ms with PASSIVE.
# It only takes effect if set before torch loads OpenMP; set OMP_WAIT_POLICY=ACTIVE
# to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Imported on first use, so `import pyllm.ops` stays light.
    if name == "LLM":
        from pyllm.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pyllm.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pyllm' has no attribute {name!r}")
