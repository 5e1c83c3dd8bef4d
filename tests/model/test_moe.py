"""Mixture-of-experts models (Qwen3-MoE, Mixtral) beyond the HF comparisons of
test_llama_hf.py and test_gguf.py: the checkpoint forms of their experts, the config
fields, clear errors, quantization at load, and what each rank of a split model holds
(tensor and expert parallelism, safetensors and GGUF), summed by hand."""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import pyllm.ops as ops
from pyllm.model.config import ModelConfig
from pyllm.model.loader import load_model
from pyllm.model.quantize import quantize_weight
from pyllm.model.shard import Shard, check_tensor_parallel
from tests.model.conftest import hf_logits, make_hf_model, run_sequences
from tests.model.test_gguf import write_gguf, write_hf_as_gguf
from tests.model.test_loader import assert_params_equal, expected_params

Q = gguf.GGMLQuantizationType

# How save_pretrained names the first expert's gate (transformers 5 writes Mixtral's
# original names back).
SAVED_NAME = {
    "qwen3moe": "model.layers.0.mlp.experts.0.gate_proj.weight",
    "mixtral": "model.layers.0.block_sparse_moe.experts.0.w1.weight",
}


@pytest.fixture(scope="module")
def qwen3moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3moe")
    return path, make_hf_model("qwen3moe", path)


def _saved_names(folder) -> list[str]:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return list(f.keys())


