"""A GGUF file opened once: its metadata and tensor table parsed, its bytes memory-mapped.

    f = open_gguf("model.gguf")
    f.metadata["llama.block_count"]         # 30
    f.tensors["blk.0.attn_q.weight"].raw    # uint8 [rows, bytes per row], straight from the map
    f.tensors["output_norm.weight"].array() # float32 view, no copy

The layout (version 2 and 3, little-endian): magic "GGUF", uint32 version, uint64 tensor count,
uint64 key-value count; the key-value pairs (key string, uint32 value type, value); per tensor its
name, uint32 dim count, uint64 dims (innermost first), uint32 ggml type and uint64 offset; then,
at the next multiple of `general.alignment` (default 32), the tensor data. A string is a uint64
byte count then UTF-8 bytes; an array is a uint32 item type, a uint64 count, then the items.

`gguf.GGUFReader` reads the same files but builds numpy views per string and per array item, which
costs seconds for a 50k-token vocabulary. Here the key-value section is walked with `struct`, and
the tensor data is never read: `.raw` and `.array()` are views of the `numpy.memmap`.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUFValueType numbers.
_STRING, _ARRAY = 8, 9
# Little-endian numpy dtypes of the numeric value types, by GGUFValueType number.
_VALUE_DTYPES = {
    0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
    4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"),
    10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8"),
}  # fmt: skip
# struct formats of the same, by GGUFValueType number.
_SCALARS = {
    number: struct.Struct(fmt)
    for number, fmt in {
        0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
        10: "<Q", 11: "<q", 12: "<d",
    }.items()
}  # fmt: skip
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# What `.array()` returns per unquantized type. numpy has no bfloat16: BF16 comes back as its
# uint16 bit patterns (torch.from_numpy(a).view(torch.bfloat16) reads them without a copy).
_ARRAY_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry in the file. shape is in numpy order (GGUF's dims reversed): a weight
    [rows, cols] has cols (the dim blocks run along) last."""

    name: str
    type_id: int  # gguf.GGMLQuantizationType number
    type_name: str  # "Q4_1", "F32", ...
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # of its first byte in the file
    block_size: int  # weights per block (1 for F32/F16/BF16)
    type_size: int  # bytes per block
    _map: np.ndarray = field(repr=False, compare=False)

    @property
    def raw(self) -> np.ndarray:
        """Its bytes as a read-only uint8 view of the map, shaped shape[:-1] + (bytes per row,):
        [rows, cols / block_size * type_size] for a 2-D weight. Nothing is read until used."""
        row_bytes = self.shape[-1] // self.block_size * self.type_size
        data = self._map[self.offset : self.offset + self.nbytes]
        return np.asarray(data).reshape(*self.shape[:-1], row_bytes)

    def drop_pages(self) -> None:
        """Unmaps the whole pages of this tensor's bytes from the process; they stay in the
        page cache, and a later read maps them again. For a tensor just copied: its mapped
        pages would count in the process's RSS beside the copy."""
        handle = getattr(self._map, "_mmap", None)  # numpy.memmap's mmap.mmap
        if handle is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = -(-self.offset // mmap.PAGESIZE) * mmap.PAGESIZE
        stop = (self.offset + self.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if stop > start:
            handle.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def array(self) -> np.ndarray:
        """The values of an unquantized tensor as a read-only view of shape `shape`, no copy:
        float32 for F32, float16 for F16, uint16 bit patterns for BF16 (numpy has no bfloat16),
        and the matching type for F64/I8/I16/I32/I64. Quantized types: use `raw`."""
        dtype = _ARRAY_DTYPES.get(self.type_name)
        if dtype is None:
            raise ValueError(
                f"tensor {self.name!r} is quantized ({self.type_name}); read its blocks "
                f"with .raw, or dequantize them"
            )
        return self.raw.view(dtype).reshape(self.shape)


class GGUFFile:
    """A parsed GGUF file over a read-only `numpy.memmap` of it.

    metadata: key -> value in file order (read-only by convention: `open_gguf` shares one
    instance): int / float / bool / str; arrays of numbers as numpy arrays, of strings as lists of
    str (invalid UTF-8 replaced by U+FFFD), of arrays as lists. tensors: name -> GGUFTensor in
    file order.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"GGUF file {self.path} not found")
        if not os.path.isfile(self.path):
            raise self._error("not a regular file")
        self.size = os.path.getsize(self.path)
        if self.size < 24:  # magic, version and the two counts
            raise self._error(f"truncated: {self.size} bytes, shorter than a GGUF header")
        self._map = np.memmap(self.path, mode="r")
        self._view = memoryview(self._map)
        try:
            self._parse()
        except struct.error:
            raise self._error("truncated (the header runs past the end of the file)") from None

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, version={self.version}, tensors={len(self.tensors)})"

    def _error(self, why: str) -> ValueError:
        return ValueError(f"{self.path} is not a readable GGUF file: {why}")

    def _parse(self) -> None:
        view = self._view
        magic = bytes(view[:4])
        if magic != GGUF_MAGIC:
            raise self._error(f"bad magic {magic!r} (expected {GGUF_MAGIC!r})")
        (self.version,) = _U32.unpack_from(view, 4)
        if self.version not in SUPPORTED_VERSIONS:
            if int.from_bytes(view[4:8], "big") in SUPPORTED_VERSIONS:
                raise self._error("big-endian GGUF files are not supported")
            raise self._error(f"unsupported GGUF version {self.version} (supported: 2, 3)")
        tensor_count, kv_count = struct.unpack_from("<QQ", view, 8)
        self._pos = 24
        # Each key-value pair takes at least 12 bytes, each tensor info at least 28: a count
        # beyond that is garbage, not a reason to loop for ages.
        self._check_count(kv_count, 12, "key-value pairs")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            (value_type,) = _U32.unpack_from(view, self._pos)
            self._pos += 4
            self.metadata[key] = self._value(value_type, key)

        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(self.alignment) is not int or self.alignment <= 0:
            raise self._error(f"general.alignment {self.alignment!r} is not a positive integer")
        if self.alignment & (self.alignment - 1):
            raise self._error(f"general.alignment {self.alignment} is not a power of two")

        self._check_count(tensor_count, 28, "tensors")
        infos = [self._tensor_info() for _ in range(tensor_count)]
        self.data_offset = -(-self._pos // self.alignment) * self.alignment
        del self._pos
        self.tensors: dict[str, GGUFTensor] = {}
        if infos:
            self._build_tensors(infos)

    def _check_count(self, count: int, min_bytes: int, what: str) -> None:
        if count > (self.size - self._pos) // min_bytes:
            raise self._error(f"truncated, or a corrupt count: {count} {what}")

    def _string(self) -> str:
        (length,) = _U64.unpack_from(self._view, self._pos)
        start = self._pos + 8
        self._pos = start + length
        if self._pos > self.size:
            raise struct.error
        return str(self._view[start : self._pos], "utf-8", "replace")

    def _value(self, value_type: int, key: str):
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = struct.unpack_from("<IQ", self._view, self._pos)
            self._pos += 12
            return self._array(item_type, count, key)
        scalar = _SCALARS.get(value_type)
        if scalar is None:
            raise self._error(f"unknown value type {value_type} of key {key!r}")
        (value,) = scalar.unpack_from(self._view, self._pos)
        self._pos += scalar.size
        return value

    def _array(self, item_type: int, count: int, key: str):
        if item_type == _STRING:
            return self._strings(count)
        if item_type == _ARRAY:
            self._check_count(count, 12, f"items in the array {key!r}")
            return [self._value(_ARRAY, key) for _ in range(count)]
        dtype = _VALUE_DTYPES.get(item_type)
        if dtype is None:
            raise self._error(f"unknown item type {item_type} of the array {key!r}")
        self._check_count(count, dtype.itemsize, f"items in the array {key!r}")
        items = np.frombuffer(self._view, dtype=dtype, count=count, offset=self._pos)
        self._pos += count * dtype.itemsize
        # A copy in native order: small, and it does not pin the map.
        return items.astype(dtype.newbyteorder("="))

    def _strings(self, count: int) -> list[str]:
        """count strings, walked and decoded in one pass over a bytes copy of the header
        (slicing bytes is cheaper than slicing the map's memoryview). The copy starts at a
        guess of 24 bytes a string and doubles while the array runs past it."""
        self._check_count(count, 8, "strings in an array")
        first, chunk = self._pos, b""
        unpack, pos, out = _U64.unpack_from, 0, []
        append = out.append
        for _ in range(count):
            if pos + 8 > len(chunk):
                chunk = self._header_bytes(first, pos + 8, max(count * 24, 2 * len(chunk)))
            (length,) = unpack(chunk, pos)
            pos += 8
            if pos + length > len(chunk):
                chunk = self._header_bytes(first, pos + length, max(count * 24, 2 * len(chunk)))
            append(chunk[pos : pos + length].decode("utf-8", "replace"))
            pos += length
        self._pos = first + pos
        return out

    def _header_bytes(self, first: int, needed: int, wanted: int) -> bytes:
        """A bytes copy of the file from `first`, `wanted` long (less at the end of the
        file), at least `needed` (else struct.error: truncated)."""
        if first + needed > self.size:
            raise struct.error
        return bytes(self._view[first : min(self.size, first + max(needed, wanted))])

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (n_dims,) = _U32.unpack_from(self._view, self._pos)
        if not 1 <= n_dims <= 8:
            raise self._error(f"tensor {name!r} has {n_dims} dims")
        dims = struct.unpack_from(f"<{n_dims}Q", self._view, self._pos + 4)
        type_id, offset = struct.unpack_from("<IQ", self._view, self._pos + 4 + 8 * n_dims)
        self._pos += 4 + 8 * n_dims + 12
        return name, dims, type_id, offset

    def _build_tensors(self, infos) -> None:
        import gguf  # only here: its import is slow, and only tensors need its type table

        for name, dims, type_id, offset in infos:
            if name in self.tensors:
                raise self._error(f"two tensors are named {name!r}")
            try:
                qtype = gguf.GGMLQuantizationType(type_id)
                block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise self._error(f"tensor {name!r} has unknown ggml type {type_id}") from None
            if dims[0] % block_size:
                raise self._error(
                    f"tensor {name!r}: rows of {dims[0]} are not whole {qtype.name} blocks "
                    f"of {block_size}"
                )
            count = 1
            for d in dims:
                count *= d
            nbytes = count // block_size * type_size
            start = self.data_offset + offset
            if start + nbytes > self.size:
                raise self._error(
                    f"truncated: tensor {name!r} needs bytes {start}..{start + nbytes}, "
                    f"the file has {self.size}"
                )
            self.tensors[name] = GGUFTensor(
                name=name,
                type_id=type_id,
                type_name=qtype.name,
                shape=tuple(reversed(dims)),
                nbytes=nbytes,
                offset=start,
                block_size=block_size,
                type_size=type_size,
                _map=self._map,
            )


_cache_lock = threading.Lock()
_cache: tuple[tuple, GGUFFile] | None = None


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """GGUFFile(path), reusing the most recently opened one while the file is unchanged (same
    real path, size and mtime): a model's config, weights and tokenizer share one parse."""
    global _cache
    path = os.fspath(path)
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"GGUF file {path} not found") from None
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    with _cache_lock:
        if _cache is not None and _cache[0] == key:
            return _cache[1]
        opened = GGUFFile(path)
        _cache = (key, opened)
        return opened
