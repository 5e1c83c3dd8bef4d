"""Rank 0's model: each call runs this rank's shard and has the other ranks run
theirs. The engine and model runner use it as they use a LlamaForCausalLM."""

from __future__ import annotations

import weakref

import torch

from pyllm.distributed.launch import Ranks, start_ranks
from pyllm.distributed.protocol import (
    ALLOC_ARENA,
    ALLOC_CACHE,
    LOGITS,
    MAIN_CACHE,
    SCRATCH_CACHE,
    Header,
    encode_step,
)
from pyllm.model.shard import check_tensor_parallel


def load_tensor_parallel(config):
    """Checks the split, starts (or joins) the ranks, and loads rank 0's shard."""
    from pyllm.model.loader import load_config, load_model

    size = config.tensor_parallel_size
    check_tensor_parallel(load_config(config.model_path), size, config.expert_parallel)
    ranks = start_ranks(config)
    try:
        with ranks.calls():  # the other ranks load theirs meanwhile
            model, _ = load_model(
                config.model_path, config.torch_dtype, config.torch_device,
                config.max_model_len, quantization=config.quantization, tp=ranks.tp,
            )  # fmt: skip
    except BaseException:
        ranks.close()
        raise
    return TensorParallelModel(model, ranks)


class TensorParallelModel:
    def __init__(self, model, ranks: Ranks) -> None:
        self.model, self.ranks = model, ranks
        self._main_cache: int | None = None  # data_ptr of the engine's first key cache
        self._arena = None
        weakref.finalize(self, ranks.close)

    def __getattr__(self, name: str):
        return getattr(self.model, name)  # config, max_model_len, local_config, ...

    def close(self) -> None:
        self.ranks.close()

    def __call__(self, input_ids, positions, attn_metadata, kv_caches, validate=True):
        if validate:
            self.model.validate_step(input_ids, positions, attn_metadata, kv_caches)
        main = kv_caches[0][0].data_ptr() == self._main_cache
        committed = None
        if attn_metadata.contiguous:
            committed = self._arena.committed_tokens_per_slot
        header, payload = encode_step(
            input_ids, positions, attn_metadata, MAIN_CACHE if main else SCRATCH_CACHE, committed
        )
        with self.ranks.calls():
            self.ranks.send(header, payload)
            return self.model(input_ids, positions, attn_metadata, kv_caches, validate=False)

    def compute_logits(self, hidden, logits_indices=None) -> torch.Tensor:
        rows = -1 if logits_indices is None else logits_indices.shape[0]
        with self.ranks.calls():
            self.ranks.send(Header(LOGITS, a=rows, payload=max(rows, 0)), logits_indices)
            return self.model.compute_logits(hidden, logits_indices)

    def allocate_kv_caches(self, num_blocks: int, block_size: int):
        """The engine's cache first; later calls (prompt logprobs' scratch cache)
        replace the ranks' previous scratch."""
        cache = MAIN_CACHE if self._main_cache is None else SCRATCH_CACHE
        with self.ranks.calls():
            self.ranks.send(Header(ALLOC_CACHE, cache, a=num_blocks, b=block_size))
            caches = self.model.allocate_kv_caches(num_blocks, block_size)
        if cache == MAIN_CACHE:
            self._main_cache = caches[0][0].data_ptr()
        return caches

    def allocate_kv_arena(self, max_num_seqs: int):
        with self.ranks.calls():
            self.ranks.send(Header(ALLOC_ARENA, a=max_num_seqs))
            self._arena = self.model.allocate_kv_arena(max_num_seqs)
        self._main_cache = self._arena.key_cache(0).data_ptr()
        return self._arena
