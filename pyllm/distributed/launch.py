"""Starting the ranks of a tensor-parallel engine, or joining the group torchrun made.

Alone, rank 0 (the process that builds the engine) starts the other ranks on this
machine as fresh interpreters (`python -m pyllm.distributed.worker`) with the same
environment torchrun gives its processes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
so one worker entry point serves both. A fresh interpreter rather than a forked or
spawned copy of the caller: forking a process with threads is unsafe, and spawn
re-imports the caller's main script. Under torchrun (several machines), rank 0 is the
driver and every other rank runs `run_worker` (pyllm's CLI does that by itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pyllm.distributed.parallel import TensorParallelGroup, WorkerLostError
from pyllm.distributed.protocol import STOP, Header
from pyllm.model.shard import Shard

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_REAP_WAIT_S = 0.5  # how long a failure waits to see which rank exited


def under_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_VARS)


def torchrun_rank() -> int:
    return int(os.environ["RANK"]) if under_torchrun() else 0


def init_group(
    rank: int, size: int, init_method: str, timeout_s: float, device: torch.device
) -> TensorParallelGroup:
    """Joins the process group (gloo on the CPU, NCCL on CUDA). Every collective,
    and the wait for the first one, fails after timeout_s."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout
    )
    # Step headers go over gloo (CPU tensors); on the CPU that is the group itself.
    control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
    return TensorParallelGroup(Shard(rank, size), dist.group.WORLD, control, device)


def threads_per_rank(ranks_here: int) -> int:
    """The CPU's cores shared by the ranks on this machine (OMP_NUM_THREADS wins)."""
    if "OMP_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // ranks_here)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """Rank 0's side of the group: sends the other ranks each call (header, payload),
    keeps them alive while idle, and ends them. Any failure while the ranks work
    together leaves them out of step, so it ends the engine: WorkerLostError."""

    def __init__(
        self, tp: TensorParallelGroup, procs: list[subprocess.Popen], timeout_s: float,
        caller_threads: int,
    ) -> None:  # fmt: skip
        self.tp, self.procs, self.timeout_s = tp, procs, timeout_s
        self.caller_threads = caller_threads  # torch's thread count, given back by close()
        self.lock = threading.Lock()
        self.dead: str | None = None
        self._last = time.monotonic()
        self._closed = threading.Event()
        threading.Thread(target=self._keep_alive, name="pyllm-tp-ping", daemon=True).start()

    def send(self, header: Header, payload: torch.Tensor | None = None) -> None:
        """Call inside `calls()`."""
        dist.broadcast(header.tensor(), 0, group=self.tp.control)
        if payload is not None and payload.numel():
            dist.broadcast(payload.contiguous(), 0, group=self.tp.group)

    @contextlib.contextmanager
    def calls(self):
        """One call the ranks make together (sends and collectives)."""
        with self.lock:
            if self.dead:
                raise WorkerLostError(self.dead)
            try:
                yield
            except Exception as error:
                self.dead = self._describe(error)
                self.kill()
                raise WorkerLostError(self.dead) from None
            finally:
                self._last = time.monotonic()

    def _describe(self, error: Exception) -> str:
        # A killed rank's sockets close a moment before its process can be reaped.
        deadline = time.monotonic() + _REAP_WAIT_S
        while all(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        exits = [(i + 1, p.poll()) for i, p in enumerate(self.procs) if p.poll() is not None]
        what = ", ".join(f"rank {r} exited with code {code}" for r, code in exits)
        first = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
        return (
            f"tensor-parallel engine stopped: {what or 'a rank failed or timed out'} "
            f"({first}); the engine cannot continue"
        )

    def _keep_alive(self) -> None:
        """A worker waits for the next call no longer than the group's timeout: while
        the engine is idle, rank 0 sends an empty call every quarter of it."""
        period = self.timeout_s / 4
        while not self._closed.wait(period / 4):
            if time.monotonic() - self._last < period or self.dead:
                continue
            with contextlib.suppress(WorkerLostError), self.calls():
                self.send(Header(0))

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)

    def close(self) -> None:
        """Stops every rank (they exit 0) and leaves the process group."""
        if self._closed.is_set():
            return
        self._closed.set()
        if not self.dead:
            with contextlib.suppress(WorkerLostError), self.calls():
                self.send(Header(STOP))
        deadline = time.monotonic() + 10
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        self.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self.caller_threads)


def start_ranks(config) -> Ranks:
    """Rank 0: the group of config.tensor_parallel_size ranks, the others started here
    (or, under torchrun, already started), each sent the engine options."""
    size, timeout = config.tensor_parallel_size, config.distributed_timeout
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group already exists in this process; pyllm makes "
            "its own (one tensor-parallel engine per process)"
        )
    device, threads_before = config.torch_device, torch.get_num_threads()
    if under_torchrun():
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != size:
            raise ValueError(
                f"tensor_parallel_size is {size} but torchrun started {world} processes"
            )
        if rank != 0:
            raise RuntimeError(f"rank {rank} runs the worker loop (pyllm.distributed.run_worker)")
        torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        tp, procs = init_group(0, size, "env://", timeout, device), []
    else:
        port, threads = _free_port(), threads_per_rank(size)
        torch.set_num_threads(threads)
        procs = [_start_worker(rank, size, port, threads, config) for rank in range(1, size)]
        try:
            tp = init_group(0, size, f"tcp://127.0.0.1:{port}", timeout, device)
        except BaseException:
            for p in procs:
                p.kill()
            raise
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    options["model"] = config.model_path
    tp.split_experts(config.expert_parallel)
    ranks = Ranks(tp, procs, timeout, threads_before)
    with ranks.calls():
        dist.broadcast_object_list([options], src=0, group=tp.control)
    return ranks


def _start_worker(rank: int, size: int, port: int, threads: int, config) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads),
        PYLLM_PARENT_PID=str(os.getpid()),
    )  # fmt: skip
    command = [sys.executable, "-m", "pyllm.distributed.worker", "--device", str(config.device),
               "--distributed-timeout", str(config.distributed_timeout)]  # fmt: skip
    return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)
