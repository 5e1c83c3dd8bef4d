"""A rank other than 0: loads its shard, then runs each call rank 0 sends until STOP.

Started by rank 0 (`python -m pyllm.distributed.worker`) or by torchrun through
pyllm's CLI; the process group comes from torchrun's environment variables.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys

import torch
import torch.distributed as dist

import pyllm.ops as ops
from pyllm.attention.backend import MAIN_CACHE, SCRATCH_CACHE, KVCache
from pyllm.attention.registry import backend_of_number
from pyllm.distributed.launch import init_group, threads_per_rank
from pyllm.distributed.protocol import (
    ALLOC_CACHE,
    FORWARD,
    HEADER_SIZE,
    LOGITS,
    STOP,
    Header,
    decode_step,
)
from pyllm.engine.config import EngineConfig


class Worker:
    def __init__(self, model, tp) -> None:
        self.model, self.tp = model, tp
        self.caches: dict[int, KVCache] = {}  # by cache id, as rank 0 names them
        self.hidden: torch.Tensor | None = None

    def run(self) -> None:
        header = torch.empty(HEADER_SIZE, dtype=torch.int64)
        while True:
            dist.broadcast(header, 0, group=self.tp.control)
            h = Header.of(header)
            if h.command == STOP:
                return
            payload = None
            if h.payload:
                payload = torch.empty(h.payload, dtype=torch.int64, device=self.tp.device)
                dist.broadcast(payload, 0, group=self.tp.group)
            self.handle(h, payload)

    @torch.inference_mode()
    def handle(self, h: Header, payload: torch.Tensor | None) -> None:
        if h.command == FORWARD:
            if h.cache == MAIN_CACHE:  # the engine's own steps: a scratch cache is done
                self.caches.pop(SCRATCH_CACHE, None)
            cache = self.caches[h.cache]
            input_ids, positions, meta = decode_step(h, payload, cache)
            self.hidden = self.model(input_ids, positions, meta, cache, False)
        elif h.command == LOGITS:
            self.model.compute_logits(self.hidden, payload if h.a >= 0 else None)
        elif h.command == ALLOC_CACHE:
            backend = backend_of_number(h.backend)
            grouped = bool(h.c)
            self.caches[h.cache] = self.model.allocate_kv_cache(backend, h.a, h.b, h.cache, grouped)


def _die_with_parent() -> None:
    """A worker rank 0 started ends when rank 0 does, however rank 0 ends."""
    parent = os.environ.get("PYLLM_PARENT_PID")
    if not parent or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):
        os._exit(1)  # rank 0 ended before the line above


def run_worker(
    device: str = EngineConfig.device, distributed_timeout: float = EngineConfig.distributed_timeout
) -> int:
    """Joins the group of the environment (torchrun's variables), receives the engine
    options from rank 0, loads this rank's shard and serves rank 0's calls."""
    from pyllm.engine.config import _resolve_device
    from pyllm.model.loader import load_model

    _die_with_parent()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "LOCAL_WORLD_SIZE" in os.environ:  # threads_per_rank leaves OMP_NUM_THREADS's choice
        torch.set_num_threads(threads_per_rank(int(os.environ["LOCAL_WORLD_SIZE"])))
    tp = init_group(rank, size, "env://", distributed_timeout, _resolve_device(device))
    box = [None]
    dist.broadcast_object_list(box, src=0, group=tp.control)
    config = EngineConfig(**box[0])
    ops.set_batch_invariant(config.batch_invariant)
    tp.split_experts(config.expert_parallel)
    model, _ = load_model(
        config.model_path, config.torch_dtype, config.torch_device, config.max_model_len,
        quantization=config.quantization, tp=tp,
    )  # fmt: skip
    model.kv_cache_dtype = config.kv_cache_dtype
    try:
        Worker(model, tp).run()
    except Exception as error:  # rank 0 ended or failed: nothing to serve any more
        print(f"pyllm worker rank {rank}: stopping: {str(error).splitlines()[0]}", file=sys.stderr)
        return 1
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pyllm.distributed.worker")
    parser.add_argument("--device", default=EngineConfig.device)
    parser.add_argument(
        "--distributed-timeout", type=float, default=EngineConfig.distributed_timeout
    )
    args = parser.parse_args(argv)
    return run_worker(args.device, args.distributed_timeout)


if __name__ == "__main__":
    sys.exit(main())
