"""What keeps a step's Python short: Module's parameters and buffers as plain
attributes, kept in step with nn.Module's own tables, and the layers' shared step
buffers (layers.StepBuffers), including the layers' reading of a projection that
returns a tensor of its own instead of writing into its buffer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pyllm.model.linear as linear
from pyllm.model.loader import load_model
from pyllm.model.module import Module
from tests.model.conftest import make_hf_model, run_sequences


class _Holder(Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3), requires_grad=False)
        self.register_buffer("table", torch.ones(2), persistent=False)
        self.inner = nn.Linear(2, 2)

    def forward(self, x):
        return x


def test_module_attributes_follow_its_tables():
    m = _Holder()
    assert m.__dict__["weight"] is m._parameters["weight"]
    assert m.__dict__["table"] is m._buffers["table"]
    m.weight = None  # a quantized layer drops its float weight
    assert m.weight is None and m._parameters["weight"] is None
    m.to(torch.float64)  # _apply puts new tensors in the tables
    assert m.table.dtype == torch.float64 and m.table is m._buffers["table"]
    m.weight = nn.Parameter(torch.ones(2), requires_grad=False)
    assert m.weight is m._parameters["weight"]
    assert sorted(m.state_dict()) == ["inner.bias", "inner.weight", "weight"]
    del m.table, m.inner
    assert not hasattr(m, "table") and not hasattr(m, "inner")
    with pytest.raises(AttributeError):
        del m.missing


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf = make_hf_model("llama", path)
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (29, 9)]
    return path, tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_projections_returning_their_own_tensors(llama, dtype, monkeypatch):
    """A kernel that cannot write into the step's buffers (oneDNN, F.linear) returns a
    new tensor: the layers read it, and the logits are bit for bit those of the run
    that wrote into the buffers (prefill chunks, mixed steps and decodes)."""
    path, tokens = llama
    model, _ = load_model(path, dtype=dtype)
    want = run_sequences(model, tokens, [20, 4], chunk_size=8, block_size=16)
    forward = linear.linear_forward

    def own_tensor(*args, out=None, **kwargs):
        args = args[:6]  # out, if passed by position, is dropped too
        return forward(*args, **kwargs)

    monkeypatch.setattr(linear, "linear_forward", own_tensor)
    got = run_sequences(model, tokens, [20, 4], chunk_size=8, block_size=16)
    assert want.mixed_steps > 0
    for a, b in zip(want.logits, got.logits, strict=True):
        assert torch.equal(a, b)
