"""A GGUF model whose weights stay quantized, against the same file widened to float32:
the bundled SmolLM2-135M-Instruct Q4_1 (Q8_0 token table), greedy tokens and logits,
and perplexity on a fixed text; an HF folder quantized at load; the memory check."""

from __future__ import annotations

import os

import pytest
import torch

from pyllm.engine.config import EngineConfig
from pyllm.engine.llm_engine import LLMEngine
from pyllm.model.default_model import default_model_path
from pyllm.model.linear import Linear
from pyllm.model.loader import estimate_weight_bytes, load_model
from pyllm.model.memory import InsufficientMemoryError
from pyllm.model.tokenizer import Tokenizer

from .conftest import hf_logits, make_hf_model, run_sequences

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]
TEXT = os.path.join(os.path.dirname(__file__), "data", "perplexity.txt")


@pytest.fixture(scope="module")
def smollm2():
    path = default_model_path()
    quantized, _ = load_model(path, torch.float32)
    widened, _ = load_model(path, torch.float32, quantization="none")
    return path, quantized, widened, Tokenizer.from_pretrained(path)


def test_weights_stay_quantized(smollm2):
    path, quantized, widened, _ = smollm2
    linears = [m for m in quantized.modules() if isinstance(m, Linear)]
    assert linears and all(m.qparts and m.weight is None for m in linears)
    assert quantized.model.embed_tokens.weight is None
    held = sum(p.qweight.numel() for m in linears for p in m.qparts)
    held += quantized.model.embed_tokens.qpart.qweight.numel()
    floats = sum(t.numel() * t.element_size() for t in quantized.state_dict().values())
    # The blocks as the file has them, plus the float32 norms: about the file's size.
    assert held + floats == estimate_weight_bytes(path, torch.float32)
    assert held + floats < os.path.getsize(path)
    assert estimate_weight_bytes(path, torch.float32, "none") > 5 * (held + floats)


def test_greedy_tokens_follow_the_widened_model(smollm2):
    _, quantized, widened, tokenizer = smollm2
    assert_greedy_follows(quantized, widened, [tokenizer.encode(p) for p in PROMPTS], tokenizer)


def assert_greedy_follows(
    quantized, widened, prompts, tokenizer, new_tokens: int = 32, min_mean: float = 0.999
) -> None:
    """new_tokens greedy tokens of the quantized model per prompt, and the widened model fed
    the same tokens: per prompt, either every greedy choice is the same, or, up to the step
    where the two part, the logits correlate >= 0.997 at every step. (The quantized path
    multiplies int8-rounded inputs, as llama.cpp does; the widened one float32 inputs. A
    step's correlation moves with the CPU's kernels: 0.9974-0.9994 on one AVX-512 CPU,
    above 0.999 on another.) Over all steps of all prompts the mean correlation stays
    >= min_mean."""
    run = run_sequences(quantized, prompts, max_new_tokens=new_tokens)
    all_corrs = []
    for prompt, generated, q_logits in zip(prompts, run.generated, run.logits, strict=True):
        forced = run_sequences(widened, [prompt + generated])
        w_logits = forced.logits[0][len(prompt) - 1 : -1]
        q_logits = q_logits[len(prompt) - 1 :]
        corrs = [
            torch.corrcoef(torch.stack([q, w]))[0, 1].item()
            for q, w in zip(q_logits, w_logits, strict=True)
        ]
        agree = [int(w.argmax()) == token for w, token in zip(w_logits, generated, strict=True)]
        all_corrs += corrs
        if all(agree):
            continue
        parted = agree.index(False)
        assert parted >= 1 and min(corrs[:parted]) >= 0.997, (
            f"{tokenizer.decode(prompt)!r} parts at step {parted}; correlations {corrs[:parted]}"
        )
    assert sum(all_corrs) / len(all_corrs) >= min_mean, all_corrs


def perplexity(model, tokens: list[int], chunk_size: int) -> float:
    logits = run_sequences(model, [tokens], chunk_size=chunk_size).logits[0]
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(tokens[1:]))
    return float(torch.exp(nll))


@pytest.fixture(scope="module")
def widened_perplexity(smollm2):
    _, _, widened, tokenizer = smollm2
    with open(TEXT, encoding="utf-8") as f:
        tokens = tokenizer.encode(f.read())
    assert 1500 <= len(tokens) <= 2600, len(tokens)
    w = perplexity(widened, tokens, 512)
    assert w < 40  # a real text to this model, not noise
    return tokens, w


def test_perplexity_within_one_percent_of_widened(smollm2, widened_perplexity):
    """Prompt chunks of 512 tokens: quant_linear's float panels."""
    tokens, w = widened_perplexity
    q = perplexity(smollm2[1], tokens, 512)
    assert abs(q - w) <= 0.01 * w, (q, w)


def test_perplexity_through_int8_tiles_within_one_percent(smollm2, widened_perplexity):
    """Chunks of 24 tokens take quant_linear's int8 tiles, as decode steps of a few
    sequences do (on the text's first 600 tokens, to keep the test short)."""
    tokens = widened_perplexity[0][:600]
    q = perplexity(smollm2[1], tokens, 24)
    w = perplexity(smollm2[2], tokens, 512)
    assert abs(q - w) <= 0.01 * w, (q, w)


@pytest.mark.parametrize(
    "qtype, min_corr", [("q8_0", 0.9995), ("q4_k", 0.98), ("q4_0", 0.97), ("mxfp4", 0.96)]
)
def test_hf_folder_quantized_at_load(tmp_path, qtype, min_corr):
    """quantization="q8_0" etc. on an HF folder: projections quantized with pyllm's own
    quantizer and multiplied by quant_linear; logits follow HF's float model."""
    hf_model = make_hf_model("llama", tmp_path, intermediate_size=512)
    model, _ = load_model(str(tmp_path), torch.float32, quantization=qtype)
    assert all(m.qparts for m in model.modules() if isinstance(m, Linear))
    tokens = list(range(3, 40, 3))
    logits = run_sequences(model, [tokens]).logits[0]
    expected = hf_logits(hf_model, tokens)
    corr = torch.corrcoef(torch.stack([logits.flatten(), expected.flatten()]))[0, 1].item()
    assert corr >= min_corr, corr


def test_model_larger_than_memory_is_refused_before_loading():
    """The weights and KV cache are compared with the memory available before anything is
    loaded, and the error names both figures and the ways out."""
    with pytest.raises(InsufficientMemoryError) as error:
        LLMEngine(EngineConfig(kv_cache_memory=100_000.0))
    message = str(error.value)
    assert "SmolLM2-135M-Instruct.Q4_1.gguf needs" in message
    assert "GiB KV cache" in message and "GiB of memory is available" in message
    assert "quantization='q4_k'" in message and "kv_cache_memory" in message


def test_quantization_option_is_checked():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="q3_k")
