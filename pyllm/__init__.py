"""pyllm: a fast, small LLM inference engine.

from pyllm import LLM, SamplingParams
llm = LLM()  # the bundled SmolLM2-135M-Instruct
print(llm.generate("The capital of France is")[0].outputs[0].text)
"""

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
