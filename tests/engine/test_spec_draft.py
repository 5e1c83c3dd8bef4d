"""Speculative decoding with a draft model end to end: greedy output token for token that
of the plain engine (batching, chunked prefill, both KV layouts, preemption, n > 1,
stops and max_tokens inside an accepted run), sampling at temperature 1 drawing from
the plain engine's distribution, the draft's KV freed, and bad drafts refused by key.

Two drafts: the target itself (every proposal must be accepted: a draft KV cache that
kept a rejected token, or missed one, would show as a rejection) and the target's
weights plus noise (some proposals accepted, some rejected)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pyllm import LLM, SamplingParams
from pyllm.cli import _engine_config, build_parser, main
from pyllm.model.memory import InsufficientMemoryError, available_memory_bytes
from pyllm.sampling import sampler as sampler_module
from tests.engine.test_engine import _assert_all_blocks_free, _write_byte_tokenizer
from tests.engine.test_spec_decode import (
    GREEDY,
    _accepted,
    _joint,
    _prompts,
    _tokens,
    assert_draws_follow,
    stops_inside_accepted_runs,
)
from tests.model.conftest import make_hf_model

K = 4


def _spec(draft: str, **keys) -> dict:
    return {"model": draft, "num_speculative_tokens": K, "disable_by_batch_size": 4096, **keys}


def _llm(path: str, draft: str | None, **options) -> LLM:
    options.setdefault("kv_cache_memory", 0.05)
    spec = None if draft is None else _spec(draft)
    return LLM(path, dtype="float32", speculative_config=spec, **options)


@pytest.fixture(scope="module")
def noisy_draft_dir(tiny_model_dir, tmp_path_factory):
    """The target's weights plus noise of a tenth of each tensor's spread (seed 1): its
    greedy tokens agree with the target's about a third of the time."""
    path = tmp_path_factory.mktemp("noisy-draft")
    model = make_hf_model("llama", path, max_position_embeddings=1024)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * p.std() * torch.randn(p.shape, generator=generator))
    model.save_pretrained(path)
    _write_byte_tokenizer(path, vocab_size=512)
    return str(path)


@pytest.fixture(scope="module")
def plain_outputs(tiny_model_dir):
    return _tokens(_llm(tiny_model_dir, None), _prompts(12))


def _draft(llm: LLM):
    return llm.engine.speculator.proposer


def _assert_draft_free(llm: LLM) -> None:
    """The draft holds no sequence and no KV memory."""
    draft = _draft(llm)
    assert draft.states == {}
    counts = draft.kv_manager.block_counts()
    if counts is None:  # contiguous: every slot free, nothing committed
        assert len(draft.kv_manager.free_slots) == draft.kv_manager.num_slots
        assert draft.kv_manager.committed_bytes() == 0
    else:
        assert counts[0] == counts[1]


