"""pyllm's Llama-family model against HF transformers on tiny random models.

Each family's model is created and saved with transformers, loaded by pyllm, and run
on a batch of sequences of different lengths: in one prefill, in prompt chunks mixed
with decode steps, and with 16 decode steps. Every position's logits must match HF's
full forward over the whole sequence (float32, max abs diff < 1e-3; logits are of
order one).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pyllm.attention.paged as paged
from pyllm.attention.contiguous import CONTIGUOUS
from pyllm.model.loader import load_model
from tests.model.conftest import hf_logits, make_hf_model, run_sequences

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500000.0,
}

FAMILIES = {
    # Llama 3: GQA, llama3 rope scaling.
    "llama3": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    # SmolLM2-like: tied embeddings, rope theta 100000.
    "smollm2": (
        "llama",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e5},
        },
    ),
    # Mistral with head_dim set apart from hidden_size / num_heads (256 != 192).
    "mistral": ("mistral", {"hidden_size": 192, "num_key_value_heads": 1}),
    # Mistral v0.1: every layer within a sliding window, shorter than the sequences and
    # than two of the test's block sizes.
    "mistral-window": ("mistral", {"sliding_window": 12}),
    # Qwen2: biases on q, k, v.
    "qwen2": ("qwen2", {}),
    # Qwen3: per-head q/k RMSNorm, untied and tied LM heads.
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    # Qwen3 with YaRN over an original context shorter than the test sequences.
    "qwen3-yarn": (
        "qwen3",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    # Phi-3: q/k/v and gate/up fused in the checkpoint; LongRoPE (the test sequences stay
    # within the pretraining context of 64, where HF and pyllm both use short_factor).
    "phi3": ("phi3", {}),
    "phi3-longrope": (
        "phi3",
        {
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(32)],
                "long_factor": [2.0 + 0.5 * i for i in range(32)],
                "original_max_position_embeddings": 64,
            },
        },
    ),
    # Qwen3-MoE: 8 experts, each token's best 2, their weights renormalized or not;
    # a dense layer between sparse ones (mlp_only_layers).
    "qwen3moe": (
        "qwen3moe",
        {"num_hidden_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": True},
    ),
    "qwen3moe-unnormed": ("qwen3moe", {"norm_topk_prob": False}),
    # Mixtral: Mistral's attention within a sliding window, every layer sparse.
    "mixtral": ("mixtral", {"sliding_window": 12}),
    # gpt-oss: attention sinks and biases, windowed and full layers in turn, YaRN, experts
    # with biases behind a router with a bias, a SwiGLU clamped at 1.5 (so that the clamp
    # engages on these weights).
    "gpt-oss": ("gpt_oss", {"swiglu_limit": 1.5}),
    # Gemma 3: a sliding-window layer and a global one (each its rope base), softmax
    # scale from query_pre_attn_scalar, GELU gate, sandwich norms of (1 + w). The
    # window (16) is shorter than every test sequence.
    "gemma3": (
        "gemma3",
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 16,
            "query_pre_attn_scalar": 48,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
        },
    ),
}

SEQ_LENS = [41, 23, 18]
MAX_ABS_DIFF = 1e-3


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    kind, overrides = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(kind, path, **overrides)
    model, _ = load_model(path, dtype="float32")
    gen = torch.Generator().manual_seed(1)
    tokens = [
        torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in SEQ_LENS
    ]
    expected = [hf_logits(hf, t) for t in tokens]
    return model, tokens, expected, path


def assert_matches_hf(result, expected) -> None:
    for i, (ours, ref) in enumerate(zip(result.logits, expected, strict=True)):
        assert ours.shape == ref.shape, f"sequence {i}"
        assert ref.abs().max() > 1.0  # the comparison is not between near-zero logits
        diff = (ours - ref).abs().max().item()
        assert diff < MAX_ABS_DIFF, f"sequence {i}: max abs diff {diff:.2e}"


def test_one_prefill(family):
    model, tokens, expected, _ = family
    result = run_sequences(model, tokens, block_size=16)
    assert result.num_steps == 1
    assert_matches_hf(result, expected)


def test_prompt_chunks_mixed_with_decodes(family):
    model, tokens, expected, _ = family
    prompt_lens = [n - 4 for n in SEQ_LENS]
    result = run_sequences(model, tokens, prompt_lens, chunk_size=7, block_size=8)
    assert result.mixed_steps > 0  # short prompts decode while long ones still prefill
    assert_matches_hf(result, expected)


def test_16_decode_steps(family):
    model, tokens, expected, _ = family
    prompt_lens = [n - 16 for n in SEQ_LENS]
    result = run_sequences(model, tokens, prompt_lens, block_size=32)
    assert result.num_steps == 17
    assert_matches_hf(result, expected)


def test_decode_with_paged_attention_v2(family, monkeypatch):
    """Long contexts decode with v2; lower the switch so these short ones take it."""
    monkeypatch.setattr(paged, "V2_MIN_SEQ_LEN", 0)
    model, tokens, expected, _ = family
    result = run_sequences(model, tokens, [n - 5 for n in SEQ_LENS], block_size=16)
    assert_matches_hf(result, expected)


def test_unpacked_weights(family):
    """The plain F.linear path (CUDA, or torch without oneDNN) gives the same logits."""
    _, tokens, expected, path = family
    model, _ = load_model(path, dtype="float32", pack_weights=False)
    assert model.model.layers[0].self_attn.qkv_proj.packed_weight is None
    result = run_sequences(model, tokens, [n - 3 for n in SEQ_LENS], chunk_size=16)
    assert_matches_hf(result, expected)


def test_bfloat16_close_to_float32_reference(tmp_path):
    hf = make_hf_model("llama", tmp_path)
    model, _ = load_model(tmp_path, dtype="bfloat16")
    tokens = [list(range(3, 40)), list(range(100, 112))]
    result = run_sequences(model, tokens, [30, 5], chunk_size=16)
    for ours, t in zip(result.logits, tokens, strict=True):
        ref = hf_logits(hf, t)
        # bf16 keeps ~3 significant digits through 2 layers: errors of a few 1e-2.
        assert (ours - ref).abs().max() < 0.15
        assert torch.equal(ours.argmax(-1)[-5:], ref.argmax(-1)[-5:])


def test_compute_logits_selects_rows(family):
    model, tokens, expected, _ = family
    hidden = torch.randn(5, model.config.hidden_size)
    all_rows = model.compute_logits(hidden)
    picked = model.compute_logits(hidden, torch.tensor([4, 1]))
    assert picked.dtype == torch.float32 and picked.shape == (2, model.config.vocab_size)
    torch.testing.assert_close(picked, model.compute_logits(hidden[[4, 1]]))
    # 2 rows take the small-batch kernel and 5 oneDNN: the same up to float rounding.
    torch.testing.assert_close(picked, all_rows[[4, 1]], atol=1e-4, rtol=1e-4)


def test_bad_step_inputs_are_named(family):
    model, tokens, _, _ = family
    caches = model.allocate_kv_cache(paged.PAGED, 4, 16)
    meta = paged.PagedMetadata(
        slot_mapping=torch.tensor([0, 1, 64]),  # 64 is past 4 blocks of 16
        num_prefill_tokens=3,
        prefill_query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([3], dtype=torch.int32),
        prefill_block_tables=torch.tensor([[0]], dtype=torch.int32),
        max_query_len=3,
    )
    ids, pos = torch.tensor([1, 2, 3]), torch.arange(3)
    with pytest.raises(ValueError, match="slot_mapping"):
        model(ids, pos, meta, caches)
    meta.slot_mapping = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="kv_caches has 1 layers"):
        model(ids, pos, meta, dataclasses.replace(caches, layers=caches.layers[:1]))
    with pytest.raises(ValueError, match="paged metadata but kv_cache is a contiguous cache"):
        model(ids, pos, meta, model.allocate_kv_cache(CONTIGUOUS, 2))
    with pytest.raises(ValueError, match="positions must lie"):
        model(ids, pos + model.max_model_len, meta, caches)
    meta.prefill_block_tables = torch.tensor([[7]], dtype=torch.int32)
    with pytest.raises(
        ValueError, match=r"prefill_block_tables holds block numbers outside \[0, 4\)"
    ):
        model(ids, pos, meta, caches)