def _fused_copy(hf, src, dst, change=None) -> None:
    """The checkpoint with transformers' in-memory names: each layer's experts as the
    3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if change:
        change(tensors)
    save_file(tensors, dst / "model.safetensors")


@pytest.mark.parametrize("kind", ["qwen3moe", "mixtral"])
def test_per_expert_and_fused_checkpoints_load_alike(tmp_path, kind):
    hf = make_hf_model(kind, tmp_path / "saved")
    assert SAVED_NAME[kind] in _saved_names(tmp_path / "saved")
    model, config = load_model(tmp_path / "saved", dtype="float32")
    expected = expected_params(hf, config)
    assert_params_equal(model, expected)
    _fused_copy(hf, tmp_path / "saved", tmp_path / "fused")
    assert "model.layers.0.mlp.experts.gate_up_proj" in _saved_names(tmp_path / "fused")
    model, _ = load_model(tmp_path / "fused", dtype="float32")
    assert_params_equal(model, expected)


def test_config_fields_from_hf_and_gguf():
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 2,
           "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3],
           "norm_topk_prob": True}  # fmt: skip
    config = ModelConfig.from_hf_dict(raw)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        8, 2, 32,
    )  # fmt: skip
    assert config.norm_topk_prob and config.qk_norm
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    mixtral = {**raw, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4}
    del mixtral["num_experts"]
    config = ModelConfig.from_hf_dict(mixtral)
    assert (config.num_experts, config.moe_intermediate_size, config.norm_topk_prob) == (
        4, 96, True,
    )  # fmt: skip
    assert all(config.is_moe_layer(i) for i in range(4)) and not config.qk_norm
    # A Mixtral GGUF file is llama's with expert keys; layers without a router are dense.
    meta = {"general.architecture": "llama", "llama.embedding_length": 64,
            "llama.attention.head_count": 2, "llama.vocab_size": 64,
            "llama.feed_forward_length": 96, "llama.block_count": 2,
            "llama.context_length": 128, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.expert_count": 8, "llama.expert_used_count": 2}  # fmt: skip
    names = {"output.weight", "blk.0.ffn_gate_inp.weight", "blk.1.ffn_gate_inp.weight"}
    config = ModelConfig.from_gguf_metadata(meta, names, "m.gguf")
    assert (config.num_experts, config.moe_intermediate_size, config.norm_topk_prob) == (
        8, 96, True,
    )  # fmt: skip
    config = ModelConfig.from_gguf_metadata(meta, names - {"blk.1.ffn_gate_inp.weight"}, "m.gguf")
    assert config.mlp_only_layers == (1,)
    unnormed = {**meta, "llama.expert_weights_norm": False}
    assert not ModelConfig.from_gguf_metadata(unnormed, names, "m.gguf").norm_topk_prob
    with pytest.raises(NotImplementedError, match=r"shared experts \(llama\.expert_shared_count"):
        ModelConfig.from_gguf_metadata({**meta, "llama.expert_shared_count": 2}, names, "m.gguf")


def test_bad_expert_configs_are_named():
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_experts": 8, "num_experts_per_tok": 9, "moe_intermediate_size": 32}  # fmt: skip
    with pytest.raises(ValueError, match=r"num_experts_per_tok must lie in \[1, num_experts=8\]"):
        ModelConfig.from_hf_dict(raw, source="moe/config.json")
    with pytest.raises(ValueError, match=r"moe_intermediate_size must be a positive int"):
        ModelConfig.from_hf_dict({**raw, "num_experts_per_tok": 2, "moe_intermediate_size": None})
    with pytest.raises(ValueError, match=r"mlp_only_layers names layers \[5\]"):
        ModelConfig.from_hf_dict({**raw, "num_experts_per_tok": 2, "mlp_only_layers": [5]})
    config = ModelConfig.from_hf_dict({**raw, "num_experts_per_tok": 2, "num_experts": 6})
    with pytest.raises(ValueError, match=r"num_experts \(6, expert parallel\)"):
        check_tensor_parallel(config, 4, expert_parallel=True)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(32\)"):
        check_tensor_parallel(config, 3)


def test_bad_expert_tensors_are_named(tmp_path, qwen3moe_dir):
    src, hf = qwen3moe_dir

    def copy(name, change):
        dst = tmp_path / name
        dst.mkdir()
        shutil.copy(src / "config.json", dst / "config.json")
        with safe_open(src / "model.safetensors", framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        change(tensors)
        save_file(tensors, dst / "model.safetensors")
        return dst

    missing = copy("missing", lambda t: t.pop("model.layers.1.mlp.experts.3.down_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.experts\.3"
                                         r"\.down_proj\.weight$"):  # fmt: skip
        load_model(missing, dtype="float32")

    def short_up(t):
        name = "model.layers.0.mlp.experts.5.up_proj.weight"
        t[name] = t[name][:-1].clone()

    with pytest.raises(ValueError, match=r"experts\.5\.up_proj\.weight' has shape \(127, 256\), "
                                         r"the model expects \(128, 256\)"):  # fmt: skip
        load_model(copy("short", short_up), dtype="float32")

    def ninth_expert(t):
        t["model.layers.0.mlp.experts.8.up_proj.weight"] = torch.zeros(128, 256)

    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.8\."):
        load_model(copy("ninth", ninth_expert), dtype="float32")

    def short_fused(t):
        t["model.layers.0.mlp.experts.gate_up_proj"] = t["model.layers.0.mlp.experts.gate_up_proj"][
            :, :-2
        ].contiguous()

    _fused_copy(hf, src, tmp_path / "fused", short_fused)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' has "
                                         r"shape \(8, 254, 256\)"):  # fmt: skip
        load_model(tmp_path / "fused", dtype="float32")


def test_bad_gguf_expert_tensors_are_named(tmp_path, qwen3moe_dir):
    _, hf = qwen3moe_dir
    write_hf_as_gguf(hf, tmp_path / "m.gguf", "qwen3moe", qtype=Q.Q8_0)
    metadata, tensors = _read_back(tmp_path / "m.gguf")
    for keep_quantized in ("auto", "none"):
        cut = dict(tensors)
        up = cut["blk.0.ffn_up_exps.weight"]
        cut["blk.0.ffn_up_exps.weight"] = (up[0][:7], up[1])  # 7 experts of 8
        write_gguf(tmp_path / "cut.gguf", "qwen3moe", metadata, cut)
        shapes = r"\(7, 128, 256\), the model expects \(8, 128, 256\)"
        with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up_exps\.weight' has shape " + shapes):
            load_model(tmp_path / "cut.gguf", quantization=keep_quantized)
    gone = {k: v for k, v in tensors.items() if k != "blk.0.ffn_down_exps.weight"}
    write_gguf(tmp_path / "gone.gguf", "qwen3moe", metadata, gone)
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.0\.mlp\.experts\."
                                         r"down_proj\.weight \(every expert\)"):  # fmt: skip
        load_model(tmp_path / "gone.gguf")


def _read_back(path) -> tuple[dict, dict]:
    """A GGUF file's qwen3moe metadata and its tensors as write_gguf takes them."""
    reader = gguf.GGUFReader(str(path))
    metadata = {k: f.contents() for k, f in reader.fields.items()
                if k.startswith(("qwen3moe.", "tokenizer."))}  # fmt: skip
    return metadata, {t.name: (np.array(t.data), t.tensor_type) for t in reader.tensors}


