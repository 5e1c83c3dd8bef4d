"""pyllm._C's direct bindings of the per-layer ops: the same results and errors as
torch.ops.pyllm on CPU tensors, the dispatcher for any other device, and a binding for
every op the model and the attention backends call."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import pyllm
import pyllm.ops as ops
from pyllm import _C as direct

ROOT = pathlib.Path(pyllm.__file__).parent


def test_every_op_the_model_calls_is_bound():
    called = set()
    for path in [*(ROOT / "model").rglob("*.py"), *(ROOT / "attention").rglob("*.py")]:
        called |= set(re.findall(r"\b_C\.(\w+)\(", path.read_text(encoding="utf-8")))
    assert called, "no calls found: the pattern no longer matches the sources"
    missing = sorted(name for name in called if not hasattr(direct, name))
    assert missing == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_results_equal_torch_ops(dtype):
    torch.manual_seed(0)
    x, w = torch.randn(3, 64, dtype=dtype), torch.randn(64, dtype=dtype)
    a, b = torch.empty_like(x), torch.empty_like(x)
    direct.rms_norm(a, x, w, 1e-6)
    torch.ops.pyllm.rms_norm(b, x, w, 1e-6)
    assert torch.equal(a, b)

    gate_up = torch.randn(3, 128, dtype=dtype)
    for name in ("silu_and_mul", "gelu_tanh_and_mul"):
        getattr(direct, name)(a, gate_up)
        getattr(torch.ops.pyllm, name)(b, gate_up)
        assert torch.equal(a, b)

    K, N, qtype = 64, 16, ops.QUANT_TYPES["Q8_0"][0]
    blocks = torch.randint(-127, 128, (N, K // 32, 34), dtype=torch.int8).view(torch.uint8)
    blocks[:, :, :2] = torch.tensor([0, 0x2C], dtype=torch.uint8)  # scale 1/16 as fp16
    qweight = blocks.reshape(N, -1).contiguous()
    bias = torch.randn(N, dtype=dtype)
    a, b = torch.empty(3, N, dtype=dtype), torch.empty(3, N, dtype=dtype)
    for many_rows in (0, 2):
        direct.quant_linear(a, x, qweight, qtype, bias, many_rows)
        torch.ops.pyllm.quant_linear(b, x, qweight, qtype, bias, many_rows)
        assert torch.equal(a, b)


def test_errors_are_those_of_torch_ops():
    x, out = torch.randn(2, 64), torch.empty(2, 64)
    with pytest.raises(ValueError, match="weight has 3 elements") as ours:
        direct.rms_norm(out, x, torch.ones(3), 1e-6)
    with pytest.raises(ValueError) as theirs:
        torch.ops.pyllm.rms_norm(out, x, torch.ones(3), 1e-6)
    assert str(ours.value).splitlines()[0] == str(theirs.value).splitlines()[0]
    with pytest.raises(TypeError):
        direct.rms_norm(out, x, torch.ones(64))  # epsilon missing


def test_other_devices_go_through_the_dispatcher():
    # No meta kernel is registered: the dispatcher's refusal shows the call went there.
    x = torch.empty(2, 64, device="meta")
    with pytest.raises(NotImplementedError, match="pyllm::rms_norm"):
        direct.rms_norm(torch.empty_like(x), x, torch.empty(64, device="meta"), 1e-6)
