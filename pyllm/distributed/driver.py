"""Rank 0's model: each call runs this rank's shard and has the other ranks run
theirs. The engine and model runner use it as they use a LlamaForCausalLM."""

from __future__ import annotations

import weakref

import torch

from pyllm.attention.backend import MAIN_CACHE, AttentionBackend, KVCache
from pyllm.attention.registry import backend_number
from pyllm.distributed.launch import Ranks, start_ranks
from pyllm.distributed.protocol import ALLOC_CACHE, LOGITS, Header, encode_step
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
    model.kv_cache_dtype = config.kv_cache_dtype
    return TensorParallelModel(model, ranks)


class TensorParallelModel:
    def __init__(self, model, ranks: Ranks) -> None:
        self.model, self.ranks = model, ranks
        weakref.finalize(self, ranks.close)

    def __getattr__(self, name: str):
        return getattr(self.model, name)  # config, max_model_len, cache_spec, ...

    def close(self) -> None:
        self.ranks.close()

    def __call__(self, input_ids, positions, attn_metadata, kv_cache: KVCache, validate=True):
        """A step over kv_cache; the other ranks run it over their cache of the same id."""
        if validate:
            self.model.validate_step(input_ids, positions, attn_metadata, kv_cache)
        header, payload = encode_step(input_ids, positions, attn_metadata, kv_cache)
        with self.ranks.calls():
            self.ranks.send(header, payload)
            return self.model(input_ids, positions, attn_metadata, kv_cache, validate=False)

    def compute_logits(self, hidden, logits_indices=None) -> torch.Tensor:
        rows = -1 if logits_indices is None else logits_indices.shape[0]
        with self.ranks.calls():
            self.ranks.send(Header(LOGITS, a=rows, payload=max(rows, 0)), logits_indices)
            return self.model.compute_logits(hidden, logits_indices)

    def allocate_kv_cache(
        self, backend: AttentionBackend, count: int, block_size: int = 16,
        cache_id: int = MAIN_CACHE, grouped: bool = False,
    ) -> KVCache:  # fmt: skip
        """Every rank allocates its cache of this id; one allocated before under the same
        id (the prompt-logprobs scratch) is replaced."""
        number = backend_number(backend)
        header = Header(
            ALLOC_CACHE, cache_id, backend=number, a=count, b=block_size, c=int(grouped)
        )
        with self.ranks.calls():
            self.ranks.send(header)
            return self.model.allocate_kv_cache(backend, count, block_size, cache_id, grouped)
