"""`pyllm export-tokenizer`: HF transformers, loading the written files, tokenizes,
decodes and renders chats exactly as pyllm's own tokenizer does."""

from __future__ import annotations

import json

import pytest

from pyllm.cli import main
from pyllm.model.tokenizer import Tokenizer
from tests.tokenizer import (
    MIXED_TEXTS,
    SP_CORPUS,
    random_texts,
    smollm_gguf,
    train_sentencepiece,
    write_sentencepiece_gguf,
)
from tests.tokenizer.test_chat_template import CONVERSATIONS

transformers = pytest.importorskip("transformers")


def _check_same(ours: Tokenizer, directory, texts=()) -> None:
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    for text in [*texts, *MIXED_TEXTS, *random_texts(50, seed=11)]:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert theirs.encode(text, add_special_tokens=special) == ids, text
        assert theirs.decode(ids) == ours.decode(ids), text
    for messages in CONVERSATIONS.values():
        for prompt in (True, False):
            expected = ours.apply_chat_template(messages, add_generation_prompt=prompt)
            rendered = theirs.apply_chat_template(
                messages, add_generation_prompt=prompt, tokenize=False
            )
            assert rendered == expected
    assert theirs.eos_token == ours.eos_token and theirs.bos_token == ours.bos_token


def test_smollm_export_loads_in_transformers(tmp_path, capsys):
    assert main(["export-tokenizer", str(tmp_path), "--model", smollm_gguf()]) == 0
    written = capsys.readouterr().out.split()
    assert sorted(p.rsplit("/", 1)[-1] for p in written) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"]
    _check_same(Tokenizer.from_gguf(smollm_gguf()), tmp_path)


def test_gemma3_export_loads_in_transformers(tmp_path):
    from tests.model.test_gemma3 import gemma3_gguf

    path = gemma3_gguf()
    assert main(["export-tokenizer", str(tmp_path), "--model", path]) == 0
    _check_same(Tokenizer.from_gguf(path), tmp_path)


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_sentencepiece_gguf_export_loads_in_transformers(tmp_path, add_space_prefix):
    model_file, gguf_file = str(tmp_path / "tiny.model"), str(tmp_path / "tiny.gguf")
    train_sentencepiece(model_file, add_dummy_prefix=add_space_prefix)
    write_sentencepiece_gguf(model_file, gguf_file, add_space_prefix=add_space_prefix)
    assert main(["export-tokenizer", str(tmp_path / "hf"), "--model", gguf_file]) == 0
    _check_same(Tokenizer.from_gguf(gguf_file), tmp_path / "hf", SP_CORPUS)


def test_export_of_a_missing_model_is_an_error(tmp_path, capsys):
    assert main(["export-tokenizer", str(tmp_path), "--model", str(tmp_path / "no.gguf")]) == 2
    assert "no.gguf" in capsys.readouterr().err
