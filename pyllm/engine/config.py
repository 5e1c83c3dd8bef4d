"""EngineConfig: every engine option in one place, validated once.

Each field is an `option`: its default, and the help text (and, where the command line
takes it otherwise than `--field-name VALUE`, how) from which `pyllm`'s flags are built
(pyllm.entrypoints.arg_utils). The engine's parts read their settings from here."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyllm.attention.registry import BACKENDS
from pyllm.engine.spec_decode.config import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    parse_speculative_config,
)

if TYPE_CHECKING:
    import torch

DEFAULT_CPU_KV_CACHE_GIB = 2.0
DEFAULT_PREFIX_CACHE_DIR_GIB = 4.0
KV_CACHE_MODES = tuple(BACKENDS)  # the KV layouts: one attention backend each
KV_CACHE_DTYPES = ("auto", "int8")  # as pyllm.kv_cache.KV_CACHE_DTYPES
# "auto": a GGUF file's quantized weights stay quantized, an HF folder's stay float;
# "none": every weight widened to dtype; a GGML type: an HF folder quantized at load.
QUANTIZATION_MODES = ("auto", "none", "q8_0", "q4_0", "q4_k", "mxfp4")
POOLING_TYPES = ("last", "mean")  # embeddings: pyllm.engine.pooling


def option(default: Any, help: str, **cli: Any) -> Any:
    """A config field: its default, its help text, and for the command line any of
    `flag` (instead of --field-name), `short`, `choices`, `type` (the parser of its
    value), `const` (a flag that stores this), `env` (where an unset value is read)."""
    return field(default=default, metadata={"help": help, **cli})


class ConfigError(ValueError):
    """A bad option value; `option` names the field, so the CLI can name its flag."""

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"{option} {problem}")
        self.option = option


def check_number(
    config: Any, name: str, low: float, *, above=False, integer=False, optional=False
) -> None:
    """Raises ConfigError unless config.<name> is a number >= low (> low if `above`),
    an integer if `integer`; or None if `optional` (an option left unset)."""
    value = getattr(config, name)
    if value is None and optional:
        return
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not _at_least(value, low, above):
        raise ConfigError(name, f"must be {_bound(low, above, integer)}, got {value!r}")


def _at_least(value: float, low: float, above: bool) -> bool:
    return value > low if above else value >= low  # False for nan


def _bound(low: float, above: bool, integer: bool) -> str:
    if integer and low == 1 and not above:
        return "a positive integer"
    if not integer and low == 0 and above:
        return "a positive number"
    return f"{'an integer' if integer else 'a number'} {'>' if above else '>='} {low:g}"


@dataclass
class EngineConfig:
    model: str | None = option(
        None, "HF directory or GGUF file (default: bundled SmolLM2-135M-Instruct)"
    )
    dtype: str = option(
        "auto",
        "auto, float32, bfloat16 or float16 (auto: bfloat16 on CUDA and on CPUs with native "
        "bf16, else float32)",
    )
    device: str = option("auto", "auto, cpu or cuda (auto: cuda when available and built)")
    block_size: int = option(16, "tokens per KV cache block")
    max_num_batched_tokens: int = option(
        512, "most tokens one engine step runs: decodes and prompt chunks together"
    )
    max_num_seqs: int = option(256, "most sequences running at once")
    long_prefill_token_threshold: int | None = option(
        None,
        "most tokens of one prompt per step while other prompts wait "
        "(default: a quarter of --max-num-batched-tokens)",
    )
    max_model_len: int | None = option(None, "context length in tokens (default: the model's own)")
    kv_cache_memory: float | None = option(
        None,
        f"GiB for the KV cache, all ranks together (default: on CPU at most "
        f"{DEFAULT_CPU_KV_CACHE_GIB:g}, less when memory is short; on a GPU "
        "--gpu-memory-utilization of its free memory)",
    )
    gpu_memory_utilization: float = option(0.9, "share of free GPU memory for the KV cache")
    enable_prefix_caching: bool | None = option(
        None,
        "turn prefix caching off (default: on with --kv-cache paged, off with contiguous)",
        flag="--no-prefix-caching",
        const=False,
    )
    prefix_cache_dir: str | None = option(
        None,
        "folder where full KV blocks of prompts are kept, so that a later engine (or "
        "process) reads a prompt's prefix back instead of recomputing it (paged KV cache, "
        "one process; docs/prefix-cache.md; default: none)",
    )
    prefix_cache_dir_size: float = option(
        DEFAULT_PREFIX_CACHE_DIR_GIB,
        "GiB that --prefix-cache-dir may hold; past it the least recently used blocks are deleted",
    )
    kv_cache: str = option(
        "paged",
        "paged: KV blocks + block tables (vLLM's PagedAttention); contiguous: one virtual "
        "range per sequence slot, memory mapped as it grows (dAttention)",
        choices=KV_CACHE_MODES,
    )
    disable_hybrid_kv_cache_manager: bool = option(
        False,
        "keep every token's KV in sliding-window layers too, one block pool for all layers "
        "(default: with kv_cache paged, a model's window layers hold only their window, in "
        "a pool of their own beside global layers; docs/sliding-window-kv.md)",
    )
    kv_cache_dtype: str = option(
        "auto",
        "auto: the KV cache in --dtype; int8: symmetric int8 with a float16 scale per token "
        "and kv head (about half of bfloat16's bytes, a quarter of float32's)",
        choices=KV_CACHE_DTYPES,
    )
    quantization: str | None = option(
        "auto",
        "auto (a GGUF file's quantized weights stay quantized), none (widen every weight "
        "to --dtype), or q8_0, q4_0, q4_k, mxfp4 (quantize an HF folder's weights at load)",
    )
    tensor_parallel_size: int = option(
        1,
        "processes to split the model over (pyllm.distributed); under torchrun, the "
        "number of processes it starts",
        short="-tp",
    )
    expert_parallel: bool = option(
        False,
        "mixture-of-experts models over several processes: each holds whole experts "
        "instead of a share of every expert (default: off)",
    )
    batch_invariant: bool = option(
        os.environ.get("PYLLM_BATCH_INVARIANT", "0") == "1",
        "quantized weights take the same int8 products at every batch size, so a prompt's "
        "greedy output never depends on batching, chunking or prefix-cache hits (slower "
        "prefill in bfloat16; default: $PYLLM_BATCH_INVARIANT=1, else off)",
    )
    enforce_eager: bool = option(
        False,
        "run every step op by op: no decode steps replayed from recorded kernel calls "
        "(CPU; default: off)",
    )
    distributed_timeout: float = option(
        60.0, "seconds a tensor-parallel rank may take to answer before the engine fails"
    )
    pooling: str = option(
        "last",
        "how an embedding request's final hidden states become one vector (LLM.embed, "
        "/v1/embeddings): last (the last prompt token's, as Qwen3-Embedding) or mean (over "
        "the prompt's tokens)",
        choices=POOLING_TYPES,
    )
    speculative_config: dict | None = option(
        None,
        "speculative decoding, as vLLM's dict (JSON on the command line), e.g. "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        f'"prompt_lookup_min": 2}}, or a draft model\'s {{"model": PATH, '
        f'"num_speculative_tokens": 4}}; "disable_by_batch_size": no proposals in a step '
        f"running more sequences (default: {DEFAULT_DISABLE_BY_BATCH_SIZE})",
        type=str,
    )

    def __post_init__(self) -> None:
        from pyllm.model.default_model import default_model_path
        from pyllm.model.dtype import resolve_dtype

        self._check_sizes()  # first: no import needed
        if self.model is None:
            self.model = default_model_path()
        self.model_path = str(self.model)
        self.torch_device = _resolve_device(self.device)
        self.torch_dtype = resolve_dtype(self.dtype, self.torch_device)
        self._check_modes()
        self._check_prefix_cache_dir()
        # The checked form the engine reads (None: no speculation).
        self.speculative = parse_speculative_config(self.speculative_config)

    def _check_modes(self) -> None:
        """quantization, kv_cache and prefix caching, block_size, expert_parallel."""
        from pyllm.ops import SUPPORTED_BLOCK_SIZES

        if self.quantization is None:
            self.quantization = "none"
        if not isinstance(self.quantization, str) or self.quantization.lower() not in (
            QUANTIZATION_MODES
        ):
            raise ConfigError(
                "quantization",
                f"must be one of {QUANTIZATION_MODES} or None, got {self.quantization!r}",
            )
        self.quantization = self.quantization.lower()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                "kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.pooling not in POOLING_TYPES:
            raise ConfigError("pooling", f"must be one of {POOLING_TYPES}, got {self.pooling!r}")
        if self.kv_cache not in KV_CACHE_MODES:
            raise ConfigError("kv_cache", f"must be one of {KV_CACHE_MODES}, got {self.kv_cache!r}")
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = self.kv_cache == "paged"
        elif self.enable_prefix_caching and self.kv_cache == "contiguous":
            raise ConfigError(
                "enable_prefix_caching",
                "needs kv_cache='paged': a contiguous slot belongs to one sequence, so cached "
                "prefixes cannot be shared without copying them",
            )
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ConfigError(
                "block_size", f"must be one of {SUPPORTED_BLOCK_SIZES}, got {self.block_size}"
            )
        for name in ("batch_invariant", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.disable_hybrid_kv_cache_manager, bool):
            raise ConfigError(
                "disable_hybrid_kv_cache_manager",
                f"must be True or False, got {self.disable_hybrid_kv_cache_manager!r}",
            )
        if not isinstance(self.expert_parallel, bool):
            raise ConfigError(
                "expert_parallel", f"must be True or False, got {self.expert_parallel!r}"
            )

    def _check_prefix_cache_dir(self) -> None:
        """prefix_cache_dir: needs the paged cache's prefix caching and one process, and
        a folder that can be written (created here if missing)."""
        from pyllm.engine.block_store import check_dir

        path = self.prefix_cache_dir
        if path is None:
            return
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ConfigError("prefix_cache_dir", f"must be a folder's path, got {path!r}")
        if self.kv_cache != "paged" or not self.enable_prefix_caching:
            raise ConfigError(
                "prefix_cache_dir",
                "needs kv_cache='paged' with prefix caching on: the contiguous layout has no "
                "prefix cache to fill from disk",
            )
        if self.tensor_parallel_size > 1:
            raise ConfigError("prefix_cache_dir", "is not supported with tensor_parallel_size > 1")
        try:
            check_dir(str(path))
        except OSError as e:
            raise ConfigError("prefix_cache_dir", f"{str(path)!r} cannot be written: {e}") from e
        self.prefix_cache_dir = str(path)

    def _check_sizes(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size"):
            check_number(self, name, 1, integer=True)
        for name in ("long_prefill_token_threshold", "max_model_len"):
            check_number(self, name, 1, integer=True, optional=True)
        check_number(self, "distributed_timeout", 0, above=True)
        check_number(self, "kv_cache_memory", 0, above=True, optional=True)
        check_number(self, "prefix_cache_dir_size", 0, above=True)
        check_number(self, "gpu_memory_utilization", 0, above=True)
        if self.gpu_memory_utilization > 1:
            raise ConfigError(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    def kv_cache_budget_bytes(
        self, device: torch.device, weights_bytes: int = 0, available: int | None = None
    ) -> int:
        """kv_cache_memory where given; on a GPU a share of its free memory; on the CPU a
        share of the memory left after the weights, at most DEFAULT_CPU_KV_CACHE_GIB
        (pyllm.model.memory.default_kv_cache_bytes)."""
        if self.kv_cache_memory is not None:
            return int(self.kv_cache_memory * 2**30)
        if device.type == "cuda":
            import torch

            free, _ = torch.cuda.mem_get_info(device)
            return int(free * self.gpu_memory_utilization)
        from pyllm.model.memory import default_kv_cache_bytes

        return default_kv_cache_bytes(weights_bytes, available=available)


def _resolve_device(device: str) -> torch.device:
    import torch

    from pyllm import ops

    if device == "auto":
        use_cuda = torch.cuda.is_available() and ops.BUILT_WITH_CUDA
        return torch.device("cuda" if use_cuda else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not (torch.cuda.is_available() and ops.BUILT_WITH_CUDA):
        raise ValueError(
            "device cuda requested but no GPU is available or pyllm lacks CUDA kernels"
        )
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or auto, got {device!r}")
    return resolved
