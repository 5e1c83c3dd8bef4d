"""The engine: owns the model, the KV cache, the scheduler and the sampler, and
advances every request by one step at a time.

    engine.add_request(...)   # validated here: a bad request never reaches a step
    while engine.has_unfinished_requests():
        for output in engine.step(): ...

One step: schedule -> model runner (flat batch -> model -> logits) -> sampler ->
append tokens, detokenize, check stops -> free finished sequences' blocks. An embedding
request (PoolingParams) is a prompt only; it ends in the step that pools its last token.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import pyllm.ops as ops
from pyllm.attention.backend import KVCache
from pyllm.engine.block_store import BlockStore, store_identity
from pyllm.engine.config import ConfigError, EngineConfig
from pyllm.engine.hybrid_block_manager import HybridBlockManager
from pyllm.engine.kv_manager import KVCacheManager, allocate_kv_cache
from pyllm.engine.model_runner import ModelRunner, PooledPart, PromptLogits
from pyllm.engine.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from pyllm.engine.pooling import PoolingParams, embedding
from pyllm.engine.scheduler import Scheduler
from pyllm.engine.sequence import Sequence
from pyllm.engine.spec_decode.draft_loader import Target
from pyllm.engine.spec_decode.speculator import Emitted, Speculator, sample_with_drafts
from pyllm.engine.stats import EngineStats, StepCounters
from pyllm.engine.stop_checker import check_stop, streamable_text
from pyllm.model.loader import estimate_weight_bytes, load_model
from pyllm.model.memory import available_memory_bytes, check_fits
from pyllm.model.tokenizer import Tokenizer
from pyllm.sampling.detokenizer import IncrementalDetokenizer
from pyllm.sampling.logprobs import prompt_logprobs
from pyllm.sampling.params import ParamError, SamplingParams
from pyllm.sampling.sampler import Sampler
from pyllm.sampling.structured import GrammarCompiler, matcher_error

logger = logging.getLogger("pyllm")

# An embedding sequence's sampling parameters: never read, it is never sampled.
_NOT_SAMPLED = SamplingParams(max_tokens=1)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    detokenizers: dict[int, IncrementalDetokenizer]
    waiting_siblings: list[Sequence]  # n > 1: added once the first has its prompt cached
    arrival_time: float
    first_token_time: float | None = None
    pooled: object = None  # embedding: the sum of its chunks' parts so far (a tensor)

    @property
    def finished(self) -> bool:
        return not self.waiting_siblings and all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        start = time.perf_counter()
        ops.set_batch_invariant(config.batch_invariant)  # process-wide: the last engine's
        self._weights_bytes, self._available = _check_memory(config)
        self.model, self.model_config, self.tokenizer = _load(config)
        self.device = config.torch_device
        self.max_model_len = self.model.max_model_len
        self.kv_cache, self.kv_manager = self._allocate_kv_cache()
        self.block_store = self._block_store()
        self.scheduler = Scheduler(
            self.kv_manager,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.long_prefill_token_threshold,
        )
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            config.block_size,
            self.device,
            max_num_batched_tokens=config.max_num_batched_tokens,
            pooling=config.pooling,
            enforce_eager=config.enforce_eager,
        )
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        self.sampler = Sampler(self.model_config.vocab_size, self.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self.requests: dict[str, _Request] = {}
        self._request_of: dict[int, _Request] = {}  # id(sequence) -> its request
        self.counters = StepCounters()
        self.speculator = self._speculator()
        logger.info(
            "pyllm engine: model=%s dtype=%s device=%s %s max_model_len=%d "
            "max_num_batched_tokens=%d max_num_seqs=%d prefix_caching=%s speculative=%s "
            "(loaded in %.1fs)",
            config.model_path,
            str(config.torch_dtype).removeprefix("torch."),
            self.device,
            self.kv_manager.describe(),
            self.max_model_len,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.enable_prefix_caching,
            _describe(self.speculator),
            time.perf_counter() - start,
        )

    # ------------------------------------------------------------------ setup

    def _allocate_kv_cache(self) -> tuple[KVCache, KVCacheManager]:
        """The KV cache in the configured layout (its attention backend's), and the
        manager that hands out its memory: blocks, or one slot per sequence."""
        cfg = self.config
        budget = cfg.kv_cache_budget_bytes(self.device, self._weights_bytes, self._available)
        self._kv_budget = budget // cfg.tensor_parallel_size  # each rank's share
        windowed = not cfg.disable_hybrid_kv_cache_manager
        cache, manager = allocate_kv_cache(
            self.model,
            cfg.kv_cache,
            self._kv_budget,
            cfg.block_size,
            cfg.max_num_seqs,
            cfg.enable_prefix_caching,
            cfg.max_num_batched_tokens if windowed else 0,
        )
        if isinstance(manager, HybridBlockManager) and cfg.prefix_cache_dir is not None:
            raise ConfigError(
                "prefix_cache_dir",
                "stores every layer's KV of a block, but this model's sliding-window layers "
                "keep only their window: set disable_hybrid_kv_cache_manager=True to use it",
            )
        return cache, manager

    def _block_store(self) -> BlockStore | None:
        """The prefix cache on disk, filling the paged cache's prefix cache."""
        cfg = self.config
        if cfg.prefix_cache_dir is None:
            return None
        identity = store_identity(
            cfg.model_path, cfg.torch_dtype, cfg.quantization, self.kv_cache, cfg.block_size
        )
        max_bytes = int(cfg.prefix_cache_dir_size * 2**30)
        try:
            store = BlockStore(cfg.prefix_cache_dir, max_bytes, identity, self.kv_cache)
        except OSError as e:
            raise ConfigError("prefix_cache_dir", f"cannot be written: {e}") from e
        self.kv_manager.disk = store
        return store

    def _speculator(self) -> Speculator | None:
        spec = self.config.speculative
        if spec is None:
            return None
        if spec.method == "draft_model" and self.config.tensor_parallel_size > 1:
            logger.warning("draft-model speculation is off: not supported with tensor parallelism")
            return None
        target = Target(
            self.config,
            self.model_config,
            self.tokenizer,
            self.max_model_len,
            self.model.cache_spec,
            self._kv_budget,
            self._weights_bytes,
            self._available,
        )
        return Speculator(spec, self.max_model_len, target)

    def close(self) -> None:
        """Stops the other tensor-parallel ranks, if any (also done at exit), and writes
        the blocks queued for the prefix cache on disk."""
        if self.block_store is not None:
            self.block_store.close()
        close = getattr(self.model, "close", None)
        if close is not None:
            close()

    # --------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams | PoolingParams,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        group: str | None = None,
    ) -> None:
        """Queues a request; raises ValueError (a ParamError naming the field) if it cannot
        run. priority: lower values are scheduled first (vLLM's meaning); group: the
        client the request belongs to (requests of one group share the engine fairly
        with other groups; default: the request alone). PoolingParams: an embedding
        request, answered by one EmbeddingRequestOutput."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ParamError(f"priority must be an integer, got {priority!r}", "priority")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string (or pass prompt_token_ids)")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = list(prompt_token_ids)
        self.validate(prompt_token_ids, params)
        if isinstance(params, PoolingParams):
            self._add_embedding(request_id, prompt, prompt_token_ids, params, priority, group)
            return
        if params.max_tokens is None:
            params = dataclasses.replace(
                params, max_tokens=self.max_model_len - len(prompt_token_ids)
            )
        seqs = self._sequences(request_id, prompt_token_ids, params, priority, group)
        request = _Request(
            request_id,
            prompt,
            prompt_token_ids,
            seqs,
            {
                id(s): IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, params.skip_special_tokens
                )
                for s in seqs
            },
            waiting_siblings=seqs[1:],
            arrival_time=time.time(),
        )
        self.requests[request_id] = request
        for seq in seqs:
            self._request_of[id(seq)] = request
        self.scheduler.add(seqs[0])

    def _add_embedding(self, request_id, prompt, prompt_token_ids, params, priority, group):
        seq = Sequence(request_id, prompt_token_ids, _NOT_SAMPLED, priority, group or request_id)
        seq.pooling_params = params
        seq.reuse_prefix = self.config.pooling != "mean"  # mean needs every token's state
        request = _Request(request_id, prompt, prompt_token_ids, [seq], {}, [], time.time())
        self.requests[request_id] = request
        self._request_of[id(seq)] = request
        self.scheduler.add(seq)

    def _sequences(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        group: str | None,
    ) -> list[Sequence]:
        """The request's samples (best_of, else n), each its own Sequence."""
        seqs = []
        for i in range(params.num_samples):
            seq_params = params
            if params.seed is not None and i > 0:  # distinct samples, still reproducible
                seq_params = dataclasses.replace(params, seed=params.seed + i)
            name = f"{request_id}-{i}"
            seqs.append(Sequence(name, prompt_token_ids, seq_params, priority, group or request_id))
        if params.structured_output is not None:  # compiled by validate(): cached
            for seq in seqs:
                seq.matcher = self.grammars.matcher(params.structured_output)
        if params.prompt_logprobs is not None:  # the first sequence computes the prompt
            seqs[0].prompt_logprobs = [None] * len(prompt_token_ids)
        return seqs

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams):
        if not isinstance(params, (SamplingParams, PoolingParams)):
            raise TypeError(
                f"params must be SamplingParams or PoolingParams, got {type(params).__name__}"
            )
        if not prompt_token_ids:
            raise ParamError("prompt is empty: at least one token is needed", "prompt")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise ParamError(f"prompt_token_ids must be token ids in [0, {vocab})", "prompt")
        if isinstance(params, PoolingParams):  # the prompt alone: nothing is generated
            params.check(self.model_config.hidden_size)
            self._check_length(len(prompt_token_ids), 0, "")
            return
        self.sampler.check_params(params)
        what = f" + max_tokens ({params.max_tokens})"
        self._check_length(len(prompt_token_ids), params.max_tokens or 1, what)
        if params.structured_output is not None:
            self.grammars.compile(params.structured_output)

    def _check_length(self, num_prompt: int, num_new: int, what: str) -> None:
        """Refuses a prompt and its num_new tokens (`what`) past the context or the cache."""
        budget = num_prompt + num_new
        if budget > self.max_model_len:
            raise ParamError(
                f"prompt ({num_prompt} tokens){what} exceeds the model's context length of "
                f"{self.max_model_len} tokens",
                "prompt",
                code="context_length_exceeded",
            )
        self.kv_manager.check_fits(budget)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        request.waiting_siblings.clear()
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                self._release(seq)
        self._forget(request)

    def _release(self, seq: Sequence) -> None:
        """seq has ended: what the sampler and the speculator keep of it goes."""
        self.sampler.forget(seq.arrival)
        if self.speculator is not None:
            self.speculator.forget(seq)

    def _forget(self, request: _Request) -> None:
        del self.requests[request.request_id]
        for seq in request.seqs:
            self._request_of.pop(id(seq), None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Runs one model step; returns the outputs of requests that progressed."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        logits, sampled, prompt_logits, pooled = self.runner.run(batch)
        _fill_prompt_logprobs(prompt_logits)
        self.counters.steps += 1
        for seq, n in batch.all():
            seq.num_computed_tokens += n
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                self.counters.prompt_tokens_computed += n
        touched: dict[str, _Request] = {}
        if sampled:
            emitted = self._sample(logits, sampled)
            now = time.time()
            for seq, (tokens, logprobs) in zip(sampled, emitted, strict=True):
                request = self._request_of[id(seq)]
                touched[request.request_id] = request
                request.first_token_time = request.first_token_time or now
                self._commit(request, seq, tokens, logprobs)
        embedded = self._pool(pooled)
        for seq, _ in batch.all():
            if not seq.is_finished:
                self.kv_manager.register_computed_blocks(seq)
        return [self._output(r) for r in touched.values()] + embedded

    def _pool(self, parts: list[PooledPart]) -> list[EmbeddingRequestOutput]:
        """Adds each embedding chunk's part to its request's sum; a request whose prompt
        is now computed gets its vector, ends, and frees its KV room."""
        outputs = []
        for seq, start, part in parts:
            request = self._request_of[id(seq)]
            # A prompt computed again from its start (after preemption) sums afresh.
            fresh = start == 0 or request.pooled is None
            request.pooled = part if fresh else request.pooled + part
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                continue
            self.scheduler.finish(seq, "stop")
            self._release(seq)
            self._forget(request)
            params, pooling = seq.pooling_params, self.config.pooling
            vector = embedding(request.pooled, seq.num_prompt_tokens, pooling, params)
            outputs.append(EmbeddingRequestOutput(
                request.request_id, request.prompt, request.prompt_token_ids, vector,
                num_cached_tokens=seq.num_cached_prompt_tokens,
            ))  # fmt: skip
        return outputs

    def _sample(self, logits, sampled: list[Sequence]) -> list[Emitted]:
        """Per sampled sequence, the tokens it emits this step (one unless a draft of
        proposed tokens was verified) and their logprobs."""
        if not any(seq.spec_token_ids for seq in sampled):
            result = self.sampler(logits, [seq.sampling_row() for seq in sampled])
            return [([t], [lp]) for t, lp in zip(result.token_ids, result.logprobs, strict=True)]
        return sample_with_drafts(self.sampler, logits, sampled)

    def _commit(self, request: _Request, seq: Sequence, tokens: list[int], logprobs) -> None:
        """Appends the step's tokens to seq until one ends it. A verified draft's
        rejected tokens are rolled back first: their KV is computed but not kept."""
        drafted = len(seq.spec_token_ids)
        if drafted:
            seq.num_computed_tokens -= drafted - (len(tokens) - 1)
            self.kv_manager.trim(seq)
            seq.spec_token_ids = []
            self.counters.count_draft(drafted, len(tokens) - 1)
        for token, logprob in zip(tokens, logprobs, strict=True):
            self._append_token(request, seq, token, logprob)
            if drafted:
                self.counters.spec_decode_num_emitted_tokens += 1
            if seq.is_finished:
                break

    def _append_token(self, request: _Request, seq: Sequence, token: int, logprob) -> None:
        seq.append_token(token)
        if seq.matcher is not None:
            seq.matcher.consume_token(token)  # allowed by its mask, so it is accepted
        self.counters.generation_tokens += 1
        if logprob is not None:
            seq.cumulative_logprob += logprob[0]
            if seq.sampling_params.logprobs is not None:
                seq.logprobs.append(logprob)
        delta = request.detokenizers[id(seq)].add(token)
        seq.output_text += delta
        check_stop(seq, delta, self.eos_token_ids, self.max_model_len)
        seq.error = matcher_error(seq.matcher)
        if seq.error is not None:  # the grammar went past its limits: not a real stop
            seq.finish_reason, seq.stop_reason = "error", None
        if seq.finish_reason is not None:
            reason = seq.finish_reason
            self.scheduler.finish(seq, reason)
            self._release(seq)
        if request.waiting_siblings and seq is request.seqs[0]:
            # The prompt's full blocks are now cached: siblings reuse them.
            for sibling in request.waiting_siblings:
                self.scheduler.add(sibling)
            request.waiting_siblings = []

    def _output(self, request: _Request) -> RequestOutput:
        finished = request.finished
        outputs = []
        for i, seq in enumerate(_returned_samples(request.seqs, finished)):
            text = streamable_text(seq)
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=seq.output_token_ids,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    error=seq.error,
                    logprobs=list(seq.logprobs)
                    if seq.sampling_params.logprobs is not None
                    else None,
                )
            )
        if finished:
            self._forget(request)
        first = request.seqs[0]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=first.num_cached_prompt_tokens,
            prompt_logprobs=None if first.prompt_logprobs is None else list(first.prompt_logprobs),
            metrics={
                "arrival_time": request.arrival_time,
                "first_token_time": request.first_token_time or 0.0,
            },
        )

    # ------------------------------------------------------------------ stats

    def _disk_stats(self) -> dict[str, int]:
        store = self.block_store
        if store is None:
            return {}
        return dict(
            prefix_cache_disk_hits=store.blocks_read * self.config.block_size,
            prefix_cache_disk_writes=store.blocks_written,
            prefix_cache_disk_damaged=store.blocks_damaged,
        )

    def kv_cache_usage(self) -> float:
        """Paged: share of blocks in use; contiguous: share of the budget committed."""
        return self.kv_manager.usage()

    def kv_cache_committed_bytes(self) -> int:
        """Physical KV memory held now: the whole cache when paged (committed at start),
        what the arena has mapped when contiguous."""
        return self.kv_manager.committed_bytes()

    def stats(self) -> EngineStats:
        """A snapshot of the engine's settings, state and totals (see EngineStats)."""
        cfg, scheduler, kv, counters = self.config, self.scheduler, self.kv_manager, self.counters
        blocks = kv.block_counts()
        return EngineStats(
            model_path=cfg.model_path,
            torch_dtype=cfg.torch_dtype,
            torch_device=cfg.torch_device,
            quantization=cfg.quantization,
            kv_cache=cfg.kv_cache,
            max_model_len=self.max_model_len,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_cache_usage=self.kv_cache_usage(),
            kv_cache_committed_bytes=self.kv_cache_committed_bytes(),
            num_kv_blocks=None if blocks is None else blocks[1],
            num_free_kv_blocks=None if blocks is None else blocks[0],
            steps=counters.steps,
            prompt_tokens_computed=counters.prompt_tokens_computed,
            generation_tokens=counters.generation_tokens,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            **self._disk_stats(),
            spec_decode_num_drafts=counters.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=counters.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=counters.spec_decode_num_accepted_tokens,
            spec_decode_num_emitted_tokens=counters.spec_decode_num_emitted_tokens,
        )


