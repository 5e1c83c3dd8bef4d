"""What the engine reports of itself: the counters it keeps as it steps, and the
snapshot LLMEngine.stats() returns for metrics and the server.

A snapshot is read from the engine's own state, one int or len() at a time (each
atomic under the GIL), so another thread may take one while the engine steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepCounters:
    steps: int = 0
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    # Preemptions are counted once, by the scheduler (Scheduler.num_preemptions).
    # Speculative decoding: drafts verified, their tokens, those accepted, and the
    # tokens the drafted sequences emitted in those steps (accepted + one, less any
    # cut by a stop).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_emitted_tokens: int = 0

    def count_draft(self, proposed: int, accepted: int) -> None:
        self.spec_decode_num_drafts += 1
        self.spec_decode_num_draft_tokens += proposed
        self.spec_decode_num_accepted_tokens += accepted


@dataclass(frozen=True)
class EngineStats:
    # Settings, fixed for the engine's life (named as EngineConfig's resolved fields).
    model_path: str
    torch_dtype: torch.dtype
    torch_device: torch.device
    quantization: str
    kv_cache: str  # the layout: "paged" or "contiguous"
    max_model_len: int
    # State now.
    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences waiting for their first schedule or to be recomputed
    kv_cache_usage: float  # 0 to 1: blocks held (paged) or budget committed (contiguous)
    kv_cache_committed_bytes: int  # physical KV memory held
    num_kv_blocks: int | None  # None where the layout has no blocks
    num_free_kv_blocks: int | None  # free to allocate (unheld cached prefixes count)
    # Totals since the engine started.
    steps: int
    prompt_tokens_computed: int  # run through the model (prefix-cache hits excluded)
    generation_tokens: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens served from it
    # The prefix cache on disk (0 without prefix_cache_dir): tokens read from it (they
    # count as prefix_cache_hits too), blocks written to it, files refused as damaged.
    prefix_cache_disk_hits: int = 0
    prefix_cache_disk_writes: int = 0
    prefix_cache_disk_damaged: int = 0
    # Speculative decoding (all 0 without it): drafts verified, tokens proposed,
    # accepted, and emitted by drafted sequences in those steps.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_emitted_tokens: int = 0
