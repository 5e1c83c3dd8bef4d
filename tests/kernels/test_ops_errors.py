"""Argument errors of every public function in pyllm.ops.

Each case starts from arguments that pass every check, changes one of them, and
expects the documented TypeError/ValueError with the argument's name in the message.
The compiled ops run for real on tiny tensors: the structural checks are theirs (the C++
checks header of each family), the Python wrappers add the type and index-value checks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import pyllm.ops as ops

NUM_BLOCKS, NUM_KV_HEADS, NUM_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 4, 64, 8


# ---------------------------------------------------------------------------
# Valid arguments for each function (fresh tensors for every test).


def cache(num_blocks=NUM_BLOCKS, dtype=torch.float32):
    return ops.allocate_kv_cache(num_blocks, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype)


def valid_allocate_kv_cache():
    return dict(num_blocks=4, num_kv_heads=2, head_size=64, block_size=8, dtype=torch.bfloat16)


def valid_reshape_and_cache():
    key_cache, value_cache = cache()
    return dict(
        key=torch.randn(3, NUM_KV_HEADS, HEAD_SIZE),
        value=torch.randn(3, NUM_KV_HEADS, HEAD_SIZE),
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=torch.tensor([0, NUM_BLOCKS * BLOCK_SIZE - 1, -1]),
        kv_cache_dtype="auto",
    )


def valid_allocate_kv_scales():
    return dict(shape=(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE))


def int8_cache_args(args):
    """args of a cache op with its cache replaced by an int8 one and its scales."""
    key_cache, value_cache = cache(dtype=torch.int8)
    k_scale, v_scale = ops.allocate_kv_scales((NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE))
    return dict(args, key_cache=key_cache, value_cache=value_cache, k_scale=k_scale,
                v_scale=v_scale)  # fmt: skip


def valid_copy_blocks():
    layers = [cache(), cache()]
    return dict(
        key_caches=[k for k, _ in layers],
        value_caches=[v for _, v in layers],
        block_mapping=torch.tensor([[0, 1], [2, 3]]),
    )


def valid_swap_blocks():
    return dict(src=cache()[0], dst=cache(3)[0], block_mapping=torch.tensor([[3, 0], [1, 2]]))


def valid_attention_common(num_tokens):
    key_cache, value_cache = cache()
    return dict(
        out=torch.empty(num_tokens, NUM_HEADS, HEAD_SIZE),
        query=torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE),
        key_cache=key_cache,
        value_cache=value_cache,
        num_kv_heads=NUM_KV_HEADS,
        scale=HEAD_SIZE**-0.5,
        # Sequence 1 uses one block; its second entry is unused and may hold anything.
        block_tables=torch.tensor([[3, 0], [1, 99]], dtype=torch.int32),
        seq_lens=torch.tensor([16, 5], dtype=torch.int32),
        block_size=BLOCK_SIZE,
        alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]),
        sinks=torch.tensor([8.0, -8.0, 0.0, 2.0]),
    )


def valid_paged_attention_v1():
    return dict(valid_attention_common(2), max_seq_len=16)


def valid_paged_attention_v2():
    args = valid_attention_common(2)
    exp_sums, max_logits, tmp_out = ops.paged_attention_v2_workspace(args["query"], 16)
    return dict(args, exp_sums=exp_sums, max_logits=max_logits, tmp_out=tmp_out, max_seq_len=16)


def valid_paged_attention_prefill():
    return dict(
        valid_attention_common(5),
        query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
        max_query_len=3,
    )


def valid_paged_attention_v2_workspace():
    return dict(query=torch.randn(2, NUM_HEADS, HEAD_SIZE), max_seq_len=600)


def valid_rotary_embedding():
    # query and key as column views of one fused qkv projection.
    qkv = torch.randn(3, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE)
    q_width, kv_width = NUM_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE
    return dict(
        positions=torch.tensor([0, 5, 31]),
        query=qkv[:, :q_width],
        key=qkv[:, q_width : q_width + kv_width],
        head_size=HEAD_SIZE,
        cos_sin_cache=torch.randn(32, 32),
        is_neox=True,
    )


def valid_rms_norm():
    return dict(
        out=torch.empty(3, 64), input=torch.randn(3, 80)[:, :64], weight=torch.ones(64), eps=1e-6
    )


def valid_fused_add_rms_norm():
    return dict(
        input=torch.randn(3, 64), residual=torch.randn(3, 64), weight=torch.ones(64), eps=1e-6
    )


def valid_silu_and_mul():
    return dict(out=torch.empty(3, 32), input=torch.randn(3, 64))


valid_gelu_tanh_and_mul = valid_silu_and_mul


def valid_small_batch_linear():
    return dict(
        out=torch.empty(2, 24), input=torch.randn(2, 64), weight=torch.randn(24, 64),
        bias=torch.randn(24),
    )  # fmt: skip


def valid_pack_weight_words():
    return dict(weight=torch.randn(32, 64))


def valid_packed_linear():
    return dict(
        out=torch.empty(2, 32), input=torch.randn(2, 64),
        packed_weight=ops.pack_weight_words(torch.randn(32, 64)), bias=torch.randn(32),
    )  # fmt: skip


def valid_packed_linear_vectorized():
    return dict(dtype=torch.bfloat16)


def valid_batch_invariant():
    return {}


def valid_strips_native():
    return {}


def valid_pack_strips():
    return dict(qweight=torch.zeros(16, 144, dtype=torch.uint8), qtype=Q4_K)


def valid_set_batch_invariant():
    return dict(on=False)  # the default: leaves the process as it was


Q4_K = ops.QUANT_TYPES["Q4_K"][0]


def valid_quant_linear():
    # Zero bytes are valid Q4_K blocks (all scales 0).
    return dict(
        out=torch.empty(2, 8), input=torch.randn(2, 256),
        qweight=torch.zeros(8, 144, dtype=torch.uint8), qtype=Q4_K, bias=torch.randn(8),
        many_rows=0,
    )  # fmt: skip


def valid_dequantize_rows():
    return dict(
        out=torch.empty(3, 256), qweight=torch.zeros(8, 144, dtype=torch.uint8), qtype=Q4_K,
        rows=torch.tensor([0, 7, 2]),
    )  # fmt: skip


def valid_moe_topk():
    return dict(router_logits=torch.randn(3, 8), top_k=2, renormalize=True)


def valid_fused_moe():
    # Experts [2, 6) of 8, Q4_K gate/up (zero blocks) and float32 down.
    return dict(
        out=torch.empty(3, 256), hidden=torch.randn(3, 256), router_logits=torch.randn(3, 8),
        top_k=2, w_gate=torch.zeros(4, 16, 144, dtype=torch.uint8),
        w_up=torch.zeros(4, 16, 144, dtype=torch.uint8), w_down=torch.randn(4, 256, 16),
        gate_type=Q4_K, up_type=Q4_K, down_type=0, renormalize=False,
        gate_bias=torch.randn(4, 16), up_bias=torch.randn(4, 16), down_bias=torch.randn(4, 256),
        activation="swigluoai", alpha=1.702, limit=7.0, expert_start=2, many_rows=0,
    )  # fmt: skip


def valid_apply_token_bitmask():
    return dict(
        logits=torch.randn(4, 70), bitmask=torch.zeros(2, 3, dtype=torch.int32),
        rows=torch.tensor([3, 0]),
    )  # fmt: skip


def valid_quant_row_bytes():
    return dict(qtype=Q4_K, in_features=512)


def contiguous_arena():
    """A small KVArena with slots 1 and 3 committed (test_contiguous.py tests the arena
    and the bad arguments of these ops)."""
    arena = ops.KVArena(1, 4, 64, NUM_KV_HEADS, HEAD_SIZE)
    arena.commit(1, 16)
    arena.commit(3, 5)
    return arena


def valid_write_kv_contiguous():
    arena = contiguous_arena()
    return dict(
        key=torch.randn(2, NUM_KV_HEADS, HEAD_SIZE),
        value=torch.randn(2, NUM_KV_HEADS, HEAD_SIZE),
        key_cache=arena.key_cache(0),
        value_cache=arena.value_cache(0),
        token_slots=torch.tensor([1, -1]),
        positions=torch.tensor([15, 63]),
    )


def valid_contiguous_attention_decode():
    arena = contiguous_arena()
    return dict(
        out=torch.empty(2, NUM_HEADS, HEAD_SIZE),
        query=torch.randn(2, NUM_HEADS, HEAD_SIZE),
        key_cache=arena.key_cache(0),
        value_cache=arena.value_cache(0),
        num_kv_heads=NUM_KV_HEADS,
        scale=HEAD_SIZE**-0.5,
        seq_slots=torch.tensor([1, 3], dtype=torch.int32),
        seq_lens=torch.tensor([16, 5], dtype=torch.int32),
        max_seq_len=16,
        sinks=torch.tensor([8.0, -8.0, 0.0, 2.0]),
    )


def valid_contiguous_attention_prefill():
    args = valid_contiguous_attention_decode()
    del args["max_seq_len"]
    return dict(
        args,
        out=torch.empty(5, NUM_HEADS, HEAD_SIZE),
        query=torch.randn(5, NUM_HEADS, HEAD_SIZE),
        query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
        max_query_len=3,
    )


VALID = {
    "allocate_kv_cache": valid_allocate_kv_cache,
    "allocate_kv_scales": valid_allocate_kv_scales,
    "reshape_and_cache": valid_reshape_and_cache,
    "copy_blocks": valid_copy_blocks,
    "swap_blocks": valid_swap_blocks,
    "paged_attention_v1": valid_paged_attention_v1,
    "paged_attention_v2": valid_paged_attention_v2,
    "paged_attention_prefill": valid_paged_attention_prefill,
    "paged_attention_v2_workspace": valid_paged_attention_v2_workspace,
    "rotary_embedding": valid_rotary_embedding,
    "rms_norm": valid_rms_norm,
    "fused_add_rms_norm": valid_fused_add_rms_norm,
    "silu_and_mul": valid_silu_and_mul,
    "gelu_tanh_and_mul": valid_gelu_tanh_and_mul,
    "small_batch_linear": valid_small_batch_linear,
    "pack_weight_words": valid_pack_weight_words,
    "packed_linear": valid_packed_linear,
    "packed_linear_vectorized": valid_packed_linear_vectorized,
    "quant_linear": valid_quant_linear,
    "moe_topk": valid_moe_topk,
    "fused_moe": valid_fused_moe,
    "dequantize_rows": valid_dequantize_rows,
    "apply_token_bitmask": valid_apply_token_bitmask,
    "quant_row_bytes": valid_quant_row_bytes,
    "batch_invariant": valid_batch_invariant,
    "strips_native": valid_strips_native,
    "pack_strips": valid_pack_strips,
    "set_batch_invariant": valid_set_batch_invariant,
    "write_kv_contiguous": valid_write_kv_contiguous,
    "contiguous_attention_decode": valid_contiguous_attention_decode,
    "contiguous_attention_prefill": valid_contiguous_attention_prefill,
}


def test_every_public_function_is_covered():
    # Classes (KVArena) are covered in test_contiguous.py.
    public = {
        name
        for name in ops.__all__
        if callable(getattr(ops, name)) and not isinstance(getattr(ops, name), type)
    } - {"kv_cache_x"}
    assert public == set(VALID)


@pytest.mark.parametrize("function", sorted(VALID))
def test_valid_arguments_pass_the_checks(function):
    getattr(ops, function)(**VALID[function]())


# ---------------------------------------------------------------------------
# Bad arguments: one change each.


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values as t, in a transposed memory order."""
    flipped = t.transpose(0, 1).contiguous().transpose(0, 1)
    assert flipped.shape == t.shape and not flipped.is_contiguous()
    return flipped


