"""pyllm against the engines users would pick instead, on one workload, in one run.

    PYTHONPATH=. python benchmarks/compare.py --dtypes float32,bfloat16 --json compare.json
    PYTHONPATH=. python benchmarks/compare.py --quick          # a fast smoke run
    ... --vllm-python /path/to/vllm-venv/bin/python --vllm-model HF_DIR

Model: SmolLM2-135M-Instruct. pyllm, HF transformers and vLLM run the same dtype (HF
dequantizes the bundled Q4_1 GGUF); llama.cpp runs the Q4_1 GGUF itself. Every engine gets
the same prompt token ids (tokenized once), greedy, with EOS ignored so each request makes
exactly the asked number of tokens.

Cases (tok/s = tokens over the wall time of one generate call):
  prefill 512   one 512-token prompt, one output token; prompt tokens / time
  decode b1     one ~30-token prompt, 128 output tokens; output tokens / time
  8x64, 32x64   8 or 32 ~30-token prompts, 64 output tokens each; all output tokens / time
                (the short prompts' prefill is included, as in /work/shared/PEERS.md)
The machine is noisy, so the engines alternate case by case (every engine runs a case,
then the next case), and each figure is the best of --repeats runs.
Before any speed is reported, pyllm's float32 greedy text is checked against HF's.

llama.cpp runs in this process: a llama-cpp-python built with its default native flags
on a CPU with AMX (Sapphire Rapids, in this project's KVM machine) died with a general
protection fault in libggml-cpu's AMX code and took the run with it. Built without AMX
it runs:
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
    -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install --force-reinstall --no-deps \
    --no-cache-dir llama-cpp-python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import time

import torch

WORDS = (
    "the a river mountain city quiet engine light story winter garden music paper window "
    "number small green ancient market bridge people carry under always between morning "
    "teacher question answer simple history machine ocean forest careful travel letter "
    "bright north summer language figure record voice circle stone"
).split()
CASES = ("prefill", "decode_b1", "batch8", "batch32")


def case_titles(workload: dict) -> dict[str, str]:
    """Column titles with the sizes actually run (--quick runs fewer tokens)."""
    return {
        "prefill": f"prefill {len(workload['prefill']['prompts'][0])}",
        "decode_b1": f"decode b1 x{workload['decode_b1']['max_tokens']}",
        "batch8": f"8x{workload['batch8']['max_tokens']}",
        "batch32": f"32x{workload['batch32']['max_tokens']}",
    }


# ----------------------------------------------------------------------------- workload


def build_workload(tokenizer_encode, quick: bool, seed: int = 0) -> dict:
    """Token ids for every case. tokenizer_encode(text) -> list[int]."""
    rng = random.Random(seed)

    def prompt_ids(length: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < length:
            ids = tokenizer_encode(" ".join(rng.choice(WORDS) for _ in range(length)))
        return ids[:length]

    short = [prompt_ids(rng.randint(26, 34)) for _ in range(32)]
    return {
        "prefill": {"prompts": [prompt_ids(512)], "max_tokens": 1},
        "decode_b1": {"prompts": [short[0]], "max_tokens": 32 if quick else 128},
        "batch8": {"prompts": short[:8], "max_tokens": 16 if quick else 64},
        "batch32": {"prompts": short, "max_tokens": 16 if quick else 64},
    }


def case_rate(name: str, case: dict, seconds: float) -> float:
    if name == "prefill":
        return len(case["prompts"][0]) / seconds
    return len(case["prompts"]) * case["max_tokens"] / seconds


# ----------------------------------------------------------------------------- engines
# Each engine: .name, .dtype, .label, .generate(prompts, max_tokens) -> list of token-id lists.


class PyllmEngine:
    name = "pyllm"

    def __init__(self, dtype: str):
        from pyllm import LLM, SamplingParams

        self.dtype, self.label = dtype, ""
        self._params = SamplingParams
        self.llm = LLM(dtype=dtype, enable_prefix_caching=False, max_num_seqs=64)

    def generate(self, prompts, max_tokens):
        params = self._params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def weight_bytes(self) -> int:
        """Weight bytes one decode step must read: every layer's matrices and norms, plus the
        LM head (the embedding lookup reads one row, so it is not counted)."""
        c = self.llm.engine.model_config
        q, kv, h = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
            c.hidden_size,
        )
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * c.intermediate_size + 2 * h
        count = c.vocab_size * h + c.num_hidden_layers * per_layer + h
        return count * self.llm.engine.config.torch_dtype.itemsize


class HFEngine:
    name = "hf"

    def __init__(self, dtype: str, gguf_path: str):
        from transformers import AutoModelForCausalLM

        self.dtype, self.label = dtype, ""
        directory, file = os.path.split(gguf_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=file, dtype=getattr(torch, dtype)
        ).eval()
        self.pad_id = 0

    @torch.inference_mode()
    def generate(self, prompts, max_tokens):
        # Left padding, so every row's last prompt token sits in the final column.
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,  # suppresses EOS: exactly max_tokens each
            pad_token_id=self.pad_id,
        )
        return [row[width:].tolist() for row in out]


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python's low-level API: every prompt is its own sequence
    (seq_id) in one llama_batch, so prefill and each decode step run all sequences together,
    as a serving engine would. Greedy is an argmax over each sequence's logits."""

    name = "llama.cpp"
    max_seqs = 32
    seq_capacity = 640  # KV cells per sequence: the 512-token prompt plus its output

    def __init__(self, gguf_path: str, threads: int):
        import llama_cpp
        import numpy

        self.lib, self.np = llama_cpp, numpy
        # llama.cpp logs every graph input on stderr; keep the callback alive on self.
        self._quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(self._quiet, None)
        self.dtype, self.label = "q4_1", "llama_batch API"
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(gguf_path.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        params = llama_cpp.llama_context_default_params()
        params.n_seq_max = self.max_seqs
        params.n_ctx = self.max_seqs * self.seq_capacity
        params.n_batch = 2048  # one llama_decode takes all prompts; it splits into ubatches
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True  # the sequences share one KV buffer, as in a server
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        self.batch = llama_cpp.llama_batch_init(params.n_batch, 0, self.max_seqs)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, seq_id, wants_logits)."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i] = token, pos
            batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        status = self.lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def _argmax(self, index: int) -> int:
        logits = self.lib.llama_get_logits_ith(self.ctx, index)
        return int(self.np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def generate(self, prompts, max_tokens):
        if len(prompts) > self.max_seqs or max(map(len, prompts)) + max_tokens > self.seq_capacity:
            raise ValueError(f"llama.cpp case too large: {len(prompts)} prompts")
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        entries, last_index = [], []
        for seq, prompt in enumerate(prompts):
            for pos, token in enumerate(prompt):
                entries.append((token, pos, seq, pos == len(prompt) - 1))
            last_index.append(len(entries) - 1)
        self._decode(entries)
        outputs = [[self._argmax(i)] for i in last_index]
        for step in range(1, max_tokens):
            self._decode(
                [
                    (out[-1], len(p) + step - 1, seq, True)
                    for seq, (p, out) in enumerate(zip(prompts, outputs, strict=True))
                ]
            )
            for seq, out in enumerate(outputs):
                out.append(self._argmax(seq))
        return outputs


class VllmEngine:
    """vLLM in its own venv: a worker process (this file with --vllm-worker) that reads one
    JSON request a line from stdin and answers with the token ids and its own wall time.

    Between its own calls the worker's whole process group is stopped (SIGSTOP): vLLM's
    engine-core process polls for work, and on a 2-core machine an idle poller would slow
    whichever engine runs next."""

    name = "vllm"

    def __init__(self, python: str, model_dir: str, dtype: str, threads: int):
        self.dtype, self.label = dtype, ""
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env["OMP_NUM_THREADS"] = str(threads)
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__), "--vllm-worker", model_dir, "--dtypes", dtype],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # its own process group, to pause it as a whole
        )
        self._wait_line()  # "ready"
        self._signal(signal.SIGSTOP)
        self.last_seconds = None

    def _signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def _wait_line(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"vLLM worker exited (rc {self.proc.poll()})")
            if line.startswith("@@"):
                return json.loads(line[2:])

    def generate(self, prompts, max_tokens):
        self._signal(signal.SIGCONT)
        try:
            request = json.dumps({"prompts": prompts, "max_tokens": max_tokens})
            self.proc.stdin.write(request + "\n")
            self.proc.stdin.flush()
            answer = self._wait_line()
        finally:
            self._signal(signal.SIGSTOP)
        self.last_seconds = answer["seconds"]
        return answer["tokens"]

    def close(self):
        self._signal(signal.SIGCONT)
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def vllm_worker(model_dir: str, dtype: str) -> None:
    from vllm import LLM, SamplingParams  # noqa: I001  (only inside the vLLM venv)

    llm = LLM(model=model_dir, dtype=dtype, enable_prefix_caching=False, max_model_len=2048)
    print("@@" + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in request["prompts"]]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        print("@@" + json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)


