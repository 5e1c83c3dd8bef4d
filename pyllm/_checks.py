"""The compiled library's limits and what the Python wrappers check before calling an
op: the arguments' Python types (the one generic _check_args) and the values of index
tensors. The structural contract of every op (shapes, dtypes, layouts, devices) is
checked in C++, by one checks header per family (csrc/<family>/<family>_checks.h),
whoever calls it. Each check raises TypeError or ValueError naming the argument."""

from __future__ import annotations

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
    """The checks of a call to op that its C++ checks cannot make: each argument has
    its schema's Python type (TypeError naming it) and each tensor is on a device this
    build runs (ValueError; the dispatcher would not reach C++). args: op's arguments
    in schema order, under the Python wrapper's names."""
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


def _tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _supported_device(name: str, t: torch.Tensor) -> None:
    if t.device.type == "cuda" and not BUILT_WITH_CUDA:
        raise ValueError(
            f"{name} is on {t.device} but pyllm was built without CUDA kernels "
            "(rebuild with PYLLM_TARGET=cuda)"
        )
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {t.device}; pyllm ops run on cpu and cuda")


# ---------------------------------------------------------------------------
# Index values. Each check reads a tensor (a device sync on CUDA) and runs only where
# the tensors it reads have the layout it expects: otherwise the op's C++ checks
# raise the layout error.


def _check_range(
    name: str, t: torch.Tensor, dtype: torch.dtype, lo: int, hi: int, note: str = ""
) -> None:
    """The values of index tensor t, of dtype, lie in [lo, hi)."""
    if t.dtype == dtype and t.numel():
        got_lo, got_hi = torch.stack(torch.aminmax(t)).tolist()
        if got_lo < lo or got_hi >= hi:
            raise ValueError(
                f"{name} must lie in [{lo}, {hi}){note}, got values in [{got_lo}, {got_hi}]"
            )


def _check_block_mapping(block_mapping: torch.Tensor, num_src: int, num_dst: int) -> None:
    """Source and destination block numbers in range."""
    if block_mapping.dim() == 2 and block_mapping.shape[1] == 2:
        _check_range(
            "block_mapping", block_mapping[:, 0], torch.int64, 0, num_src, " (source blocks)"
        )
        _check_range(
            "block_mapping", block_mapping[:, 1], torch.int64, 0, num_dst, " (destination blocks)"
        )


def _check_block_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, value_cache: torch.Tensor, block_size: int
) -> None:
    """seq_lens within the blocks each table row holds, and the table entries that
    hold tokens within the cache (unused entries may be anything)."""
    if not (
        block_tables.dim() == 2
        and value_cache.dim() == 4
        and block_size == value_cache.shape[3]
        and seq_lens.shape == block_tables.shape[:1]
        and seq_lens.device == block_tables.device
        and seq_lens.numel()
    ):
        return
    blocks = block_tables.shape[1]
    note = f" (block_tables holds {blocks} blocks of {block_size})"
    _check_range("seq_lens", seq_lens, torch.int32, 0, blocks * block_size + 1, note)
    starts = torch.arange(blocks, device=seq_lens.device) * block_size
    used = block_tables[starts[None, :] < seq_lens[:, None]]
    _check_range(
        "block_tables", used, torch.int32, 0, value_cache.shape[0], " (block numbers in use)"
    )


def _check_max_len(name: str, value: int, seq_lens: torch.Tensor) -> None:
    if seq_lens.numel() and (longest := int(seq_lens.max())) > value:
        raise ValueError(f"{name} ({value}) is smaller than the longest of seq_lens ({longest})")


def _check_query_lens(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, query: torch.Tensor, max_query_len: int
) -> None:
    """Prefill's query offsets against the tokens, max_query_len and seq_lens."""
    if (
        query_start_loc.dtype != torch.int32
        or query_start_loc.dim() != 1
        or not query_start_loc.numel()
        or query.dim() != 3
    ):
        return
    # Checked for zero sequences too: query tokens that no sequence covers would
    # leave their rows of out unwritten.
    first, last = query_start_loc[[0, -1]].tolist()
    if first != 0 or last != query.shape[0]:
        raise ValueError(
            f"query_start_loc must start at 0 and end at num_tokens ({query.shape[0]}), got "
            f"{first}..{last}"
        )
    if query_start_loc.shape[0] == 1:
        return
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    shortest, longest = torch.stack(torch.aminmax(q_lens)).tolist()
    if shortest < 0:
        raise ValueError("query_start_loc must be non-decreasing")
    if longest > max_query_len:
        raise ValueError(
            f"max_query_len ({max_query_len}) is smaller than the longest query ({longest})"
        )
    if q_lens.shape == seq_lens.shape and q_lens.device == seq_lens.device:
        if bool((q_lens > seq_lens).any()):
            raise ValueError("each sequence's query length must be <= its seq_lens entry")


# ---------------------------------------------------------------------------
# The Python-only functions' own arguments (allocation, weight packing).


def _float_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: float32, float16, bfloat16")


def _ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


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


def kv_cache_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte group in the key cache's last dimension."""
    return 16 // dtype.itemsize