def heads_not_packed(t: torch.Tensor) -> torch.Tensor:
    """[T, H, D] with the same values, head_size no longer the fastest dimension."""
    flipped = t.transpose(1, 2).contiguous().transpose(1, 2)
    assert flipped.shape == t.shape and flipped.stride(2) != 1
    return flipped


def on_meta(t: torch.Tensor) -> torch.Tensor:
    """A tensor on a device pyllm does not run on, available on every machine."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


@dataclass
class Case:
    function: str
    name: str  # test id
    change: dict[str, Any]  # argument -> new value, or a function of the valid arguments
    error: type[Exception]
    match: str  # the argument the message must name (a whole word), or a regex

    def apply(self, args: dict[str, Any]) -> dict[str, Any]:
        for key, value in self.change.items():
            args[key] = value(args) if callable(value) and not isinstance(value, type) else value
        return args

    def pattern(self) -> str:
        return rf"\b{self.match}\b" if re.fullmatch(r"\w+", self.match) else self.match


def cases_for(function: str, *cases: tuple) -> list[Case]:
    return [Case(function, *case) for case in cases]


def different_cache_layout(args):
    """A value cache whose head_size does not match the key cache's (x groups)."""
    return torch.empty(NUM_BLOCKS, NUM_KV_HEADS, 2 * HEAD_SIZE, BLOCK_SIZE)


