"""A real `python -m pyllm serve` process on 127.0.0.1, shared by the server tests.

The server runs the bundled model widened to float32 (so a greedy output must not depend
on what else is in the batch) with an API key, so every /v1/ test also exercises authentication.
Its log is written to a file and shown if it fails to start.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[2]
QWEN3_TEMPLATE = REPO_ROOT / "tests" / "tokenizer" / "data" / "qwen3_chat_template.jinja"
API_KEY = "test-key-7f3a"
STARTUP_TIMEOUT_S = 300
# Small enough to be light on a shared machine, large enough for 32 concurrent streams.
# Widened weights: quantized ones take int8 products below 32 rows and float panels from
# 32 (ops.quant_linear), so their logits depend on how many tokens share a step.
SERVER_ARGS = [
    "--dtype", "float32",
    "--quantization", "none",
    "--kv-cache-memory", "0.25",
    "--max-model-len", "2048",
]  # fmt: skip


@dataclass
class Server:
    base_url: str
    api_key: str | None
    model: str
    max_model_len: int
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_healthy(process: subprocess.Popen, base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"server exited with {process.returncode} at start-up:\n{log}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()}")


def start_server(
    log_dir: Path, extra_args: list[str] = (), api_key: str | None = API_KEY
) -> Server:
    """A `pyllm serve` process with SERVER_ARGS (+ extra_args), healthy; stop it with
    stop_server. `api_key` None: a server without one."""
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = log_dir / "server.log"
    command = [sys.executable, "-m", "pyllm", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += [*(["--api-key", api_key] if api_key else []), *SERVER_ARGS, *extra_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYLLM_API_KEY", None)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        _wait_until_healthy(process, base_url, log_path)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        card = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=10).json()["data"][0]
    except BaseException:
        stop_server(process)
        raise
    return Server(base_url, api_key, card["id"], card["max_model_len"], process, log_path)


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    started = start_server(tmp_path_factory.mktemp("server"))
    try:
        yield started
    finally:
        stop_server(started.process)


@pytest.fixture
def http(server: Server):
    """An httpx client with the API key; checks the server is still alive afterwards."""
    headers = {"Authorization": f"Bearer {server.api_key}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=120) as client:
        yield client
    assert server.process.poll() is None, f"the server died:\n{server.log_tail()}"


@pytest.fixture
def client(server: Server):
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=120
    ) as c:
        yield c
    assert server.process.poll() is None, f"the server died:\n{server.log_tail()}"


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3 model folder with SmolLM2's vocabulary (whose <|im_start|> and
    <|im_end|> are Qwen's too) and Qwen3's chat template."""
    from tests.model.conftest import make_hf_model
    from tests.tokenizer import hf_smollm

    path = tmp_path_factory.mktemp("qwen3")
    vocabulary = hf_smollm()
    make_hf_model(
        "qwen3", path, vocab_size=len(vocabulary), max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    vocabulary.backend_tokenizer.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": QWEN3_TEMPLATE.read_text()}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def hf_tokenizer():
    """The model's tokenizer as HF transformers builds it from the GGUF: an independent
    reference for token counts."""
    import transformers

    from pyllm.model.default_model import default_model_path

    path = Path(default_model_path())
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def read_metrics(base_url: str) -> dict[str, float]:
    """Every sample of /metrics by name (labels dropped: one model per server)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels.keys() - {"model_name"}:
                samples[sample.name] = sample.value
    return samples


def wait_for(predicate, timeout: float, interval: float = 0.1):
    """Polls predicate() until it returns something truthy; returns it (or the last value)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