@pytest.mark.parametrize("qtype, min_corr", [("q8_0", 0.999), ("q4_k", 0.98)])
def test_hf_folder_quantizes_its_experts_at_load(tmp_path, qtype, min_corr):
    """Every expert's three projections become GGUF blocks, one uint8 tensor each
    (down's rows of 256 are whole Q4_K blocks); the router stays in floats."""
    hf = make_hf_model("qwen3moe", tmp_path, moe_intermediate_size=256)
    model, _ = load_model(tmp_path, torch.float32, quantization=qtype)
    moe = model.model.layers[0].mlp
    row_bytes = {"q8_0": 256 // 32 * 34, "q4_k": 256 // 256 * 144}[qtype]
    for proj in moe.projections():
        assert proj.weight is None and proj.qweight.dtype == torch.uint8
        assert tuple(proj.qweight.shape) == (8, 256, row_bytes)
    assert moe.gate.weight.dtype == torch.float32
    tokens = list(range(3, 40, 3))
    logits = run_sequences(model, [tokens]).logits[0]
    expected = hf_logits(hf, tokens)
    corr = torch.corrcoef(torch.stack([logits.flatten(), expected.flatten()]))[0, 1].item()
    assert corr >= min_corr, corr


# ---------------------------------------------------------------------------
# What each rank holds: two shards of a split model, built in this process with their
# all-reduce left to the test, sum to the whole model's MoE layer.


class _Rank:
    """A rank's place in a group, without the group: the test sums the outputs."""

    def __init__(self, rank: int, expert_parallel: bool) -> None:
        self.shard = Shard(rank, 2, expert_parallel)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


def _shards_sum_to_whole(path, expert_parallel: bool, tolerance: float = 2e-4):
    whole, config = load_model(path, dtype="float32")
    ranks = [load_model(path, dtype="float32", tp=_Rank(r, expert_parallel))[0] for r in range(2)]
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(3))
    layer = next(i for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
    expected = whole.model.layers[layer].mlp(x)
    summed = sum(rank.model.layers[layer].mlp(x) for rank in ranks)
    error = (summed - expected).norm() / expected.norm()
    assert error < tolerance, error
    return whole.model.layers[layer].mlp, [rank.model.layers[layer].mlp for rank in ranks]


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tensor", "expert"])
@pytest.mark.parametrize("source", ["safetensors", "gguf-f32", "gguf-q8_0"])
def test_two_shards_sum_to_the_whole_layer(tmp_path, qwen3moe_dir, source, expert_parallel):
    path, hf = qwen3moe_dir
    if source != "safetensors":
        path = tmp_path / "m.gguf"
        write_hf_as_gguf(hf, path, "qwen3moe", qtype=Q.Q8_0 if source == "gguf-q8_0" else None)
    whole, ranks = _shards_sum_to_whole(path, expert_parallel)
    inter = whole.experts.gate_proj.out_features
    for r, moe in enumerate(ranks):
        gate, down = moe.experts.gate_proj, moe.experts.down_proj
        torch.testing.assert_close(moe.gate.weight, whole.gate.weight)  # replicated
        if expert_parallel:  # whole experts: 4 of 8 each
            assert moe.expert_start == 4 * r and gate.num_experts == 4
            assert (gate.out_features, down.in_features) == (inter, inter)
        else:  # every expert's half of the intermediate rows
            assert gate.num_experts == 8 and (gate.out_features, down.in_features) == (64, 64)
        if source == "gguf-q8_0":  # the file's blocks, never widened: the right share
            assert gate.weight is None and down.qweight.dtype == torch.uint8
            assert gate.qtype == whole.experts.gate_proj.qtype  # rows or strips alike
            rows = slice(64 * r, 64 * (r + 1))
            experts = slice(4 * r, 4 * (r + 1)) if expert_parallel else slice(None)
            whole_gate = whole.experts.gate_proj.dense_weight()[experts]
            ours = whole_gate if expert_parallel else whole_gate[:, rows]
            assert torch.equal(gate.dense_weight(), ours)
            cols = slice(64 * r, 64 * (r + 1)) if not expert_parallel else slice(None)
            whole_down = whole.experts.down_proj.dense_weight()[experts]
            assert torch.equal(down.dense_weight(), whole_down[:, :, cols])


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tensor", "expert"])
def test_biases_split_as_their_weights(tmp_path, qwen3moe_dir, expert_parallel):
    """A router bias and per-expert biases (gpt-oss has both; here added to a qwen3moe
    file): gate/up biases split as their rows, down's counted once (rank 0's) under
    tensor parallelism, each rank its experts' under expert parallelism."""
    _, hf = qwen3moe_dir
    write_hf_as_gguf(hf, tmp_path / "m.gguf", "qwen3moe", qtype=Q.Q8_0)
    metadata, tensors = _read_back(tmp_path / "m.gguf")
    rng = np.random.default_rng(0)
    for i in range(hf.config.num_hidden_layers):
        b = f"blk.{i}."
        tensors[b + "ffn_gate_inp.bias"] = rng.standard_normal(8).astype(np.float32)
        for name, rows in (("gate", 128), ("up", 128), ("down", 256)):
            tensors[f"{b}ffn_{name}_exps.bias"] = rng.standard_normal((8, rows)).astype(np.float32)
    write_gguf(tmp_path / "bias.gguf", "qwen3moe", metadata, tensors)
    whole, ranks = _shards_sum_to_whole(tmp_path / "bias.gguf", expert_parallel)
    assert whole.gate.bias is not None and whole.experts.down_proj.bias.shape == (8, 256)
    for r, moe in enumerate(ranks):
        down = moe.experts.down_proj.bias
        if expert_parallel:
            torch.testing.assert_close(down, whole.experts.down_proj.bias[4 * r : 4 * (r + 1)])
        else:
            assert moe.experts.gate_proj.bias.shape == (8, 64)
            assert bool(down.any()) == (r == 0)


def test_a_share_of_partial_blocks_is_widened_on_its_rank(tmp_path):
    """Down's rows of 256 are one Q4_K block: split in two, a rank's 128 values are no
    whole block, so (as for dense down_proj) each rank widens its share."""
    hf = make_hf_model("qwen3moe", tmp_path / "hf", moe_intermediate_size=256)
    write_hf_as_gguf(hf, tmp_path / "m.gguf", "qwen3moe", qtype=Q.Q8_0)
    metadata, tensors = _read_back(tmp_path / "m.gguf")
    for name, (raw, qtype) in tensors.items():
        if name.endswith("ffn_down_exps.weight"):  # Q8_0 -> floats -> Q4_K, per expert
            w = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
            blocks = torch.stack([quantize_weight(w[e], "q4_k") for e in range(w.shape[0])])
            tensors[name] = (blocks.numpy(), Q.Q4_K)
    write_gguf(tmp_path / "q4k.gguf", "qwen3moe", metadata, tensors)
    # The whole layer multiplies down's blocks by quantized activations (as quant_linear
    # does; 1.7% off a float product with the same weights here), the ranks multiply
    # their widened floats: they agree to that rounding.
    whole, ranks = _shards_sum_to_whole(tmp_path / "q4k.gguf", False, tolerance=3e-2)
    # Q4_K, or its strips where this build reads them (ops.pack_strips)
    assert whole.experts.down_proj.qtype in (Q.Q4_K, ops.STRIPS_TYPES[Q.Q4_K])
    assert whole.experts.down_proj.weight is None
    for moe in ranks:
        assert moe.experts.down_proj.qweight is None
        assert moe.experts.down_proj.weight.shape == (8, 256, 128)
        assert moe.experts.gate_proj.qweight is not None  # whole Q8_0 blocks stay


# ---------------------------------------------------------------------------
# The memory check before loading: Qwen3-30B-A3B in Q4_K_M.

# Its shapes, and llama.cpp's Q4_K_M mix (Q4_K; Q6_K for attn_v, the LM head and half
# the layers' ffn_down_exps).
_A3B = dict(layers=48, hidden=2048, q=4096, kv=512, head_dim=128, experts=128, inter=768,
            vocab=151936)  # fmt: skip


def _a3b_tensors() -> dict[str, tuple[tuple[int, ...], Q]]:
    a = _A3B
    out = {"token_embd.weight": ((a["vocab"], a["hidden"]), Q.Q4_K),
           "output.weight": ((a["vocab"], a["hidden"]), Q.Q6_K),
           "output_norm.weight": ((a["hidden"],), Q.F32)}  # fmt: skip
    for i in range(a["layers"]):
        b, e = f"blk.{i}.", a["experts"]
        down = Q.Q6_K if i % 2 == 0 else Q.Q4_K
        out.update({
            b + "attn_norm.weight": ((a["hidden"],), Q.F32),
            b + "ffn_norm.weight": ((a["hidden"],), Q.F32),
            b + "attn_q_norm.weight": ((a["head_dim"],), Q.F32),
            b + "attn_k_norm.weight": ((a["head_dim"],), Q.F32),
            b + "attn_q.weight": ((a["q"], a["hidden"]), Q.Q4_K),
            b + "attn_k.weight": ((a["kv"], a["hidden"]), Q.Q4_K),
            b + "attn_v.weight": ((a["kv"], a["hidden"]), Q.Q6_K),
            b + "attn_output.weight": ((a["hidden"], a["q"]), Q.Q4_K),
            b + "ffn_gate_inp.weight": ((e, a["hidden"]), Q.F32),
            b + "ffn_gate_exps.weight": ((e, a["inter"], a["hidden"]), Q.Q4_K),
            b + "ffn_up_exps.weight": ((e, a["inter"], a["hidden"]), Q.Q4_K),
            b + "ffn_down_exps.weight": ((e, a["hidden"], a["inter"]), down),
        })  # fmt: skip
    return out


def _write_table_only(path, tensors) -> int:
    """A GGUF file with the tensor table and no weights (a sparse hole where they would
    be); returns the weights' bytes in the file."""
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, value in {"context_length": 40960, "embedding_length": _A3B["hidden"],
                       "block_count": _A3B["layers"], "feed_forward_length": 6144,
                       "attention.head_count": 32, "attention.head_count_kv": 4,
                       "attention.key_length": 128, "vocab_size": _A3B["vocab"],
                       "expert_count": 128, "expert_used_count": 8,
                       "expert_feed_forward_length": 768}.items():  # fmt: skip
        writer.add_uint32(f"qwen3moe.{key}", value)
    writer.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    total = 0
    for name, (shape, qtype) in tensors.items():
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * type_size
        writer.add_tensor_info(name, shape, np.float32, nbytes, raw_dtype=qtype)
        total += nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    size = path.stat().st_size
    os.truncate(path, size + total + 32 * (len(tensors) + 1))
    return total


def test_memory_check_counts_kept_experts_as_file_bytes(tmp_path, monkeypatch):
    """A 17-18 GB Qwen3-30B-A3B Q4_K_M file: its 3-D expert tensors stay in their
    blocks, so they count as their bytes in the file (not as bfloat16, 58 GB), and a
    machine with 16 GiB available is refused before anything is read."""
    from pyllm.engine.config import EngineConfig
    from pyllm.engine.llm_engine import LLMEngine
    from pyllm.model.loader import estimate_weight_bytes
    from pyllm.model.memory import InsufficientMemoryError, check_fits

    tensors = _a3b_tensors()
    path = tmp_path / "Qwen3-30B-A3B-Q4_K_M.gguf"
    file_bytes = _write_table_only(path, tensors)
    floats = sum(int(np.prod(s)) * 4 for s, q in tensors.values() if q == Q.F32)
    estimate = estimate_weight_bytes(path, torch.bfloat16)
    assert estimate == file_bytes - floats + floats // 2  # F32 norms and routers as bf16
    assert 17e9 < estimate < 19e9, estimate
    check_fits(estimate, 2**30, path.name, available=24 * 2**30)  # fits in 24 GiB
    monkeypatch.setattr("pyllm.engine.llm_engine.available_memory_bytes", lambda: 16 * 2**30)
    with pytest.raises(InsufficientMemoryError, match=r"Q4_K_M\.gguf needs 1[78]\.\d GiB for "
                                                     r"its weights .* only 16\.0 GiB"):  # fmt: skip
        LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", device="cpu"))
