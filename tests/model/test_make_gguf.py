"""benchmarks/make_gguf.py: random-weight GGUF files of real shapes. Files written to
tmp_path are reopened with gguf's own reader: tensor names, types (llama.cpp's mixes)
and shapes, metadata, and the statistics of the dequantized weights."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest

import pyllm.ops as ops

Q = gguf.GGMLQuantizationType


def _load_script():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "make_gguf.py"
    spec = importlib.util.spec_from_file_location("make_gguf", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_gguf"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


mg = _load_script()

SMOL_LAYER_NAMES = [
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
]


def smol_expected(file_type: str) -> dict[str, tuple[Q, tuple[int, ...]]]:
    """name -> (type, numpy shape) of a 2-layer smollm2-135m file. Its rows of 576 are
    not whole 256-weight blocks: Q4_K falls back to Q5_0, Q5_K to Q5_1 and Q6_K to Q8_0
    there."""
    weight = {
        "Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0, "Q4_K_M": Q.Q5_0, "Q5_K_M": Q.Q5_1, "F16": Q.F16,
        "MXFP4": Q.MXFP4,
    }[file_type]  # fmt: skip
    k_quant = {"Q4_K_M": Q.Q4_K, "Q5_K_M": Q.Q5_K}.get(file_type)
    # The tied head (token_embd) takes Q6_K (-> Q8_0) in the quantized mixes but Q8_0 and
    # MXFP4, Q8_0 itself.
    head = Q.F16 if file_type == "F16" else Q.Q8_0
    out = {"token_embd.weight": (head, (49152, 576)), "output_norm.weight": (Q.F32, (576,))}
    shapes = {
        "attn_norm": (576,),
        "ffn_norm": (576,),
        "attn_q": (576, 576),
        "attn_k": (192, 576),
        "attn_v": (192, 576),
        "attn_output": (576, 576),
        "ffn_gate": (1536, 576),
        "ffn_up": (1536, 576),
        "ffn_down": (576, 1536),
    }
    for i in range(2):
        for part in SMOL_LAYER_NAMES:
            qtype = Q.F32 if part.endswith("norm") else weight
            if k_quant is not None and part == "ffn_down":
                # 1536 columns are whole K-quant blocks; layer 1 of 2 is a "more bits" layer
                qtype = Q.Q6_K if i == 1 else k_quant
            if k_quant is not None and part == "attn_v" and i == 1:
                qtype = Q.Q8_0  # Q6_K's fallback
            out[f"blk.{i}.{part}.weight"] = (qtype, shapes[part])
    return out


def assert_weight_stats(name: str, values: np.ndarray, is_norm: bool) -> None:
    assert np.all(np.isfinite(values)), name
    if is_norm:
        assert abs(values.mean() - 1) < 0.01, name
        assert 0.01 < values.std() < 0.03, name
    else:
        assert abs(values.mean()) < 0.03 * mg.WEIGHT_STD, (name, values.mean())
        assert abs(values.std() / mg.WEIGHT_STD - 1) < 0.05, (name, values.std())


def dequantized(tensor, max_rows: int = 1024) -> np.ndarray:
    data = np.asarray(tensor.data)
    if data.ndim == 2:
        data = data[:max_rows]
    return np.asarray(gguf.quants.dequantize(data, tensor.tensor_type), dtype=np.float32)


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "F16", "MXFP4"])
def test_smollm2_shape_file(tmp_path, file_type):
    result = mg.write_gguf("smollm2-135m", file_type, tmp_path, layers=2, tokenizer=[])
    assert result.written
    assert result.path == tmp_path / f"smollm2-135m-2l.{file_type}.gguf"
    assert result.path.stat().st_size == result.size
    assert not list(tmp_path.glob("*.partial"))

    reader = gguf.GGUFReader(str(result.path))
    assert field(reader, "general.architecture") == "llama"
    assert field(reader, "general.file_type") == int(mg.FILE_TYPES[file_type][1])
    for key, value in {
        "llama.block_count": 2,
        "llama.embedding_length": 576,
        "llama.feed_forward_length": 1536,
        "llama.attention.head_count": 9,
        "llama.attention.head_count_kv": 3,
        "llama.rope.dimension_count": 64,
        "llama.vocab_size": 49152,
        "llama.context_length": 8192,
    }.items():
        assert field(reader, key) == value, key
    assert field(reader, "llama.rope.freq_base") == 100000.0

    expected = smol_expected(file_type)
    tensors = {t.name: t for t in reader.tensors}
    assert sorted(tensors) == sorted(expected)
    for name, (qtype, shape) in expected.items():
        t = tensors[name]
        assert (t.tensor_type, tuple(int(d) for d in reversed(t.shape))) == (qtype, shape), name
        assert_weight_stats(name, dequantized(t), is_norm=len(shape) == 1)
        if qtype == Q.Q8_0:  # symmetric quants, as llama.cpp's quantizer makes
            assert np.asarray(t.data)[:, 2:34].view(np.int8).min() == -127, name


def test_untied_k_quant_mix(tmp_path):
    """Rows of 2048 take the K-quants themselves; the untied output head is Q6_K."""
    result = mg.write_gguf("tinyllama-1.1b", "Q4_K_M", tmp_path, layers=1, tokenizer=[])
    reader = gguf.GGUFReader(str(result.path))
    tensors = {t.name: t for t in reader.tensors}
    types = {name: t.tensor_type for name, t in tensors.items()}
    assert types["token_embd.weight"] == Q.Q4_K
    assert types["output.weight"] == Q.Q6_K
    # a single layer is both the first and the last eighth: more bits
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == Q.Q6_K
    for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
        assert types[f"blk.0.{part}.weight"] == Q.Q4_K
    assert tuple(tensors["output.weight"].shape) == (2048, 49152)
    assert tuple(tensors["blk.0.attn_k.weight"].shape) == (2048, 256)
    assert tuple(tensors["blk.0.ffn_down.weight"].shape) == (5632, 2048)
    for name in ("output.weight", "blk.0.attn_v.weight", "blk.0.ffn_up.weight"):
        assert_weight_stats(name, dequantized(tensors[name], max_rows=256), is_norm=False)


def test_q4_k_m_layer_choice():
    """TinyLlama's 22 layers: the first and last eighth (0-1, 19-21) and every third
    layer from the first eighth on (4, 7, ..., 16) get Q6_K attn_v and ffn_down."""
    plans = {p.name: p.qtype for p in mg.plan_tensors(mg.SHAPES["tinyllama-1.1b"], "Q4_K_M")}
    more = {0, 1, 4, 7, 10, 13, 16, 19, 20, 21}
    for i in range(22):
        for part in ("attn_v", "ffn_down"):
            assert plans[f"blk.{i}.{part}.weight"] == (Q.Q6_K if i in more else Q.Q4_K)
        assert plans[f"blk.{i}.attn_q.weight"] == Q.Q4_K
    assert plans["output.weight"] == Q.Q6_K
    assert len(plans) == 1 + 22 * 9 + 2
    # Q4_0 files keep a Q6_K head, as llama.cpp's do; --pure gives one type to all
    q4_0 = {p.name: p.qtype for p in mg.plan_tensors(mg.SHAPES["llama-2-7b"], "Q4_0")}
    assert q4_0["output.weight"] == Q.Q6_K and q4_0["token_embd.weight"] == Q.Q4_0
    pure = mg.plan_tensors(mg.SHAPES["llama-2-7b"], "Q4_K_M", pure=True)
    assert {p.qtype for p in pure if len(p.shape) == 2} == {Q.Q4_K}


def read_metadata(path) -> dict:
    """The file's metadata: with pyllm's GGUF parser where it exists (gguf's reader
    takes seconds over a 49152-token vocabulary), else with gguf's."""
    try:
        from pyllm.model.gguf_file import GGUFFile
    except ImportError:
        reader = gguf.GGUFReader(str(path))
        return {key: f.contents() for key, f in reader.fields.items()}
    return GGUFFile(path).metadata


