"""moe_topk and fused_moe against a float64 reference (per expert, vectorized over its
tokens), on every GGUF type, float weights, every activation dtype, both activations.

The CPU kernels quantize activations to int8 where the weights are GGUF blocks (each
token's inputs for gate/up, the activation for down), and the bf16/fp16 float paths
round to the dtype: the reference computes each expert's rows both exactly and with
those roundings, and allows the difference (see reference_moe) plus the dtype's
tolerance. The cases form a covering grid rather than
a Cartesian product: every type, dtype, expert count, top-k and token count appears,
with renormalize, biases, both activations and expert_start spread over them.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch

import pyllm.ops as ops

from .utils import (
    ALL_DEVICES,
    DTYPES,
    POISON,
    TOLERANCES,
    device_param,
    kernel_threads,
    seed_and_single_thread,
)

TYPES = list(ops.QUANT_TYPES)
FLOAT_TYPE = "float"  # weights as floats of the activations' dtype
# Rows of one expert from which the CPU kernel leaves the int8 tiles for the float
# paths (quant_matmul.h: kPanelMinRows 32, kGemmMinRows 64; float weights from 16).
MANY_ROWS = 64

# Per GGUF type: where each block keeps its scale fields (fp16, or MXFP4's E8M0 byte).
SCALE_FIELDS = {
    "Q4_0": ("f16", (0,)),
    "Q4_1": ("f16", (0, 2)),
    "Q5_0": ("f16", (0,)),
    "Q5_1": ("f16", (0, 2)),
    "Q8_0": ("f16", (0,)),
    "Q4_K": ("f16", (0, 2)),
    "Q5_K": ("f16", (0, 2)),
    "Q6_K": ("f16", (208,)),
    "MXFP4": ("e8m0", (0,)),
}


@pytest.fixture(autouse=True)
def _seed(request):
    yield from seed_and_single_thread(request)


def _set_scales(raw: np.ndarray, type_name: str, factor: np.ndarray) -> np.ndarray:
    """Blocks [n, block bytes] with every scale field set to factor [n] (rounded)."""
    kind, offsets = SCALE_FIELDS[type_name]
    raw = raw.copy()
    for offset in offsets:
        if kind == "f16":
            field = factor.astype(np.float16).view(np.uint8).reshape(-1, 2)
            raw[:, offset : offset + 2] = field
        else:  # E8M0: 2^(e - 128) per block (the kernels' e8m0_half)
            raw[:, offset] = np.clip(np.round(np.log2(factor)) + 128, 1, 254).astype(np.uint8)
    return raw


@functools.lru_cache(maxsize=32)
def expert_blocks(type_name: str, experts: int, rows: int, cols: int, seed: int):
    """uint8 [experts, rows, row bytes] of random valid blocks whose weights have an RMS
    near 1 / sqrt(cols), and their float32 values [experts, rows, cols]."""
    type_id, block, nbytes = ops.QUANT_TYPES[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(experts * rows * cols // block, nbytes), dtype=np.uint8)
    spread = rng.uniform(0.5, 1.5, raw.shape[0])

    def values(blocks):
        q = torch.from_numpy(blocks.reshape(experts * rows, -1).copy())
        out = torch.empty(experts * rows, cols)
        ops.dequantize_rows(out, q, type_id)
        return q, out

    # Unit scales first, then every scale field times the factor that brings the RMS
    # to 1 / sqrt(cols) (the weights are linear in their scales).
    _, unit = values(_set_scales(raw, type_name, spread))
    factor = spread / (unit.pow(2).mean().sqrt().item() * cols**0.5)
    q, dense = values(_set_scales(raw, type_name, factor))
    return q.view(experts, rows, -1), dense.view(experts, rows, cols)


def make_weights(types, dtype, experts, hidden, inter, seed=0):
    """(w_gate, w_up, w_down, type ids, their float32 values); types: one type name for
    all three projections, or (gate/up, down)."""
    gate_up, down = (types, types) if isinstance(types, str) else types
    shapes = [(gate_up, inter, hidden), (gate_up, inter, hidden), (down, hidden, inter)]
    weights, ids, dense = [], [], []
    for i, (type_name, n, k) in enumerate(shapes):
        if type_name == FLOAT_TYPE:
            d = (torch.randn(experts, n, k) / k**0.5).to(dtype)
            weights.append(d)
            ids.append(ops.FLOAT_WEIGHT_TYPES[dtype])
            dense.append(d.float())
        else:
            q, d = expert_blocks(type_name, experts, n, k, seed + i)
            weights.append(q)
            ids.append(ops.QUANT_TYPES[type_name][0])
            dense.append(d)
    return weights, ids, dense


def packed_strips(weights, type_ids):
    """The weights of types with strips packed, and their type ids."""
    packed = [
        ops.pack_strips(w, i) if i in ops.STRIPS_TYPES else w
        for w, i in zip(weights, type_ids, strict=True)
    ]
    return packed, [ops.STRIPS_TYPES.get(i, i) for i in type_ids]


def int8_span(type_name: str) -> int:
    """The span the CPU kernels quantize a GGUF type's inputs in (0: float weights)."""
    if type_name == FLOAT_TYPE:
        return 0
    return 256 if ops.QUANT_TYPES[type_name][1] == 256 else 32