def _describe(speculator: Speculator | None) -> str:
    if speculator is None:
        return "off"
    cfg = speculator.config
    if cfg.method == "draft_model":
        draft = speculator.proposer
        how = f"model={draft.name}, draft {draft.kv_manager.describe()}"
    else:
        how = f"n={cfg.prompt_lookup_min}..{cfg.prompt_lookup_max}"
    return (
        f"{cfg.method}(k={cfg.num_speculative_tokens}, {how}, off above batch "
        f"{cfg.disable_by_batch_size})"
    )


def _fill_prompt_logprobs(prompt_logits: list[PromptLogits]) -> None:
    """Fills seq.prompt_logprobs from the step's prompt logits: the entry at position
    p + 1 comes from the logits at position p."""
    for seq, first, logits in prompt_logits:
        next_ids = seq.prompt_token_ids[first + 1 : first + 1 + logits.shape[0]]
        k = seq.sampling_params.prompt_logprobs
        for offset, entry in enumerate(prompt_logprobs(logits, next_ids, k)):
            seq.prompt_logprobs[first + 1 + offset] = entry


def _returned_samples(seqs: list[Sequence], finished: bool) -> list[Sequence]:
    """The sequences a request's output shows: all of them, or, when best_of draws more
    than n, none until all are done and then the n with the highest logprob per token
    (OpenAI's definition of best; ties keep the order of drawing)."""
    params = seqs[0].sampling_params
    if not params.ranks_samples:
        return seqs
    if not finished:
        return []

    def logprob_per_token(seq: Sequence) -> float:
        return seq.cumulative_logprob / max(1, len(seq.output_token_ids))

    return sorted(seqs, key=logprob_per_token, reverse=True)[: params.n]


