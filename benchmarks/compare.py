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
                (the short prompts' prefill is included)
The machine is noisy, so the engines alternate case by case (every engine runs a case,
then the next case), and each figure is the best of --repeats runs.
Before any speed is reported, pyllm's float32 greedy text is checked against HF's.

GGUF mode: pyllm and llama.cpp on the same GGUF file(s), each engine in its own process
    PYTHONPATH=. python benchmarks/compare.py --gguf A.gguf,B.gguf [--pyllm-arg dtype=float32]
Each engine's worker process (this file with --worker ENGINE FILE) loads the file, warms
up (two short prompts, then the long prompt untimed: every weight read once), runs every
case once and reports its load time and peak RSS (its VmHWM: Linux would count the
launching process's high-water mark in a child's ru_maxrss); per repeat the engines' workers
run one after the other, and each figure is the best of --repeats. The prompts are
tokenized once, with pyllm's tokenizer of that file. A worker is skipped when MemAvailable
cannot hold its estimated need, and killed when its anonymous RSS passes --max-rss-gib (or
MemAvailable falls under a floor). --pyllm-arg key=value goes into pyllm's LLM(...) options.

In the default mode llama.cpp runs in this process: a llama-cpp-python built with its
default native flags on a CPU with AMX (a Sapphire Rapids-class KVM guest) died with a
general protection fault in libggml-cpu's AMX code and took the run with it. Built
without AMX it runs:
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
import tempfile
import time

# torch is imported where it is used: a llama.cpp worker's peak RSS must not include it.

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


def build_workload(tokenizer_encode, quick: bool, seed: int = 0, prefill_tokens: int = 512) -> dict:
    """Token ids for every case. tokenizer_encode(text) -> list[int]; prefill_tokens is
    less than 512 only for a model whose context is shorter."""
    rng = random.Random(seed)

    def prompt_ids(length: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < length:
            ids = tokenizer_encode(" ".join(rng.choice(WORDS) for _ in range(length)))
        return ids[:length]

    short = [prompt_ids(rng.randint(26, 34)) for _ in range(32)]
    return {
        "prefill": {"prompts": [prompt_ids(prefill_tokens)], "max_tokens": 1},
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

    def __init__(self, dtype: str, model: str | None = None, **options):
        from pyllm import LLM, SamplingParams

        self.dtype, self.label = dtype, ""
        self._params = SamplingParams
        # No prefix caching: the cases share prompts, and a cached prefix would skip prefill.
        options = {"enable_prefix_caching": False, "max_num_seqs": 64, **options}
        self.llm = LLM(model=model, dtype=dtype, **options)
        self.options = options
        quantization = getattr(self.llm.engine.config, "quantization", None)
        if quantization is not None:
            self.label = f"quantization={quantization}"

    def generate(self, prompts, max_tokens):
        params = self._params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def weight_bytes(self) -> int:
        """Weight bytes one decode step must read: every layer's matrices and norms, plus the
        LM head (the embedding lookup reads one row, so it is not counted)."""
        path = self.llm.engine.config.model_path
        if path.endswith(".gguf") and pyllm_keeps_weights_quantized(self.options):
            return gguf_file_info(path)["decode_bytes"]
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
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.dtype, self.label = dtype, ""
        directory, file = os.path.split(gguf_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=file, dtype=getattr(torch, dtype)
        ).eval()
        self.pad_id = 0

    def generate(self, prompts, max_tokens):
        with self.torch.inference_mode():
            return self._generate(prompts, max_tokens)

    def _generate(self, prompts, max_tokens):
        torch = self.torch
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

    def __init__(self, gguf_path: str, threads: int, dtype: str = "q4_1"):
        import llama_cpp
        import numpy

        self.lib, self.np = llama_cpp, numpy
        # llama.cpp logs every graph input on stderr; keep the callback alive on self.
        self._quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(self._quiet, None)
        self.dtype, self.label = dtype, "llama_batch API"
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
    import torch

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


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    """A markdown table with its columns padded to one width."""
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]

    def fmt(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(header), rule, *(fmt(b) for b in body)])


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
    return markdown_table(header, body)


# ----------------------------------------------------------------------------- GGUF mode
# pyllm and llama.cpp on the same GGUF file, each engine in a worker process of its own, so
# that its load time and peak RSS are its own.

GGUF_ENGINES = ("pyllm", "llama.cpp")
WATCHDOG_POLL_S = 0.1
MEM_FLOOR_BYTES = 512 * 2**20  # a worker is killed when MemAvailable falls under this
HEADROOM_BYTES = 2**30  # left to the rest of the machine when a worker starts
GIB = 2**30


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def meminfo() -> dict[str, int]:
    """/proc/meminfo, in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            parts = value.split()
            out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def warm_page_cache(path: str) -> str:
    """Reads the file once, so that every engine loads it from the page cache: the
    first engine to open a file the kernel has dropped (it reclaims idle pages here)
    would otherwise pay the disk for both. pyllm's strip cache file of it, where there
    is one, is read too: it is what pyllm maps instead of the file's packed tensors.
    Each is skipped where the bytes read so far would pass half of MemAvailable."""
    budget = meminfo()["MemAvailable"] // 2
    start, size_read, read, skipped = time.perf_counter(), 0, [], []
    buffer = bytearray(8 << 20)
    named = [("the file", path)] + [("its strip cache file", p) for p in strip_cache_files(path)]
    for name, p in named:
        size = os.path.getsize(p)
        if size_read + size > budget:
            skipped.append(f"{name}, {gib(size)}")
            continue
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
        size_read += size
        read.append(name)
    done = " and ".join(read) or "nothing"
    line = f"page cache: read {done} first, {gib(size_read)} ({time.perf_counter() - start:.1f} s)"
    if skipped:
        line += f"; not read ahead (over half of MemAvailable): {'; '.join(skipped)}"
    return line


def strip_cache_files(path: str) -> list[str]:
    """pyllm's strip cache file of the GGUF file (one rank), where it exists."""
    try:
        from pyllm.model.strip_cache import StripCache
    except ImportError:
        return []
    cached = StripCache(path).path
    return [str(cached)] if cached.exists() else []


def process_memory(pid: int | str) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of a process in bytes ({} once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


def gguf_file_info(path: str) -> dict:
    """Sizes and types of a GGUF file's tensors, and the bytes one decode token reads."""
    import gguf

    from pyllm.model.loader import load_config

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    by_type: dict[str, int] = {}
    for t in reader.tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
    tensor_bytes = sum(by_type.values())
    config = load_config(path)
    # A decode token reads every tensor once, but only one row of the embedding table
    # when the LM head is a tensor of its own (tied, the table is the head and is read),
    # and of a MoE layer's experts (the 3-D ffn_*_exps) only the top_k it is routed to.
    decode_bytes = tensor_bytes
    if "output.weight" in tensors and "token_embd.weight" in tensors:
        decode_bytes -= int(tensors["token_embd.weight"].n_bytes)
    expert_bytes = sum(int(t.n_bytes) for n, t in tensors.items() if "_exps." in n)
    if config.num_experts:
        decode_bytes -= expert_bytes * (1 - config.num_experts_per_tok / config.num_experts)
    label = max(by_type, key=by_type.get)
    field = reader.fields.get("general.file_type")
    if field is not None:
        try:
            label = gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_")
        except ValueError:
            pass
    return {
        "path": path,
        "name": os.path.basename(path),
        "file_bytes": os.path.getsize(path),
        "tensor_bytes": tensor_bytes,
        "decode_bytes": int(decode_bytes),
        "expert_bytes": expert_bytes,
        "type": label,
        "bytes_by_type": by_type,
        "weight_elements": sum(int(t.n_elements) for t in reader.tensors),
        "kv_elements_per_token": 2 * config.num_hidden_layers * config.kv_size,
    }


def parse_pyllm_args(items: list[str]) -> dict:
    """--pyllm-arg key=value items -> LLM(...) options. Values are read as JSON where they
    parse (numbers, true/false), else kept as strings ("none" stays "none")."""
    from pyllm.engine.config import EngineConfig

    known = sorted(set(EngineConfig.__dataclass_fields__) - {"model"})
    options = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--pyllm-arg takes key=value, got {item!r}")
        if key not in known:
            raise ValueError(
                f"--pyllm-arg {key}: pyllm's LLM has no option {key!r} (its options: "
                + ", ".join(known)
                + ")"
            )
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        options[key] = value
    return options


def pyllm_keeps_weights_quantized(options: dict) -> bool:
    """Whether this pyllm keeps GGUF weights quantized with these options (older builds have
    no `quantization` option and widen every weight to the dtype)."""
    from pyllm.engine.config import EngineConfig

    field = EngineConfig.__dataclass_fields__.get("quantization")
    if field is None:
        return False
    return str(options.get("quantization", field.default)).lower() != "none"


def estimated_need(engine: str, info: dict, options: dict) -> tuple[int, str]:
    """Bytes a worker may need at its peak, and how that was reckoned."""
    runtime = 512 * 2**20  # interpreter, libraries, activations
    if engine == "llama.cpp":
        cells = LlamaCppEngine.max_seqs * LlamaCppEngine.seq_capacity
        kv = cells * info["kv_elements_per_token"] * 2  # float16 K and V
        return info["file_bytes"] + kv + runtime, "the file + an f16 KV cache + 0.5 GiB"
    from pyllm.engine.config import DEFAULT_CPU_KV_CACHE_GIB
    from pyllm.model.dtype import resolve_dtype
    from pyllm.model.loader import estimate_weight_bytes

    kv = int(float(options.get("kv_cache_memory") or DEFAULT_CPU_KV_CACHE_GIB) * GIB)
    # Kept blocks take their bytes in the file, one copy; widened weights their dtype's,
    # with more slack for the widening at load.
    dtype = resolve_dtype(options.get("dtype", "auto"), "cpu")
    keep = pyllm_keeps_weights_quantized(options)
    quantization = "auto" if keep else "none"
    factor = 1.05 if keep else 1.25
    weights = int(factor * estimate_weight_bytes(info["path"], dtype, quantization))
    how = f"{factor} x the weights as pyllm holds them ({'kept' if keep else 'widened'})"
    return weights + kv + runtime, f"{how} + a {gib(kv)} KV cache + 0.5 GiB"


def gguf_worker(
    engine_name: str, path: str, workload_path: str, threads: int | None, options: dict
) -> None:
    """One engine on one file: load, warm up, every case once; prints one @@JSON line."""
    with open(workload_path) as f:
        workload = json.load(f)
    # Load time is the model's: the engine's library (and torch) is imported first.
    if engine_name == "pyllm":
        from pyllm import LLM  # noqa: F401  (pyllm imports its parts on first use)
    elif engine_name == "llama.cpp":
        import llama_cpp  # noqa: F401
    start = time.perf_counter()
    if engine_name == "pyllm":
        if threads:
            import torch

            torch.set_num_threads(threads)
        options = dict(options)
        engine = PyllmEngine(options.pop("dtype", "auto"), model=path, **options)
        config = engine.llm.engine.config
        engine.dtype = str(config.torch_dtype).removeprefix("torch.")
        if getattr(config, "quantization", None) is not None:
            engine.dtype += f" quantization={config.quantization}"
    elif engine_name == "llama.cpp":
        engine = LlamaCppEngine(
            path, threads or os.cpu_count(), dtype=""
        )  # the parent names the file's type
    else:
        raise ValueError(f"--worker engine must be one of {GGUF_ENGINES}, got {engine_name!r}")
    load_s = time.perf_counter() - start
    after_load = process_memory("self")
    engine.generate(workload["batch8"]["prompts"][:2], 2)  # first-call costs are not counted
    # The long prompt reads every weight once: a file (or pyllm's strip cache) too large
    # to read ahead would otherwise fault its pages in from disk inside the first case.
    engine.generate(workload["prefill"]["prompts"], 1)
    rates, seconds, tokens = {}, {}, {}
    for name in CASES:
        seconds[name], out = timed(engine, workload[name])
        rates[name] = case_rate(name, workload[name], seconds[name])
        tokens[name] = out[0]
    memory = process_memory("self")
    result = {
        "engine": engine.name,
        "dtype": engine.dtype,
        "note": engine.label,
        "load_s": load_s,
        "rss_after_load_bytes": after_load.get("VmRSS"),
        # VmHWM, not ru_maxrss: Linux carries the launching process's high-water mark into
        # a child's ru_maxrss across fork and exec.
        "vm_hwm_bytes": memory.get("VmHWM"),
        "rates": rates,
        "seconds": seconds,
        "decode_b1_tokens": tokens["decode_b1"],
    }
    print("@@" + json.dumps(result), flush=True)


def run_worker(engine: str, info: dict, workload_path: str, args, threads: int) -> dict:
    """Runs one worker under a watchdog that polls its memory and kills it past the limit."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", engine, info["path"]]
    cmd += ["--workload", workload_path, "--threads", str(threads)]
    for item in args.pyllm_arg:
        cmd += ["--pyllm-arg", item]
    if args.max_rss_gib:
        limit = int(args.max_rss_gib * GIB)
    else:
        limit = meminfo()["MemAvailable"] - HEADROOM_BYTES
    peak_rss = peak_anon = 0
    killed, last = None, {}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, start_new_session=True)
        while True:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
            if pid:
                break
            memory = process_memory(proc.pid) or last
            last = memory
            # Anonymous pages only: mapped file pages (llama.cpp maps the weights) can be
            # dropped by the kernel and are no OOM risk.
            anon = memory.get("RssAnon", 0) + memory.get("RssShmem", 0)
            peak_anon = max(peak_anon, anon)
            peak_rss = max(peak_rss, memory.get("VmRSS", 0))
            if killed is None:
                reason = None
                if anon > limit:
                    reason = f"its anonymous RSS passed the limit {gib(limit)}"
                elif meminfo()["MemAvailable"] < MEM_FLOOR_BYTES:
                    reason = f"MemAvailable fell under {gib(MEM_FLOOR_BYTES)}"
                elif time.monotonic() - started > args.worker_timeout:
                    reason = f"it ran past --worker-timeout {args.worker_timeout:.0f} s"
                if reason:
                    killed = (
                        f"killed: {reason} (RSS {gib(memory.get('VmRSS', 0))}, "
                        f"anonymous {gib(anon)})"
                    )
                    os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(WATCHDOG_POLL_S)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    record = {
        "engine": engine,
        "returncode": proc.returncode,
        # polled every WATCHDOG_POLL_S: a killed worker reports no VmHWM of its own
        "peak_rss_polled_bytes": peak_rss,
        "peak_anon_bytes": peak_anon,
        "wall_s": time.monotonic() - started,
    }
    answers = [line[2:] for line in stdout.splitlines() if line.startswith("@@")]
    if killed:
        record.update(status="killed", reason=killed)
    elif proc.returncode != 0 or not answers:
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        record.update(status="failed", reason=f"exit status {proc.returncode}: {tail}")
    else:
        record.update(status="ok", **json.loads(answers[-1]))
        if engine == "llama.cpp":
            record["dtype"] = info["type"]
    return record


def matching_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def format_gguf_table(rows: list[dict], titles: dict[str, str]) -> str:
    header = [
        "engine",
        "file",
        "dtype",
        "load s",
        "peak RSS",
        *(titles[c] + " tok/s" for c in CASES),
    ]
    header.append("decode b1 reads")
    body = []
    for r in rows:
        cells = [r["engine"], r["file"], r["dtype"] or "-"]
        if r["status"] != "ok":
            cells += ["-"] * (len(header) - len(cells) - 1) + [r["status"]]
            body.append(cells)
            continue
        cells += [f"{r['load_s']:.2f}", gib(r["peak_rss_bytes"])]
        for c in CASES:
            ratio = r.get(c + "_vs_pyllm")
            cells.append(f"{r[c]:.1f}" + (f" ({ratio:.2f}x)" if ratio is not None else ""))
        cells.append(
            f"{r['decode_b1_read_bytes_per_s'] / 1e9:.2f} GB/s "
            f"({r['decode_b1_bandwidth_fraction']:.0%})"
        )
        body.append(cells)
    return markdown_table(header, body)


def gguf_rows(info: dict, runs: dict[str, list[dict]], workload: dict, bandwidth: float):
    """The best of each engine's runs on one file: one row per engine."""
    rows = []
    for engine, records in runs.items():
        done = [r for r in records if r["status"] == "ok"]
        row = {"engine": engine, "file": info["name"], "dtype": None, "note": ""}
        if not done:
            row.update(status=records[-1]["status"], reason=records[-1]["reason"], runs=records)
            rows.append(row)
            continue
        row.update(
            status="ok",
            dtype=done[0]["dtype"],
            note=done[0]["note"],
            runs_ok=len(done),
            load_s=min(r["load_s"] for r in done),
            peak_rss_bytes=max(r["vm_hwm_bytes"] or r["peak_rss_polled_bytes"] for r in done),
            peak_anon_bytes=max(r["peak_anon_bytes"] for r in done),
            rss_after_load_bytes=max(r["rss_after_load_bytes"] or 0 for r in done),
        )
        for c in CASES:
            row[c] = max(r["rates"][c] for r in done)
        rate = row["decode_b1"]
        row["weights_read_per_token_bytes"] = info["decode_bytes"]
        row["decode_b1_read_bytes_per_s"] = info["decode_bytes"] * rate
        row["decode_b1_bandwidth_fraction"] = info["decode_bytes"] * rate / bandwidth
        row["batch_sizes"] = {c: len(workload[c]["prompts"]) for c in CASES}
        row["max_tokens"] = {c: workload[c]["max_tokens"] for c in CASES}
        row["runs"] = records
        rows.append(row)
    reference = next((r for r in rows if r["engine"] == "pyllm" and r["status"] == "ok"), None)
    for row in rows:
        if row["status"] == "ok":
            for c in CASES:
                ok = reference is not None and row["engine"] != "pyllm"
                row[c + "_vs_pyllm"] = row[c] / reference[c] if ok else None
    return rows


def describe_run(record: dict, titles: dict[str, str]) -> str:
    if record["status"] != "ok":
        return f"{record['status']}: {record['reason']}"
    rates = ", ".join(f"{titles[c]} {record['rates'][c]:.1f}" for c in CASES)
    return (
        f"{record['dtype']}: load {record['load_s']:.2f} s, peak RSS "
        f"{gib(record['vm_hwm_bytes'] or record['peak_rss_polled_bytes'])}; {rates} tok/s"
    )


def pyllm_context(path: str) -> int:
    """The longest sequence pyllm runs this model with by default (its max_model_len)."""
    from pyllm.model.config import resolve_max_model_len
    from pyllm.model.loader import load_config

    return resolve_max_model_len(load_config(path), None)


def gguf_mode(args, files: list[str]) -> int:
    import importlib.util

    import torch

    from pyllm.model.tokenizer import Tokenizer

    options = parse_pyllm_args(args.pyllm_arg)
    engines = [e for e in GGUF_ENGINES if e in args.engines.split(",")]
    repeats = 1 if args.quick else args.repeats
    threads = args.threads or torch.get_num_threads()
    print("$ " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, threads {threads} per engine, "
        f"load average {os.getloadavg()[0]:.1f} (other work on the cores makes figures noisy)"
    )
    bandwidth = memory_read_bandwidth()
    print(f"memory read bandwidth (float32 sum over 1 GiB, best of 3): {bandwidth / 1e9:.1f} GB/s")
    skipped = []
    if "llama.cpp" in engines and importlib.util.find_spec("llama_cpp") is None:
        engines.remove("llama.cpp")
        skipped.append("llama.cpp: llama_cpp is not importable")
        print("skipped llama.cpp: llama_cpp is not importable")
    if not engines:
        raise ValueError(f"--engines {args.engines!r} names none of {GGUF_ENGINES}")
    print(f"pyllm LLM options: {options or 'defaults'}")
    rows, files_meta, titles = [], [], {}
    with tempfile.TemporaryDirectory() as scratch:
        for path in files:
            info = gguf_file_info(path)
            files_meta.append({k: v for k, v in info.items() if k != "path"})
            print(
                f"{info['name']}: {info['type']}, file {gib(info['file_bytes'])}; a decode token "
                f"reads {info['decode_bytes'] / 1e6:.0f} MB of tensors (the file's "
                f"{info['tensor_bytes'] / 1e6:.0f} MB, less the embedding table when the LM "
                "head is its own tensor, and less the experts a token is not routed to)",
                flush=True,
            )
            tokenizer = Tokenizer.from_pretrained(path)
            workload = build_workload(
                lambda text, t=tokenizer: t.encode(text, add_special_tokens=False),
                args.quick,
                prefill_tokens=min(512, pyllm_context(path) - 1),
            )
            titles = case_titles(workload)
            workload_path = os.path.join(scratch, "workload.json")
            with open(workload_path, "w") as f:
                json.dump(workload, f)
            runs: dict[str, list[dict]] = {e: [] for e in engines}
            print(f"  {warm_page_cache(path)}", flush=True)
            for repeat in range(repeats):
                for engine in engines:  # one after the other, never two at once
                    need, how = estimated_need(engine, info, options if engine == "pyllm" else {})
                    available = meminfo()["MemAvailable"]
                    if need > available - HEADROOM_BYTES:
                        record = {
                            "engine": engine,
                            "status": "skipped",
                            "reason": f"needs ~{gib(need)} ({how}), MemAvailable is "
                            f"{gib(available)} and {gib(HEADROOM_BYTES)} stays free",
                        }
                    else:
                        record = run_worker(engine, info, workload_path, args, threads)
                    runs[engine].append(record)
                    print(
                        f"  {engine} on {info['name']} run {repeat + 1}: "
                        + describe_run(record, titles),
                        flush=True,
                    )
            file_rows = gguf_rows(info, runs, workload, bandwidth)
            rows += file_rows
            done = {r["engine"]: r for r in file_rows if r["status"] == "ok"}
            if len(done) == 2:
                ours, theirs = (
                    next(r for r in done[e]["runs"] if r["status"] == "ok")["decode_b1_tokens"]
                    for e in GGUF_ENGINES
                )
                same = matching_prefix(ours, theirs)
                print(
                    f"  greedy decode b1 tokens: pyllm and llama.cpp agree on the first {same} "
                    f"of {len(ours)} (their arithmetic differs: a near-tie may part them)"
                )
                done["llama.cpp"]["greedy_matching_prefix"] = same

    print()
    print(
        f"best of {repeats} run(s) per engine, each engine's cases in its own worker process, "
        "the engines' workers one after the other: tok/s the highest, load the fastest, peak "
        "RSS (the worker's VmHWM) the highest; ratios in parentheses: engine / pyllm on "
        "the same file"
    )
    print(format_gguf_table(rows, titles))
    print(
        f"decode b1 reads = weights read per token x decode b1 tok/s, and its share of the "
        f"measured {bandwidth / 1e9:.1f} GB/s; load average now {os.getloadavg()[0]:.1f}"
    )
    for row in rows:
        if row["status"] != "ok":
            print(f"{row['engine']} on {row['file']}: {row['status']}: {row['reason']}")
    if args.json:
        meta = {
            "mode": "gguf",
            "command": sys.argv,
            "cpus": os.cpu_count(),
            "threads": threads,
            "load_average_at_end": os.getloadavg()[0],
            "bandwidth_bytes_per_s": bandwidth,
            "repeats": repeats,
            "best_of": "tok/s highest, load_s lowest, peak_rss_bytes highest",
            "pyllm_options": options,
            "files": files_meta,
            "skipped": skipped,
            "case_titles": titles,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


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
    parser.add_argument(
        "--gguf",
        "--model",
        dest="gguf",
        action="append",
        default=[],
        metavar="FILE",
        help="GGUF mode: pyllm and llama.cpp on this file (repeat, or a comma list)",
    )
    parser.add_argument(
        "--pyllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option for pyllm's LLM(...), e.g. quantization=none (repeatable)",
    )
    parser.add_argument(
        "--max-rss-gib",
        type=float,
        default=None,
        help="GGUF mode: kill a worker whose anonymous RSS passes this "
        f"(default: MemAvailable when it starts, less {HEADROOM_BYTES // GIB} GiB)",
    )
    parser.add_argument("--worker-timeout", type=float, default=1800.0, help="seconds")
    parser.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="GGUF mode: threads of both engines (default: torch's thread count)",
    )
    args = parser.parse_args()
    if args.worker:
        if not args.workload:
            parser.error("--worker needs --workload")
        options = parse_pyllm_args(args.pyllm_arg)
        gguf_worker(*args.worker, args.workload, args.threads, options)
        return 0
    if args.gguf:
        files = [f for item in args.gguf for f in item.split(",") if f]
        for f in files:
            if not f.endswith(".gguf") or not os.path.isfile(f):
                parser.error(f"--gguf {f}: not a .gguf file")
        if args.threads is not None and args.threads < 1:
            parser.error(f"--threads must be positive, got {args.threads}")
        if args.max_rss_gib is not None and args.max_rss_gib <= 0:
            parser.error(f"--max-rss-gib must be positive, got {args.max_rss_gib}")
        try:
            return gguf_mode(args, [os.path.abspath(f) for f in files])
        except ValueError as error:
            parser.error(str(error))
    dtypes = args.dtypes.split(",")
    if args.vllm_worker:
        vllm_worker(args.vllm_worker, dtypes[0])
        return 0
    repeats = 1 if args.quick else args.repeats
    wanted = args.engines.split(",")
    try:
        pyllm_options = parse_pyllm_args(args.pyllm_arg)
    except ValueError as error:
        parser.error(str(error))
    if "dtype" in pyllm_options:
        parser.error("--pyllm-arg dtype: this mode takes the dtypes from --dtypes")

    from pyllm.model.default_model import default_model_path

    gguf = default_model_path()
    import torch

    threads = torch.get_num_threads()
    print("$ " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, torch threads {threads}")
    bandwidth = memory_read_bandwidth()
    print(f"memory read bandwidth (float32 sum over 1 GiB, best of 3): {bandwidth / 1e9:.1f} GB/s")

    engines: list = []
    skipped: list[str] = []
    for dtype in dtypes:
        engines.append(PyllmEngine(dtype, **pyllm_options))
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
