"""The prefix cache on disk (prefix_cache_dir): full KV blocks of prompts kept in files
named by their block hash, read back into free blocks instead of being recomputed,
by this process or a later one.

A block hash covers the block's tokens and every token before it, but not what computed
their KV: the model, its dtype and quantization, the KV layout, dtype and shape, the
block size, the tensor-parallel rank. Those make a per-configuration subfolder (a short
hash of them), so a different setting never reads another's files.

Writes go through a small background thread with a bounded queue: the engine step only
copies the block out of the cache. When the queue is full the block is not written.
The folder is kept under max_bytes by deleting the least recently used files (a read
touches its file's mtime), oldest first, over every configuration's subfolder.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import tempfile
import threading
import time

import torch

from pyllm.attention.backend import KVCache
from pyllm.engine.block_file import TMP_SUFFIX, DamagedBlock, read_block, remove_quietly
from pyllm.engine.block_file import write_block as write_block_file

logger = logging.getLogger("pyllm")

# 2: GGUF Llama keys keep llama.cpp's order within each head (rope on pairs 2i, 2i + 1).
FORMAT_VERSION = 2
SUFFIX = ".kv"
QUEUE_BYTES = 256 * 2**20  # blocks copied out and waiting to be written, at most
PRUNE_TO = 0.9  # past the bound, delete down to this share of it
STALE_TMP_SECONDS = 3600  # a temporary file this old was left by a process that died


def check_dir(path: str) -> None:
    """Creates path if needed and checks a file can be written there (raises OSError)."""
    os.makedirs(path, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=path, suffix=TMP_SUFFIX)
    os.close(fd)
    os.remove(probe)


def model_fingerprint(path: str) -> list:
    """The model's real path and the name, size and mtime of its files (a GGUF file, or
    an HF folder's config and weights): a changed model gets other keys."""
    path = os.path.realpath(path)
    if os.path.isfile(path):
        files = [path]
    else:
        names = sorted(os.listdir(path))
        files = [os.path.join(path, n) for n in names if n.endswith((".json", ".safetensors"))]
    stats = [(os.path.basename(f), os.stat(f)) for f in files]
    return [path] + [(name, st.st_size, st.st_mtime_ns) for name, st in stats]


def store_identity(
    model_path: str,
    torch_dtype: torch.dtype,
    quantization: str,
    cache: KVCache,
    block_size: int,
    tensor_parallel: tuple[int, int] = (0, 1),
) -> dict:
    """What the KV of a block depends on besides its tokens; tensor_parallel: (rank,
    size), each rank's cache holding its own heads."""
    key, value, *scales = cache.layers[0]
    # An int8 cache's files hold its scales too: their dtype is part of the format.
    kv_dtype = str(key.dtype) + "".join(f" scales {s.dtype}" for s in scales[:1])
    return {
        "format": FORMAT_VERSION,
        "model": model_fingerprint(model_path),
        "dtype": str(torch_dtype),
        "quantization": quantization,
        "layout": cache.backend.name,
        "kv_dtype": kv_dtype,
        "kv_shape": [len(cache.layers), list(key.shape[1:]), list(value.shape[1:])],
        "block_size": block_size,
        "tensor_parallel": list(tensor_parallel),
    }


