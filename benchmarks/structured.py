"""Decode speed with every request constrained by a JSON schema, against the same
requests unconstrained, in one run; and the time to first token with a cold schema.

    python benchmarks/structured.py                       # bundled SmolLM2-135M, batch 1,8,32
    python benchmarks/structured.py --batches 32 --max-tokens 256 --repeats 3

Each request makes exactly --max-tokens tokens: unconstrained ones ignore EOS, and
the schema (an array of at least 100 person records) cannot be finished sooner, so both
modes decode the same number of tokens and only the grammar's cost differs. Decode
tokens/s counts the tokens after the first of each request over the time after the
first step. Modes alternate within each repeat; the best repeat is reported.

TTFT with a cold schema: one request whose schema was never compiled (a fresh property
name), against the same request once its schema is cached, and unconstrained.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

from bench_timing import cpu_name

from pyllm.engine.config import EngineConfig
from pyllm.engine.llm_engine import LLMEngine
from pyllm.sampling.params import SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "mood", "city"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": PERSON, "minItems": 100}
PROMPT = "List one hundred people as JSON records with name, age, mood and city:"


def run_batch(engine: LLMEngine, batch: int, params: SamplingParams) -> tuple[float, float]:
    """(decode tokens/s, seconds to the first step's end) of `batch` requests at once."""
    ids = engine.tokenizer.encode(PROMPT)
    start = time.perf_counter()
    for i in range(batch):
        engine.add_request(f"r{i}-{uuid.uuid4().hex[:6]}", None, params, prompt_token_ids=ids)
    first = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if first is None and outputs:
            first = time.perf_counter()
    end = time.perf_counter()
    decoded = batch * (params.max_tokens - 1)
    return decoded / (end - first), first - start


def ttft(engine: LLMEngine, params: SamplingParams) -> float:
    ids = engine.tokenizer.encode(PROMPT)
    start = time.perf_counter()
    engine.add_request(f"t-{uuid.uuid4().hex}", None, params, prompt_token_ids=ids)
    first = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if first is None and outputs:
            first = time.perf_counter()
    return first - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print("$ " + " ".join([os.path.basename(sys.executable), *sys.argv]))
    print(f"machine: {cpu_name()}, {os.cpu_count()} cpus")
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=64))
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                 structured_output={"json": SCHEMA})  # fmt: skip
    engine.grammars.compile(constrained.structured_output)  # the tokenizer's one-time setup
    run_batch(engine, 1, free)  # warm-up

    print(f"\n{'batch':>5} {'free tok/s':>11} {'json tok/s':>11} {'ratio':>7}")
    for batch in [int(b) for b in args.batches.split(",")]:
        best = {"free": 0.0, "json": 0.0}
        for _ in range(args.repeats):
            for mode, params in (("free", free), ("json", constrained)):
                best[mode] = max(best[mode], run_batch(engine, batch, params)[0])
        ratio = best["json"] / best["free"]
        print(f"{batch:>5} {best['free']:>11.1f} {best['json']:>11.1f} {ratio:>7.1%}")

    cold_schema = {**PERSON, "properties": {**PERSON["properties"], uuid.uuid4().hex[:8]: {}}}
    cold = SamplingParams(temperature=0.0, max_tokens=2, structured_output={"json": cold_schema})
    cold_s = ttft(engine, cold)
    warm_s = ttft(engine, cold)
    free_s = ttft(engine, SamplingParams(temperature=0.0, max_tokens=2))
    print(f"\nTTFT ms: cold schema {cold_s * 1e3:.1f}, cached schema {warm_s * 1e3:.1f}, "
          f"unconstrained {free_s * 1e3:.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
