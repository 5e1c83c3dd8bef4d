"""Test processes keep their strip cache (pyllm.model.strip_cache) in a directory of their own,
not in the user's cache."""

from __future__ import annotations

import os
import shutil
import tempfile

_made: list[str] = []


def pytest_configure(config):
    if "PYLLM_CACHE_DIR" not in os.environ:
        _made.append(tempfile.mkdtemp(prefix="pyllm-test-cache-"))
        os.environ["PYLLM_CACHE_DIR"] = _made[0]


def pytest_unconfigure(config):
    for directory in _made:
        shutil.rmtree(directory, ignore_errors=True)