@pytest.mark.parametrize("noisy", [False, True], ids=["self", "noisy"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill, and the draft's catch-up
        {"kv_cache": "contiguous"},
        {"kv_cache": "contiguous", "max_num_batched_tokens": 16},
    ],
)
def test_greedy_output_is_the_plain_engines(
    tiny_model_dir, noisy_draft_dir, plain_outputs, options, noisy
):
    llm = _llm(tiny_model_dir, noisy_draft_dir if noisy else tiny_model_dir, **options)
    assert _tokens(llm, _prompts(12)) == plain_outputs
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    if noisy:
        assert stats.spec_decode_num_draft_tokens > 2 * stats.spec_decode_num_accepted_tokens
    else:  # the target as its own draft: every proposal is the target's own token
        assert stats.spec_decode_num_draft_tokens == stats.spec_decode_num_accepted_tokens
    assert stats.spec_decode_num_emitted_tokens == (
        stats.spec_decode_num_accepted_tokens + stats.spec_decode_num_drafts
    )
    _assert_draft_free(llm)
    if options.get("kv_cache") != "contiguous":
        _assert_all_blocks_free(llm)


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_proposals_are_the_drafts_own_greedy_tokens(tiny_model_dir, noisy_draft_dir, kv_cache):
    """The draft keeps the KV of proposals the target accepted and drops the rest: each
    proposal is what the draft model alone generates greedily from the sequence's
    tokens (a rejected proposal's KV left in place would change the draft's next
    tokens)."""
    llm = _llm(tiny_model_dir, noisy_draft_dir, kv_cache=kv_cache)
    draft, seen = _draft(llm), []
    propose = draft.propose

    def recording(seqs, lengths):
        proposals = propose(seqs, lengths)
        seen.extend((list(s.token_ids), p) for s, p in zip(seqs, proposals, strict=True) if p)
        return proposals

    draft.propose = recording
    _tokens(llm, _prompts(3))
    assert len(seen) > 10 and _accepted(llm) > 0
    alone = LLM(noisy_draft_dir, dtype="float32", kv_cache_memory=0.05)
    for tokens, proposal in seen[:: max(1, len(seen) // 12)]:
        params = SamplingParams(temperature=0.0, max_tokens=len(proposal), ignore_eos=True)
        out = alone.generate(None, params, prompt_token_ids=[tokens], use_tqdm=False)
        assert out[0].outputs[0].token_ids == proposal


def test_preemption_loses_nothing(tiny_model_dir, noisy_draft_dir, plain_outputs):
    # 24 blocks of 16 tokens for the engine (and as many tokens for the draft) while 12
    # prompts of up to 152 tokens run: the engine preempts, the draft runs out of room.
    llm = _llm(
        tiny_model_dir, noisy_draft_dir, kv_cache_memory=24 * 16 * 2 * 2 * 2 * 64 * 4 / 2**30
    )
    assert _draft(llm).kv_manager.block_counts() == (24, 24)
    assert _tokens(llm, _prompts(12)) == plain_outputs
    assert llm.engine.scheduler.num_preemptions > 0
    assert _accepted(llm) > 0
    _assert_draft_free(llm)
    _assert_all_blocks_free(llm)


def test_n_samples_each_have_their_own_draft(tiny_model_dir, noisy_draft_dir):
    params = SamplingParams(n=3, temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(3, seed=4)
    plain = _llm(tiny_model_dir, None).generate(prompt_token_ids=prompts, sampling_params=params)
    llm = _llm(tiny_model_dir, noisy_draft_dir)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for want, out in zip(plain, got, strict=True):
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in want.outputs]
    assert _accepted(llm) > 0
    _assert_draft_free(llm)


def test_stops_and_max_tokens_inside_an_accepted_run(tiny_model_dir):
    prompt = _prompts(3, seed=7)[2]  # a random prompt: proposals come from the draft
    llm, *_ = stops_inside_accepted_runs(
        _llm(tiny_model_dir, None),
        lambda: _llm(tiny_model_dir, tiny_model_dir),
        prompt,
        stop_tokens=False,
    )
    _assert_draft_free(llm)


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_abort_frees_the_drafts_kv(tiny_model_dir, kv_cache):
    llm = _llm(tiny_model_dir, tiny_model_dir, kv_cache=kv_cache)
    engine = llm.engine
    for i, prompt in enumerate(_prompts(2, seed=9)):
        engine.add_request(f"r{i}", None, GREEDY, prompt_token_ids=prompt)
    for _ in range(3):
        engine.step()
    draft = _draft(llm)
    assert len(draft.states) == 2 and _accepted(llm) > 0
    held = draft.kv_manager.block_counts()
    assert draft.kv_manager.committed_bytes() > 0 if held is None else held[0] < held[1]
    engine.abort_request("r0")
    assert len(draft.states) == 1
    engine.abort_request("r1")
    _assert_draft_free(llm)


# ------------------------------------------------------------------ sampling


@pytest.mark.parametrize("broken", [False, True])
def test_sampling_keeps_the_plain_distribution(
    tiny_model_dir, noisy_draft_dir, broken, monkeypatch
):
    # 2000 draws of 3 tokens at temperature 1, top_k 4 (64 outcomes), against the
    # plain engine's probabilities; `broken` accepts every proposal, and must fail.
    if broken:
        monkeypatch.setattr(sampler_module, "accepted_sampled", lambda probs, _: len(probs))
    prompt = _prompts(3, seed=2)[2]
    expected = _joint(_llm(tiny_model_dir, None), prompt, k=4, depth=3)
    llm = LLM(
        tiny_model_dir,
        dtype="float32",
        kv_cache_memory=0.05,
        speculative_config=_spec(noisy_draft_dir, num_speculative_tokens=2),
    )
    assert_draws_follow(llm, prompt, expected, broken)


# ------------------------------------------------------------------- refusals


def _retokenized(source: str, path, name: str = "<{}>", eos: int = 1) -> str:
    """source's weights beside a tokenizer of 512 tokens named name.format(i), EOS the
    one of id eos."""
    from tokenizers import Tokenizer, models

    shutil.copytree(source, path)
    vocab = {name.format(i): i for i in range(512)}
    Tokenizer(models.WordLevel(vocab, unk_token=name.format(0))).save(str(path / "tokenizer.json"))
    config = {"eos_token": name.format(eos), "bos_token": name.format(0)}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def test_a_draft_of_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    bigger = tmp_path / "bigger"
    make_hf_model("llama", bigger, max_position_embeddings=1024, vocab_size=640)
    _write_byte_tokenizer(bigger, vocab_size=640)
    drafts = {
        "vocab_size 640, the target's 512": str(bigger),
        "token 0 is '\\[0\\]', the target's '<0>'": _retokenized(
            tiny_model_dir, tmp_path / "a", name="[{}]"
        ),
        "BOS/EOS ids 0/\\[2, 3\\], the target's 0/\\[1, 2\\]": _retokenized(
            tiny_model_dir, tmp_path / "b", eos=3
        ),
    }
    for problem, draft in drafts.items():
        with pytest.raises(ValueError, match=rf"speculative_config\['model'\].*{problem}"):
            _llm(tiny_model_dir, draft)


def test_a_draft_of_a_shorter_context_is_refused(tiny_model_dir, tmp_path):
    make_hf_model("llama", tmp_path)  # 256 positions
    _write_byte_tokenizer(tmp_path, vocab_size=512)
    with pytest.raises(ValueError, match=r"speculative_config\['model'\].* 256 tokens"):
        _llm(tiny_model_dir, str(tmp_path))
    llm = _llm(tiny_model_dir, str(tmp_path), max_model_len=256)
    assert _draft(llm).runner.model.max_model_len == 256


def test_a_draft_that_does_not_fit_is_refused(tiny_model_dir):
    available = available_memory_bytes()
    if available is None:
        pytest.skip("the available memory is not known here")
    # The engine's (virtual) contiguous cache takes all but 0.2 GiB of what the
    # margin allows; the draft's, 256 slots of 1024 tokens, needs 0.5 GiB.
    budget = (0.9 * available - 0.2 * 2**30) / 2**30
    with pytest.raises(InsufficientMemoryError, match=r"speculative_config\['model'\]"):
        _llm(tiny_model_dir, tiny_model_dir, kv_cache="contiguous", kv_cache_memory=budget)


@pytest.mark.parametrize(
    "config, key",
    [
        ({"model": "no/such/draft", "num_speculative_tokens": 2}, "model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "draft_model", "model": None, "num_speculative_tokens": 2}, "model"),
        ({"model": "TINY", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"model": "TINY"}, "num_speculative_tokens"),
        ({"model": "TINY", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
         "prompt_lookup_max"),
        ({"model": "TINY", "num_speculative_tokens": 2, "prompt_lookup_min": 1},
         "prompt_lookup_min"),
        ({"method": "ngram", "model": "TINY", "num_speculative_tokens": 2}, "model"),
        ({"model": "TINY", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
         "disable_by_batch_size"),
    ],
)  # fmt: skip
def test_bad_draft_configs_are_refused_by_key(tiny_model_dir, config, key):
    config = {k: tiny_model_dir if v == "TINY" else v for k, v in config.items()}
    with pytest.raises(ValueError, match=rf"speculative_config\['{key}'\]"):
        LLM(tiny_model_dir, dtype="float32", speculative_config=config)


def test_a_draft_that_is_no_model_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"speculative_config\['model'\].*cannot be loaded"):
        _llm(tiny_model_dir, str(tmp_path))  # a folder without config.json


def test_command_line_takes_a_draft(tiny_model_dir, capsys):
    argv = ["generate", "hi", "--speculative-config"]
    spec = json.dumps({"model": tiny_model_dir, "num_speculative_tokens": 3})
    config = _engine_config(build_parser().parse_args([*argv, spec])).speculative
    assert (config.method, config.model, config.num_speculative_tokens) == (
        "draft_model", tiny_model_dir, 3,
    )  # fmt: skip
    assert main([*argv, '{"model": "no/such/draft", "num_speculative_tokens": 3}']) == 2
    err = capsys.readouterr().err
    assert "--speculative-config" in err and "speculative_config['model']" in err
