"""The prefix cache on disk (prefix_cache_dir): a later engine reads a seen prompt's
prefix back and generates the same tokens; other settings never read it; damaged files
are recomputed; concurrent writers leave every file readable; the size bound evicts
the least recently used files; bad options are refused by name."""

from __future__ import annotations

import os
import pathlib
import random
import subprocess
import sys

import pytest

from pyllm import LLM, SamplingParams
from pyllm.engine.block_file import HEADER
from pyllm.engine.block_manager import chain_hash
from pyllm.engine.block_store import prune
from pyllm.engine.config import ConfigError, EngineConfig
from tests.engine.test_engine import _write_byte_tokenizer
from tests.model.conftest import make_hf_model

REPO = pathlib.Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [random.Random(1).randint(2, 511) for _ in range(100)]  # 6 full blocks to share
FULL_BLOCKS = (len(PROMPT) - 1) // 16


def _llm(model: str, folder, **options) -> LLM:
    options = dict(dtype="float32", kv_cache_memory=0.02) | options
    if folder is not None:
        options["prefix_cache_dir"] = str(folder)
    return LLM(model, **options)


def _run(llm: LLM, prompt=PROMPT):
    (output,) = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)
    return output.outputs[0].token_ids, output.num_cached_tokens


def _run_once(model: str, folder, **options):
    """A fresh engine's tokens and cached tokens for PROMPT, and its stats (the blocks
    it queued are written when it closes)."""
    llm = _llm(model, folder, **options)
    try:
        tokens, cached = _run(llm)
    finally:
        llm.engine.close()
    return tokens, cached, llm.engine.stats()


def _block_path(folder, index: int, prompt=PROMPT) -> pathlib.Path:
    """The file of PROMPT's block `index` (the only configuration in folder)."""
    previous = None
    for i in range(index + 1):
        previous = chain_hash(previous, tuple(prompt[i * 16 : (i + 1) * 16]))
    (config,) = [p for p in pathlib.Path(folder).iterdir() if p.is_dir()]
    return config / f"{previous.hex()}.kv"


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """PROMPT's greedy tokens, computed without a prefix cache on disk."""
    tokens, cached = _run(_llm(tiny_model_dir, None))
    assert cached == 0
    return tokens


def test_a_new_engine_reads_the_prefix_from_disk(tiny_model_dir, tmp_path, reference):
    tokens, cached, stats = _run_once(tiny_model_dir, tmp_path)
    assert (tokens, cached, stats.prefix_cache_disk_hits) == (reference, 0, 0)
    assert stats.prefix_cache_disk_writes == FULL_BLOCKS
    tokens, cached, stats = _run_once(tiny_model_dir, tmp_path)
    assert tokens == reference
    assert cached == stats.prefix_cache_disk_hits == FULL_BLOCKS * 16
    assert stats.prefix_cache_hits == FULL_BLOCKS * 16
    assert stats.prefix_cache_disk_writes == 0  # its blocks were on disk already


def test_other_settings_never_read_the_files(tiny_model_dir, tmp_path, reference):
    other_model = tmp_path / "other-model"
    make_hf_model("llama", other_model, max_position_embeddings=1024)
    _write_byte_tokenizer(other_model, vocab_size=512)
    folder = tmp_path / "cache"
    _run_once(tiny_model_dir, folder)
    for model, options in [
        (tiny_model_dir, dict(block_size=32)),
        (tiny_model_dir, dict(dtype="bfloat16")),
        (tiny_model_dir, dict(quantization="q8_0")),
        (tiny_model_dir, dict(kv_cache_dtype="int8")),
        (str(other_model), {}),
    ]:
        _, cached, stats = _run_once(model, folder, **options)
        assert cached == stats.prefix_cache_disk_hits == 0, options
    assert len([p for p in folder.iterdir() if p.is_dir()]) == 6
    tokens, cached, _ = _run_once(tiny_model_dir, folder)  # its own files are still read
    assert (tokens, cached) == (reference, FULL_BLOCKS * 16)