def test_real_tokenizer_copied(tmp_path):
    result = mg.write_gguf("smollm2-135m", "Q8_0", tmp_path, layers=1, verify=False)
    meta = read_metadata(result.path)
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "smollm"
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert len(meta["tokenizer.ggml.merges"]) == 48900
    assert len(meta["tokenizer.ggml.token_type"]) == 49152
    assert meta["tokenizer.ggml.bos_token_id"] == 1
    assert meta["tokenizer.ggml.eos_token_id"] == 2
    assert "im_start" in meta["tokenizer.chat_template"]
    assert meta["llama.vocab_size"] == 49152


def test_existing_file_kept_unless_forced(tmp_path):
    first = mg.write_gguf("smollm2-135m", "Q4_0", tmp_path, layers=1, tokenizer=[])
    mtime = first.path.stat().st_mtime_ns
    again = mg.write_gguf("smollm2-135m", "Q4_0", tmp_path, layers=1, tokenizer=[])
    assert not again.written and again.size == first.size
    assert first.path.stat().st_mtime_ns == mtime
    # a file of the wrong size is rewritten
    with open(first.path, "ab") as f:
        f.write(b"x")
    assert mg.write_gguf("smollm2-135m", "Q4_0", tmp_path, layers=1, tokenizer=[]).written
    forced = mg.write_gguf("smollm2-135m", "Q4_0", tmp_path, layers=1, tokenizer=[], force=True)
    assert forced.written and forced.path.stat().st_size == first.size
    assert not list(tmp_path.glob("*.partial"))


