"""Shared pieces of the kernel tests: devices, dtypes, tolerances, and a paged KV cache
filled from dense per-sequence keys/values in plain PyTorch (no pyllm kernel involved),
so attention tests do not depend on reshape_and_cache being right."""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass

import pytest
import torch

import pyllm.ops as ops

# torch's thread count when the tests loaded: the kernels run with it.
KERNEL_THREADS = torch.get_num_threads()


def seed_and_single_thread(request):
    """For an autouse fixture: fresh random inputs per case, reproducible from the test
    id. Setup and the float64 reference run on one thread (their tensors are small, and
    on a shared 2-core machine thread hand-offs cost more than the math); kernel calls
    go through kernel_threads(), so the kernels' parallel paths are what is tested."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(KERNEL_THREADS)


@contextlib.contextmanager
def kernel_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(KERNEL_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# Devices the suite runs on: CUDA joins automatically where a GPU is present.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and ops.BUILT_WITH_CUDA else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (atol, rtol) per dtype against a float64/float32 reference, for every op.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

# A value no kernel would compute from the random inputs: outputs are filled with it
# before the call so that an element the kernel forgot to write fails the comparison.
POISON = float("nan")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(
        actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol, equal_nan=False
    )


def device_param(device: str):
    """Marks a CUDA case as skipped when no GPU is present, with the reason shown."""
    return pytest.param(
        device,
        marks=pytest.mark.skipif(
            device == "cuda" and "cuda" not in DEVICES, reason="no CUDA device"
        ),
    )


ALL_DEVICES = [device_param("cpu"), device_param("cuda")]


@dataclass
class PagedKV:
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_size]
    values: list[torch.Tensor]


def scatter_into_cache(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Plain-PyTorch reshape_and_cache: writes key/value [T, Hkv, D] at the given slots."""
    block_size = value_cache.shape[3]
    x = key_cache.shape[4]
    num_tokens, num_kv_heads, head_size = key.shape
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced indices split by slices put the token dimension first: [T, Hkv, D/x, x].
    key_cache[blocks, :, :, offsets, :] = key[keep].reshape(-1, num_kv_heads, head_size // x, x)
    value_cache[blocks, :, :, offsets] = value[keep]


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    extra_blocks: int = 3,
    generator: torch.Generator | None = None,
) -> PagedKV:
    """Random keys/values for each sequence, stored in randomly permuted cache blocks."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    key_cache, value_cache = ops.allocate_kv_cache(
        num_blocks, num_kv_heads, head_size, block_size, dtype, device
    )
    # Unused cache slots hold garbage a wrong kernel would pick up.
    key_cache.normal_(generator=generator) if device == "cpu" else key_cache.normal_()
    value_cache.normal_(generator=generator) if device == "cpu" else value_cache.normal_()
    order = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(max(blocks_per_seq, default=1), 1)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    keys, values = [], []
    for s, n in enumerate(seq_lens):
        table = [order.pop() for _ in range(blocks_per_seq[s])]
        block_tables[s, : len(table)] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_size, generator=generator).to(dtype)
        v = torch.randn(n, num_kv_heads, head_size, generator=generator).to(dtype)
        slots = torch.tensor(
            [table[i // block_size] * block_size + i % block_size for i in range(n)],
            dtype=torch.int64,
        )
        scatter_into_cache(key_cache, value_cache, k.to(device), v.to(device), slots)
        keys.append(k.to(device))
        values.append(v.to(device))
    return PagedKV(
        key_cache,
        value_cache,
        block_tables.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        keys,
        values,
    )
