"""The strip cache: packed weights written by a first load and mapped by later ones, with the
same logits; a damaged, stale or foreign cache file rewritten; no cache where the disk is
short or the directory unusable; a failed load leaves no temporary file."""

from __future__ import annotations

import json
import os

import gguf
import pytest
import torch

import pyllm.ops as ops
from pyllm.model import strip_cache
from pyllm.model.loader import load_model
from tests.model.conftest import make_hf_model, run_sequences
from tests.model.test_gguf import write_hf_as_gguf

TOKENS = [list(range(5, 30)), list(range(200, 209))]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PYLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PYLLM_STRIP_CACHE", raising=False)
    return tmp_path / "cache" / "strips"


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    """A tiny Llama with Q8_0 projections (Q8_0 has strips) and an F32 head."""
    folder = tmp_path_factory.mktemp("strip-cache")
    hf = make_hf_model("llama", folder / "hf")
    write_hf_as_gguf(hf, folder / "q8.gguf", "llama", qtype=gguf.GGMLQuantizationType.Q8_0)
    return folder / "q8.gguf"


def mapped_from(tensor: torch.Tensor) -> str | None:
    """The file whose map holds the tensor's first byte (None for anonymous memory)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, stop = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < stop:
                return fields[5].strip() if len(fields) == 6 else None
    return None


def load(path):
    model, _ = load_model(path, dtype="float32")
    qkv = model.model.layers[0].self_attn.qkv_proj.qparts[0].qweight
    logits = torch.cat(run_sequences(model, TOKENS, [3, 3], chunk_size=8).logits)
    return qkv, logits


def cache_files(directory) -> list:
    return sorted(directory.glob("*")) if directory.exists() else []


@pytest.mark.skipif(not ops.strips_native(), reason="this build's kernels read no strips")
def test_a_later_load_maps_what_the_first_packed(cache_dir, q8_file, monkeypatch):
    first, first_logits = load(q8_file)
    (written,) = cache_files(cache_dir)
    assert written.suffix == ".strips"
    assert mapped_from(first) == str(written)  # packed straight into the new file
    inode = written.stat().st_ino
    second, second_logits = load(q8_file)
    assert mapped_from(second) == str(written)
    assert written.stat().st_ino == inode  # read, not written again
    assert cache_files(cache_dir) == [written]
    monkeypatch.setenv("PYLLM_STRIP_CACHE", "0")
    private, private_logits = load(q8_file)
    assert mapped_from(private) is None
    assert torch.equal(first_logits, private_logits)
    assert torch.equal(second_logits, private_logits)


@pytest.mark.skipif(ops.strips_native(), reason="this build packs strips")
def test_nothing_is_cached_where_nothing_is_packed(cache_dir, q8_file):
    load(q8_file)
    assert cache_files(cache_dir) == []


def damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    magic, at, length = strip_cache._HEADER.unpack_from(data)
    index = json.loads(data[at : at + length])
    if how == "truncated":
        del data[len(data) // 2 :]
    elif how == "magic":
        data[:4] = b"nope"
    elif how in ("offset", "identity", "lacking"):
        if how == "offset":
            entry = next(iter(index["entries"].values()))
            entry["offset"] = at  # past the weights' part
        elif how == "identity":
            index["identity"]["layout"] = "0" * 16
        else:  # as written by a build that packed fewer types
            del index["entries"][next(key for key in index["entries"] if "attn_q" in key)]
        text = json.dumps(index).encode()
        data[at:] = text
        data[: strip_cache._HEADER.size] = strip_cache._HEADER.pack(magic, at, len(text))
    path.write_bytes(bytes(data))


@pytest.mark.skipif(not ops.strips_native(), reason="this build's kernels read no strips")
@pytest.mark.parametrize("how", ["truncated", "magic", "offset", "identity", "source changed"])
def test_a_cache_file_that_does_not_match_is_rewritten(cache_dir, q8_file, tmp_path, how):
    source = tmp_path / "model.gguf"
    source.write_bytes(q8_file.read_bytes())
    _, reference = load(source)
    (written,) = cache_files(cache_dir)
    inode = written.stat().st_ino
    if how == "source changed":
        stat = os.stat(source)
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    else:
        damage(written, how)
    qkv, logits = load(source)
    assert torch.equal(logits, reference)
    assert mapped_from(qkv) == str(written)  # packed again, into a new file of that name
    assert written.stat().st_ino != inode
    assert strip_cache.StripCache(str(source)).open()


@pytest.mark.skipif(not ops.strips_native(), reason="this build's kernels read no strips")
def test_a_cache_file_that_lacks_a_weight_is_replaced(cache_dir, q8_file, tmp_path):
    """As one written by a build that packed fewer types: the load packs what it lacks in
    memory and removes it; the next load writes a whole file, and the one after maps it."""
    source = tmp_path / "model.gguf"
    source.write_bytes(q8_file.read_bytes())
    _, reference = load(source)
    (written,) = cache_files(cache_dir)
    damage(written, "lacking")
    qkv, logits = load(source)
    assert torch.equal(logits, reference)
    assert mapped_from(qkv) is None and cache_files(cache_dir) == []
    load(source)
    qkv, logits = load(source)
    assert torch.equal(logits, reference) and mapped_from(qkv) == str(written)


@pytest.mark.skipif(not ops.strips_native(), reason="this build's kernels read no strips")
def test_no_cache_where_the_disk_is_short_or_the_directory_unusable(
    cache_dir, q8_file, tmp_path, monkeypatch, caplog
):
    _, reference = load(q8_file.parent / "q8.gguf")
    for name in cache_files(cache_dir):
        name.unlink()
    usage = strip_cache.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(
        strip_cache.shutil, "disk_usage", lambda path: usage._replace(free=strip_cache.DISK_MARGIN)
    )
    with caplog.at_level("INFO", logger="pyllm"):
        qkv, logits = load(q8_file)
    assert "packed weights not cached" in caplog.text and "GiB free" in caplog.text
    assert mapped_from(qkv) is None and cache_files(cache_dir) == []
    assert torch.equal(logits, reference)
    monkeypatch.undo()
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    monkeypatch.setenv("PYLLM_CACHE_DIR", str(not_a_directory))
    qkv, logits = load(q8_file)
    assert mapped_from(qkv) is None
    assert torch.equal(logits, reference)


@pytest.mark.skipif(not ops.strips_native(), reason="this build's kernels read no strips")
def test_a_failed_load_leaves_no_temporary_file(cache_dir, q8_file, monkeypatch):
    from pyllm.model import loader_gguf

    calls = []

    def fail_on_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return pack(*args, **kwargs)

    pack = loader_gguf._pack_in_place
    monkeypatch.setattr(loader_gguf, "_pack_in_place", fail_on_the_second)
    with pytest.raises(RuntimeError, match="interrupted"):
        load_model(q8_file, dtype="float32")
    assert cache_files(cache_dir) == []
