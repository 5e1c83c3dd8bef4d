"""moe_topk and fused_moe against a float64 reference that loops over tokens and
their experts one at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pyllm.ops as ops

from .utils import POISON, kernel_threads, seed_and_single_thread


@pytest.fixture(autouse=True)
def _seed(request):
    yield from seed_and_single_thread(request)


def reference_moe(x, logits, top_k, w_gate, w_up, w_down, renormalize=True, biases=None,
                  activation="silu", alpha=1.702, limit=7.0, expert_start=0):  # fmt: skip
    """float64 [T, H]: each token through each of its experts, weighted and summed."""
    probs = torch.softmax(logits.double(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    b_gate, b_up, b_down = biases or (None, None, None)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        for j in range(top_k):
            e = int(ids[t, j]) - expert_start
            if not 0 <= e < w_gate.shape[0]:
                continue
            gate, up = xt @ w_gate[e].double().T, xt @ w_up[e].double().T
            if b_gate is not None:
                gate, up = gate + b_gate[e].double(), up + b_up[e].double()
            if activation == "silu":
                act = F.silu(gate) * up
            else:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                act = (up + 1) * gate * torch.sigmoid(alpha * gate)
            y = act @ w_down[e].double().T
            if b_down is not None:
                y = y + b_down[e].double()
            out[t] += weights[t, j] * y
    return out


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_fused_moe_float_weights(tokens, activation):
    E, top_k, H, inter = 8, 2, 64, 32
    x, logits = torch.randn(tokens, H), torch.randn(tokens, E)
    w_gate, w_up = torch.randn(E, inter, H) / 8, torch.randn(E, inter, H) / 8
    w_down = torch.randn(E, H, inter) / 6
    biases = (torch.randn(E, inter), torch.randn(E, inter), torch.randn(E, H))
    out = torch.full((tokens, H), POISON)
    f32 = ops.FLOAT_WEIGHT_TYPES[torch.float32]
    with kernel_threads():
        ops.fused_moe(out, x, logits, top_k, w_gate, w_up, w_down, f32, f32, f32,
                      gate_bias=biases[0], up_bias=biases[1], down_bias=biases[2],
                      activation=activation)  # fmt: skip
    expected = reference_moe(x, logits, top_k, w_gate, w_up, w_down, True, biases, activation)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


def test_fused_moe_expert_start_skips_other_experts():
    E, top_k, H, inter = 8, 3, 32, 16
    x, logits = torch.randn(9, H), torch.randn(9, E)
    w_gate, w_up = torch.randn(3, inter, H), torch.randn(3, inter, H)
    w_down = torch.randn(3, H, inter)
    out = torch.full((9, H), POISON)
    with kernel_threads():
        ops.fused_moe(out, x, logits, top_k, w_gate, w_up, w_down, 0, 0, 0, renormalize=False,
                      expert_start=4)  # fmt: skip
    expected = reference_moe(x, logits, top_k, w_gate, w_up, w_down, False, expert_start=4)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


def test_moe_topk_matches_softmax_topk():
    logits = torch.randn(17, 32)
    weights, ids = ops.moe_topk(logits, 4, renormalize=False)
    expected_w, expected_ids = torch.softmax(logits, -1).topk(4, -1)
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_w)
    weights, _ = ops.moe_topk(logits, 4)
    torch.testing.assert_close(weights, torch.softmax(logits.gather(1, expected_ids), -1))