def test_same_seed_same_bytes():
    plan = mg.TensorPlan("w", (64, 512), Q.Q4_K)

    def data(seed, chunk_bytes=1 << 20):
        return b"".join(c.tobytes() for c in mg.tensor_chunks(plan, 3, seed, {}, chunk_bytes))

    assert len(data(0)) == plan.nbytes
    assert data(0) == data(0)
    assert data(0) != data(1)


def test_refuses_without_room(tmp_path, monkeypatch):
    monkeypatch.setattr(mg, "MIN_MEM_AVAILABLE", 1 << 60)
    with pytest.raises(MemoryError, match="memory available"):
        mg.write_gguf("smollm2-135m", "Q8_0", tmp_path, layers=1, tokenizer=[])
    monkeypatch.undo()
    monkeypatch.setattr(mg, "DISK_MARGIN", 1 << 60)
    with pytest.raises(OSError, match="GiB free"):
        mg.write_gguf("smollm2-135m", "Q8_0", tmp_path, layers=1, tokenizer=[])
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(shape_name="llama-3-8b"), "shape"),
        (dict(file_type="Q3_K_M"), "file_type"),
        (dict(layers=0), "layers"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, match):
    args = dict(shape_name="smollm2-135m", file_type="Q8_0", out_dir=tmp_path, tokenizer=[])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        mg.write_gguf(**args)


def test_qwen3_moe_plan():
    """Qwen3-30B-A3B: per layer a router (F32) and three 3-D expert tensors; ffn_down_exps
    takes Q6_K in the Q4_K_M mix where a dense ffn_down would."""
    shape = mg.SHAPES["qwen3-30b-a3b"]
    plans = {p.name: p for p in mg.plan_tensors(shape, "Q4_K_M")}
    assert plans["blk.0.ffn_gate_inp.weight"].shape == (128, 2048)
    assert plans["blk.0.ffn_gate_inp.weight"].qtype == Q.F32
    assert plans["blk.0.ffn_gate_exps.weight"].shape == (128, 768, 2048)
    assert plans["blk.0.ffn_down_exps.weight"].shape == (128, 2048, 768)
    assert plans["blk.0.attn_q_norm.weight"].shape == (128,)
    assert "blk.0.ffn_gate.weight" not in plans
    more = {i for i in range(48) if mg._more_bits(i, 48)}
    for i in range(48):
        down = plans[f"blk.{i}.ffn_down_exps.weight"].qtype
        assert down == (Q.Q6_K if i in more else Q.Q4_K)
        assert plans[f"blk.{i}.ffn_up_exps.weight"].qtype == Q.Q4_K
    total = sum(p.nbytes for p in plans.values())
    assert 16.5 < total / 2**30 < 17.5  # the real file, less Qwen's larger vocabulary


def test_moe_shape_file(tmp_path, monkeypatch):
    """A cut-down MoE shape written and read back: metadata, 3-D shapes, statistics."""
    small = mg.Shape(256, 512, 1, 4, 2, 64, 1e6, 1e-6, 4096, tied=False, arch="qwen3moe",
                     experts=4, experts_used=2, expert_ff=256, qk_norm=True)  # fmt: skip
    monkeypatch.setitem(mg.SHAPES, "tiny-moe", small)
    result = mg.write_gguf("tiny-moe", "Q8_0", tmp_path, tokenizer=[])
    reader = gguf.GGUFReader(str(result.path))
    assert field(reader, "general.architecture") == "qwen3moe"
    assert field(reader, "qwen3moe.expert_count") == 4
    assert field(reader, "qwen3moe.expert_used_count") == 2
    assert field(reader, "qwen3moe.expert_feed_forward_length") == 256
    tensors = {t.name: t for t in reader.tensors}
    gate = tensors["blk.0.ffn_gate_exps.weight"]
    assert gate.tensor_type == Q.Q8_0
    assert tuple(int(d) for d in reversed(gate.shape)) == (4, 256, 256)
    values = gguf.quants.dequantize(np.asarray(gate.data).reshape(-1, 272), Q.Q8_0)
    assert_weight_stats(gate.name, values, is_norm=False)


