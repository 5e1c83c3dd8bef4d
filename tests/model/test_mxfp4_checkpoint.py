"""gpt-oss's HF checkpoints with MXFP4 experts (``*_blocks`` / ``*_scales``): repacked
into GGML blocks that read back as transformers dequantizes them, kept in those blocks
or widened, and the model follows HF's on the same weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import pyllm.ops as ops
from pyllm.model.loader import estimate_weight_bytes, load_model
from pyllm.model.mxfp4_checkpoint import ggml_blocks

from .conftest import hf_logits, make_hf_model, run_sequences

MXFP4 = ops.QUANT_TYPES["MXFP4"][0]


def random_ocp(rows: tuple[int, ...], k: int, seed: int, exponents=(118, 122)):
    """Random OCP MXFP4 blocks [*rows, k / 32, 16] and E8M0 exponents [*rows, k / 32].
    The default exponents give weights of about a quarter of 1 / sqrt(k): at 1 / sqrt(k)
    the int8 rounding of activations in the kept products flipped one token's second
    expert (of 34) in the tiny model, a near tie, not an error of the blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*rows, k // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(*exponents, (*rows, k // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_repacked_blocks_read_back_as_transformers_dequantizes():
    # Exponents from the subnormal scales (0, 1) to large ones, every code.
    blocks, scales = random_ocp((3, 40), 96, seed=1, exponents=(0, 200))
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 96, 40]
    rows = ggml_blocks(blocks, scales)
    assert rows.shape == (3, 40, 3 * 17) and rows.dtype == torch.uint8
    ours = torch.empty(3, 40, 96)
    for e in range(3):
        ops.dequantize_rows(ours[e], rows[e].contiguous(), MXFP4)
    torch.testing.assert_close(ours, expected.transpose(1, 2), rtol=0, atol=0)


def test_bad_blocks_are_named():
    blocks, scales = random_ocp((2, 4), 64, seed=0)
    with pytest.raises(ValueError, match="must be uint8"):
        ggml_blocks(blocks.to(torch.int16), scales)
    with pytest.raises(ValueError, match="do not pair"):
        ggml_blocks(blocks, scales[..., :1])


@pytest.fixture(scope="module")
def gpt_oss_folders(tmp_path_factory):
    """(the HF model, its folder with MXFP4 experts, the same weights dequantized): the
    experts' float weights are replaced by random MXFP4 blocks in both."""
    root = tmp_path_factory.mktemp("mxfp4")
    dense, packed = root / "dense", root / "mxfp4"
    make_hf_model("gpt_oss", dense)
    tensors = load_file(dense / "model.safetensors")
    blocks_sd = dict(tensors)
    for i, name in enumerate(n for n in list(tensors) if n.endswith(("gate_up_proj", "down_proj"))):
        experts, k, n = tensors[name].shape  # x @ W: [E, in, out]
        blocks, scales = random_ocp((experts, n), k, seed=i)
        tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        del blocks_sd[name]
        blocks_sd[name + "_blocks"], blocks_sd[name + "_scales"] = blocks, scales
    save_file(tensors, dense / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(dense, packed)
    save_file(blocks_sd, packed / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (packed / "config.json").write_text(json.dumps(config))
    import transformers

    hf = transformers.GptOssForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    return hf, packed, dense


def test_mxfp4_experts_widened_equal_the_dense_checkpoint(gpt_oss_folders):
    hf, packed, dense = gpt_oss_folders
    ours, _ = load_model(packed, dtype="float32", quantization="none")
    reference, _ = load_model(dense, dtype="float32", quantization="none")
    theirs = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.equal(param, theirs[name]), name
    tokens = [list(range(5, 30)), list(range(200, 209))]
    result = run_sequences(ours, tokens, [20, 4], chunk_size=8)
    for logits, t in zip(result.logits, tokens, strict=True):
        assert (logits - hf_logits(hf, t)).abs().max() < 1e-3


def test_mxfp4_experts_kept_in_their_blocks(gpt_oss_folders):
    """ "auto" keeps the experts as GGML MXFP4 rows, one copy, exactly the checkpoint's
    values; the model then follows the widened one (int8 activations in the products)."""
    _, packed, dense = gpt_oss_folders
    kept, _ = load_model(packed, dtype="float32")
    widened, _ = load_model(dense, dtype="float32", quantization="none")
    for layer, reference in zip(kept.model.layers, widened.model.layers, strict=True):
        for proj, ref in zip(layer.mlp.projections(), reference.mlp.projections(), strict=True):
            assert proj.weight is None and proj.qtype == MXFP4
            assert torch.equal(proj.dense_weight(), ref.weight)
    tokens = [list(range(5, 30)), list(range(200, 209))]
    a = run_sequences(kept, tokens, [8, 4], chunk_size=8).logits
    b = run_sequences(widened, tokens, [8, 4], chunk_size=8).logits
    for x, y in zip(a, b, strict=True):
        corr = [torch.corrcoef(torch.stack([p, q]))[0, 1].item() for p, q in zip(x, y, strict=True)]
        assert min(corr) >= 0.999, corr


def test_memory_estimate_counts_mxfp4_blocks(gpt_oss_folders):
    _, packed, dense = gpt_oss_folders
    widened = estimate_weight_bytes(packed, torch.float32, quantization="none")
    assert widened == estimate_weight_bytes(dense, torch.float32)
    kept = estimate_weight_bytes(packed, torch.float32)
    experts = sum(
        p.numel() * 4 for n, p in load_file(dense / "model.safetensors").items()
        if n.endswith(("gate_up_proj", "down_proj"))
    )  # fmt: skip
    # The experts' floats become 17 bytes per 32 weights.
    assert kept == widened - experts + experts // 4 * 17 // 32


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_keeps_its_share_of_the_blocks(rank):
    """Two ranks: gate/up (column-parallel) keep each expert's half of the rows, down
    (row-parallel) each row's half of the blocks; expert parallelism whole experts. The
    shares laid side by side are the whole."""
    from types import SimpleNamespace

    from pyllm.model.shard import Shard
    from pyllm.model.weights import expert_share

    experts, inter, hidden = 4, 64, 96
    gate_up = ggml_blocks(*random_ocp((experts, inter), hidden, seed=3))  # [E, I, H / 32 * 17]
    down = ggml_blocks(*random_ocp((experts, hidden), inter, seed=4))  # [E, H, I / 32 * 17]

    def model(shard, held):
        return SimpleNamespace(shard=shard, device=torch.device("cpu"),
                               local_config=SimpleNamespace(expert_range=held))  # fmt: skip

    def module(out_features, in_features):
        return SimpleNamespace(out_features=out_features, in_features=in_features)

    width = model(Shard(rank, 2), range(experts))
    rows = expert_share(width, module(inter // 2, hidden), gate_up, MXFP4)
    assert torch.equal(rows, gate_up[:, rank * inter // 2 : (rank + 1) * inter // 2])
    cols = expert_share(width, module(hidden, inter // 2), down, MXFP4)
    half = down.shape[2] // 2
    assert torch.equal(cols, down[:, :, rank * half : (rank + 1) * half])
    whole = model(Shard(rank, 2, expert_parallel=True), range(2 * rank, 2 * rank + 2))
    mine = expert_share(whole, module(inter, hidden), gate_up, MXFP4)
    assert torch.equal(mine, gate_up[2 * rank : 2 * rank + 2])
