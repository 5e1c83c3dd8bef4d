"""pyllm: a fast, small LLM inference engine.

from pyllm import LLM, SamplingParams
llm = LLM()  # the bundled SmolLM2-135M-Instruct
print(llm.generate("The capital of France is")[0].outputs[0].text)
"""

# OpenMP threads are left to spin briefly between parallel regions (libgomp's default):
# a decode step runs ~120 small ops back to back, and OMP_WAIT_POLICY=PASSIVE (sleep at
# once) costs a wake-up per op. In one script here, 32 x 32 tokens fell from 647 to
# 453 tok/s and batch 1 from 59 to 39 tok/s with it. Set it if other work must share
# the cores.

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