CASES = [
    *cases_for(
        "allocate_kv_cache",
        ("num_blocks_zero", {"num_blocks": 0}, ValueError, "num_blocks"),
        ("num_kv_heads_float", {"num_kv_heads": 2.0}, ValueError, "num_kv_heads"),
        ("head_size_unsupported", {"head_size": 72}, ValueError, "head_size"),
        ("block_size_unsupported", {"block_size": 12}, ValueError, "block_size"),
        ("dtype_int16", {"dtype": torch.int16}, TypeError, "dtype"),
    ),
    *cases_for(
        "reshape_and_cache",
        ("key_not_tensor", {"key": lambda a: a["key"].tolist()}, TypeError, "key"),
        ("key_float64", {"key": lambda a: a["key"].double()}, TypeError, "key"),
        ("key_on_meta", {"key": lambda a: on_meta(a["key"])}, ValueError, "key"),
        ("key_2d", {"key": lambda a: a["key"].flatten(1)}, ValueError, "key"),
        (
            "key_heads_not_packed",
            {"key": lambda a: heads_not_packed(a["key"])},
            ValueError,
            "key",
        ),
        ("value_dtype", {"value": lambda a: a["value"].half()}, TypeError, "value"),
        ("value_shape", {"value": lambda a: a["value"][:2]}, ValueError, "value"),
        ("value_on_meta", {"value": lambda a: on_meta(a["value"])}, ValueError, "value"),
        (
            "value_heads_not_packed",
            {"value": lambda a: heads_not_packed(a["value"])},
            ValueError,
            "value",
        ),
        ("kv_cache_dtype_fp8", {"kv_cache_dtype": "fp8"}, ValueError, "kv_cache_dtype"),
        ("k_scale_for_float_cache", {"k_scale": torch.zeros(4, 2, 8)}, ValueError, "k_scale"),
        (
            "int8_cache_without_scales",
            {
                "kv_cache_dtype": "int8",
                "key_cache": lambda a: cache(dtype=torch.int8)[0],
                "value_cache": lambda a: cache(dtype=torch.int8)[1],
            },
            ValueError,
            "k_scale",
        ),  # fmt: skip
        (
            "v_scale_shape",
            {
                "kv_cache_dtype": "int8",
                "k_scale": lambda a: int8_cache_args(a)["k_scale"],
                "key_cache": lambda a: cache(dtype=torch.int8)[0],
                "value_cache": lambda a: cache(dtype=torch.int8)[1],
                "v_scale": torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE + 1, dtype=torch.half),
            },
            ValueError,
            "v_scale",
        ),  # fmt: skip
        (
            "int8_cache_said_auto",
            {
                "key_cache": lambda a: cache(dtype=torch.int8)[0],
                "value_cache": lambda a: cache(dtype=torch.int8)[1],
            },
            TypeError,
            "key_cache",
        ),  # fmt: skip
        (
            "key_cache_not_contiguous",
            {"key_cache": lambda a: non_contiguous(a["key_cache"])},
            ValueError,
            "key_cache",
        ),
        (
            "value_cache_not_contiguous",
            {"value_cache": lambda a: non_contiguous(a["value_cache"])},
            ValueError,
            "value_cache",
        ),
        ("key_cache_dtype", {"key_cache": lambda a: a["key_cache"].half()}, TypeError, "key_cache"),
        (
            "value_cache_3d",
            {"value_cache": lambda a: a["value_cache"][0]},
            ValueError,
            "value_cache",
        ),
        (
            "key_cache_layout_mismatch",
            {"value_cache": different_cache_layout},
            ValueError,
            "key_cache",
        ),
        (
            "cache_head_size_unsupported",
            {"key_cache": torch.empty(4, 2, 18, 8, 4), "value_cache": torch.empty(4, 2, 72, 8)},
            ValueError,
            "head_size",
        ),
        (
            "cache_block_size_unsupported",
            {"key_cache": torch.empty(4, 2, 16, 12, 4), "value_cache": torch.empty(4, 2, 64, 12)},
            ValueError,
            "block_size",
        ),
        (
            "key_heads_differ_from_cache",
            {"key": torch.randn(3, 1, 64), "value": torch.randn(3, 1, 64)},
            ValueError,
            "key",
        ),
        (
            "slot_mapping_int32",
            {"slot_mapping": lambda a: a["slot_mapping"].int()},
            TypeError,
            "slot_mapping",
        ),
        ("slot_mapping_not_tensor", {"slot_mapping": [0, 1, 2]}, TypeError, "slot_mapping"),
        ("slot_mapping_length", {"slot_mapping": torch.tensor([0, 1])}, ValueError, "slot_mapping"),
        (
            "slot_mapping_on_meta",
            {"slot_mapping": lambda a: on_meta(a["slot_mapping"])},
            ValueError,
            "slot_mapping",
        ),
        (
            "slot_past_cache_end",
            {"slot_mapping": torch.tensor([0, NUM_BLOCKS * BLOCK_SIZE, 1])},
            ValueError,
            "slot_mapping",
        ),
        (
            "slot_below_minus_one",
            {"slot_mapping": torch.tensor([0, -2, 1])},
            ValueError,
            "slot_mapping",
        ),
    ),
    *cases_for(
        "copy_blocks",
        (
            "key_caches_tensor",
            {"key_caches": lambda a: a["key_caches"][0]},
            TypeError,
            "key_caches",
        ),
        (
            "layer_counts_differ",
            {"value_caches": lambda a: a["value_caches"][:1]},
            ValueError,
            "value_caches",
        ),
        ("no_layers", {"key_caches": [], "value_caches": []}, ValueError, "key_caches"),
        (
            "layer0_key_cache_not_contiguous",
            {"key_caches": lambda a: [non_contiguous(a["key_caches"][0]), a["key_caches"][1]]},
            ValueError,
            "layer 0: key_cache",
        ),
        (
            "layer1_value_cache_dtype",
            {"value_caches": lambda a: [a["value_caches"][0], a["value_caches"][1].half()]},
            TypeError,
            "layer 1: value_cache",
        ),
        (
            "layer1_num_blocks_differs",
            {
                "key_caches": lambda a: [a["key_caches"][0], cache(5)[0]],
                "value_caches": lambda a: [a["value_caches"][0], cache(5)[1]],
            },
            ValueError,
            "layer 1",
        ),
        (
            "block_mapping_int32",
            {"block_mapping": lambda a: a["block_mapping"].int()},
            TypeError,
            "block_mapping",
        ),
        (
            "block_mapping_three_columns",
            {"block_mapping": torch.tensor([[0, 1, 2]])},
            ValueError,
            "block_mapping",
        ),
        ("block_mapping_1d", {"block_mapping": torch.tensor([0, 1])}, ValueError, "block_mapping"),
        (
            "block_mapping_not_contiguous",
            {"block_mapping": torch.tensor([[0, 2], [1, 3]]).t()},
            ValueError,
            "block_mapping",
        ),
        (
            "block_mapping_on_meta",
            {"block_mapping": lambda a: on_meta(a["block_mapping"])},
            ValueError,
            "block_mapping",
        ),
        (
            "source_block_out_of_range",
            {"block_mapping": torch.tensor([[NUM_BLOCKS, 0]])},
            ValueError,
            "block_mapping",
        ),
        (
            "destination_block_negative",
            {"block_mapping": torch.tensor([[0, -1]])},
            ValueError,
            "block_mapping",
        ),
    ),
    *cases_for(
        "swap_blocks",
        ("src_int", {"src": lambda a: a["src"].int()}, TypeError, "src"),
        ("src_on_meta", {"src": lambda a: on_meta(a["src"])}, ValueError, "src"),
        ("dst_dtype", {"dst": lambda a: a["dst"].bfloat16()}, TypeError, "dst"),
        ("dst_not_contiguous", {"dst": lambda a: non_contiguous(a["dst"])}, ValueError, "dst"),
        ("dst_block_shape", {"dst": lambda a: cache(3)[1]}, ValueError, "dst"),
        (
            "destination_block_out_of_range",
            {"block_mapping": torch.tensor([[0, 3]])},
            ValueError,
            "block_mapping",
        ),
        (
            "block_mapping_float",
            {"block_mapping": torch.tensor([[0.0, 1.0]])},
            TypeError,
            "block_mapping",
        ),
    ),
]

