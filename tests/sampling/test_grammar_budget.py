"""The compiled-grammar cache's byte budget, the compiler's limits, and JSON depth."""

from __future__ import annotations

import pytest

from pyllm.sampling import grammar_budget as budget
from pyllm.sampling.errors import ParamError
from pyllm.sampling.json_depth import json_text_depth, loads_bounded

MIB = 2**20


def test_cache_evicts_least_recently_used_within_its_bytes():
    cache = budget.GrammarCache(max_bytes=10 * MIB, max_entries=100)
    for key in "abcd":
        cache.put(key, key.upper(), 3 * MIB)
    assert cache.bytes == 9 * MIB and len(cache) == 3 and cache.get("a") is None
    cache.get("b")  # now the most recently used
    assert cache.put("e", "E", 5 * MIB)  # evicts c, then d
    assert cache.get("c") is None and cache.get("d") is None and cache.get("b") == "B"
    assert cache.bytes == 8 * MIB


def test_cache_keeps_nothing_larger_than_its_budget_and_bounds_entries():
    cache = budget.GrammarCache(max_bytes=10 * MIB, max_entries=2)
    assert not cache.put("huge", object(), 11 * MIB) and len(cache) == 0
    for key in "xyz":
        cache.put(key, key, 0)  # counted as MIN_ENTRY_BYTES
    assert len(cache) == 2 and cache.bytes == 2 * budget.MIN_ENTRY_BYTES


@pytest.mark.parametrize(
    "text, depth",
    [("1", 0), ("[]", 1), ('{"a": [[1]]}', 3), ('["[[[[", "]"]', 1), ('"\\"[["', 0)],
)
def test_json_text_depth_skips_strings(text, depth):
    assert json_text_depth(text) == depth


def test_loads_bounded_refuses_deep_text():
    assert loads_bounded("[" * 10 + "]" * 10) == [[[[[[[[[[]]]]]]]]]]
    with pytest.raises(ValueError, match="5000 levels deep; the limit is 128"):
        loads_bounded("[" * 5000 + "]" * 5000)


@pytest.fixture(scope="module")
def compiler_for():
    from pyllm.model.default_model import default_model_path
    from pyllm.model.tokenizer import Tokenizer
    from pyllm.sampling.structured import GrammarCompiler

    tokenizer = Tokenizer.from_pretrained(default_model_path())
    return lambda cache_bytes: GrammarCompiler(tokenizer, tokenizer.vocab_size, cache_bytes)


def test_compiler_cache_stays_within_its_bytes(compiler_for):
    from pyllm.sampling.structured import StructuredOutput

    limit = 4 * budget.MIN_ENTRY_BYTES
    compiler = compiler_for(limit)
    for i in range(8):
        compiler.compile(StructuredOutput(regex=f"item-{i}: [a-z]{{1,{i + 5}}}"))
        assert compiler.cache.bytes <= limit
    assert 1 <= len(compiler.cache) <= 4


def test_compiler_refuses_an_explosive_regex_naming_the_limit(compiler_for):
    from pyllm.sampling.structured import StructuredOutput

    with pytest.raises(ParamError) as error:
        compiler_for(budget.CACHE_BYTES).compile(StructuredOutput(regex="a{1000}{1001}"))
    assert error.value.param == "structured_output.regex"
    assert error.value.code == "grammar_too_complex"
    assert f"{budget.LIMITS['max_lexer_states']} lexer states" in str(error.value)