def _check_memory(config: EngineConfig) -> tuple[int, int | None]:
    """Refuses (InsufficientMemoryError) a CPU model whose weights and KV cache would not
    fit in the memory available now, before anything is loaded; returns the weights'
    bytes and that memory figure."""
    weights = estimate_weight_bytes(config.model_path, config.torch_dtype, config.quantization)
    if config.torch_device.type != "cpu":
        return weights, None
    available = available_memory_bytes()
    kv = config.kv_cache_budget_bytes(config.torch_device, weights, available)
    held_as = config.quantization if config.quantization not in ("auto", "none") else None
    check_fits(
        weights,
        kv,
        os.path.basename(config.model_path),
        [
            "a quantized GGUF file",
            "quantization='q4_k' (CLI --quantization q4_k) for an HF folder",
            "a smaller max_model_len",
            "a smaller kv_cache_memory",
        ],
        weights_dtype=held_as or str(config.torch_dtype).removeprefix("torch."),
        available=available,
    )
    return weights, available


def _load(config: EngineConfig):
    if config.tensor_parallel_size > 1:
        from pyllm.distributed.driver import load_tensor_parallel

        model = load_tensor_parallel(config)
    else:
        model, _ = load_model(
            config.model_path,
            config.torch_dtype,
            config.torch_device,
            config.max_model_len,
            quantization=config.quantization,
        )
        model.kv_cache_dtype = config.kv_cache_dtype
    tokenizer = Tokenizer.from_pretrained(config.model_path)
    return model, model.config, tokenizer
