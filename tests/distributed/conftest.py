"""Tiny models for the tensor-parallel tests, and what the tests read of processes."""

from __future__ import annotations

import os

import pytest

from tests.engine.test_engine import _write_byte_tokenizer
from tests.model.conftest import make_hf_model


def make_model_dir(path, kind: str = "llama", **overrides) -> str:
    """A tiny random HF model of `kind` with a byte-level tokenizer, ready for LLM."""
    make_hf_model(kind, path, max_position_embeddings=1024, **overrides)
    _write_byte_tokenizer(path, vocab_size=overrides.get("vocab_size", 512))
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("tp-llama"))


def child_pids(pid: int | None = None) -> list[int]:
    pid = pid or os.getpid()
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def is_gone(pid: int) -> bool:
    """Exited (gone, or a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def rss_anon_bytes(pid: int | None = None) -> int:
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/<pid>/status")
