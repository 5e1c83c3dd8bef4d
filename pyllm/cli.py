"""The `pyllm` command: `pyllm generate PROMPT...`, `pyllm serve`, `pyllm bench`,
`pyllm export-tokenizer DIR`, `pyllm --version`.

The engine's flags are made from EngineConfig's fields and serve's own from
ServerConfig's (pyllm.entrypoints.arg_utils). Every value is checked before a model
loads: a bad one, or a port already taken, is reported at once, naming its flag."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import sys

from pyllm import __version__
from pyllm.engine.config import EngineConfig
from pyllm.entrypoints.arg_utils import add_config_arguments, config_from_args, option_help
from pyllm.entrypoints.server_config import ServerConfig

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
COMPLETION_MAX_TOKENS = 64  # generate's default for a completion; a chat runs to its end


def _positive_ints(value: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]."""
    try:
        numbers = [int(item) for item in value.split(",")]
    except ValueError:
        numbers = []
    if not numbers or any(n < 1 for n in numbers):
        raise argparse.ArgumentTypeError(f"must be positive integers, comma-separated: {value!r}")
    return numbers


def _positive_int(value: str) -> int:
    (number,) = _positive_ints(value)
    return number


def _engine_arguments(parser: argparse.ArgumentParser, bench: bool = False) -> None:
    # bench: a list of sizes, each measured in turn
    tp_list = dict(
        type=_positive_ints,
        default="1",
        help="comma-separated processes to split the model over, each run in turn, e.g. 1,2 "
        "(default: %(default)s)",
    )
    overrides = {"tensor_parallel_size": tp_list} if bench else None
    add_config_arguments(parser.add_argument_group("engine"), EngineConfig, overrides)


