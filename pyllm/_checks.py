"""The compiled library's limits and the argument checks shared by pyllm.ops and
pyllm.kv_cache: each check raises TypeError or ValueError naming the argument and the
value that was wrong."""

from __future__ import annotations

from collections.abc import Sequence

import torch

import pyllm._C  # noqa: F401  (loads the library, which registers torch.ops.pyllm)

_C = torch.ops.pyllm

# paged_attention_v2 reduces each partition of this many tokens separately.
PARTITION_SIZE: int = int(_C.partition_size())
BUILT_WITH_CUDA: bool = bool(_C.built_with_cuda())
# Tokens per tile of the contiguous KV layout.
TOKEN_TILE: int = int(_C.token_tile())
# Most input rows small_batch_linear takes.
SMALL_BATCH_MAX_ROWS: int = int(_C.small_batch_max_rows())
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The attention kernels' head sizes and KV block sizes (csrc/attention/sizes.h).
SUPPORTED_HEAD_SIZES: tuple[int, ...] = tuple(_C.supported_head_sizes())
SUPPORTED_BLOCK_SIZES: tuple[int, ...] = tuple(_C.supported_block_sizes())


# What a Python value must be for each type of an op's schema.
_PYTHON_TYPES = {
    "int": (int, "an int"),
    "float": ((int, float), "a float"),
    "bool": (bool, "a bool"),
    "str": (str, "a str"),
}
# op -> the types of its schema's arguments, read once.
_SCHEMA_TYPES: dict[object, tuple[str, ...]] = {}


def _check_args(op, **args: object) -> None:
    """The Python-level checks of a call to op, which its C++ checks cannot see: each
    argument has its schema's Python type (TypeError naming it) and each tensor is on
    a device this build runs (ValueError). args: op's arguments in schema order."""
    types = _SCHEMA_TYPES.get(op)
    if types is None:
        types = _SCHEMA_TYPES[op] = tuple(str(a.type) for a in op.default._schema.arguments)
    for (name, value), kind in zip(args.items(), types, strict=True):
        if kind == "Tensor" or (kind == "Optional[Tensor]" and value is not None):
            _supported_device(name, _tensor(name, value))
        elif kind == "List[Tensor]":
            if not isinstance(value, (list, tuple)):
                raise TypeError(f"{name} must be a list of tensors, got {type(value).__name__}")
            for i, t in enumerate(value):
                _supported_device(f"{name}[{i}]", _tensor(f"{name}[{i}]", t))
        elif kind in _PYTHON_TYPES:
            expected, text = _PYTHON_TYPES[kind]
            if not isinstance(value, expected) or (isinstance(value, bool) and kind != "bool"):
                raise TypeError(f"{name} must be {text}, got {type(value).__name__}")


def _check_range(name: str, t: torch.Tensor, lo: int, hi: int, note: str = "") -> None:
    """The values of index tensor t lie in [lo, hi) (one device sync on CUDA)."""
    if t.numel():
        got_lo, got_hi = torch.stack(torch.aminmax(t)).tolist()
        if got_lo < lo or got_hi >= hi:
            raise ValueError(
                f"{name} must lie in [{lo}, {hi}){note}, got values in [{got_lo}, {got_hi}]"
            )


def _tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other tensors are on {device}")


def _supported_device(name: str, t: torch.Tensor) -> None:
    if t.device.type == "cuda" and not BUILT_WITH_CUDA:
        raise ValueError(
            f"{name} is on {t.device} but pyllm was built without CUDA kernels "
            "(rebuild with PYLLM_TARGET=cuda)"
        )
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {t.device}; pyllm ops run on cpu and cuda")


def _float_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: float32, float16, bfloat16")


def _same_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but must match the others ({dtype})")


def _index_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")


def _ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def _contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _packed_rows(name: str, t: torch.Tensor) -> None:
    """Rows (dim 0) may be strided, as in a view of a wider tensor; the elements
    inside one row must be packed."""
    expected = 1
    for dim in range(t.dim() - 1, 0, -1):
        if t.shape[dim] > 1 and t.stride(dim) != expected:
            raise ValueError(
                f"{name} must have each row's elements packed (all dims but the first "
                f"contiguous), got shape {tuple(t.shape)} with strides {t.stride()}"
            )
        expected *= t.shape[dim]
    if t.dim() == 1 and t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def _shape(name: str, t: torch.Tensor, expected: Sequence[int], layout: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)} {layout}, got {tuple(t.shape)}")


def _head_size(head_size: int) -> None:
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(
            f"head_size {head_size} is not supported; supported: {SUPPORTED_HEAD_SIZES}"
        )


def _block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"block_size {block_size!r} is not supported; supported: {SUPPORTED_BLOCK_SIZES}"
        )


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _finite_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def kv_cache_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte group in the key cache's last dimension."""
    return 16 // dtype.itemsize


