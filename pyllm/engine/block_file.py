"""One KV block on disk: a header (magic, the block's hash, payload length, crc32 of
the payload) and the payload, every layer's key then value rows of the block.

A file is written under a temporary name in the same folder and renamed over its
final name (os.replace is atomic), so a reader sees a whole file or none, whatever
other processes write at once. A file that is short, long, of another hash or whose
checksum fails is refused: read_block returns None and the block is recomputed.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib

MAGIC = b"PYLLMKV1"
HEADER = struct.Struct("<8s16sQI")  # magic, block hash, payload bytes, crc32
TMP_SUFFIX = ".tmp"


def write_block(path: str, block_hash: bytes, payload: bytes | memoryview) -> None:
    """Writes payload to path atomically (raises OSError)."""
    header = HEADER.pack(MAGIC, block_hash, len(payload), zlib.crc32(payload))
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise


class DamagedBlock(ValueError):
    """A block file that is not what write_block wrote for that hash."""


def read_block(path: str, block_hash: bytes, size: int) -> memoryview | None:
    """The payload of size bytes stored at path for block_hash; None where there is no
    such file; raises DamagedBlock where it is damaged."""
    buffer = bytearray(HEADER.size + size + 1)  # one more: a long file is refused too
    try:
        with open(path, "rb") as f:
            length = f.readinto(buffer)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DamagedBlock(f"{path}: {e}") from e
    if length != HEADER.size + size:
        raise DamagedBlock(f"{path}: {length} bytes, {HEADER.size + size} expected")
    magic, stored_hash, stored_size, crc = HEADER.unpack_from(buffer)
    payload = memoryview(buffer)[HEADER.size : HEADER.size + size]
    if (magic, stored_hash, stored_size) != (MAGIC, block_hash, size):
        raise DamagedBlock(f"{path}: header is not this block's")
    if zlib.crc32(payload) != crc:
        raise DamagedBlock(f"{path}: checksum mismatch")
    return payload


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