def _engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The engine's options from the flags, checked: a bad value fails before a model
    loads."""
    return config_from_args(EngineConfig, args, **overrides)


# ------------------------------------------------------------------ generate


def _add_generate(commands) -> None:
    generate = commands.add_parser(
        "generate", help="complete one or more prompts", description="Complete prompts."
    )
    generate.add_argument("prompts", nargs="+", help="the prompts, each completed in turn")
    generate.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"most tokens to generate (default: {COMPLETION_MAX_TOKENS}; with --chat, until "
        "the reply ends, bounded by the context)",
    )
    generate.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)"
    )
    generate.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)"
    )
    generate.add_argument(
        "--top-k", type=int, default=-1, help="sample among the k likeliest tokens; -1: all "
        "(default: %(default)s)",
    )  # fmt: skip
    generate.add_argument(
        "--seed", type=int, default=None, help="seed of the draws (default: none, each run differs)"
    )
    generate.add_argument(
        "--chat", action="store_true", help="wrap each prompt in the chat template (default: off)"
    )
    _engine_arguments(generate)
    generate.set_defaults(handler=_generate, parser=generate)


def _generate(args: argparse.Namespace) -> int:
    from pyllm.sampling.params import SamplingParams

    max_tokens = args.max_tokens
    if max_tokens is None and not args.chat:
        max_tokens = COMPLETION_MAX_TOKENS
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    config = _engine_config(args)
    _configure_logging("info")
    from pyllm.entrypoints.llm import LLM

    # The imports' ~170,000 objects live as long as the process: later full garbage
    # collections skip them (one over them took 0.08 s of a load).
    gc.freeze()
    llm = LLM(**dataclasses.asdict(config))
    try:
        if args.chat:
            conversations = [[{"role": "user", "content": p}] for p in args.prompts]
            outputs = llm.chat(conversations, params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompts, params, use_tqdm=False)
    finally:
        llm.close()  # run() skips the exit handlers that would do it
    for prompt, output in zip(args.prompts, outputs, strict=True):
        text = output.outputs[0].text
        print(text if args.chat else prompt + text, flush=True)
        if len(args.prompts) > 1:
            print("-" * 40)
    return 0


# --------------------------------------------------------------------- serve


def _add_serve(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        description="Serve an OpenAI-compatible HTTP API and a chat page.",
    )
    add_config_arguments(serve.add_argument_group("server"), ServerConfig)
    _engine_arguments(serve)
    serve.set_defaults(handler=_serve, parser=serve)


def _serve(args: argparse.Namespace) -> int:
    config = config_from_args(ServerConfig, args)
    engine_config = _engine_config(args)
    _configure_logging(config.log_level, everything=True)
    from pyllm.entrypoints import server

    return server.run_server(engine_config, config)


# --------------------------------------------------------------------- bench


def _add_bench(commands) -> None:
    bench = commands.add_parser(
        "bench",
        help="prompt-processing and generation speed",
        description="Prompt-processing (pp) and generation (tg) speed, per concurrency.",
    )
    skip = "; 0: skip (default: %(default)s)"
    bench.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens" + skip)
    bench.add_argument("-g", "--n-gen", type=int, default=128, help="generated tokens" + skip)
    bench.add_argument(
        "-r", "--repetitions", type=_positive_int, default=3,
        help="runs of each test, averaged (default: %(default)s)",
    )  # fmt: skip
    bench.add_argument(
        "-c", "--concurrency", type=_positive_ints, default="1",
        help="sequences at once, comma-separated, e.g. 1,8,32 (default: %(default)s)",
    )  # fmt: skip
    bench.add_argument(
        "--json", default=None, help="also write the rows to this file (default: none)"
    )
    _engine_arguments(bench, bench=True)
    bench.set_defaults(handler=_bench, parser=bench)


def _bench(args: argparse.Namespace) -> int:
    import platform

    import torch

    from pyllm.benchmark import format_table, rows_to_json, run_bench
    from pyllm.engine.llm_engine import LLMEngine

    most = max(args.concurrency)
    configs = [
        _engine_config(
            args,
            tensor_parallel_size=size,
            # Every prompt is fresh: measure compute, unless a prefix cache on disk is asked for.
            enable_prefix_caching=None if args.prefix_cache_dir else False,
            max_num_seqs=max(args.max_num_seqs, most),
        )
        for size in args.tensor_parallel_size
    ]
    print(f"$ pyllm bench {' '.join(sys.argv[2:])}")
    rows = []
    for config in configs:
        engine = LLMEngine(config)
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} cpus, tp "
            f"{config.tensor_parallel_size}, torch threads per rank {torch.get_num_threads()}",
            flush=True,
        )
        try:
            rows += run_bench(engine, args.n_prompt, args.n_gen, args.repetitions, args.concurrency)
        finally:
            engine.close()
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            f.write(rows_to_json(rows))
    return 0


# ---------------------------------------------------------- export-tokenizer


def _add_export_tokenizer(commands) -> None:
    export = commands.add_parser(
        "export-tokenizer",
        help="write the model's tokenizer as HF tokenizer.json + tokenizer_config.json",
        description="Write the model's tokenizer as HF tokenizer.json + tokenizer_config.json.",
    )
    export.add_argument("output_dir", help="the directory to write (made if missing)")
    export.add_argument("--model", default=None, help=option_help(EngineConfig, "model"))
    export.set_defaults(handler=_export_tokenizer, parser=export)


def _export_tokenizer(args: argparse.Namespace) -> int:
    from pyllm.model.default_model import default_model_path
    from pyllm.model.tokenizer import Tokenizer
    from pyllm.model.tokenizer.export import export_hf_tokenizer

    tokenizer = Tokenizer.from_pretrained(args.model or default_model_path())
    for path in export_hf_tokenizer(tokenizer, args.output_dir):
        print(path)
    return 0


# ---------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pyllm", description="A fast, small LLM inference engine."
    )
    parser.add_argument(
        "--version", action="version", version=f"pyllm {__version__}", help="print the version"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(commands)
    _add_serve(commands)
    _add_bench(commands)
    _add_export_tokenizer(commands)
    return parser


def _configure_logging(level: str, everything: bool = False) -> None:
    """pyllm's messages (`everything`: every library's) at `level` and above, on stderr."""
    if everything:
        logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    else:
        logging.basicConfig(format=LOG_FORMAT)
        logging.getLogger("pyllm").setLevel(level.upper())


def _flag_error(args: argparse.Namespace, error: Exception) -> str:
    """The error, naming the flag of the option (a ConfigError's) or sampling parameter
    (a ParamError's) it is about, if it names one."""
    name = getattr(error, "option", None) or getattr(error, "param", None)
    flags = {a.dest: a.option_strings for a in args.parser._actions if a.option_strings}
    if name in flags:
        return f"argument {'/'.join(flags[name])}: {error}"
    return str(error)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("generate", "serve", "bench"):
            from pyllm.distributed.launch import torchrun_rank

            if torchrun_rank():  # torchrun started this process as a rank other than 0
                from pyllm.distributed.worker import run_worker

                return run_worker(args.device, args.distributed_timeout)
        return args.handler(args)
    except (ValueError, TypeError, FileNotFoundError, MemoryError) as error:
        print(f"pyllm: error: {_flag_error(args, error)}", file=sys.stderr)
        return 2


def run() -> None:
    """The `pyllm` command: main, then the exit. After `generate` (its engine closed, its
    output printed) the interpreter's own teardown is skipped: a garbage collection over
    torch's objects and the modules' clean-up, ~0.35 s of a ~1.8 s run on 2 cores."""
    status = main()
    if sys.argv[1:2] == ["generate"]:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    run()
