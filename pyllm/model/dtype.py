"""Which floating-point type the weights, activations and KV cache use."""

from __future__ import annotations

import torch

_DTYPE_NAMES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def auto_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype "auto" means on this device.

    CUDA: bfloat16 where the GPU supports it, else float16.
    CPU: bfloat16 where the cores multiply bf16 natively (AVX512-BF16 or AMX), else
    float32. Measured on 2 cores with AVX512-BF16, SmolLM2-135M, one decode step at
    context 64 with oneDNN-packed weights: bf16 took 27 ms vs 37-72 ms for f32 at
    batch 1 (half the bytes to stream) and 57-93 ms vs 103-250 ms at batch 32 (native
    bf16 dot products); runs were noisy, bf16 won every pair. Without those
    instructions bf16 is emulated and slower than f32.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """ "auto", a name ("bfloat16", "bf16", ...) or a torch dtype -> a supported torch dtype."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        return auto_dtype(device)
    elif dtype in _DTYPE_NAMES:
        resolved = _DTYPE_NAMES[dtype]
    else:
        raise ValueError(
            f"dtype {dtype!r} is not supported; use auto, float32, bfloat16 or float16"
        )
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {resolved} is not supported; use float32, bfloat16 or float16")
    return resolved