class BlockStore:
    """The blocks of one KV cache's configuration under root (see the module's doc)."""

    def __init__(self, root: str, max_bytes: int, identity: dict, cache: KVCache):
        text = json.dumps(identity, sort_keys=True)
        name = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
        self.dir = os.path.join(root, name)
        os.makedirs(self.dir, exist_ok=True)
        _write_text(os.path.join(self.dir, "config.json"), text + "\n")  # for people
        self.layers = cache.layers
        # Keys and values (and an int8 cache's scales) of one block in every layer.
        self.block_bytes = sum(t[0].nbytes for layer in cache.layers for t in layer)
        self.blocks_read = 0
        self.blocks_damaged = 0  # files refused: their blocks were recomputed
        self.writer = _Writer(root, max_bytes, max(4, QUEUE_BYTES // self.block_bytes))

    def path(self, block_hash: bytes) -> str:
        return os.path.join(self.dir, block_hash.hex() + SUFFIX)

    def contains(self, block_hash: bytes) -> bool:
        return os.path.exists(self.path(block_hash))

    def load(self, block_hash: bytes, block_id: int) -> bool:
        """Reads the block's file into block block_id of the cache; False where it is
        missing or damaged (a damaged file is deleted: the block is written again once
        recomputed)."""
        path = self.path(block_hash)
        try:
            payload = read_block(path, block_hash, self.block_bytes)
        except DamagedBlock as e:
            logger.warning("prefix_cache_dir: %s; recomputing the block", e)
            self.blocks_damaged += 1
            remove_quietly(path)
            return False
        if payload is None:
            return False
        offset = 0
        for t in self._block_tensors(block_id):
            stored = torch.frombuffer(payload, dtype=t.dtype, count=t.numel(), offset=offset)
            t.copy_(stored.view(t.shape))
            offset += t.nbytes
        _touch(path)
        self.blocks_read += 1
        return True

    def save(self, block_hash: bytes, block_id: int) -> None:
        """Queues block block_id's KV to be written, unless its file exists already."""
        path = self.path(block_hash)
        if os.path.exists(path):
            return
        rows = [t.reshape(-1).view(torch.uint8) for t in self._block_tensors(block_id)]
        self.writer.put(path, block_hash, torch.cat(rows).cpu())  # a copy: the block may be reused

    def _block_tensors(self, block_id: int) -> list[torch.Tensor]:
        return [t[block_id] for pair in self.layers for t in pair]

    @property
    def blocks_written(self) -> int:
        return self.writer.written

    def flush(self) -> None:
        """Waits until every queued block is written."""
        self.writer.queue.join()

    def close(self) -> None:
        self.writer.close()


class _Writer:
    """The thread writing queued blocks and keeping the folder under its bound."""

    def __init__(self, root: str, max_bytes: int, max_queued: int):
        self.root, self.max_bytes = root, max_bytes
        self.queue: queue.Queue = queue.Queue(max_queued)
        self.written = 0
        self.dropped = 0  # the queue was full
        self.failed = 0
        self.total = prune(root, max_bytes)  # bytes of blocks under root
        self.thread: threading.Thread | None = None

    def put(self, path: str, block_hash: bytes, data: torch.Tensor) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="prefix-cache-dir", daemon=True)
            self.thread.start()
            atexit.register(self.close)  # a process that never closes its engine
        try:
            self.queue.put_nowait((path, block_hash, data))
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        """Writes what is queued, then stops the thread."""
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join()
            self.thread = None

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            self._write(*item)
            self.queue.task_done()
        self.queue.task_done()

    def _write(self, path: str, block_hash: bytes, data: torch.Tensor) -> None:
        try:
            write_block_file(path, block_hash, data.numpy().data)
        except OSError as e:
            if not self.failed:  # once: a full disk would say it for every block
                logger.warning("prefix_cache_dir: cannot write %s: %s", path, e)
            self.failed += 1
            return
        self.written += 1
        self.total += data.numel()
        if self.total > self.max_bytes:
            self.total = prune(self.root, int(self.max_bytes * PRUNE_TO))


def prune(root: str, max_bytes: int) -> int:
    """Deletes the least recently used block files under root until they hold at most
    max_bytes (and temporary files left by dead processes); returns the bytes left."""
    files = sorted(_block_files(root))
    total = sum(size for _, size, _ in files)
    for _, size, path in files:
        if total <= max_bytes:
            break
        remove_quietly(path)
        total -= size
    return total


def _block_files(root: str):
    """(mtime, size, path) of every block file under root's subfolders."""
    for sub in _scan(root):
        if not sub.is_dir():
            continue
        for entry in _scan(sub.path):
            try:
                stat = entry.stat()
            except OSError:
                continue  # deleted meanwhile by another process
            if entry.name.endswith(SUFFIX):
                yield stat.st_mtime, stat.st_size, entry.path
            elif entry.name.endswith(TMP_SUFFIX) and _age(stat.st_mtime) > STALE_TMP_SECONDS:
                remove_quietly(entry.path)


def _scan(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except OSError:
        return []


def _age(mtime: float) -> float:
    return time.time() - mtime


def _write_text(path: str, text: str) -> None:
    """Writes path atomically: other processes may write the same file at once."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=TMP_SUFFIX)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _touch(path: str) -> None:
    """Marks the file as just used (least recently used files are evicted first)."""
    try:
        os.utime(path)
    except OSError:
        pass
