"""Config parsing and the safetensors loader: where each tensor lands, clear errors for
bad folders, and the loader's peak memory."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from safetensors.torch import save_file

from pyllm.model.config import ModelConfig, rope_inv_freq
from pyllm.model.dtype import cpu_has_native_bf16, resolve_dtype
from pyllm.model.linear import Linear, can_pack_weight_words
from pyllm.model.loader import load_model
from pyllm.model.moe import ExpertProjection
from tests.model.conftest import TINY, make_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf = make_hf_model("llama", path)
    return path, hf


def expected_params(hf_model, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our fused parameters, built from HF's state dict by plain concatenation."""
    sd = hf_model.state_dict()
    out = {"model.embed_tokens.weight": sd["model.embed_tokens.weight"]}
    out["model.norm.weight"] = sd["model.norm.weight"]
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
            fused = sd.get(p + f"self_attn.qkv_proj.{kind}")  # Phi-3 stores it fused
            if fused is None:
                fused = torch.cat([sd[p + f"self_attn.{x}_proj.{kind}"] for x in "qkv"])
            out[p + f"self_attn.qkv_proj.{kind}"] = fused
        out[p + "self_attn.o_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        if p + "self_attn.sinks" in sd:  # gpt-oss
            out.update(_gpt_oss_params(sd, p))
            continue
        if p + "mlp.gate.weight" in sd:  # a sparse layer: HF keeps gate/up fused, [E, 2I, H]
            gate, up = sd[p + "mlp.experts.gate_up_proj"].chunk(2, dim=1)
            out[p + "mlp.gate.weight"] = sd[p + "mlp.gate.weight"]
            out[p + "mlp.experts.gate_proj.weight"] = gate
            out[p + "mlp.experts.up_proj.weight"] = up
            out[p + "mlp.experts.down_proj.weight"] = sd[p + "mlp.experts.down_proj"]
            continue
        gate_up = sd.get(p + "mlp.gate_up_proj.weight")
        if gate_up is None:
            gate_up = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        out[p + "mlp.gate_up_proj.weight"] = gate_up
        out[p + "mlp.down_proj.weight"] = sd[p + "mlp.down_proj.weight"]
    # Every norm (the layers' two, q/k norms, Gemma's four) keeps HF's name.
    out.update({name: t for name, t in sd.items() if name.endswith("norm.weight")})
    return out


def _gpt_oss_params(sd: dict, p: str) -> dict[str, torch.Tensor]:
    """gpt-oss's layer: attention's o bias and sinks; the router (HF: mlp.router); experts
    stored as x @ W with gate and up interleaved, and their biases."""
    gate_up, gate_up_bias = (
        sd[p + "mlp.experts.gate_up_proj"],
        sd[p + "mlp.experts.gate_up_proj_bias"],
    )
    e = p + "mlp.experts."
    return {
        p + "self_attn.o_proj.bias": sd[p + "self_attn.o_proj.bias"],
        p + "self_attn.sinks": sd[p + "self_attn.sinks"],
        p + "mlp.gate.weight": sd[p + "mlp.router.weight"],
        p + "mlp.gate.bias": sd[p + "mlp.router.bias"],
        e + "gate_proj.weight": gate_up[..., ::2].transpose(1, 2),
        e + "up_proj.weight": gate_up[..., 1::2].transpose(1, 2),
        e + "gate_proj.bias": gate_up_bias[:, ::2],
        e + "up_proj.bias": gate_up_bias[:, 1::2],
        e + "down_proj.weight": sd[e + "down_proj"].transpose(1, 2),
        e + "down_proj.bias": sd[e + "down_proj_bias"],
    }


def dense_params(model) -> dict[str, torch.Tensor]:
    """The model's parameters by name, packed projection weights read back."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, (Linear, ExpertProjection)):
            out[f"{name}.weight"] = module.dense_weight()
    for name, p in model.named_parameters():
        out.setdefault(name, p)
    return out


def assert_params_equal(model, expected: dict[str, torch.Tensor]) -> None:
    ours = dense_params(model)
    assert set(ours) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(ours[name].float(), value.float(), atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "tied"])
def test_tensors_land_in_their_fused_slots(tmp_path, kind):
    overrides = {"tie_word_embeddings": True} if kind == "tied" else {}
    hf = make_hf_model("qwen2" if kind == "qwen2" else "llama", tmp_path, **overrides)
    model, config = load_model(tmp_path, dtype="float32")
    assert config.qkv_bias == (kind == "qwen2") and not config.o_bias
    assert config.tie_word_embeddings == (kind == "tied")
    if kind == "tied":
        assert model.lm_head_weight is model.model.embed_tokens.weight
    gate_up = model.model.layers[0].mlp.gate_up_proj
    # Packed by default on the CPU: word-packed where packed_linear is vectorized.
    assert (gate_up.word_weight if can_pack_weight_words(gate_up.dense_weight()) else
            gate_up.packed_weight) is not None  # fmt: skip
    assert_params_equal(model, expected_params(hf, config))


def test_sharded_checkpoint_loads_like_one_file(tmp_path, llama_dir):
    path, hf = llama_dir
    hf.save_pretrained(tmp_path, max_shard_size="200KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 2
    model, config = load_model(tmp_path, dtype="float32")
    assert_params_equal(model, expected_params(hf, config))


def test_bfloat16_load_rounds_each_weight(llama_dir):
    path, hf = llama_dir
    model, config = load_model(path, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    expected = {k: v.to(torch.bfloat16) for k, v in expected_params(hf, config).items()}
    assert_params_equal(model, expected)


# ---------------------------------------------------------------------------
# Bad folders and files: one clear error naming the file and the problem.


def _copy_model(src, dst, drop: str | None = None, reshape: str | None = None) -> None:
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(src, "model.safetensors"))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1].clone()
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = f.read()
    with open(os.path.join(dst, "config.json"), "w") as f:
        f.write(config)


def test_missing_tensor_is_named(tmp_path, llama_dir):
    _copy_model(llama_dir[0], tmp_path, drop="model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.self_attn\.k_proj"):
        load_model(tmp_path, dtype="float32")


def test_shape_mismatch_is_named(tmp_path, llama_dir):
    _copy_model(llama_dir[0], tmp_path, reshape="model.layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"model\.safetensors.*up_proj\.weight.*shape"):
        load_model(tmp_path, dtype="float32")


def test_unexpected_tensor_is_named(tmp_path, llama_dir):
    _copy_model(llama_dir[0], tmp_path)
    extra = {"model.layers.0.self_attn.q_norm.weight": torch.ones(64)}
    save_file(extra, tmp_path / "extra.safetensors")
    index = {"weight_map": {"model.layers.0.self_attn.q_norm.weight": "extra.safetensors"}}
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        index["weight_map"].update({k: "model.safetensors" for k in f.keys()})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"extra\.safetensors.*unexpected tensor.*q_norm"):
        load_model(tmp_path, dtype="float32")


def test_missing_and_corrupt_files(tmp_path, llama_dir):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text((llama_dir[0] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match=r"model\.safetensors is not a valid safetensors file"):
        load_model(tmp_path, dtype="float32")


def _hf_config(**changes) -> dict:
    config = transformers.LlamaConfig(**TINY).to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    config.update(changes)
    return config


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel"):
        ModelConfig.from_hf_dict(_hf_config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(NotImplementedError, match="'dynamic'"):
        ModelConfig.from_hf_dict(
            _hf_config(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4})
        )
    with pytest.raises(ValueError, match="yarn rope scaling lacks original_max_position"):
        ModelConfig.from_hf_dict(
            _hf_config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
        )
    with pytest.raises(NotImplementedError, match="'gelu'"):
        ModelConfig.from_hf_dict(_hf_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf_dict(_hf_config(num_key_value_heads=3))


def test_longrope_cache_takes_long_factors_past_the_original_context():
    """LongRoPE (Phi-3): positions within the pretraining context rotate by short_factor,
    later ones by long_factor (vLLM's rule), cos/sin scaled by the attention factor."""
    from pyllm.model.layers import rotary_cos_sin_cache

    short, long = [1.0 + 0.1 * i for i in range(32)], [2.0 + 0.5 * i for i in range(32)]
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": short,
            "long_factor": long, "original_max_position_embeddings": 64}  # fmt: skip
    raw = _hf_config(architectures=["Phi3ForCausalLM"], rope_parameters=rope)
    config = ModelConfig.from_hf_dict(raw)
    factor = (1 + math.log(256 / 64) / math.log(64)) ** 0.5
    assert config.rope_scaling["attention_factor"] == pytest.approx(factor)
    cache = rotary_cos_sin_cache(config, 256, "cpu")
    base = 1e4 ** (torch.arange(0, 64, 2).float() / 64)
    for position, factors in ((10, short), (63, short), (64, long), (200, long)):
        angles = position / (torch.tensor(factors) * base)
        expected = torch.cat((angles.cos(), angles.sin())) * factor
        torch.testing.assert_close(cache[position], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("factor", [4.0, 32.0])
def test_yarn_matches_transformers(factor, truncate):
    """YaRN's frequencies and attention factor as transformers computes them (gpt-oss's
    parameters: factor 32 over 4096 positions, beta 32/1, truncate false)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pyllm.model.config import rope_inv_freq
    from pyllm.model.layers import rotary_cos_sin_cache

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": factor,
            "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": truncate}  # fmt: skip
    raw = _hf_config(rope_parameters=rope, max_position_embeddings=4096 * 32)
    config = ModelConfig.from_hf_dict(raw)
    hf_config = transformers.LlamaConfig(**{**TINY, "rope_parameters": rope,
                                            "max_position_embeddings": 4096 * 32})  # fmt: skip
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    torch.testing.assert_close(rope_inv_freq(config), inv_freq, rtol=1e-6, atol=0)
    assert config.rope_scaling["attention_factor"] == pytest.approx(attention)
    cache = rotary_cos_sin_cache(config, 8192, "cpu")
    angles = 5000.0 * inv_freq
    expected = torch.cat((angles.cos(), angles.sin())) * attention
    torch.testing.assert_close(cache[5000], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rope", ["default", "longrope", "yarn"])
def test_rotary_table_is_filled_as_positions_are_reached(rope):
    """The rows a RotaryTable computes as steps reach them equal the whole table's, bit
    for bit (LongRoPE's switch to the long factors inside a chunk included), and rows past
    the last chunk reached are not computed."""
    from pyllm.model.layers import RotaryTable, rotary_cos_sin_cache

    parameters = {
        "default": None,
        "longrope": {"rope_type": "longrope", "rope_theta": 1e4,
                     "original_max_position_embeddings": 5000,
                     "short_factor": [1.0 + 0.1 * i for i in range(32)],
                     "long_factor": [2.0 + 0.5 * i for i in range(32)]},
        "yarn": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                 "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0},
    }[rope]  # fmt: skip
    arch = {"architectures": ["Phi3ForCausalLM"]} if rope == "longrope" else {}
    raw = _hf_config(**arch, **({"rope_parameters": parameters} if parameters else {}))
    config = ModelConfig.from_hf_dict(raw)
    whole = rotary_cos_sin_cache(config, 10000, "cpu")
    table = RotaryTable(config, 10000, "cpu")
    address = table.table.data_ptr()
    table.ensure(17)
    assert table.filled == RotaryTable.ROWS and not table.table[table.filled :].any()
    for reached in (4096, 4097, 9000, 10000, 3):
        table.ensure(reached)
        assert torch.equal(table.table[: table.filled], whole[: table.filled])
    assert table.filled == 10000 and table.table.data_ptr() == address


def test_sliding_window_leaves_max_model_len_and_marks_layers():
    """A windowed model runs at its whole context; each layer knows its own window."""
    from pyllm.model.config import resolve_max_model_len

    mistral = ModelConfig.from_hf_dict(
        _hf_config(architectures=["MistralForCausalLM"], sliding_window=64)
    )
    assert resolve_max_model_len(mistral, None) == 256
    assert resolve_max_model_len(mistral, 100) == 100
    with pytest.raises(ValueError, match="max_model_len"):
        resolve_max_model_len(mistral, 257)
    assert [mistral.layer_window(i) for i in range(mistral.num_hidden_layers)] == [64] * 2
    # Qwen2 keeps a window in its config that is off unless use_sliding_window is set.
    qwen = ModelConfig.from_hf_dict(
        _hf_config(architectures=["Qwen2ForCausalLM"], sliding_window=32)
    )
    assert qwen.layer_window(0) is None


def test_config_variants_that_load():
    # A window as long as the context never limits attention; Qwen2 keeps a window
    # in its config that is off unless use_sliding_window is set.
    mistral = _hf_config(architectures=["MistralForCausalLM"], sliding_window=256)
    assert ModelConfig.from_hf_dict(mistral).architecture == "mistral"
    qwen = _hf_config(architectures=["Qwen2ForCausalLM"], sliding_window=32)
    assert ModelConfig.from_hf_dict(qwen).qkv_bias
    # transformers < 5 wrote rope_theta and rope_scaling at the top level.
    old = _hf_config(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    del old["rope_parameters"]
    config = ModelConfig.from_hf_dict(old)
    assert config.rope_theta == 5e5
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        },
    ],
)
def test_rope_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(**{**TINY, "head_dim": 128}, rope_parameters=rope)
    ours = rope_inv_freq(ModelConfig.from_hf_dict(_hf_config(**hf_config.to_dict())))
    if rope["rope_type"] == "default":
        base = rope["rope_theta"]
        expected = 1.0 / base ** (torch.arange(0, 128, 2).float() / 128)
    else:
        expected, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
        assert scaling == 1.0
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)


def test_resolve_dtype():
    native = cpu_has_native_bf16()
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("bf16") == torch.bfloat16
    assert resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="'int8'"):
        resolve_dtype("int8")


# ---------------------------------------------------------------------------
# Peak memory while loading.

_RSS_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[2])
    from pyllm.model.loader import load_model

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024

    before = status("VmRSS")
    model, _ = load_model(sys.argv[1], dtype="float32", pack_weights=False)
    model.pack_weights(keep_plain=sys.argv[3] == "keep_plain")
    print(before, status("VmHWM"))
    """
)


@pytest.mark.parametrize("keep_plain", [False, True])
def test_peak_rss_while_loading(tmp_path, keep_plain):
    """A ~340 MB float32 checkpoint: the loader's peak resident memory above what the
    process held before must stay within 1.3x the weights (parameters plus one
    tensor in flight, not a second copy of the model), packing included; keeping the
    plain projection weights for the small-batch path adds exactly their size."""
    config = dict(TINY, hidden_size=1024, intermediate_size=2048, num_hidden_layers=6,
                  num_attention_heads=16, num_key_value_heads=4, vocab_size=16000)  # fmt: skip
    cfg = _hf_config(**config)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    H, inter, kv = 1024, 2048, 4 * 64
    shapes = {"model.embed_tokens.weight": (16000, H), "lm_head.weight": (16000, H),
              "model.norm.weight": (H,)}  # fmt: skip
    for i in range(6):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (H, H), p + "self_attn.k_proj.weight": (kv, H),
            p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, H),
            p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
            p + "mlp.down_proj.weight": (H, inter), p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
        })  # fmt: skip
    save_file({k: torch.rand(s) for k, s in shapes.items()}, tmp_path / "model.safetensors")
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(tmp_path), ROOT, "keep_plain" * keep_plain],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    before, peak = map(int, out.stdout.split())
    weights = sum(math.prod(s) for s in shapes.values()) * 4
    # The Linear weights: every matrix but the embedding (the LM head is not tied here).
    projections = 4 * sum(
        math.prod(s) for k, s in shapes.items() if len(s) == 2 and k != "model.embed_tokens.weight"
    )
    ratio = (peak - before - (projections if keep_plain else 0)) / weights
    print(f"weights {weights / 2**20:.0f} MiB, peak above start {(peak - before) / 2**20:.0f} "
          f"MiB: {ratio:.2f}x")  # fmt: skip
    assert weights > 300 * 2**20
    assert ratio < 1.3


def test_bf16_weights_stay_with_onednn_on_amx_cpus(monkeypatch):
    """oneDNN multiplies bf16 with AMX tiles where the CPU has them, so bf16 weights are
    not word-packed there; float32 ones still are wherever packed_linear is vectorized."""
    import pyllm.model.linear as linear
    import pyllm.ops as ops

    monkeypatch.setattr(linear, "_cpu_has_amx", lambda: True)
    weight = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert not can_pack_weight_words(weight)
    assert can_pack_weight_words(weight.float()) == ops.packed_linear_vectorized(torch.float32)