def test_gpt_oss_plan_and_file(tmp_path, monkeypatch):
    """gpt-oss-20b: MXFP4 experts and Q8_0 elsewhere (its releases' mix), biases and
    sinks in F32, post_attention_norm, the window and YaRN in the metadata."""
    plans = {p.name: p for p in mg.plan_tensors(mg.SHAPES["gpt-oss-20b"], "MXFP4")}
    assert plans["blk.0.ffn_gate_exps.weight"].shape == (32, 2880, 2880)
    assert plans["blk.0.ffn_gate_exps.weight"].qtype == Q.MXFP4
    assert plans["blk.0.attn_q.weight"].qtype == plans["output.weight"].qtype == Q.Q8_0
    assert plans["blk.0.ffn_down_exps.bias"].shape == (32, 2880)
    assert plans["blk.0.attn_sinks.weight"].shape == (64,)
    assert "blk.0.post_attention_norm.weight" in plans and "blk.0.ffn_norm.weight" not in plans
    assert 10.0 < sum(p.nbytes for p in plans.values()) / 2**30 < 11.0
    small = mg.Shape(256, 256, 2, 4, 2, 64, 150000.0, 1e-5, 4096, tied=False, arch="gpt-oss",
                     experts=4, experts_used=2, expert_ff=256, sliding_window=128,
                     original_context=512)  # fmt: skip
    monkeypatch.setitem(mg.SHAPES, "tiny-oss", small)
    reader = gguf.GGUFReader(str(mg.write_gguf("tiny-oss", "MXFP4", tmp_path, tokenizer=[]).path))
    assert field(reader, "general.architecture") == "gpt-oss"
    assert field(reader, "gpt-oss.attention.sliding_window") == 128
    assert field(reader, "gpt-oss.rope.scaling.type") == "yarn"
    assert field(reader, "gpt-oss.rope.scaling.original_context_length") == 512
    tensors = {t.name: t for t in reader.tensors}
    bias = np.asarray(tensors["blk.1.ffn_up_exps.bias"].data)
    assert bias.shape == (4, 256) and abs(bias.std() / mg.WEIGHT_STD - 1) < 0.1
    gate = tensors["blk.0.ffn_gate_exps.weight"]
    values = gguf.quants.dequantize(np.asarray(gate.data).reshape(-1, 17 * 8), Q.MXFP4)
    assert_weight_stats(gate.name, values, is_norm=False)


def test_q5_k_m_file_loads_as_strips(tmp_path):
    """A Q5_K_M file's Q5_K weights (layer 0's ffn_down of a 2-layer smollm2-135m file)
    load as strips where the kernels read them, and the model follows the widened
    weights as closely as with those weights left in GGUF rows."""
    from pyllm.model import loader_gguf
    from pyllm.model.loader import load_model
    from tests.model.conftest import assert_strips_follow_widened

    path = str(mg.write_gguf("smollm2-135m", "Q5_K_M", tmp_path, layers=2, tokenizer=[]).path)
    q5_k = ops.QUANT_TYPES["Q5_K"][0]
    strips, _ = load_model(path, dtype="float32")
    kept = ops.STRIPS_TYPES[q5_k] if ops.strips_native() else q5_k
    assert [p.qtype for p in strips.model.layers[0].mlp.down_proj.qparts] == [kept]
    packs = loader_gguf._packs_strips
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader_gguf, "_packs_strips", lambda m, t: t != q5_k and packs(m, t))
        rows, _ = load_model(path, dtype="float32")
    assert [p.qtype for p in rows.model.layers[0].mlp.down_proj.qparts] == [q5_k]
    widened, _ = load_model(path, dtype="float32", quantization=None)
    assert_strips_follow_widened(strips, rows, widened)