def _check_kv_cache(
    key_cache: torch.Tensor, value_cache: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, int, int]:
    """Validates a cache pair; returns (num_blocks, num_kv_heads, head_size, block_size)."""
    _tensor("key_cache", key_cache)
    _tensor("value_cache", value_cache)
    _device("key_cache", key_cache, device)
    _device("value_cache", value_cache, device)
    _same_dtype("key_cache", key_cache, dtype)
    _same_dtype("value_cache", value_cache, dtype)
    _ndim("key_cache", key_cache, 5, "[num_blocks, num_kv_heads, head_size // x, block_size, x]")
    _ndim("value_cache", value_cache, 4, "[num_blocks, num_kv_heads, head_size, block_size]")
    _contiguous("key_cache", key_cache)
    _contiguous("value_cache", value_cache)
    num_blocks, num_kv_heads, head_size, block_size = value_cache.shape
    x = kv_cache_x(dtype)
    _shape(
        "key_cache",
        key_cache,
        (num_blocks, num_kv_heads, head_size // x, block_size, x),
        f"(x = {x} for {dtype}, matching value_cache {tuple(value_cache.shape)})",
    )
    _head_size(head_size)
    _block_size(block_size)
    return num_blocks, num_kv_heads, head_size, block_size


def _check_block_tables(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
    num_blocks: int,
    block_size: int,
    device: torch.device,
) -> None:
    _tensor("block_tables", block_tables)
    _tensor("seq_lens", seq_lens)
    _device("block_tables", block_tables, device)
    _device("seq_lens", seq_lens, device)
    _index_dtype("block_tables", block_tables, torch.int32)
    _index_dtype("seq_lens", seq_lens, torch.int32)
    _ndim("block_tables", block_tables, 2, "[num_seqs, max_num_blocks_per_seq]")
    _contiguous("block_tables", block_tables)
    _contiguous("seq_lens", seq_lens)
    _shape("seq_lens", seq_lens, (num_seqs,), "[num_seqs]")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows but there are {num_seqs} sequences"
        )
    if num_seqs == 0:
        return
    max_len = block_tables.shape[1] * block_size
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 0 or hi > max_len:
        raise ValueError(
            f"seq_lens must lie in [0, {max_len}] (block_tables holds "
            f"{block_tables.shape[1]} blocks of {block_size}), got values in [{lo}, {hi}]"
        )
    # Only the blocks that hold tokens are read; unused table entries may be anything.
    used = torch.arange(block_tables.shape[1], device=device)[None, :] * block_size
    used = used < seq_lens[:, None]
    if bool(used.any()):
        entries = block_tables[used]
        if int(entries.min()) < 0 or int(entries.max()) >= num_blocks:
            raise ValueError(
                f"block_tables holds block numbers outside [0, {num_blocks}) "
                f"(got {int(entries.min())}..{int(entries.max())})"
            )


def _check_attention_io(
    out: torch.Tensor, query: torch.Tensor, num_kv_heads: int
) -> tuple[int, int, int]:
    """Checks out/query; returns (num_tokens, num_heads, head_size)."""
    _tensor("query", query)
    _tensor("out", out)
    _supported_device("query", query)
    _float_dtype("query", query)
    _ndim("query", query, 3, "[num_tokens, num_heads, head_size]")
    _packed_rows("query", query)
    _device("out", out, query.device)
    _same_dtype("out", out, query.dtype)
    _shape("out", out, query.shape, "(same as query)")
    _contiguous("out", out)
    num_tokens, num_heads, head_size = query.shape
    _head_size(head_size)
    _positive_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must divide the query's num_heads ({num_heads})"
        )
    return num_tokens, num_heads, head_size


