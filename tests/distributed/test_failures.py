"""A rank that dies or hangs ends the engine with a clear error in bounded time, and
leaves no process behind; `pyllm serve` then answers 503 and exits non-zero."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pyllm import LLM, SamplingParams
from pyllm.distributed.parallel import WorkerLostError
from tests.distributed.conftest import child_pids, is_gone

LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def _start(model: str, timeout: float = 60.0) -> tuple[LLM, int]:
    llm = LLM(model, dtype="float32", kv_cache_memory=0.02, tensor_parallel_size=2,
              distributed_timeout=timeout)  # fmt: skip
    (worker,) = llm.engine.model.ranks.procs
    for i in range(4):
        llm.engine.add_request(str(i), None, LONG, prompt_token_ids=[5 + i] * 20)
    for _ in range(5):  # mid-generation
        llm.engine.step()
    return llm, worker.pid


def _step_until_error(llm: LLM, within: float) -> WorkerLostError:
    start = time.monotonic()
    with pytest.raises(WorkerLostError) as raised:
        while time.monotonic() - start < within + 30:
            llm.engine.step()
    assert time.monotonic() - start < within
    with pytest.raises(WorkerLostError):  # and it stays failed
        llm.engine.step()
    return raised.value


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_lost_worker_ends_the_engine_with_an_error(tiny_llama, how):
    llm, pid = _start(tiny_llama, timeout=3.0)
    try:
        os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        error = _step_until_error(llm, within=2.0 if how == "killed" else 10.0)
        assert "tensor-parallel engine stopped" in str(error)
        if how == "killed":
            assert "rank 1 exited with code -9" in str(error)
        assert is_gone(pid) and not child_pids()
    finally:
        llm.engine.close()


def test_server_answers_503_and_exits_nonzero_when_a_worker_dies(tiny_llama, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "pyllm", "serve", "--model", tiny_llama, "--port", str(port),
         "--tensor-parallel-size", "2", "--kv-cache-memory", "0.02", "--distributed-timeout",
         "5"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        body = {"model": "tp-llama0", "prompt": "<5> <6>", "max_tokens": 4}
        body["model"] = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        (worker,) = child_pids(server.pid)
        os.kill(worker, signal.SIGKILL)
        try:
            response = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "engine_failed", error
            # What a user needs; gloo's source paths and the group's port stay in the log.
            assert "a rank was lost" in error["message"] and "server log" in error["message"]
            assert not any(s in error["message"] for s in (".cc", "gloo", "127.0.0.1")), error
        except httpx.TransportError:
            pass  # already gone: the server stops as soon as the engine has failed
        assert server.wait(30) == 1
        assert is_gone(worker)
        text = (tmp_path / "server.log").read_text()
        assert "tensor-parallel engine stopped" in text and "Traceback" not in text
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