# The three attention functions share their query/cache/block table checks.
ATTENTION_COMMON = [
    ("query_float64", {"query": lambda a: a["query"].double()}, TypeError, "query"),
    ("query_2d", {"query": lambda a: a["query"].flatten(1)}, ValueError, "query"),
    ("query_on_meta", {"query": lambda a: on_meta(a["query"])}, ValueError, "query"),
    ("out_shape", {"out": lambda a: a["out"][:, :2]}, ValueError, "out"),
    ("out_dtype", {"out": lambda a: a["out"].half()}, TypeError, "out"),
    ("out_not_contiguous", {"out": lambda a: non_contiguous(a["out"])}, ValueError, "out"),
    (
        "head_size_unsupported",
        {
            "query": lambda a: a["query"].new_zeros(*a["query"].shape[:2], 72),
            "out": lambda a: a["out"].new_zeros(*a["out"].shape[:2], 72),
        },
        ValueError,
        "head_size",
    ),
    ("heads_not_divisible", {"num_kv_heads": 3}, ValueError, "num_kv_heads"),
    ("num_kv_heads_zero", {"num_kv_heads": 0}, ValueError, "num_kv_heads"),
    ("num_kv_heads_differs_from_cache", {"num_kv_heads": 4}, ValueError, "num_kv_heads"),
    (
        "cache_head_size_differs",
        {"key_cache": torch.empty(4, 2, 32, 8, 4), "value_cache": torch.empty(4, 2, 128, 8)},
        ValueError,
        "head_size",
    ),
    (
        "key_cache_not_contiguous",
        {"key_cache": lambda a: non_contiguous(a["key_cache"])},
        ValueError,
        "key_cache",
    ),
    ("block_size_differs_from_cache", {"block_size": 16}, ValueError, "block_size"),
    ("block_size_unsupported", {"block_size": 12}, ValueError, "block_size"),
    ("scale_nan", {"scale": float("nan")}, ValueError, "scale"),
    ("scale_string", {"scale": "0.1"}, TypeError, "scale"),
    (
        "block_tables_int64",
        {"block_tables": lambda a: a["block_tables"].long()},
        TypeError,
        "block_tables",
    ),
    (
        "block_tables_entry_out_of_range",
        {"block_tables": torch.tensor([[3, NUM_BLOCKS], [1, 0]], dtype=torch.int32)},
        ValueError,
        "block_tables",
    ),
    (
        "block_tables_entry_negative",
        {"block_tables": torch.tensor([[3, 0], [-1, 0]], dtype=torch.int32)},
        ValueError,
        "block_tables",
    ),
    (
        "block_tables_rows",
        {"block_tables": lambda a: a["block_tables"][:1]},
        ValueError,
        "block_tables",
    ),
    (
        "seq_lens_over_capacity",
        {"seq_lens": torch.tensor([17, 5], dtype=torch.int32)},
        ValueError,
        "seq_lens",
    ),
    (
        "seq_lens_negative",
        {"seq_lens": torch.tensor([16, -1], dtype=torch.int32)},
        ValueError,
        "seq_lens",
    ),
    ("seq_lens_int64", {"seq_lens": lambda a: a["seq_lens"].long()}, TypeError, "seq_lens"),
    ("alibi_slopes_shape", {"alibi_slopes": torch.ones(2)}, ValueError, "alibi_slopes"),
    ("sliding_window_negative", {"sliding_window": -1}, ValueError, "sliding_window"),
    ("sliding_window_float", {"sliding_window": 4.5}, TypeError, "sliding_window"),
    (
        "alibi_slopes_bfloat16",
        {"alibi_slopes": lambda a: a["alibi_slopes"].bfloat16()},
        TypeError,
        "alibi_slopes",
    ),
]

