"""Fixtures shared by the engine tests."""

import pytest

from tests.engine.test_engine import _write_byte_tokenizer
from tests.model.conftest import make_hf_model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama (1024 positions) with a byte-level tokenizer beside it."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_hf_model("llama", path, max_position_embeddings=1024)
    # The engine needs a tokenizer beside the weights: a tiny byte-level one.
    _write_byte_tokenizer(path, vocab_size=512)
    return str(path)
