"""`pyllm bench`: prompt processing (pp) and text generation (tg) speed, per concurrency.

    pyllm bench -p 512 -g 128 -r 3 -c 1,8,32

pp N: c prompts of N random tokens, prefilled together (one output token each);
       t/s counts prompt tokens over the time until every prompt has its first token.
tg N: c sequences generate N tokens each after a short prompt; only steps that decode
       (no prefill in them) are timed, so t/s is pure decode speed.
t/s is per sequence (mean ± std over the repeats), ms/t its inverse, and
throughput/s = t/s x concurrency, as in mistral.rs's bench table; tp is the number of
tensor-parallel ranks the model is split over.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

from pyllm.engine.llm_engine import LLMEngine
from pyllm.sampling.params import SamplingParams


@dataclass
class BenchRow:
    model: str
    backend: str
    test: str
    concurrency: int
    tokens_per_s: float  # per sequence, mean over repeats
    tokens_per_s_std: float
    ms_per_token: float
    throughput: float  # all sequences together
    tp: int = 1  # tensor-parallel ranks


def _random_prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    # Ids from the middle of the vocabulary: ordinary tokens, no special ones.
    low, high = min(1000, vocab // 4), vocab - 1
    return [[rng.randint(low, high) for _ in range(length)] for _ in range(count)]


def _run_pp(engine: LLMEngine, prompts: list[list[int]], tag: str) -> float:
    """Seconds until every prompt is prefilled (it has its first token)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", None, params, prompt_token_ids=prompt)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def _run_tg(engine: LLMEngine, prompts: list[list[int]], tokens: int, tag: str) -> float:
    """Seconds spent in decode-only steps per generated token of one sequence."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", None, params, prompt_token_ids=prompt)
    decode_seconds, decoded = 0.0, 0
    while engine.has_unfinished_requests():
        scheduler = engine.scheduler
        prefilling = bool(scheduler.waiting) or any(
            s.num_pending_tokens > 1 or s.num_computed_tokens == 0 for s in scheduler.running
        )
        before = engine.counters.generation_tokens
        start = time.perf_counter()
        engine.step()
        if not prefilling:
            decode_seconds += time.perf_counter() - start
            decoded += engine.counters.generation_tokens - before
    # A step emits a token per sequence, or more where speculation's proposals pass.
    return decode_seconds * len(prompts) / max(decoded, 1)


def run_bench(
    engine: LLMEngine,
    prompt_tokens: int,
    gen_tokens: int,
    repeats: int,
    concurrencies: list[int],
    seed: int = 0,
) -> list[BenchRow]:
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    model = engine.config.model_path.rsplit("/", 1)[-1]
    backend = f"{engine.device.type} {str(engine.config.torch_dtype).removeprefix('torch.')}"
    tp = engine.config.tensor_parallel_size
    rows = []
    # One untimed warm-up so first-call costs (allocator, thread pool) are not counted.
    _run_pp(engine, _random_prompts(rng, 1, 16, vocab), "warmup")
    for c in concurrencies:
        if prompt_tokens > 0:
            speeds = []
            for r in range(repeats):
                prompts = _random_prompts(rng, c, prompt_tokens, vocab)
                seconds = _run_pp(engine, prompts, f"pp{c}-{r}")
                speeds.append(prompt_tokens / seconds)  # per sequence
            rows.append(_row(model, backend, f"pp {prompt_tokens}", c, speeds, tp))
        if gen_tokens > 0:
            speeds = []
            for r in range(repeats):
                prompts = _random_prompts(rng, c, 8, vocab)
                seconds_per_token = _run_tg(engine, prompts, gen_tokens, f"tg{c}-{r}")
                speeds.append(1.0 / seconds_per_token)
            rows.append(_row(model, backend, f"tg {gen_tokens}", c, speeds, tp))
    return rows


def _row(model: str, backend: str, test: str, c: int, speeds: list[float], tp: int) -> BenchRow:
    mean = statistics.fmean(speeds)
    std = statistics.stdev(speeds) if len(speeds) > 1 else 0.0
    return BenchRow(model, backend, test, c, mean, std, 1000.0 / mean, mean * c, tp)


def format_table(rows: list[BenchRow]) -> str:
    header = ["model", "backend", "tp", "test", "t/s", "ms/t", "concurrency", "throughput/s"]
    body = [
        [
            r.model,
            r.backend,
            str(r.tp),
            r.test,
            f"{r.tokens_per_s:.2f}±{r.tokens_per_s_std:.2f}",
            f"{r.ms_per_token:.3f}",
            str(r.concurrency),
            f"{r.throughput:.2f}",
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def fmt(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line, fmt(header), line, *(fmt(b) for b in body), line])


def rows_to_json(rows: list[BenchRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=2)