# sinks: float32 [num_heads], contiguous, on the query's device (every attention op).
SINKS_CASES = [
    ("sinks_bfloat16", {"sinks": lambda a: a["sinks"].bfloat16()}, TypeError, "sinks"),
    ("sinks_float64", {"sinks": lambda a: a["sinks"].double()}, TypeError, "sinks"),
    ("sinks_num_kv_heads", {"sinks": torch.zeros(NUM_KV_HEADS)}, ValueError, "sinks"),
    ("sinks_2d", {"sinks": lambda a: a["sinks"][None]}, ValueError, "sinks"),
    (
        "sinks_not_contiguous",
        {"sinks": lambda a: torch.zeros(2 * NUM_HEADS)[::2]},
        ValueError,
        "sinks",
    ),
    ("sinks_on_meta", {"sinks": lambda a: on_meta(a["sinks"])}, ValueError, "sinks"),
    ("sinks_list", {"sinks": [0.0] * NUM_HEADS}, TypeError, "sinks"),
]

for _function in ("paged_attention_v1", "paged_attention_v2", "paged_attention_prefill"):
    CASES += cases_for(_function, *ATTENTION_COMMON, *SINKS_CASES)
for _function in ("contiguous_attention_decode", "contiguous_attention_prefill"):
    CASES += cases_for(
        _function,
        ("sliding_window_negative", {"sliding_window": -2}, ValueError, "sliding_window"),
        ("sliding_window_huge", {"sliding_window": 2**40}, ValueError, "sliding_window"),
        *SINKS_CASES,
    )

