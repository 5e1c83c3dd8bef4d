"""Times the sampler per step and prints a table, with a naive sampler as the baseline.

    python benchmarks/sampler.py                     # 64 sequences x 49152 vocab, CPU
    python benchmarks/sampler.py --threads 1         # one core (steadier on a busy machine)
    python benchmarks/sampler.py --logit-std 2       # flatter logits: top-p keeps ~10k tokens
    python benchmarks/sampler.py --device cuda

Logits are random normals times --logit-std (4 gives a next-token entropy near 3 nats at
temperature 0.8, like a language model mid-sentence; the table prints what the cuts kept).
Every sequence has a prompt of --prompt-len and --output-len generated tokens, so the
penalties see a realistic context. Baselines, in the same run: argmax alone for the greedy
case; for the others a naive sampler that applies the same cuts through a full sort of the
vocabulary (the textbook top-k/top-p) and draws with torch.multinomial.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

from pyllm.engine.sequence import Sequence
from pyllm.sampling.params import SamplingParams
from pyllm.sampling.sampler import Sampler


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], device: str, min_time: float = 1.0) -> tuple[float, float]:
    """(median, min) seconds per call over enough repeats to fill min_time (at least 5).
    The min is what the code costs on a quiet machine; the median what it cost here."""
    fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - start, 1e-6)
    samples = []
    for _ in range(max(5, min(200, int(min_time / once)))):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), min(samples)


SCENARIOS: dict[str, Callable[[int], SamplingParams]] = {
    "all greedy": lambda i: SamplingParams(temperature=0.0),
    "temperature 0.8": lambda i: SamplingParams(temperature=0.8),
    "top-p 0.95": lambda i: SamplingParams(temperature=0.8, top_p=0.95),
    # Everything at once; odd rows seeded, even rows on the shared generator.
    "all options": lambda i: SamplingParams(
        temperature=0.8,
        top_k=40,
        top_p=0.95,
        min_p=0.05,
        repetition_penalty=1.1,
        repeat_last_n=64,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={11: 2.0, 220: -1.0, 13: 0.5},
        logprobs=5,
        seed=i if i % 2 else None,
    ),
}


def make_batch(args, scenario: str) -> list[Sequence]:
    rng = random.Random(0)
    seqs = []
    for i in range(args.num_seqs):
        prompt = [rng.randrange(args.vocab) for _ in range(args.prompt_len)]
        seq = Sequence(str(i), prompt, SCENARIOS[scenario](i))
        for _ in range(args.output_len):
            seq.append_token(rng.randrange(args.vocab))
        seqs.append(seq)
    return seqs


def naive_sample(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The baseline: same temperature and cuts by a full descending sort, then multinomial
    (no penalties, no logprobs, no per-request seeds: it does strictly less work)."""
    params = [seq.sampling_params for seq in seqs]
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    if bool((temperature == 0).all()):
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    if all(p.top_k <= 0 and p.top_p == 1.0 and p.min_p == 0.0 for p in params):
        return torch.multinomial(probs, 1).squeeze(1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[1], device=device)
    top_k = torch.tensor(
        [p.top_k if p.top_k > 0 else probs.shape[1] for p in params], device=device
    )
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    sorted_probs = sorted_probs * (ranks[None, :] < top_k[:, None])
    before = sorted_probs.cumsum(-1) - sorted_probs
    mass = sorted_probs.sum(-1, keepdim=True)
    sorted_probs = sorted_probs * (before < top_p[:, None] * mass)
    sorted_probs = sorted_probs * (sorted_probs >= min_p[:, None] * sorted_probs[:, :1])
    return order.gather(1, torch.multinomial(sorted_probs, 1)).squeeze(1)


def describe_kept(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence]) -> str:
    probs = sampler.distribution(logits, seqs)
    kept = (probs > 0).sum(-1).float()
    return f"{kept.median().item():.0f} (max {kept.max().item():.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--logit-std", type=float, default=4.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    print("command:", " ".join([os.path.basename(sys.executable), *sys.argv]))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs,"
        f" torch {torch.__version__} with {torch.get_num_threads()} threads, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
        + f", load average {load:.1f} at start"
    )
    print(
        f"batch: {args.num_seqs} sequences x {args.vocab} vocab, context {args.prompt_len}"
        f" prompt + {args.output_len} output tokens, logits ~ N(0, {args.logit_std}^2)"
    )
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.num_seqs, args.vocab, generator=gen) * args.logit_std
    logits = logits.to(args.device)
    sampler = Sampler(args.vocab, {0}, seed=0)

    header = (
        f"{'scenario':<16} {'tokens kept':>18} {'sampler ms':>11} {'(min)':>7}"
        f" {'baseline ms':>12} {'(min)':>7} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for scenario in SCENARIOS:
        seqs = make_batch(args, scenario)
        ours, ours_min = time_call(lambda seqs=seqs: sampler(logits, seqs), args.device)
        base, base_min = time_call(lambda seqs=seqs: naive_sample(logits, seqs), args.device)
        kept = describe_kept(sampler, logits, seqs)
        print(
            f"{scenario:<16} {kept:>18} {ours * 1e3:>11.2f} {ours_min * 1e3:>7.2f}"
            f" {base * 1e3:>12.2f} {base_min * 1e3:>7.2f} {base / ours:>6.2f}"
        )
    print("ratio = baseline median / sampler median (above 1: the sampler is faster)")


if __name__ == "__main__":
    main()