# ----------------------------------------------------------------------------- measuring


def timed(engine, case: dict) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    tokens = engine.generate(case["prompts"], case["max_tokens"])
    seconds = time.perf_counter() - start
    if getattr(engine, "last_seconds", None) is not None:
        seconds = engine.last_seconds  # the worker's own wall time, without the pipe
    counts = {len(t) for t in tokens}
    if counts != {case["max_tokens"]}:
        raise RuntimeError(f"{engine.name} made {counts} tokens, asked {case['max_tokens']}")
    return seconds, tokens


def memory_read_bandwidth(gib: float = 1.0) -> float:
    """Bytes/s of a float32 sum over `gib` GiB (best of 3): a read-only stream."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def check_greedy(pyllm_fp32, hf_fp32, workload: dict, tokens: int) -> bool:
    """pyllm float32 greedy tokens == HF float32 greedy tokens, prompt by prompt (HF run
    unpadded, one prompt at a time, so padding cannot move a near-tie)."""
    ok = True
    for i, prompt in enumerate(workload["batch8"]["prompts"][:3]):
        ours = pyllm_fp32.generate([prompt], tokens)[0]
        ref = hf_fp32.generate([prompt], tokens)[0]
        if ours != ref:
            at = next(k for k, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b)
            print(f"!!! GREEDY MISMATCH prompt {i}: pyllm and HF differ from token {at}:")
            print(f"!!!   pyllm {ours[at : at + 8]}  HF {ref[at : at + 8]}")
            ok = False
    print(
        f"greedy check (pyllm fp32 vs HF fp32, 3 prompts x {tokens} tokens): "
        + ("IDENTICAL" if ok else "MISMATCH -- speeds below compare different outputs")
    )
    return ok


def format_table(rows: list[dict], titles: dict[str, str]) -> str:
    header = ["engine", "dtype", *(titles[c] + " tok/s" for c in CASES), "note"]
    body = []
    for r in rows:
        cells = [r["engine"], r["dtype"]]
        for c in CASES:
            rate, ratio = r.get(c), r.get(c + "_vs_pyllm")
            if rate is None:
                cells.append("-")
            else:
                cells.append(f"{rate:.1f}" + (f" ({ratio:.2f}x)" if ratio is not None else ""))
        cells.append(r.get("note", ""))
        body.append(cells)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]

    def fmt(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(header), rule, *(fmt(b) for b in body)])


# ----------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--engines", default="pyllm,hf,llama.cpp,vllm")
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    parser.add_argument("--quick", action="store_true", help="fewer tokens, one repeat")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    parser.add_argument("--vllm-model", default=None, help="HF folder of the model, for vLLM")
    parser.add_argument("--vllm-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    if args.vllm_worker:
        vllm_worker(args.vllm_worker, dtypes[0])
        return 0
    repeats = 1 if args.quick else args.repeats
    wanted = args.engines.split(",")

    from pyllm.model.default_model import default_model_path

    gguf = default_model_path()
    threads = torch.get_num_threads()
    print("$ " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, torch threads {threads}")
    bandwidth = memory_read_bandwidth()
    print(f"memory read bandwidth (float32 sum over 1 GiB, best of 3): {bandwidth / 1e9:.1f} GB/s")

    engines: list = []
    skipped: list[str] = []
    for dtype in dtypes:
        engines.append(PyllmEngine(dtype))
    workload = build_workload(
        lambda text: engines[0].llm.tokenizer.encode(text, add_special_tokens=False), args.quick
    )
    if "hf" in wanted:
        for dtype in dtypes:
            start = time.perf_counter()
            engines.append(HFEngine(dtype, gguf))
            print(f"HF {dtype}: loaded the GGUF in {time.perf_counter() - start:.0f} s")
    if "llama.cpp" in wanted:
        try:
            import llama_cpp  # noqa: F401

            engines.append(LlamaCppEngine(gguf, threads))
        except ImportError as error:
            skipped.append(f"llama.cpp: llama_cpp is not importable ({error})")
    if "vllm" in wanted:
        if not args.vllm_python or not args.vllm_model:
            skipped.append(
                "vllm: needs --vllm-python (a venv with vllm-cpu) and --vllm-model "
                "(an HF folder: vLLM cannot read this GGUF on the CPU)"
            )
        else:
            for dtype in dtypes:
                engines.append(VllmEngine(args.vllm_python, args.vllm_model, dtype, threads))
    for reason in skipped:
        print(f"skipped {reason}")

    titles = case_titles(workload)
    by_key = {(e.name, e.dtype): e for e in engines}
    greedy_ok = None
    if ("pyllm", "float32") in by_key and ("hf", "float32") in by_key:
        greedy_ok = check_greedy(
            by_key["pyllm", "float32"], by_key["hf", "float32"], workload, 16 if args.quick else 32
        )
    else:
        print("greedy check skipped: needs pyllm and HF both in float32")

    for engine in engines:  # warm-up: first-call costs are not counted
        engine.generate(workload["batch8"]["prompts"][:2], 2)
    best: dict[tuple[str, str], dict[str, float]] = {(e.name, e.dtype): {} for e in engines}
    for case_name in CASES:
        case = workload[case_name]
        for _ in range(repeats):
            for engine in engines:  # alternate: every engine, then the next repeat
                seconds, _ = timed(engine, case)
                rate = case_rate(case_name, case, seconds)
                print(
                    f"  {engine.name} {engine.dtype} {titles[case_name]}: {rate:.1f} tok/s "
                    f"({seconds:.1f} s)",
                    flush=True,
                )
                slot = best[engine.name, engine.dtype]
                slot[case_name] = max(slot.get(case_name, 0.0), rate)
        print(f"done: {titles[case_name]}", flush=True)

    rows = []
    for engine in engines:
        rates = best[engine.name, engine.dtype]
        reference = best.get(("pyllm", engine.dtype)) or best[engines[0].name, engines[0].dtype]
        row = {"engine": engine.name, "dtype": engine.dtype, "note": engine.label}
        for c in CASES:
            row[c] = rates[c]
            row[c + "_vs_pyllm"] = None if engine.name == "pyllm" else rates[c] / reference[c]
        row["batch_sizes"] = {c: len(workload[c]["prompts"]) for c in CASES}
        row["max_tokens"] = {c: workload[c]["max_tokens"] for c in CASES}
        rows.append(row)
    print()
    print(
        "ratios in parentheses: engine / pyllm of the same dtype (llama.cpp: / pyllm "
        f"{engines[0].dtype}); best of {repeats}"
    )
    print(format_table(rows, titles))
    print()
    for engine in engines:
        if engine.name != "pyllm":
            continue
        weights = engine.weight_bytes()
        rate = best["pyllm", engine.dtype]["decode_b1"]
        fraction = weights * rate / bandwidth
        print(
            f"pyllm {engine.dtype}: weights {weights / 1e6:.0f} MB; decode b1 {rate:.1f} tok/s "
            f"reads {weights * rate / 1e9:.1f} GB/s = {fraction:.0%} of the measured "
            f"bandwidth (limit {bandwidth / weights:.0f} tok/s)"
        )
    if greedy_ok is False:
        print("!!! WARNING: pyllm fp32 greedy output differs from HF fp32 (see above)")
    for engine in engines:
        if isinstance(engine, VllmEngine):
            engine.close()
    if args.json:
        meta = {
            "command": sys.argv,
            "cpus": os.cpu_count(),
            "torch_threads": threads,
            "bandwidth_bytes_per_s": bandwidth,
            "greedy_identical": greedy_ok,
            "skipped": skipped,
            "case_titles": titles,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
