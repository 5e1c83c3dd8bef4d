"""The `pyllm` command's front door: every flag of every subcommand says what it does and
its default, --version prints the version, a chat runs to its end of turn, and bad
values (or a port already taken) are refused, naming the flag, before a model loads."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
import subprocess
import sys
import time

import pytest

from pyllm import __version__, cli
from pyllm.engine.config import EngineConfig
from pyllm.entrypoints.server_config import ServerConfig

# What a refusal may take: the interpreter, the imports and the checks (1.4-1.9 s on 2
# busy cores). The engine's load line must not appear either: the discriminating check.
REFUSAL_S = 6.0
ENGINE_LOADED = "pyllm engine: model="


def _parsers(parser: argparse.ArgumentParser, name: str = "pyllm"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {command}")


def _expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return parser._get_formatter()._expand_help(action)


def test_every_flag_has_help_that_gives_its_default():
    parsers = dict(_parsers(cli.build_parser()))
    assert set(parsers) == {
        "pyllm", "pyllm generate", "pyllm serve", "pyllm bench", "pyllm export-tokenizer"
    }  # fmt: skip
    for name, parser in parsers.items():
        for action in parser._actions:
            where = f"{name} {'/'.join(action.option_strings) or action.dest}"
            if isinstance(action, argparse._SubParsersAction):
                assert all(choice.help for choice in action._choices_actions), where
                continue
            help = _expanded_help(parser, action)
            assert help and help.strip(), f"{where}: no help"
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            if action.option_strings:
                assert "default" in help, f"{where}: no default in {help!r}"
            if action.default not in (None, True, False):
                assert f"default: {action.default}" in help, f"{where}: {help!r}"


@pytest.mark.parametrize("command, config_class", [("serve", EngineConfig),
                                                   ("serve", ServerConfig),
                                                   ("generate", EngineConfig),
                                                   ("bench", EngineConfig)])  # fmt: skip
def test_every_option_of_the_configs_is_a_flag(command, config_class):
    parser = dict(_parsers(cli.build_parser()))[f"pyllm {command}"]
    dests = {action.dest for action in parser._actions}
    assert {f.name for f in dataclasses.fields(config_class)} <= dests


def test_flags_default_to_the_configs_defaults():
    parser = dict(_parsers(cli.build_parser()))["pyllm serve"]
    args = parser.parse_args([])
    for config_class in (EngineConfig, ServerConfig):
        for field in dataclasses.fields(config_class):
            assert getattr(args, field.name) == field.default, field.name


def test_version():
    run = subprocess.run([sys.executable, "-m", "pyllm", "--version"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0 and run.stdout == f"pyllm {__version__}\n"


def test_generate_output_and_status_survive_the_quick_exit(tmp_path):
    """`pyllm generate` skips the interpreter's teardown (cli.run): what it printed and
    logged still reaches the pipes, and its exit status is its own."""
    argv = [sys.executable, "-m", "pyllm", "generate", "--max-tokens", "3", "--kv-cache-memory",
            "0.05", "Hello"]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("Hello") and ENGINE_LOADED in run.stderr
    missing = str(tmp_path / "missing.gguf")
    run = subprocess.run([*argv[:4], "--model", missing, "x"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 2 and "pyllm: error:" in run.stderr, run.stderr[-2000:]


def _refused(argv: list[str], flag: str) -> str:
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "pyllm", *argv], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    elapsed = time.monotonic() - start
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"pyllm: error: argument {flag}" in run.stderr, run.stderr[-2000:]
    assert ENGINE_LOADED not in run.stderr
    assert elapsed < REFUSAL_S, f"{elapsed:.1f} s"
    return run.stderr


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["generate", "--max-tokens", "-1", "x"], "--max-tokens"),
        (["generate", "--temperature", "-1", "x"], "--temperature"),
        (["generate", "--chat", "--top-p", "0", "x"], "--top-p"),
        (["generate", "--max-num-seqs", "0", "x"], "--max-num-seqs"),
        (["serve", "--read-timeout", "0"], "--read-timeout"),
        (["serve", "--kv-cache-memory", "-1"], "--kv-cache-memory"),
        (["serve", "--prefix-cache-dir-size", "-1"], "--prefix-cache-dir-size"),
        (["serve", "--port", "70000"], "--port"),
        (["serve", "--reasoning-parser", "r1"], "--reasoning-parser"),
        (["serve", "--tool-call-parser", "xml"], "--tool-call-parser"),
    ],
)
def test_bad_values_are_refused_before_the_model_loads(argv, flag):
    _refused(argv, flag)


@pytest.mark.parametrize("command", [["generate", "x"], ["serve"], ["bench"]])
def test_kv_cache_dtype_flag_takes_its_choices(command):
    parser = dict(_parsers(cli.build_parser()))[f"pyllm {command[0]}"]
    assert parser.parse_args(["--kv-cache-dtype", "int8", *command[1:]]).kv_cache_dtype == "int8"
    run = subprocess.run([sys.executable, "-m", "pyllm", *command, "--kv-cache-dtype", "fp8"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2
    assert "argument --kv-cache-dtype: invalid choice: 'fp8'" in run.stderr, run.stderr[-2000:]
    assert ENGINE_LOADED not in run.stderr


def test_a_port_in_use_is_refused_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        stderr = _refused(["serve", "--port", str(port)], "--port")
    assert "in use" in stderr


def test_the_checks_run_before_the_engine_is_built(monkeypatch):
    """In process: building the engine fails the test, so a value checked only after
    it would show here."""

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built before the arguments were checked")

    monkeypatch.setattr("pyllm.entrypoints.llm.LLM.__init__", no_engine)
    monkeypatch.setattr("pyllm.engine.llm_engine.LLMEngine.__init__", no_engine)
    assert cli.main(["generate", "--max-tokens", "-1", "x"]) == 2
    assert cli.main(["generate", "--temperature", "-1", "x"]) == 2
    assert cli.main(["serve", "--shutdown-timeout", "-1"]) == 2
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert cli.main(["serve", "--port", str(taken.getsockname()[1])]) == 2


class _FakeLLM:
    seen: list = []

    def __init__(self, **options):
        pass

    def generate(self, prompts, params, use_tqdm=True):
        self.seen.append(("generate", params))
        return [_Output(" done")] * len(prompts)

    def chat(self, conversations, params, use_tqdm=True):
        self.seen.append(("chat", params))
        return [_Output("done")] * len(conversations)

    def close(self):
        self.seen.append(("close", None))


@dataclasses.dataclass
class _Completion:
    text: str


class _Output:
    def __init__(self, text: str):
        self.outputs = [_Completion(text)]


def test_a_chat_runs_to_its_end_of_turn_and_a_completion_to_64_tokens(monkeypatch, capsys):
    monkeypatch.setattr("pyllm.entrypoints.llm.LLM", _FakeLLM)
    _FakeLLM.seen = []
    assert cli.main(["generate", "--chat", "hi"]) == 0
    assert cli.main(["generate", "The sky is"]) == 0
    assert cli.main(["generate", "--chat", "--max-tokens", "5", "hi"]) == 0
    kinds = [(kind, params and params.max_tokens) for kind, params in _FakeLLM.seen]
    assert kinds == [("chat", None), ("close", None), ("generate", 64), ("close", None),
                     ("chat", 5), ("close", None)]  # fmt: skip
    assert capsys.readouterr().out.splitlines() == ["done", "The sky is done", "done"]


def test_the_library_leaves_logging_alone():
    """LLM() configures no logging: the CLI does (pyllm's messages at INFO)."""
    from pyllm import LLM

    logger = logging.getLogger("pyllm")
    before = (logger.level, list(logger.handlers), list(logging.getLogger().handlers))
    LLM(dtype="float32", kv_cache_memory=0.05)
    assert (logger.level, logger.handlers, logging.getLogger().handlers) == before
