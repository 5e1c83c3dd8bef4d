"""EngineConfig: every engine option in one place, validated once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_CPU_KV_CACHE_GIB = 2.0
KV_CACHE_MODES = ("paged", "contiguous")
# "auto": a GGUF file's quantized weights stay quantized, an HF folder's stay float;
# "none": every weight widened to dtype; a GGML type: an HF folder quantized at load.
QUANTIZATION_MODES = ("auto", "none", "q8_0", "q4_0", "q4_k", "mxfp4")


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory or GGUF file; None: the bundled SmolLM2
    dtype: str = "auto"
    device: str = "auto"  # "auto": cuda when available (and built), else cpu
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    # A prompt's share of a step while other prompts compete (None: a quarter of
    # max_num_batched_tokens); see pyllm.engine.scheduler.
    long_prefill_token_threshold: int | None = None
    max_model_len: int | None = None
    kv_cache_memory: float | None = None  # GiB; default 2 on CPU
    gpu_memory_utilization: float = 0.9  # share of free GPU memory for the KV cache
    # None: on with the paged cache, off with the contiguous one (which cannot share).
    enable_prefix_caching: bool | None = None
    # "paged": blocks + block tables (vLLM's PagedAttention); "contiguous": each sequence
    # slot contiguous in a virtual KV arena, memory mapped as it grows (dAttention).
    kv_cache: str = "paged"
    quantization: str | None = "auto"  # see QUANTIZATION_MODES; None is "none"
    # Ranks the model is split over (pyllm.distributed); kv_cache_memory is their total.
    tensor_parallel_size: int = 1
    # Seconds a rank may take to answer the others before the engine fails.
    distributed_timeout: float = 60.0

    def __post_init__(self) -> None:
        from pyllm.model.default_model import default_model_path
        from pyllm.model.dtype import resolve_dtype
        from pyllm.ops import SUPPORTED_BLOCK_SIZES

        if self.model is None:
            self.model = default_model_path()
        self.model_path = str(self.model)
        self.torch_device = _resolve_device(self.device)
        self.torch_dtype = resolve_dtype(self.dtype, self.torch_device)
        if self.quantization is None:
            self.quantization = "none"
        if not isinstance(self.quantization, str) or self.quantization.lower() not in (
            QUANTIZATION_MODES
        ):
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_MODES} or None, "
                f"got {self.quantization!r}"
            )
        self.quantization = self.quantization.lower()
        if self.kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache must be one of {KV_CACHE_MODES}, got {self.kv_cache!r}")
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = self.kv_cache == "paged"
        elif self.enable_prefix_caching and self.kv_cache == "contiguous":
            raise ValueError(
                "enable_prefix_caching needs kv_cache='paged': a contiguous slot belongs to one "
                "sequence, so cached prefixes cannot be shared without copying them"
            )
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(
                f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {self.block_size}"
            )
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
        if not (
            isinstance(self.distributed_timeout, (int, float)) and self.distributed_timeout > 0
        ):
            raise ValueError(
                f"distributed_timeout must be positive seconds, got {self.distributed_timeout!r}"
            )
        threshold = self.long_prefill_token_threshold
        if threshold is not None and (not isinstance(threshold, int) or threshold < 1):
            raise ValueError(
                f"long_prefill_token_threshold must be a positive integer, got {threshold!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive GiB, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
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
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * self.gpu_memory_utilization)
        from pyllm.model.memory import default_kv_cache_bytes

        return default_kv_cache_bytes(weights_bytes, available=available)


def _resolve_device(device: str) -> torch.device:
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
