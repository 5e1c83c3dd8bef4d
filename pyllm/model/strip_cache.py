"""Packed weights kept on disk, so that a later load maps them instead of copying and packing.

Where kernels read strips (`ops.strips_native`), the loader copies each quantized weight
out of the GGUF file and packs it (`loader_gguf`). The first
load of a file packs them into one cache file, through a shared map of it; later loads of
the unchanged file map that file read-only: no copy and no packing, and the pages are the
page cache's, shared by every process that maps the file, as the GGUF file's own blocks are.

A cache file belongs to one GGUF file (real path, size, modification time), one
tensor-parallel rank, one pyllm version and one strip layout (a digest of a small probe
packed by this build), and lists every weight with its type and shape: a file that does not
match is rewritten, a weight it lacks is packed in memory and the file removed, for the
next load to write whole (the types a build packs can change). Where: $PYLLM_CACHE_DIR, else
$XDG_CACHE_HOME/pyllm, else ~/.cache/pyllm, under strips/. `PYLLM_STRIP_CACHE=0` turns it
off. A load leaves the cache off when the disk would keep less than 1 GiB free.

Layout: a 32-byte header (magic, then the index's offset and length), each weight at a
4 KiB boundary, and the JSON index last.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
import shutil
import struct
import warnings
from pathlib import Path

import torch

from pyllm import ops

logger = logging.getLogger("pyllm")

MAGIC = b"pyllm-strips\x00\x00\x00\x01"
_HEADER = struct.Struct("<16sQQ")
ALIGN = 4096
DISK_MARGIN = 1 << 30


def cache_dir() -> Path:
    """Where cache files go: $PYLLM_CACHE_DIR, $XDG_CACHE_HOME/pyllm or ~/.cache/pyllm, /strips."""
    root = os.environ.get("PYLLM_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "pyllm")
    return Path(root) / "strips"


def enabled() -> bool:
    return os.environ.get("PYLLM_STRIP_CACHE", "1") != "0"


def layout_digest() -> str:
    """A digest of fixed blocks of every strips type as this build packs them: a build that
    packs differently misses every cache file the others wrote."""
    digest = hashlib.sha256()
    generator = torch.Generator().manual_seed(0)
    for type_id in sorted(ops.STRIPS_TYPES):
        row_bytes = ops.quant_row_bytes(type_id, 256)
        blocks = torch.randint(0, 256, (32, row_bytes), dtype=torch.uint8, generator=generator)
        digest.update(ops.pack_strips(blocks, type_id).numpy().tobytes())
    return digest.hexdigest()[:16]


def _identity(path: str, rank: int, ranks: int) -> dict:
    from pyllm import __version__

    stat = os.stat(path)
    return {
        "source": os.path.realpath(path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "rank": rank,
        "ranks": ranks,
        "pyllm": __version__,
        "layout": layout_digest(),
    }


class StripCache:
    """The cache file of one GGUF file and rank: `take` gives a weight from a complete file;
    `place` gives the memory to pack a new one in, in a file that `finish` completes."""

    def __init__(self, gguf_path: str, rank: int = 0, ranks: int = 1):
        self.identity = _identity(gguf_path, rank, ranks)
        name = hashlib.sha256(f"{self.identity['source']}@{rank}/{ranks}".encode()).hexdigest()
        self.path = cache_dir() / f"{Path(gguf_path).stem}-{name[:16]}.strips"
        self.entries: dict[str, dict] = {}
        self._map: mmap.mmap | None = None
        self._writing: tuple[Path, int] | None = None  # (temporary file, its capacity)
        self._cursor = ALIGN
        self._missed = 0  # weights asked of a complete file that it lacks

    # ---------------------------------------------------------------- reading
    def open(self) -> bool:
        """Maps a complete cache file of this identity; False (and nothing mapped) if there is
        none, or it is damaged or another file's."""
        try:
            with open(self.path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                magic, at, length = _HEADER.unpack(file.read(_HEADER.size))
                if magic != MAGIC or at < ALIGN or at + length != size:
                    return False
                file.seek(at)
                index = json.loads(file.read(length))
                if index.get("identity") != self.identity:
                    return False
                entries = {key: e for key, e in index["entries"].items() if _fits(e, at)}
                if len(entries) != len(index["entries"]):
                    return False
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                self._map = mmap.mmap(file.fileno(), size, flags=flags, prot=mmap.PROT_READ)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error):
            return False
        self.entries = entries
        return True

    def take(self, key: str, type_id: int, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The packed weight `key` of this type and shape as a read-only view, or None."""
        if self._writing:
            return None
        entry = self.entries.get(key)
        if entry is None or entry["type"] != type_id or tuple(entry["shape"]) != tuple(shape):
            self._missed += 1
            return None
        with warnings.catch_warnings():
            # Read-only: the kernels only read weights; a write would fault, not corrupt.
            warnings.simplefilter("ignore", UserWarning)
            return self._view(entry["offset"], shape)

    # ---------------------------------------------------------------- writing
    def start(self, capacity: int) -> bool:
        """Opens a new cache file of at most `capacity` bytes of weights (reserved on disk
        at once: a full disk fails here, not as a fault while packing)."""
        directory = self.path.parent
        if not hasattr(os, "posix_fallocate"):
            return False  # a sparse file would fault, not fail, when the disk fills
        try:
            directory.mkdir(parents=True, exist_ok=True)
            _remove_orphans(self.path)
            total = ALIGN + capacity
            free = shutil.disk_usage(directory).free
            if free < total + DISK_MARGIN:
                logger.info(
                    "pyllm: packed weights not cached: %s has %.1f GiB free, they need %.1f "
                    "GiB and 1 GiB left over", directory, free / 2**30, total / 2**30,
                )  # fmt: skip
                return False
            temporary = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.posix_fallocate(fd, 0, total)
                self._map = mmap.mmap(fd, total, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
        except OSError as error:
            logger.info("pyllm: packed weights not cached in %s: %s", directory, error)
            self._discard()
            return False
        self._writing = (temporary, total)
        return True

    def place(self, key: str, type_id: int, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Zeroed memory in the new file for the packed weight `key`, or None when no file
        is being written (or it has no room: the caller then packs in its own memory)."""
        nbytes = math.prod(shape)
        if self._writing is None or self._cursor + nbytes > self._writing[1]:
            return None
        offset = self._cursor
        self._cursor = -(-(offset + nbytes) // ALIGN) * ALIGN
        self.entries[key] = {"offset": offset, "type": type_id, "shape": list(shape)}
        return self._view(offset, shape)

    def finish(self) -> None:
        """Writes the index after the weights and renames the file into place; removes a
        complete file that lacked weights of this load (its map stays valid)."""
        if self._writing is None:
            if self._missed:
                logger.info("pyllm: %s lacked %d packed weights; removed", self.path, self._missed)
                try:
                    os.unlink(self.path)
                except OSError:
                    pass
            return
        temporary, _ = self._writing
        index = json.dumps({"identity": self.identity, "entries": self.entries}).encode()
        at = self._cursor
        try:
            with open(temporary, "r+b") as file:
                file.seek(at)
                file.write(index)
                file.truncate(at + len(index))
                file.seek(0)
                file.write(_HEADER.pack(MAGIC, at, len(index)))
            os.replace(temporary, self.path)
        except OSError as error:
            logger.info("pyllm: packed weights not cached in %s: %s", self.path, error)
            self._discard()
            return
        self._writing = None
        logger.info("pyllm: packed weights cached in %s", self.path)

    def abandon(self) -> None:
        """Removes the file being written (the load failed); the weights placed in it stay
        valid while they are referenced."""
        if self._writing is not None:
            self._discard()

    def _discard(self) -> None:
        if self._writing is not None:
            try:
                os.unlink(self._writing[0])
            except OSError:
                pass
        self._writing = None
        self.entries = {}

    def _view(self, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        data = torch.frombuffer(self._map, dtype=torch.uint8, count=math.prod(shape), offset=offset)
        return data.view(shape)


def _fits(entry: dict, end: int) -> bool:
    """Whether an index entry is well formed and lies in the weights' part of the file."""
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d > 0 for d in shape):
        return False
    offset = entry.get("offset")
    if type(offset) is not int or offset < ALIGN or offset % ALIGN:
        return False
    return type(entry.get("type")) is int and offset + math.prod(shape) <= end


def _remove_orphans(path: Path) -> None:
    """Temporary files of this cache file left by processes that are gone."""
    for orphan in path.parent.glob(f"{path.name}.*.tmp"):
        pid = orphan.name[len(path.name) + 1 : -len(".tmp")]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            orphan.unlink(missing_ok=True)
        except OSError:
            pass
