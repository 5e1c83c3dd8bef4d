"""memory: the available figure (from meminfo and cgroup files), the refusal and its
message, and the default KV cache size; every figure is passed in explicitly."""

from __future__ import annotations

import pytest

from pyllm.model.memory import (
    DEFAULT_KV_CACHE_CAP_BYTES,
    GIB,
    MIN_KV_CACHE_BYTES,
    InsufficientMemoryError,
    available_memory_bytes,
    check_fits,
    default_kv_cache_bytes,
)

HINTS = [
    "a quantized GGUF file",
    "LLM(..., quantization='q4_k')",
    "a smaller max_model_len",
    "a smaller kv_cache_memory",
]

MEMINFO = """MemTotal:       24576000 kB
MemFree:         1000000 kB
MemAvailable:   10276044 kB
Buffers:          123456 kB
"""


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_refusal_names_both_figures_and_the_ways_out():
    with pytest.raises(InsufficientMemoryError) as info:
        check_fits(
            int(13.5 * GIB),
            2 * GIB,
            "model.gguf",
            HINTS,
            weights_dtype="bfloat16",
            available=int(9.8 * GIB),
        )
    assert str(info.value) == (
        "model.gguf needs 13.5 GiB for its weights in bfloat16 + 2.00 GiB KV cache, but only "
        "9.80 GiB of memory is available (and 10% of that is kept free); use a quantized "
        "GGUF file, LLM(..., quantization='q4_k'), a smaller max_model_len, or a smaller "
        "kv_cache_memory"
    )
    assert info.value.needed_bytes == int(13.5 * GIB) + 2 * GIB
    assert info.value.available_bytes == int(9.8 * GIB)
    # A MemoryError, so no `except ValueError` takes it for a bad request.
    assert isinstance(info.value, MemoryError)
    assert not isinstance(info.value, ValueError)


def test_message_without_dtype_kv_or_hints():
    with pytest.raises(InsufficientMemoryError) as info:
        check_fits(3 * GIB, 0, "weights", [], available=GIB)
    assert str(info.value) == (
        "weights needs 3.00 GiB for its weights, but only 1.00 GiB of memory is available "
        "(and 10% of that is kept free)"
    )
    with pytest.raises(InsufficientMemoryError, match=r"; use a smaller max_model_len$"):
        check_fits(3 * GIB, 0, "m", ["a smaller max_model_len"], available=GIB)