def test_an_int8_cache_reads_its_own_blocks_back(tiny_model_dir, tmp_path):
    """The int8 cache's blocks (int8 rows and their scales) go to disk and come back:
    a later engine generates what a fresh one does."""
    expected, _ = _run(_llm(tiny_model_dir, None, kv_cache_dtype="int8"))
    _, _, stats = _run_once(tiny_model_dir, tmp_path, kv_cache_dtype="int8")
    assert stats.prefix_cache_disk_writes == FULL_BLOCKS
    tokens, cached, stats = _run_once(tiny_model_dir, tmp_path, kv_cache_dtype="int8")
    assert (tokens, cached, stats.prefix_cache_disk_hits) == (
        expected,
        16 * FULL_BLOCKS,
        16 * FULL_BLOCKS,
    )


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_a_damaged_file_is_recomputed(tiny_model_dir, tmp_path, reference, damage):
    _run_once(tiny_model_dir, tmp_path)
    path = _block_path(tmp_path, 2)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[HEADER.size + len(data) // 2] ^= 0xFF
    elif damage == "header":
        data[8] ^= 0x01  # the stored block hash
    path.write_bytes(data[: len(data) - 100] if damage == "truncate" else data)
    tokens, cached, stats = _run_once(tiny_model_dir, tmp_path)
    assert tokens == reference
    assert cached == stats.prefix_cache_disk_hits == 2 * 16  # the blocks before it
    assert stats.prefix_cache_disk_damaged == 1
    assert stats.prefix_cache_disk_writes == 1  # it alone: the others are on disk
    tokens, cached, stats = _run_once(tiny_model_dir, tmp_path)
    assert (tokens, cached, stats.prefix_cache_disk_damaged) == (reference, FULL_BLOCKS * 16, 0)


WRITER = """
import random, sys
from pyllm import LLM, SamplingParams
model, folder, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
shared = [random.Random(0).randint(2, 511) for _ in range(160)]
rng = random.Random(seed)
prompts = [shared[: rng.randint(20, 160)] + [rng.randint(2, 511) for _ in range(70)]
           for _ in range(24)]
llm = LLM(model, dtype="float32", kv_cache_memory=0.02, prefix_cache_dir=folder,
          max_num_batched_tokens=64)
llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=4),
             use_tqdm=False)
llm.engine.close()
"""


def test_two_processes_writing_at_once_leave_every_file_readable(tiny_model_dir, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, tiny_model_dir, str(tmp_path), str(seed)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for seed in (1, 2)
    ]
    for writer in writers:
        _, stderr = writer.communicate(timeout=300)
        assert writer.returncode == 0, stderr[-2000:]
    llm = _llm(tiny_model_dir, tmp_path)
    store = llm.engine.block_store
    files = sorted(pathlib.Path(store.dir).glob("*.kv"))
    assert len(files) > 20
    assert not list(pathlib.Path(store.dir).glob("*.tmp"))
    for path in files:
        assert store.load(bytes.fromhex(path.stem), block_id=0), path
    assert store.blocks_damaged == 0


def test_prune_deletes_the_least_recently_used_first(tmp_path):
    folder = tmp_path / "config"
    folder.mkdir()
    paths = [folder / f"{i:02x}.kv" for i in range(6)]
    for age, path in zip([5, 1, 4, 0, 3, 2], paths, strict=True):
        path.write_bytes(b"x" * 100)
        os.utime(path, (1e9 - age, 1e9 - age))  # age 5: the least recently used
    (folder / "config.json").write_text("{}")  # not a block: never counted or deleted
    assert prune(str(tmp_path), 350) == 300
    assert [p.exists() for p in paths] == [False, True, False, True, False, True]


def test_reads_touch_and_writes_keep_the_bound(tiny_model_dir, tmp_path):
    _run_once(tiny_model_dir, tmp_path)
    old = [_block_path(tmp_path, i) for i in range(FULL_BLOCKS)]
    for path in old:
        os.utime(path, (1e9, 1e9))
    file_bytes = old[0].stat().st_size
    size = 8 * file_bytes / 2**30  # room for 8 blocks
    _run_once(tiny_model_dir, tmp_path, prefix_cache_dir_size=size)
    assert all(p.stat().st_mtime > 1e9 for p in old)  # read: now the most recently used
    other = [random.Random(2).randint(2, 511) for _ in range(100)]
    llm = _llm(tiny_model_dir, tmp_path, prefix_cache_dir_size=size)
    _run(llm, other)
    llm.engine.close()
    assert all(_block_path(tmp_path, i, other).exists() for i in range(FULL_BLOCKS))
    assert sum(p.exists() for p in old) <= 2
    total = sum(p.stat().st_size for p in pathlib.Path(tmp_path).glob("*/*.kv"))
    assert total <= 8 * file_bytes


def test_bad_options_are_refused_by_name(tiny_model_dir, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = [
        (dict(prefix_cache_dir=str(tmp_path), prefix_cache_dir_size=-1), "prefix_cache_dir_size"),
        (dict(prefix_cache_dir=str(tmp_path), prefix_cache_dir_size=0), "prefix_cache_dir_size"),
        (dict(prefix_cache_dir=str(a_file)), "prefix_cache_dir"),
        (dict(prefix_cache_dir=str(a_file / "below")), "prefix_cache_dir"),
        (dict(prefix_cache_dir=str(tmp_path), kv_cache="contiguous"), "prefix_cache_dir"),
        (dict(prefix_cache_dir=str(tmp_path), enable_prefix_caching=False), "prefix_cache_dir"),
        (dict(prefix_cache_dir=str(tmp_path), tensor_parallel_size=2), "prefix_cache_dir"),
    ]
    for options, name in cases:
        with pytest.raises(ConfigError) as error:
            EngineConfig(model=tiny_model_dir, **options)
        assert error.value.option == name, options
        assert str(error.value).startswith(name + " ")