def router_logits(tokens, total, hot=None, cold=()):
    """Logits whose values lie at least 0.05 apart within each row (so that the float32
    kernel and the float64 reference rank them alike); `hot` wins most rows, `cold`
    experts never win."""
    logits = torch.stack([torch.randperm(total) for _ in range(tokens)]).double() * 0.05
    if hot is not None:
        logits[: tokens * 7 // 8, hot] += 0.0513 * total
    for e in cold:
        logits[:, e] -= 0.0517 * total
    return logits.float()


def int8_rounded(v: torch.Tensor, span: int) -> torch.Tensor:
    """v as the CPU kernels quantize it, in float32 per span of `span` values:
    round(v / scale) * scale with scale = max |v| / 127 (torch.round and nearbyint both
    round halves to even)."""
    f = v.float().reshape(v.shape[0], -1, span)
    scale = f.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(f * inv).double() * scale.double()).reshape(v.shape)


def reference_moe(x, logits, top_k, dense, spans, dtype, renormalize=True, biases=None,
                  activation="silu", alpha=1.702, limit=7.0, expert_start=0):  # fmt: skip
    """float64 (out [T, H], allowed error [T, H]), expert by expert.

    Each expert's rows are computed exactly and as the kernels may round them: int8
    spans (spans: of the gate/up inputs, of the activation; 0 for float weights) as the
    CPU's int8 tiles for GGUF weights take them, the dtype's rounding of the weights,
    the gate/up outputs and the activation (the bf16/fp16 float paths), and int8
    products whose outputs are rounded to the dtype. A
    kernel's expert takes one of these paths, so its rows lie within the largest of
    those differences of the exact ones (twice it, for the float32 sums and the rare
    int8 rounding that the kernel's float32 activation takes the other way): a
    worst-case bound (all roundings of a sum adding up, as test_quant.py's
    activation_error_bound) would exceed the outputs themselves after two products."""
    probs = torch.softmax(logits.double(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    b_gate, b_up, b_down = (b.double() if b is not None else None for b in biases or [None] * 3)
    xd = x.double().cpu()
    out, slack = (
        torch.zeros(xd.shape, dtype=torch.float64),
        torch.zeros(xd.shape, dtype=torch.float64),
    )

    def in_dtype(v):
        return v.to(dtype).double()

    def expert(e, xe, w_gate, w_up, w_down, inputs, outputs):
        """Rows of expert e with inputs[0] applied to the gate/up input, inputs[1] to the
        down input, `outputs` to the gate/up outputs."""
        g, u = inputs[0](xe) @ w_gate[e].T, inputs[0](xe) @ w_up[e].T
        g, u = outputs(g), outputs(u)
        if b_gate is not None:
            g, u = g + b_gate[e], u + b_up[e]
        if activation == "silu":
            act = g * torch.sigmoid(g) * u
        else:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            act = (u + 1) * g * torch.sigmoid(alpha * g)
        y = inputs[1](act) @ w_down[e].T
        return y + b_down[e] if b_down is not None else y

    def as_int8(span):
        return (lambda v: int8_rounded(v, span)) if span else (lambda v: v)

    exact = [w.double() for w in dense]
    same = (lambda v: v, lambda v: v)
    int8 = tuple(as_int8(span) for span in spans)
    variants = []
    if any(spans):
        variants.append((exact, int8, same[0]))
    if dtype != torch.float32:
        rounded = [in_dtype(w) for w in exact]
        variants.append((rounded, (in_dtype, in_dtype), in_dtype))
        if any(spans):  # int8 products whose outputs are stored in the dtype
            both = tuple(lambda v, f=f: f(in_dtype(v)) for f in int8)
            variants.append((exact, both, in_dtype))
    for e in range(exact[0].shape[0]):
        tok, slot = torch.nonzero(ids == e + expert_start, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = xd[tok]
        y = expert(e, xe, *exact, same, same[0])
        dy = torch.zeros_like(y)
        for ws, inputs, outputs in variants:
            dy = torch.maximum(dy, (expert(e, xe, *ws, inputs, outputs) - y).abs())
        w = weights[tok, slot].unsqueeze(1)
        out.index_add_(0, tok, w * y)
        slack.index_add_(0, tok, w * dy)
    atol, rtol = TOLERANCES[dtype]
    return out, 2 * slack + atol + rtol * out.abs()


def run_case(types, dtype, experts, top_k, tokens, device, renormalize=True, biases=False,
             activation="silu", expert_start=0, total=None, hidden=None, inter=None,
             logits=None, alpha=1.702, limit=7.0, strips=False):  # fmt: skip
    """fused_moe against reference_moe; types as make_weights takes them; strips: the
    weights of types with strips packed (ops.pack_strips)."""
    gate_up, down = (types, types) if isinstance(types, str) else types
    k_formats = 256 in (int8_span(gate_up), int8_span(down))
    hidden = hidden or (256 if k_formats else 96)
    inter = inter or (256 if k_formats else 160)
    total = total or experts
    (w_gate, w_up, w_down), type_ids, dense = make_weights(types, dtype, experts, hidden, inter)
    if strips:
        (w_gate, w_up, w_down), type_ids = packed_strips((w_gate, w_up, w_down), type_ids)
    x = torch.randn(tokens, hidden + 8).to(dtype)[:, 4 : 4 + hidden]  # rows of a wider tensor
    if logits is None:
        logits = router_logits(tokens, total)
    bias = (
        [torch.randn(experts, n).to(dtype) / 4 for n in (inter, inter, hidden)] if biases else None
    )
    out = torch.full((tokens, hidden), POISON, dtype=dtype, device=device)
    on = [t.to(device) for t in (x, logits, w_gate, w_up, w_down)]
    with kernel_threads():
        ops.fused_moe(out, on[0], on[1], top_k, *on[2:], *type_ids, renormalize=renormalize,
                      gate_bias=bias and bias[0].to(device), up_bias=bias and bias[1].to(device),
                      down_bias=bias and bias[2].to(device), activation=activation, alpha=alpha,
                      limit=limit, expert_start=expert_start)  # fmt: skip
    spans = (int8_span(gate_up), int8_span(down))
    expected, allowed = reference_moe(x, logits, top_k, dense, spans, dtype, renormalize, bias,
                                      activation, alpha, limit, expert_start)  # fmt: skip
    error = (out.double().cpu() - expected).abs()
    worst = np.unravel_index(torch.argmax(error - allowed).item(), error.shape)
    assert (error <= allowed).all(), (
        f"out{list(worst)} = {out[worst].item()}, expected {expected[worst].item()} "
        f"(allowed error {allowed[worst].item():.3g})"
    )
    return out


def covering_cases():
    """Every type (and float weights) with each dtype in turn; expert counts, top-k,
    token counts and options cycled at different strides so that they meet in many
    combinations."""
    experts_k = [(8, 1), (8, 2), (32, 4), (128, 8), (32, 2), (8, 4), (128, 1)]
    tokens = [1, 2, 7, 33, 512, 5]
    cases = []
    for i, (type_name, dtype) in enumerate(itertools.product(TYPES + [FLOAT_TYPE], DTYPES)):
        experts, top_k = experts_k[i % len(experts_k)]
        t = tokens[i % len(tokens)]
        if experts == 128 and t == 512:
            t = 33  # every expert busy: kept to the smaller shapes' cases
        cases.append(
            pytest.param(
                type_name, dtype, experts, top_k, t, bool(i % 2), i % 3 == 1,
                "swigluoai" if i % 4 == 2 else "silu",
                id=f"{type_name}-{str(dtype)[6:]}-E{experts}-k{top_k}-T{t}",
            )
        )  # fmt: skip
    return cases


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize(
    "type_name,dtype,experts,top_k,tokens,renormalize,biases,activation", covering_cases()
)
def test_fused_moe(type_name, dtype, experts, top_k, tokens, renormalize, biases, activation,
                   device):  # fmt: skip
    # swigluoai with a limit that clamps a good part of the gate and up values.
    run_case(type_name, dtype, experts, top_k, tokens, device, renormalize, biases, activation,
             alpha=1.25, limit=0.75)  # fmt: skip


def skewed_logits(tokens, experts):
    """Expert 3 wins nearly every token; experts 0 and 6 never win."""
    return router_logits(tokens, experts, hot=3, cold=(0, 6))


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0", FLOAT_TYPE])
def test_fused_moe_busy_and_idle_experts(type_name, dtype, device):
    """One expert with far more rows than the many-row thresholds, others with a few or
    none, in one call: the float paths and the int8 tiles side by side."""
    tokens, experts, top_k = 150, 32, 2
    logits = skewed_logits(tokens, experts)
    counts = torch.bincount(logits.topk(top_k).indices.flatten(), minlength=experts)
    assert counts.max() >= MANY_ROWS and 0 < counts[counts > 0].min() < 32 and counts[0] == 0
    run_case(type_name, dtype, experts, top_k, tokens, device, biases=True,
             activation="swigluoai", logits=logits, limit=1.0)  # fmt: skip


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("types", [(FLOAT_TYPE, "Q8_0"), ("Q4_1", FLOAT_TYPE)])
def test_fused_moe_mixed_weight_types(types, dtype, device):
    """Float gate/up with GGUF down (a hidden size that is no multiple of 16: a partial
    panel) and the reverse, with busy and idle experts."""
    tokens, experts, top_k = 120, 16, 2
    hidden = 40 if types[0] == FLOAT_TYPE else 64
    run_case(types, dtype, experts, top_k, tokens, device, biases=True, hidden=hidden, inter=64,
             logits=skewed_logits(tokens, experts))  # fmt: skip


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("type_name", ["Q6_K", "Q4_0", FLOAT_TYPE])
def test_fused_moe_expert_start(type_name, device):
    """Experts [4, 7) of 10: the other choices add nothing; a token with none is 0."""
    tokens, top_k = 40, 3
    logits = router_logits(tokens, 10)
    logits[0, 4:7] -= 10.0  # token 0 chooses none of the local experts
    out = run_case(type_name, torch.float32, 3, top_k, tokens, device, renormalize=False,
                   expert_start=4, total=10, logits=logits)  # fmt: skip
    assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu()))


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_fused_moe_no_local_tokens(device):
    """No token chooses a local expert: the output is zeros, not left unwritten."""
    (w_gate, w_up, w_down), ids, _ = make_weights("Q8_0", torch.float32, 2, 64, 32)
    logits = torch.zeros(3, 6)
    logits[:, 2:] = 1.0
    out = torch.full((3, 64), POISON, device=device)
    x = torch.randn(3, 64, device=device)
    on = [t.to(device) for t in (w_gate, w_up, w_down)]
    with kernel_threads():
        ops.fused_moe(out, x, logits.to(device), 2, *on, *ids)
    assert torch.equal(out.cpu(), torch.zeros(3, 64))


@pytest.mark.parametrize("device", [device_param("cuda")])
def test_fused_moe_cuda_takes_one_gate_up_type(device):
    """The CUDA kernels multiply gate and up in one pass: their types must agree there."""
    (w_gate, _, w_down), ids, _ = make_weights("Q8_0", torch.float32, 4, 64, 32)
    w_up, up_ids, _ = make_weights("Q4_0", torch.float32, 4, 64, 32)
    on = [t.to(device) for t in (w_gate, w_up[1], w_down)]
    out, x = torch.empty(2, 64, device=device), torch.randn(2, 64, device=device)
    with pytest.raises(ValueError, match=r"\bup_type\b"):
        ops.fused_moe(out, x, torch.randn(2, 4, device=device), 2, *on, ids[0], up_ids[1], ids[2])


@pytest.mark.parametrize("type_name", ["Q5_K", "Q4_1", FLOAT_TYPE])
def test_fused_moe_threads_agree(type_name):
    """One thread and all of them give the same bits (items are independent of which
    thread runs them, and each token sums its experts in its own order)."""
    tokens, experts, top_k = 70, 8, 2
    logits = skewed_logits(tokens, experts)
    (w_gate, w_up, w_down), ids, _ = make_weights(type_name, torch.float32, experts, 256, 256)
    x = torch.randn(tokens, 256)
    outs = []
    for threads in (1, 2):
        out = torch.full((tokens, 256), POISON)
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            ops.fused_moe(out, x, logits, top_k, w_gate, w_up, w_down, *ids)
        finally:
            torch.set_num_threads(previous)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts,top_k", [(8, 1), (32, 4), (128, 8)])
def test_moe_topk(experts, top_k, dtype, device):
    logits = router_logits(37, experts).to(dtype)
    expected_w, expected_ids = torch.softmax(logits.double(), -1).topk(top_k, -1)
    for renormalize in (False, True):
        with kernel_threads():
            weights, ids = ops.moe_topk(logits.to(device), top_k, renormalize=renormalize)
        assert torch.equal(ids.long().cpu(), expected_ids)
        expected = expected_w / expected_w.sum(-1, keepdim=True) if renormalize else expected_w
        torch.testing.assert_close(weights.double().cpu(), expected, atol=1e-6, rtol=1e-5)


def test_moe_topk_ties_take_the_lower_id():
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0]])
    _, ids = ops.moe_topk(logits, 2)
    assert ids.tolist() == [[1, 2]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_K"])
def test_prompt_tokens_compute_alike_however_split(type_name, dtype):
    """Tokens passed as many_rows give bitwise what they give in a call whose experts
    have rows enough for the many-row path by count (72 tokens, each of 4 experts 36),
    alone or ahead of tokens that take their own rows' paths (as four alone)."""
    hidden, inter = (256, 256) if type_name == "Q4_K" else (96, 160)
    (w_gate, w_up, w_down), ids, _ = make_weights(type_name, dtype, 4, hidden, inter)
    x = torch.randn(76, hidden).to(dtype)
    # Token t chooses experts t % 4 and (t + 1) % 4.
    logits = torch.tensor([[1.0, 0.5, -0.5, -1.0]]).repeat(76, 1)
    logits = torch.stack([row.roll(t % 4) for t, row in enumerate(logits)])

    def run(rows, prompt):
        out = torch.empty(len(rows), hidden, dtype=dtype)
        ops.fused_moe(out, x[rows], logits[rows], 2, w_gate, w_up, w_down, *ids, many_rows=prompt)
        return out

    whole = run(list(range(72)), 0)
    few = run([72, 73, 74, 75], 0)
    for first, last in ((0, 1), (5, 12), (20, 40)):
        assert torch.equal(run(list(range(first, last)), last - first), whole[first:last])
        mixed = run(list(range(first, last)) + [72, 73, 74, 75], last - first)
        assert torch.equal(mixed[: last - first], whole[first:last]), (first, last)
        assert torch.equal(mixed[last - first :], few), (first, last)