def _check_alibi(alibi_slopes: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    if alibi_slopes is None:
        return
    _tensor("alibi_slopes", alibi_slopes)
    _device("alibi_slopes", alibi_slopes, device)
    _index_dtype("alibi_slopes", alibi_slopes, torch.float32)
    _shape("alibi_slopes", alibi_slopes, (num_heads,), "[num_heads]")
    _contiguous("alibi_slopes", alibi_slopes)


def _check_cache_heads(
    num_kv_heads: int, cache_kv_heads: int, head_size: int, cache_head_size: int
) -> None:
    """The query's head size and the caller's num_kv_heads against the cache's."""
    if cache_kv_heads != num_kv_heads:
        raise ValueError(
            f"num_kv_heads is {num_kv_heads} but the cache holds {cache_kv_heads} kv heads"
        )
    if cache_head_size != head_size:
        raise ValueError(
            f"query head_size {head_size} does not match the cache's head_size {cache_head_size}"
        )


def _check_attention_common(
    out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
    block_size, alibi_slopes,
) -> tuple[int, int, int]:  # fmt: skip
    num_tokens, num_heads, head_size = _check_attention_io(out, query, num_kv_heads)
    num_blocks, cache_kv_heads, cache_head_size, cache_block_size = _check_kv_cache(
        key_cache, value_cache, query.dtype, query.device
    )
    _check_cache_heads(num_kv_heads, cache_kv_heads, head_size, cache_head_size)
    _block_size(block_size)
    if block_size != cache_block_size:
        raise ValueError(
            f"block_size is {block_size} but the cache's blocks hold {cache_block_size} tokens"
        )
    _finite_float("scale", scale)
    _check_alibi(alibi_slopes, num_heads, query.device)
    return num_tokens, num_heads, num_blocks


def _check_max_seq_len(max_seq_len: int, seq_lens: torch.Tensor) -> None:
    _positive_int("max_seq_len", max_seq_len)
    if seq_lens.numel() and int(seq_lens.max()) > max_seq_len:
        raise ValueError(
            f"max_seq_len ({max_seq_len}) is smaller than the longest of seq_lens "
            f"({int(seq_lens.max())})"
        )


def _query_start_loc(query_start_loc: torch.Tensor, device: torch.device) -> int:
    """Checks query_start_loc's tensor properties; returns num_seqs."""
    _tensor("query_start_loc", query_start_loc)
    _device("query_start_loc", query_start_loc, device)
    _index_dtype("query_start_loc", query_start_loc, torch.int32)
    _ndim("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    _contiguous("query_start_loc", query_start_loc)
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("query_start_loc must hold num_seqs + 1 offsets, got an empty tensor")
    return num_seqs


def _check_query_lens(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, max_query_len: int
) -> None:
    """Prefill's query offsets against the tokens, max_query_len and seq_lens."""
    _positive_int("max_query_len", max_query_len)
    # Checked for zero sequences too: query tokens that no sequence covers would
    # leave their rows of out unwritten.
    if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != num_tokens:
        raise ValueError(
            f"query_start_loc must start at 0 and end at num_tokens ({num_tokens}), got "
            f"{int(query_start_loc[0])}..{int(query_start_loc[-1])}"
        )
    if query_start_loc.shape[0] > 1:
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        if int(q_lens.min()) < 0:
            raise ValueError("query_start_loc must be non-decreasing")
        if int(q_lens.max()) > max_query_len:
            raise ValueError(
                f"max_query_len ({max_query_len}) is smaller than the longest query "
                f"({int(q_lens.max())})"
            )
        if bool((q_lens > seq_lens).any()):
            raise ValueError("each sequence's query length must be <= its seq_lens entry")


def _check_block_mapping(block_mapping: torch.Tensor, num_src: int, num_dst: int) -> None:
    """Source and destination block numbers in range (the rows' layout is checked in C++)."""
    if block_mapping.dim() == 2 and block_mapping.shape[1] == 2:
        _check_range("block_mapping", block_mapping[:, 0], 0, num_src, " (source blocks)")
        _check_range("block_mapping", block_mapping[:, 1], 0, num_dst, " (destination blocks)")


def _check_eps(eps: object) -> None:
    if _finite_float("eps", eps) <= 0:
        raise ValueError(f"eps must be positive, got {eps}")


def _check_norm_weight(weight: torch.Tensor, t: torch.Tensor, name: str) -> None:
    _tensor("weight", weight)
    _device("weight", weight, t.device)
    _same_dtype("weight", weight, t.dtype)
    _ndim("weight", weight, 1, "[hidden_size]")
    _contiguous("weight", weight)
    if t.dim() < 1 or weight.shape[0] != t.shape[-1]:
        raise ValueError(
            f"weight has {weight.shape[0]} elements but {name}'s last dimension is "
            f"{t.shape[-1] if t.dim() else 'missing'}"
        )


def _check_linear_input(
    input: torch.Tensor, weight_name: str, weight: torch.Tensor, out: torch.Tensor
) -> None:
    """The linear ops' input [rows, in_features] (rows may be strided, elements packed),
    and that the weight and out are tensors."""
    _tensor("input", input)
    _tensor(weight_name, weight)
    _tensor("out", out)
    _supported_device("input", input)
    _float_dtype("input", input)
    _ndim("input", input, 2, "[rows, in_features]")
    _packed_rows("input", input)


def _check_linear_output(
    out: torch.Tensor, bias: torch.Tensor | None, input: torch.Tensor, rows: int, features: int
) -> None:
    """out [rows, features] and bias [features] of the linear ops (out's dtype and device
    are checked beside the weight's)."""
    _shape("out", out, (rows, features), "[rows, out_features]")
    _contiguous("out", out)
    _check_linear_bias(bias, input, features)


def _check_linear_bias(bias: torch.Tensor | None, input: torch.Tensor, features: int) -> None:
    if bias is not None:
        _tensor("bias", bias)
        _device("bias", bias, input.device)
        _same_dtype("bias", bias, input.dtype)
        _shape("bias", bias, (features,), "[out_features]")
        _contiguous("bias", bias)