def test_the_margin_is_kept():
    available = 10 * GIB
    check_fits(8 * GIB, GIB, "m", HINTS, available=available)  # exactly 90%: fits
    with pytest.raises(InsufficientMemoryError):
        check_fits(8 * GIB, GIB + 1, "m", HINTS, available=available)
    # Below the available figure but inside the margin: refused, and the message says why.
    with pytest.raises(InsufficientMemoryError, match="9.50 GiB.*10.0 GiB.*10% of that"):
        check_fits(9 * GIB + GIB // 2, 0, "m", HINTS, available=available)
    check_fits(9 * GIB + GIB // 2, 0, "m", HINTS, available=available, margin=1.0)


def test_check_fits_rejects_bad_figures():
    with pytest.raises(ValueError, match="model_bytes"):
        check_fits(-1, 0, "m", available=GIB)
    with pytest.raises(ValueError, match="kv_bytes"):
        check_fits(0, 1.5, "m", available=GIB)
    with pytest.raises(ValueError, match="margin"):
        check_fits(0, 0, "m", available=GIB, margin=0)
    with pytest.raises(ValueError, match="available"):
        check_fits(0, 0, "m", available=-1)


def test_default_kv_cache_follows_the_memory_left():
    # Plenty left: the cap.
    assert default_kv_cache_bytes(GIB, available=64 * GIB) == DEFAULT_KV_CACHE_CAP_BYTES
    # 0.25 * (0.9 * 10 GiB - 6 GiB) = 0.75 GiB.
    assert default_kv_cache_bytes(6 * GIB, available=10 * GIB) == int(0.75 * GIB)
    # Nothing left: the floor (check_fits then refuses the weights themselves).
    assert default_kv_cache_bytes(9 * GIB, available=10 * GIB) == MIN_KV_CACHE_BYTES
    assert default_kv_cache_bytes(20 * GIB, available=10 * GIB, minimum=12345) == 12345
    # What the user asked for wins, whatever is left.
    assert default_kv_cache_bytes(9 * GIB, 5 * GIB, available=10 * GIB) == 5 * GIB


def test_default_kv_cache_fits_beside_weights_that_fit():
    available = 10 * GIB
    for weights in (0, GIB, 5 * GIB, 8 * GIB, int(8.7 * GIB)):
        kv = default_kv_cache_bytes(weights, available=available)
        check_fits(weights, kv, "m", HINTS, available=available)


def test_default_kv_cache_rejects_bad_figures():
    with pytest.raises(ValueError, match="requested"):
        default_kv_cache_bytes(GIB, 0, available=GIB)
    with pytest.raises(ValueError, match="requested"):
        default_kv_cache_bytes(GIB, 2.5, available=GIB)
    with pytest.raises(ValueError, match="weights_bytes"):
        default_kv_cache_bytes(-1, available=GIB)


def test_available_from_meminfo(tmp_path):
    meminfo = write(tmp_path / "meminfo", MEMINFO)
    no_cgroup = tmp_path / "missing"
    assert available_memory_bytes(meminfo, no_cgroup, no_cgroup) == 10276044 * 1024
    # No MemAvailable line, no cgroup limit: unknown, and check_fits checks nothing.
    old = write(tmp_path / "old", "MemTotal: 1000 kB\nMemFree: 10 kB\n")
    assert available_memory_bytes(old, no_cgroup, no_cgroup) is None
    assert available_memory_bytes(no_cgroup, no_cgroup, no_cgroup) is None


def test_available_is_bounded_by_a_cgroup_v2_limit(tmp_path):
    meminfo = write(tmp_path / "meminfo", MEMINFO)
    proc = write(tmp_path / "cgroup", "0::/app/worker\n")
    root = tmp_path / "fs"
    write(root / "app" / "memory.max", f"{4 * GIB}\n")
    write(root / "app" / "memory.current", f"{3 * GIB}\n")
    write(root / "app" / "memory.stat", f"anon 1\ninactive_file {GIB // 2}\nactive_file 7\n")
    write(root / "app" / "worker" / "memory.max", "max\n")
    write(root / "app" / "worker" / "memory.current", f"{3 * GIB}\n")
    # The parent's limit binds: 4 - 3 + 0.5 (reclaimable cache) GiB.
    assert available_memory_bytes(meminfo, proc, root) == GIB + GIB // 2
    # A generous limit leaves MemAvailable in charge.
    write(root / "app" / "memory.max", f"{400 * GIB}\n")
    assert available_memory_bytes(meminfo, proc, root) == 10276044 * 1024


def test_available_is_bounded_by_a_cgroup_v1_limit(tmp_path):
    meminfo = write(tmp_path / "meminfo", MEMINFO)
    # In a container the listed group is not under the mount: its root is the group.
    proc = write(tmp_path / "cgroup", "5:cpu:/x\n4:memory:/docker/abc\n0::/\n")
    memory = tmp_path / "fs" / "memory"
    write(memory / "memory.limit_in_bytes", f"{2 * GIB}\n")
    write(memory / "memory.usage_in_bytes", f"{GIB}\n")
    write(memory / "memory.stat", "cache 5\ntotal_inactive_file 1024\n")
    assert available_memory_bytes(meminfo, proc, tmp_path / "fs") == GIB + 1024
    # No limit (2^63 rounded down to a page) is no bound.
    write(memory / "memory.limit_in_bytes", "9223372036854771712\n")
    assert available_memory_bytes(meminfo, proc, tmp_path / "fs") == 10276044 * 1024


def test_available_on_this_machine_is_plausible():
    available = available_memory_bytes()
    if available is None:
        pytest.skip("no /proc/meminfo here")
    assert 0 < available < 2**50
