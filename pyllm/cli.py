"""The `pyllm` command: `pyllm generate PROMPT...`, `pyllm serve`, `pyllm bench`,
`pyllm export-tokenizer DIR`."""

from __future__ import annotations

import argparse
import os
import sys


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=None,
        help="HF directory or GGUF file (default: bundled SmolLM2-135M-Instruct)",
    )
    group.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    group.add_argument("--device", default="auto", help="auto, cpu or cuda")
    group.add_argument(
        "--quantization",
        default="auto",
        help="auto (a GGUF file's quantized weights stay quantized), none (widen every "
        "weight to --dtype), or q8_0, q4_0, q4_k, mxfp4 (quantize an HF folder's weights "
        "at load)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        default="1",
        help="processes to split the model over (bench: a comma-separated list, e.g. 1,2); "
        "under torchrun, the number of processes it starts",
    )
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--max-num-batched-tokens", type=int, default=512)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="most tokens of one prompt per step while other prompts wait "
        "(default: a quarter of --max-num-batched-tokens)",
    )
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--kv-cache-memory", type=float, default=None, help="GiB for the KV cache")
    group.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="(prefix caching is on by default with --kv-cache paged, off with contiguous)",
    )
    group.add_argument(
        "--distributed-timeout",
        type=float,
        default=60.0,
        help="seconds a tensor-parallel rank may take to answer before the engine fails",
    )
    group.add_argument(
        "--kv-cache",
        choices=("paged", "contiguous"),
        default="paged",
        help="paged: KV blocks + block tables; contiguous: one virtual range per sequence "
        "slot, memory mapped as it grows",
    )


def _tensor_parallel_sizes(args: argparse.Namespace) -> None:
    """Reads --tensor-parallel-size: a list for bench, one number otherwise."""
    try:
        sizes = [int(s) for s in str(args.tensor_parallel_size).split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes) or (len(sizes) > 1 and args.command != "bench"):
        raise ValueError(
            f"--tensor-parallel-size must be a positive integer (bench: a list of them), "
            f"got {args.tensor_parallel_size!r}"
        )
    args.tensor_parallel_sizes = sizes
    args.tensor_parallel_size = sizes[0]


def _engine_options(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=False if args.no_prefix_caching else None,
        kv_cache=args.kv_cache,
        quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_timeout=args.distributed_timeout,
    )


def _generate(args: argparse.Namespace) -> int:
    from pyllm.entrypoints.llm import LLM
    from pyllm.sampling.params import SamplingParams

    llm = LLM(**_engine_options(args))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    if args.chat:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False
        )
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, output in zip(args.prompts, outputs, strict=True):
        text = output.outputs[0].text
        print(text if args.chat else prompt + text, flush=True)
        if len(args.prompts) > 1:
            print("-" * 40)
    return 0


def _origins(value: str) -> list[str]:
    return [origin.strip() for origin in value.split(",") if origin.strip()]


def _serve(args: argparse.Namespace) -> int:
    from pyllm.entrypoints.server import run_server

    if args.port is not None and not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.max_seqs_per_request < 1:
        raise ValueError(
            f"--max-seqs-per-request must be positive, got {args.max_seqs_per_request}"
        )
    return run_server(
        _engine_options(args),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
        allowed_origins=args.allowed_origins,
        max_seqs_per_request=args.max_seqs_per_request,
        shutdown_timeout=args.shutdown_timeout,
        ui=not args.no_ui,
    )


def _export_tokenizer(args: argparse.Namespace) -> int:
    from pyllm.model.default_model import default_model_path
    from pyllm.model.tokenizer import Tokenizer
    from pyllm.model.tokenizer.export import export_hf_tokenizer

    tokenizer = Tokenizer.from_pretrained(args.model or default_model_path())
    for path in export_hf_tokenizer(tokenizer, args.output_dir):
        print(path)
    return 0


def _bench(args: argparse.Namespace) -> int:
    import platform

    import torch

    from pyllm.benchmark import format_table, rows_to_json, run_bench
    from pyllm.engine.config import EngineConfig
    from pyllm.engine.llm_engine import LLMEngine

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if any(c < 1 for c in concurrencies) or args.repetitions < 1:
        raise ValueError("concurrency and repetitions must be positive")
    options = _engine_options(args)
    options["enable_prefix_caching"] = False  # every prompt is fresh; measure compute
    options["max_num_seqs"] = max(options["max_num_seqs"], max(concurrencies))
    print(f"$ pyllm bench {' '.join(sys.argv[2:])}")
    rows = []
    for size in args.tensor_parallel_sizes:
        engine = LLMEngine(EngineConfig(**dict(options, tensor_parallel_size=size)))
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} cpus, tp {size}, torch threads "
            f"per rank {torch.get_num_threads()}",
            flush=True,
        )
        try:
            rows += run_bench(engine, args.n_prompt, args.n_gen, args.repetitions, concurrencies)
        finally:
            engine.close()
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            f.write(rows_to_json(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pyllm", description="A fast, small LLM inference engine")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete one or more prompts")
    generate.add_argument("prompts", nargs="+")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=-1)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument(
        "--chat", action="store_true", help="wrap each prompt in the chat template"
    )
    _engine_arguments(generate)
    generate.set_defaults(handler=_generate)

    serve = commands.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=os.environ.get("PYLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $PYLLM_API_KEY)",
    )
    serve.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: file name)"
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--allowed-origins",
        type=_origins,
        default=None,
        help="browser origins allowed to call the API, comma-separated, or '*' for any "
        "(default: none, no CORS headers)",
    )
    serve.add_argument(
        "--max-seqs-per-request",
        type=int,
        default=256,
        help="the most sequences one request may ask for: prompts x n (or best_of)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds running requests may go on before they are "
        "ended (new ones get 503 meanwhile)",
    )
    serve.add_argument(
        "--no-ui", action="store_true", help="do not serve the chat page at / (then 404)"
    )
    _engine_arguments(serve)
    serve.set_defaults(handler=_serve)

    export = commands.add_parser(
        "export-tokenizer",
        help="write the model's tokenizer as HF tokenizer.json + tokenizer_config.json",
    )
    export.add_argument("output_dir", help="the directory to write (made if missing)")
    export.add_argument(
        "--model",
        default=None,
        help="HF directory or GGUF file (default: bundled SmolLM2-135M-Instruct)",
    )
    export.set_defaults(handler=_export_tokenizer)

    bench = commands.add_parser("bench", help="prompt-processing and generation speed")
    bench.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (0: skip)")
    bench.add_argument("-g", "--n-gen", type=int, default=128, help="generated tokens (0: skip)")
    bench.add_argument("-r", "--repetitions", type=int, default=3)
    bench.add_argument("-c", "--concurrency", default="1", help="comma-separated, e.g. 1,8,32")
    bench.add_argument("--json", default=None, help="also write the rows to this file")
    _engine_arguments(bench)
    bench.set_defaults(handler=_bench)

    args = parser.parse_args(argv)
    try:
        if args.command in ("generate", "serve", "bench"):
            _tensor_parallel_sizes(args)
            from pyllm.distributed.launch import torchrun_rank

            if torchrun_rank():  # torchrun started this process as a rank other than 0
                from pyllm.distributed.worker import run_worker

                return run_worker(args.device, args.distributed_timeout)
        return args.handler(args)
    except (ValueError, TypeError, FileNotFoundError, MemoryError) as error:
        print(f"pyllm: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