CASES += [
    *cases_for(
        "paged_attention_v1",
        (
            "seq_lens_length",
            {"seq_lens": torch.tensor([16], dtype=torch.int32)},
            ValueError,
            "seq_lens",
        ),
        ("max_seq_len_too_small", {"max_seq_len": 15}, ValueError, "max_seq_len"),
        ("max_seq_len_zero", {"max_seq_len": 0}, ValueError, "max_seq_len"),
    ),
    *cases_for(
        "paged_attention_v2",
        ("max_seq_len_too_small", {"max_seq_len": 15}, ValueError, "max_seq_len"),
        (
            "exp_sums_heads",
            {"exp_sums": lambda a: a["exp_sums"][:, :3].contiguous()},
            ValueError,
            "exp_sums",
        ),
        ("exp_sums_not_tensor", {"exp_sums": None}, TypeError, "exp_sums"),
        (
            "max_logits_float16",
            {"max_logits": lambda a: a["max_logits"].half()},
            TypeError,
            "max_logits",
        ),
        (
            "tmp_out_head_size",
            {"tmp_out": lambda a: a["tmp_out"][..., :32].contiguous()},
            ValueError,
            "tmp_out",
        ),
        ("tmp_out_dtype", {"tmp_out": lambda a: a["tmp_out"].half()}, TypeError, "tmp_out"),
        # The workspace was sized for max_seq_len 16 (one partition).
        (
            "workspace_too_few_partitions",
            {"max_seq_len": ops.PARTITION_SIZE + 1},
            ValueError,
            "exp_sums",
        ),
    ),
    *cases_for(
        "paged_attention_v2_workspace",
        ("query_2d", {"query": lambda a: a["query"].flatten(1)}, ValueError, "query"),
        ("query_not_tensor", {"query": None}, TypeError, "query"),
        ("max_seq_len_zero", {"max_seq_len": 0}, ValueError, "max_seq_len"),
    ),
    *cases_for(
        "paged_attention_prefill",
        (
            "query_start_loc_int64",
            {"query_start_loc": lambda a: a["query_start_loc"].long()},
            TypeError,
            "query_start_loc",
        ),
        (
            "query_start_loc_2d",
            {"query_start_loc": lambda a: a["query_start_loc"][None]},
            ValueError,
            "query_start_loc",
        ),
        (
            "query_start_loc_empty",
            {"query_start_loc": torch.empty(0, dtype=torch.int32)},
            ValueError,
            "query_start_loc",
        ),
        (
            "query_start_loc_not_from_zero",
            {"query_start_loc": torch.tensor([1, 3, 5], dtype=torch.int32)},
            ValueError,
            "query_start_loc",
        ),
        (
            "query_start_loc_short_of_num_tokens",
            {"query_start_loc": torch.tensor([0, 3, 4], dtype=torch.int32)},
            ValueError,
            "query_start_loc",
        ),
        (
            "query_start_loc_decreasing",
            {"query_start_loc": torch.tensor([0, 6, 5], dtype=torch.int32)},
            ValueError,
            "query_start_loc",
        ),
        (
            "query_start_loc_no_sequences_but_tokens",
            {
                "query_start_loc": torch.tensor([0], dtype=torch.int32),
                "seq_lens": torch.empty(0, dtype=torch.int32),
                "block_tables": torch.empty(0, 2, dtype=torch.int32),
            },
            ValueError,
            "query_start_loc",
        ),
        (
            "seq_lens_length",
            {"seq_lens": torch.tensor([16], dtype=torch.int32)},
            ValueError,
            "seq_lens",
        ),
        (
            "query_longer_than_seq_len",
            {"seq_lens": torch.tensor([2, 5], dtype=torch.int32)},
            ValueError,
            "seq_lens",
        ),
        ("max_query_len_too_small", {"max_query_len": 2}, ValueError, "max_query_len"),
        ("max_query_len_zero", {"max_query_len": 0}, ValueError, "max_query_len"),
    ),
    *cases_for(
        "rotary_embedding",
        ("positions_int32", {"positions": lambda a: a["positions"].int()}, TypeError, "positions"),
        ("positions_2d", {"positions": lambda a: a["positions"][None]}, ValueError, "positions"),
        (
            "positions_on_meta",
            {"positions": lambda a: on_meta(a["positions"])},
            ValueError,
            "positions",
        ),
        ("position_past_cache", {"positions": torch.tensor([0, 5, 32])}, ValueError, "positions"),
        ("position_negative", {"positions": torch.tensor([0, -1, 3])}, ValueError, "positions"),
        ("query_float64", {"query": lambda a: a["query"].double()}, TypeError, "query"),
        ("query_not_tensor", {"query": None}, TypeError, "query"),
        ("query_tokens", {"query": lambda a: a["query"][:2]}, ValueError, "query"),
        ("query_partial_head", {"query": lambda a: a["query"][:, :100]}, ValueError, "query"),
        ("query_heads_not_packed", {"query": lambda a: a["query"][:, ::2]}, ValueError, "query"),
        (
            "query_3d_wrong_head_size",
            {"query": lambda a: a["query"].reshape(3, 8, 32)},
            ValueError,
            "query",
        ),
        ("key_dtype", {"key": lambda a: a["key"].half()}, TypeError, "key"),
        ("key_4d", {"key": lambda a: a["key"].reshape(3, 2, 1, 64)}, ValueError, "key"),
        ("head_size_zero", {"head_size": 0}, ValueError, "head_size"),
        (
            "cos_sin_cache_float64",
            {"cos_sin_cache": lambda a: a["cos_sin_cache"].double()},
            TypeError,
            "cos_sin_cache",
        ),
        (
            "cos_sin_cache_odd_rot_dim",
            {"cos_sin_cache": torch.randn(32, 31)},
            ValueError,
            "cos_sin_cache",
        ),
        (
            "cos_sin_cache_rot_dim_over_head_size",
            {"cos_sin_cache": torch.randn(32, 66)},
            ValueError,
            "cos_sin_cache",
        ),
        (
            "cos_sin_cache_not_contiguous",
            {"cos_sin_cache": torch.randn(32, 32).t()},
            ValueError,
            "cos_sin_cache",
        ),
        ("cos_sin_cache_1d", {"cos_sin_cache": torch.randn(32)}, ValueError, "cos_sin_cache"),
        ("is_neox_int", {"is_neox": 1}, TypeError, "is_neox"),
    ),
    *cases_for(
        "rms_norm",
        ("input_int", {"input": lambda a: a["input"].int()}, TypeError, "input"),
        ("input_0d", {"input": torch.tensor(1.0), "out": torch.tensor(0.0)}, ValueError, "input"),
        (
            "input_not_packed",
            {"input": lambda a: a["input"].t().contiguous().t()},
            ValueError,
            "input",
        ),
        ("out_shape", {"out": lambda a: a["out"][:2]}, ValueError, "out"),
        ("out_dtype", {"out": lambda a: a["out"].half()}, TypeError, "out"),
        ("out_not_contiguous", {"out": lambda a: torch.empty(3, 80)[:, :64]}, ValueError, "out"),
        ("weight_size", {"weight": torch.ones(63)}, ValueError, "weight"),
        ("weight_dtype", {"weight": lambda a: a["weight"].bfloat16()}, TypeError, "weight"),
        ("weight_2d", {"weight": torch.ones(1, 64)}, ValueError, "weight"),
        ("eps_zero", {"eps": 0.0}, ValueError, "eps"),
        ("eps_nan", {"eps": float("nan")}, ValueError, "eps"),
        ("eps_string", {"eps": "1e-6"}, TypeError, "eps"),
    ),
    *cases_for(
        "fused_add_rms_norm",
        ("input_float64", {"input": lambda a: a["input"].double()}, TypeError, "input"),
        (
            "input_not_contiguous",
            {"input": lambda a: torch.randn(3, 80)[:, :64]},
            ValueError,
            "input",
        ),
        ("residual_shape", {"residual": lambda a: a["residual"][:2]}, ValueError, "residual"),
        ("residual_dtype", {"residual": lambda a: a["residual"].half()}, TypeError, "residual"),
        (
            "residual_not_contiguous",
            {"residual": lambda a: non_contiguous(a["residual"])},
            ValueError,
            "residual",
        ),
        ("weight_size", {"weight": torch.ones(65)}, ValueError, "weight"),
        ("eps_negative", {"eps": -1e-6}, ValueError, "eps"),
    ),
    *[
        case
        for gated in ("silu_and_mul", "gelu_tanh_and_mul")  # the same checks
        for case in cases_for(
            gated,
            ("input_odd_width", {"input": torch.randn(3, 63)}, ValueError, "input"),
            ("input_float64", {"input": lambda a: a["input"].double()}, TypeError, "input"),
            (
                "input_not_packed",
                {"input": lambda a: non_contiguous(a["input"])},
                ValueError,
                "input",
            ),
            ("out_shape", {"out": torch.empty(3, 64)}, ValueError, "out"),
            ("out_dtype", {"out": lambda a: a["out"].bfloat16()}, TypeError, "out"),
            (
                "out_not_contiguous",
                {"out": lambda a: torch.empty(3, 40)[:, :32]},
                ValueError,
                "out",
            ),
        )
    ],
    *cases_for(
        "small_batch_linear",
        (
            "too_many_rows",
            {
                "input": torch.randn(ops.SMALL_BATCH_MAX_ROWS + 1, 64),
                "out": torch.empty(ops.SMALL_BATCH_MAX_ROWS + 1, 24),
            },
            ValueError,
            "input",
        ),  # fmt: skip
        ("input_1d", {"input": torch.randn(64)}, ValueError, "input"),
        ("input_float64", {"input": lambda a: a["input"].double()}, TypeError, "input"),
        ("input_not_packed", {"input": lambda a: non_contiguous(a["input"])}, ValueError, "input"),
        ("input_on_meta", {"input": lambda a: on_meta(a["input"])}, ValueError, "input"),
        ("weight_in_features", {"weight": torch.randn(24, 63)}, ValueError, "weight"),
        ("weight_dtype", {"weight": lambda a: a["weight"].half()}, TypeError, "weight"),
        ("weight_not_contiguous", {"weight": torch.randn(64, 24).t()}, ValueError, "weight"),
        ("weight_not_tensor", {"weight": [[1.0]]}, TypeError, "weight"),
        ("out_shape", {"out": torch.empty(2, 23)}, ValueError, "out"),
        ("out_dtype", {"out": lambda a: a["out"].bfloat16()}, TypeError, "out"),
        ("out_not_contiguous", {"out": lambda a: torch.empty(2, 40)[:, :24]}, ValueError, "out"),
        ("bias_size", {"bias": torch.randn(23)}, ValueError, "bias"),
        ("bias_dtype", {"bias": lambda a: a["bias"].double()}, TypeError, "bias"),
    ),
    *cases_for(
        "pack_weight_words",
        ("weight_1d", {"weight": torch.randn(64)}, ValueError, "weight"),
        ("weight_int", {"weight": torch.ones(32, 64, dtype=torch.int32)}, TypeError, "weight"),
        ("weight_rows_not_16s", {"weight": torch.randn(24, 64)}, ValueError, "weight"),
        ("weight_odd_bf16", {"weight": torch.randn(32, 63).bfloat16()}, ValueError, "weight"),
        ("weight_not_tensor", {"weight": [[1.0]]}, TypeError, "weight"),
    ),
    *cases_for(
        "packed_linear",
        ("input_1d", {"input": torch.randn(64)}, ValueError, "input"),
        ("input_float64", {"input": lambda a: a["input"].double()}, TypeError, "input"),
        ("input_not_packed", {"input": lambda a: non_contiguous(a["input"])}, ValueError, "input"),
        ("input_on_meta", {"input": lambda a: on_meta(a["input"])}, ValueError, "input"),
        (
            "weight_not_packed",
            {"packed_weight": torch.randn(32, 64)},
            ValueError,
            "packed_weight",
        ),
        (
            "weight_in_features",
            {"packed_weight": ops.pack_weight_words(torch.randn(32, 48))},
            ValueError,
            "packed_weight",
        ),
        (
            "weight_dtype",
            {"packed_weight": lambda a: a["packed_weight"].half()},
            TypeError,
            "packed_weight",
        ),
        (
            "weight_not_contiguous",
            {"packed_weight": lambda a: a["packed_weight"].transpose(0, 1)},
            ValueError,
            "packed_weight",
        ),
        ("out_shape", {"out": torch.empty(2, 16)}, ValueError, "out"),
        ("out_dtype", {"out": lambda a: a["out"].bfloat16()}, TypeError, "out"),
        ("out_not_contiguous", {"out": lambda a: torch.empty(2, 40)[:, :32]}, ValueError, "out"),
        ("bias_size", {"bias": torch.randn(31)}, ValueError, "bias"),
        ("bias_dtype", {"bias": lambda a: a["bias"].double()}, TypeError, "bias"),
    ),
    *cases_for(
        "quant_linear",
        ("qtype_unknown", {"qtype": 99}, ValueError, "qtype"),
        ("qtype_bool", {"qtype": True}, TypeError, "qtype"),
        ("many_rows_negative", {"many_rows": -1}, ValueError, "many_rows"),
        ("many_rows_past_input", {"many_rows": 3}, ValueError, "many_rows"),
        ("many_rows_float", {"many_rows": 1.0}, TypeError, "many_rows"),
        ("in_features_not_blocks", {"input": torch.randn(2, 96)}, ValueError, "in_features"),
        ("input_float64", {"input": lambda a: a["input"].double()}, TypeError, "input"),
        ("input_on_meta", {"input": lambda a: on_meta(a["input"])}, ValueError, "input"),
        (
            "qweight_int8",
            {"qweight": lambda a: a["qweight"].view(torch.int8)},
            ValueError,
            "qweight",
        ),
        (
            "qweight_row_bytes",
            {"qweight": torch.zeros(8, 143, dtype=torch.uint8)},
            ValueError,
            "qweight",
        ),
        (
            "qweight_not_contiguous",
            {"qweight": torch.zeros(144, 8, dtype=torch.uint8).t()},
            ValueError,
            "qweight",
        ),
        ("qweight_not_tensor", {"qweight": [[0]]}, TypeError, "qweight"),
        ("out_shape", {"out": torch.empty(2, 9)}, ValueError, "out"),
        ("out_dtype", {"out": lambda a: a["out"].bfloat16()}, TypeError, "out"),
        ("out_not_packed", {"out": lambda a: torch.empty(8, 2).t()}, ValueError, "out"),
        ("bias_size", {"bias": torch.randn(7)}, ValueError, "bias"),
        ("bias_dtype", {"bias": lambda a: a["bias"].double()}, TypeError, "bias"),
    ),
    *cases_for(
        "dequantize_rows",
        ("out_float64", {"out": torch.empty(3, 256, dtype=torch.float64)}, TypeError, "out"),
        ("out_not_contiguous", {"out": torch.empty(256, 3).t()}, ValueError, "out"),
        (
            "qweight_row_bytes",
            {"qweight": torch.zeros(8, 72, dtype=torch.uint8)},
            ValueError,
            "qweight",
        ),
        ("rows_int32", {"rows": lambda a: a["rows"].int()}, TypeError, "rows"),
        ("rows_length", {"rows": torch.tensor([0, 1])}, ValueError, "rows"),
        ("rows_out_of_range", {"rows": torch.tensor([0, 8, 1])}, ValueError, "rows"),
        ("rows_negative", {"rows": torch.tensor([0, -1, 1])}, ValueError, "rows"),
        ("no_rows_row_count", {"rows": None}, ValueError, "out"),
    ),
    *cases_for(
        "apply_token_bitmask",
        ("logits_float64", {"logits": lambda a: a["logits"].double()}, TypeError, "logits"),
        ("logits_1d", {"logits": torch.randn(70)}, ValueError, "logits"),
        ("logits_not_packed", {"logits": torch.randn(70, 4).t()}, ValueError, "logits"),
        ("bitmask_int64", {"bitmask": lambda a: a["bitmask"].long()}, TypeError, "bitmask"),
        ("bitmask_1d", {"bitmask": torch.zeros(3, dtype=torch.int32)}, ValueError, "bitmask"),
        ("bitmask_on_meta", {"bitmask": lambda a: on_meta(a["bitmask"])}, ValueError, "bitmask"),
        ("rows_int32", {"rows": lambda a: a["rows"].int()}, TypeError, "rows"),
        ("rows_length", {"rows": torch.tensor([0])}, ValueError, "rows"),
        ("rows_out_of_range", {"rows": torch.tensor([0, 4])}, IndexError, "rows"),
        ("rows_negative", {"rows": torch.tensor([-1, 0])}, IndexError, "rows"),
    ),
    *cases_for(
        "moe_topk",
        ("top_k_over_experts", {"top_k": 9}, ValueError, "top_k"),
        ("top_k_zero", {"top_k": 0}, ValueError, "top_k"),
        ("logits_1d", {"router_logits": torch.randn(8)}, ValueError, "router_logits"),
        (
            "logits_int",
            {"router_logits": torch.zeros(3, 8, dtype=torch.int32)},
            TypeError,
            "router_logits",
        ),
        ("renormalize_int", {"renormalize": 1}, TypeError, "renormalize"),
    ),
    *cases_for(
        "fused_moe",
        ("top_k_over_experts", {"top_k": 9}, ValueError, "top_k"),
        ("many_rows_past_hidden", {"many_rows": 4}, ValueError, "many_rows"),
        ("many_rows_negative", {"many_rows": -2}, ValueError, "many_rows"),
        ("logits_rows", {"router_logits": torch.randn(2, 8)}, ValueError, "router_logits"),
        ("hidden_float64", {"hidden": lambda a: a["hidden"].double()}, TypeError, "hidden"),
        ("out_shape", {"out": torch.empty(3, 128)}, ValueError, "out"),
        ("gate_type_unknown", {"gate_type": 99}, ValueError, "qtype"),
        ("up_row_bytes", {"w_up": torch.zeros(4, 16, 143, dtype=torch.uint8)}, ValueError, "w_up"),
        ("up_rows", {"w_up": torch.zeros(4, 8, 144, dtype=torch.uint8)}, ValueError, "w_up"),
        ("down_experts", {"w_down": torch.randn(3, 256, 16)}, ValueError, "w_down"),
        ("down_type_dtype", {"down_type": 30}, TypeError, "w_down"),
        ("down_dtype", {"w_down": lambda a: a["w_down"].bfloat16()}, TypeError, "w_down"),
        ("down_bias_shape", {"down_bias": torch.randn(4, 16)}, ValueError, "down_bias"),
        ("activation_unknown", {"activation": "gelu"}, ValueError, "activation"),
        ("limit_negative", {"limit": -1.0}, ValueError, "limit"),
        ("expert_start_past", {"expert_start": 5}, ValueError, "expert_start"),
        ("expert_start_negative", {"expert_start": -1}, ValueError, "expert_start"),
        ("weights_on_meta", {"w_gate": lambda a: on_meta(a["w_gate"])}, ValueError, "w_gate"),
    ),
    *cases_for("set_batch_invariant", ("on_not_bool", {"on": 1}, ValueError, "on")),
    *cases_for(
        "quant_row_bytes",
        ("qtype_unknown", {"qtype": 1}, ValueError, "qtype"),
        (
            "qtype_strips_block",
            {"qtype": ops.STRIPS_TYPES[Q4_K], "in_features": 100},
            ValueError,
            "in_features",
        ),
        ("in_features_not_blocks", {"in_features": 100}, ValueError, "in_features"),
    ),
    *cases_for(
        "pack_strips",
        ("qtype_no_strips", {"qtype": 1}, ValueError, "qtype"),
        ("qweight_not_tensor", {"qweight": [0] * 144}, TypeError, "qweight"),
        ("qweight_float", {"qweight": torch.zeros(16, 144)}, ValueError, "qweight"),
        (
            "qweight_4d",
            {"qweight": torch.zeros(2, 2, 16, 144, dtype=torch.uint8)},
            ValueError,
            "qweight",
        ),
        (
            "qweight_row_bytes",
            {"qweight": torch.zeros(16, 100, dtype=torch.uint8)},
            ValueError,
            "qweight",
        ),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.function}-{c.name}" for c in CASES])
def test_bad_argument_raises_naming_it(case: Case):
    args = case.apply(VALID[case.function]())
    with pytest.raises(case.error, match=case.pattern()):
        getattr(ops, case.function)(**args)
