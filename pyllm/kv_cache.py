"""KV-cache memory, in the layouts of pyllm.ops's docstring: one layer's tensors of the
paged pool (allocate_kv_cache) and the virtually contiguous arena (KVArena), with the
checks the contiguous ops make against an arena's committed tokens."""

from __future__ import annotations

import weakref

import torch

from pyllm._checks import (
    BUILT_WITH_CUDA,
    SUPPORTED_DTYPES,
    TOKEN_TILE,
    _block_size,
    _check_range,
    _head_size,
    _positive_int,
    kv_cache_x,
)
from pyllm.model.memory import zeros_on_huge_pages

# The KV cache's element types: "auto" (the model's dtype) or "int8" (symmetric int8, one
# float16 scale per token and kv head for K and one for V).
KV_CACHE_DTYPES = ("auto", "int8")
# An int8 cache's scales: 2 bytes keep 2 D / (D + 2) of bfloat16's tokens (1.94x at 64).
KV_SCALE_DTYPE = torch.float16


def kv_cache_dtype_name(kv_cache_dtype: object) -> str:
    """kv_cache_dtype checked: one of KV_CACHE_DTYPES (ValueError naming it otherwise)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return kv_cache_dtype


def kv_token_bytes(head_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes one token's key and value rows take in one kv head of one layer: an int8
    row plus its float16 scale, or a row of dtype."""
    if kv_cache_dtype == "int8":
        return 2 * (head_size + KV_SCALE_DTYPE.itemsize)
    return 2 * head_size * dtype.itemsize


def allocate_kv_scales(
    shape: tuple[int, ...], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 cache's (k_scale, v_scale): float16 of shape (the cache's shape without
    head_size: paged ``[num_blocks, num_kv_heads, block_size]``, contiguous
    ``[max_num_seqs, num_kv_heads, num_tiles, TOKEN_TILE]``), zero-filled."""
    if torch.device(device).type == "cpu":
        return tuple(zeros_on_huge_pages(shape, KV_SCALE_DTYPE) for _ in range(2))
    return tuple(torch.zeros(shape, dtype=KV_SCALE_DTYPE, device=device) for _ in range(2))


def allocate_kv_cache(
    num_blocks: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocates one layer's (key_cache, value_cache) in the layout the kernels read;
    dtype torch.int8 for an int8 cache (its scales: allocate_kv_scales).

    Zero. On the CPU the memory is anonymous and committed as blocks are first written
    (on 2 MiB pages past each tensor's first 2 MiB: zeros_on_huge_pages), so a cache
    sized for many sequences costs only what they use; the engine hands out blocks
    that were written before ahead of never-used ones (BlockManager), so those faults
    come once, not on every new prompt."""
    _positive_int("num_blocks", num_blocks)
    _positive_int("num_kv_heads", num_kv_heads)
    _head_size(head_size)
    _block_size(block_size)
    if dtype not in (*SUPPORTED_DTYPES, torch.int8):
        raise TypeError(
            f"dtype {dtype} is not supported; supported: float32, float16, bfloat16, int8"
        )
    x = kv_cache_x(dtype)
    key_shape = (num_blocks, num_kv_heads, head_size // x, block_size, x)
    value_shape = (num_blocks, num_kv_heads, head_size, block_size)
    if torch.device(device).type == "cpu":
        return zeros_on_huge_pages(key_shape, dtype), zeros_on_huge_pages(value_shape, dtype)
    return (
        torch.zeros(key_shape, dtype=dtype, device=device),
        torch.zeros(value_shape, dtype=dtype, device=device),
    )


# The views of every live arena, by data pointer, so the ops below can refuse to read
# or write past a slot's committed tokens (the kernels cannot know what is committed).
_ARENA_VIEWS: dict[int, weakref.ref[KVArena]] = {}


def _forget_views(pointers: list[int], ref: weakref.ref) -> None:
    for pointer in pointers:
        if _ARENA_VIEWS.get(pointer) is ref:
            del _ARENA_VIEWS[pointer]


def _check_arena_args(
    num_layers: int,
    max_num_seqs: int,
    max_model_len: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.device:
    """KVArena's arguments checked; returns the device, with its index on CUDA."""
    for name, value in (
        ("num_layers", num_layers),
        ("max_num_seqs", max_num_seqs),
        ("max_model_len", max_model_len),
        ("num_kv_heads", num_kv_heads),
    ):
        _positive_int(name, value)
    if max_model_len > 2**31 - 1:
        raise ValueError(f"max_model_len must fit int32, got {max_model_len}")
    _head_size(head_size)
    if dtype not in (*SUPPORTED_DTYPES, torch.int8):
        raise TypeError(
            f"dtype {dtype} is not supported; supported: float32, float16, bfloat16, int8"
        )
    device = torch.device(device)
    if device.type == "cuda":
        if not BUILT_WITH_CUDA:
            raise ValueError(
                f"device {device}: pyllm was built without CUDA kernels "
                "(rebuild with PYLLM_TARGET=cuda)"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"device {device} is not supported; pyllm runs on cpu and cuda")
    return device


class KVArena:
    """A virtually contiguous KV cache: every slot's K/V reserved, memory mapped on demand.

    One reserved virtual range for keys and one for values hold ``max_num_seqs`` slots of
    ``max_model_len`` tokens in every layer; physical memory is mapped under a slot only
    by ``commit`` and given back by ``release``. Reserving far more than the machine's
    memory is fine: only committed tokens cost memory (``committed_bytes``).

    ``key_cache(layer)`` / ``value_cache(layer)`` are the views the contiguous ops read,
    in the layout of this module's docstring; they keep the reservation alive. With
    dtype torch.int8 (an int8 cache) each layer also has float16 scales
    ``[max_num_seqs, num_kv_heads, num_tiles, TOKEN_TILE]`` for keys and values
    (``kv_caches`` gives them after the views), in anonymous memory that is mapped as
    tokens are first written and kept across releases: 2 bytes per token and kv head
    beside the int8 row's head_size.

    Inside a slot, tiles of TOKEN_TILE tokens are outermost (then layers, then kv heads),
    so the memory under tokens ``[0, n)`` of a slot, in every layer, is one prefix of the
    slot's range: a commit is one mapping per reservation, rounded up to ``granularity``
    bytes (a 4 KiB page on the CPU, a 2 MiB granule on CUDA), and no page or granule is
    shared by two slots.

    Reading or writing a slot past its committed tokens is a caller bug: the checked ops
    below raise ValueError for it. Through ``torch.ops.pyllm`` directly it is harmless on
    the CPU: never-committed or released memory reads as zeros (and writes there are
    given back by the next ``release``).
    """

    def __init__(
        self,
        num_layers: int,
        max_num_seqs: int,
        max_model_len: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        device = _check_arena_args(
            num_layers, max_num_seqs, max_model_len, num_kv_heads, head_size, dtype, device
        )
        self.num_layers, self.max_num_seqs, self.max_model_len = (
            num_layers,
            max_num_seqs,
            max_model_len,
        )
        self.num_kv_heads, self.head_size, self.dtype, self.device = (
            num_kv_heads,
            head_size,
            dtype,
            device,
        )
        self._arena = torch.classes.pyllm.KVArena(
            num_layers, max_num_seqs, max_model_len, num_kv_heads, head_size, dtype, device
        )
        self._key_caches = [self._arena.key_cache(layer) for layer in range(num_layers)]
        self._value_caches = [self._arena.value_cache(layer) for layer in range(num_layers)]
        num_tiles = self._value_caches[0].shape[2]
        # int8: a float16 scale per token, kv head and layer, for keys and for values.
        scale_bytes = 2 * KV_SCALE_DTYPE.itemsize * num_layers * num_kv_heads
        self._scale_bytes_per_token = scale_bytes if dtype == torch.int8 else 0
        scale_shape = (max_num_seqs, num_kv_heads, num_tiles, TOKEN_TILE)
        self._scales = [
            allocate_kv_scales(scale_shape, device) if dtype == torch.int8 else ()
            for _ in range(num_layers)
        ]
        # Committed tokens per slot, mirrored on the host for the ops' checks.
        self._committed = torch.zeros(max_num_seqs, dtype=torch.int64)
        ref = weakref.ref(self)
        pointers = [t.data_ptr() for t in (*self._key_caches, *self._value_caches)]
        for pointer in pointers:
            _ARENA_VIEWS[pointer] = ref
        weakref.finalize(self, _forget_views, pointers, ref)

    def _slot(self, slot: object) -> int:
        if not isinstance(slot, int) or isinstance(slot, bool):
            raise TypeError(f"slot must be an int, got {type(slot).__name__}")
        if not 0 <= slot < self.max_num_seqs:
            raise ValueError(f"slot {slot} is outside [0, {self.max_num_seqs})")
        return slot

    def _layer(self, layer: object) -> int:
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside [0, {self.num_layers})")
        return layer

    def key_cache(self, layer: int) -> torch.Tensor:
        """Layer's key view ``[max_num_seqs, num_kv_heads, num_tiles, head_size // x,
        TOKEN_TILE, x]``."""
        return self._key_caches[self._layer(layer)]

    def value_cache(self, layer: int) -> torch.Tensor:
        """Layer's value view ``[max_num_seqs, num_kv_heads, num_tiles, head_size,
        TOKEN_TILE]``."""
        return self._value_caches[self._layer(layer)]

    def commit(self, slot: int, num_tokens: int) -> int:
        """Maps memory under tokens ``[0, num_tokens)`` of the slot in every layer.

        Idempotent, never shrinks, and cheap when nothing new is needed (~10 us
        here); rounded up to whole pages/granules, so it may cover more tokens
        than asked: the return value, ``committed_tokens(slot)``, tells when the next
        call is due. Mapping costs what first-touching the memory costs (on this CPU
        about 1 GiB/s of page faults, so a 16-token tile of a 22-layer model, 704 KiB,
        takes ~0.6 ms); the Python thread that calls it lets others run meanwhile
        (measured), so an engine may commit ahead of need from a helper thread. Newly
        mapped memory holds zeros on the CPU and unspecified values on CUDA."""
        self._slot(slot)
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool):
            raise TypeError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
        if not 0 <= num_tokens <= self.max_model_len:
            raise ValueError(
                f"num_tokens {num_tokens} is outside [0, max_model_len = {self.max_model_len}]"
            )
        committed = int(self._arena.commit(slot, num_tokens))
        self._committed[slot] = committed
        return committed

    def release(self, slot: int, keep_tokens: int = 0) -> None:
        """Gives back the slot's memory past its first keep_tokens tokens (rounded up to
        whole pages/granules); 0, the default, gives back all of it (a finished or
        preempted sequence). Cost grows with the memory freed (on the CPU about 75 ms
        for 352 MiB): a new sequence may reuse a slot's committed memory instead, and
        keep_tokens trims a slot to a watermark."""
        self._slot(slot)
        if not isinstance(keep_tokens, int) or isinstance(keep_tokens, bool):
            raise TypeError(f"keep_tokens must be an int, got {type(keep_tokens).__name__}")
        if not 0 <= keep_tokens <= self.max_model_len:
            raise ValueError(
                f"keep_tokens {keep_tokens} is outside [0, max_model_len = {self.max_model_len}]"
            )
        self._arena.release(slot, keep_tokens)
        self._committed[slot] = int(self._arena.committed_tokens(slot))

    @property
    def committed_tokens_per_slot(self) -> torch.Tensor:
        """[max_num_seqs] int64: committed_tokens of every slot (a copy)."""
        return self._committed.clone()

    def committed_tokens(self, slot: int) -> int:
        """Tokens of the slot backed by memory in every layer (<= max_model_len)."""
        return int(self._arena.committed_tokens(self._slot(slot)))

    def bytes_for_tokens(self, num_tokens: int) -> int:
        """Bytes (keys and values) that committing num_tokens tokens of one empty slot
        maps: whole tiles of every layer, rounded up to the granularity."""
        tiles = -(-num_tokens // TOKEN_TILE)
        element = self.dtype.itemsize
        tile_bytes = TOKEN_TILE * self.num_layers * self.num_kv_heads * self.head_size * element
        granularity = self.granularity
        scale_bytes = tiles * TOKEN_TILE * self._scale_bytes_per_token
        return 2 * (-(-tiles * tile_bytes // granularity) * granularity) + scale_bytes

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, ...]]:
        """(key_cache, value_cache) of every layer, then (k_scale, v_scale) for int8."""
        return [
            (k, v, *scales)
            for k, v, scales in zip(self._key_caches, self._value_caches, self._scales, strict=True)
        ]

    @property
    def committed_bytes(self) -> int:
        """Bytes of memory mapped under all slots, keys and values (and an int8 cache's
        scales of the committed tokens)."""
        scales = int(self._committed.sum()) * self._scale_bytes_per_token
        return int(self._arena.committed_bytes()) + scales

    @property
    def reserved_bytes(self) -> int:
        """Bytes of virtual address space reserved, keys and values."""
        return int(self._arena.reserved_bytes())

    @property
    def granularity(self) -> int:
        """Bytes per mapping unit: the page (CPU) or allocation granule (CUDA)."""
        return int(self._arena.granularity())

    def __repr__(self) -> str:
        return (
            f"KVArena(num_layers={self.num_layers}, max_num_seqs={self.max_num_seqs}, "
            f"max_model_len={self.max_model_len}, num_kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, dtype={self.dtype}, device={self.device}, "
            f"committed_bytes={self.committed_bytes}, reserved_bytes={self.reserved_bytes})"
        )


def _arena_of(key_cache: torch.Tensor) -> KVArena | None:
    """The live arena whose key view key_cache is, if any."""
    ref = _ARENA_VIEWS.get(key_cache.data_ptr())
    arena = ref() if ref is not None else None
    if arena is None or key_cache.stride() != arena._key_caches[0].stride():
        return None
    return arena


def _check_committed(
    key_cache: torch.Tensor, slots: torch.Tensor, ends: torch.Tensor, what: str
) -> None:
    """Where key_cache is a KVArena view: every (slot, end) with slot >= 0 must have
    end <= the slot's committed tokens."""
    arena = _arena_of(key_cache)
    if arena is None or slots.numel() == 0:
        return
    slots, ends = slots.cpu().long(), ends.cpu().long()
    used = slots >= 0
    committed = arena._committed[slots.clamp(min=0)]
    bad = (used & (ends > committed)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(
            f"{what}[{i}] reaches token {int(ends[i])} of slot {int(slots[i])}, which has "
            f"{int(committed[i])} committed tokens (KVArena.commit the slot first)"
        )


def _check_token_slots(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    token_slots: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """write_kv_contiguous's slots and positions: inside the views and, for an arena's
    views, below each slot's committed tokens."""
    if value_cache.dim() != 5 or token_slots.dim() != 1 or positions.shape != token_slots.shape:
        return
    num_slots, _, num_tiles = value_cache.shape[:3]
    _check_range("token_slots", token_slots, torch.int64, -1, num_slots)
    if positions.device == token_slots.device and token_slots.dtype == torch.int64:
        written = positions[token_slots >= 0]
        note = " for written tokens (the slots' capacity)"
        _check_range("positions", written, torch.int64, 0, num_tiles * TOKEN_TILE, note)
        _check_committed(key_cache, token_slots, positions + 1, "positions")


def _check_seq_slots(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_slots: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """The contiguous attention ops' slots and lengths: inside the views and, for an
    arena's views, within each slot's committed tokens."""
    if value_cache.dim() != 5 or seq_slots.dim() != 1 or seq_lens.shape != seq_slots.shape:
        return
    _check_range("seq_slots", seq_slots, torch.int32, 0, value_cache.shape[0])
    capacity = value_cache.shape[2] * TOKEN_TILE
    _check_range("seq_lens", seq_lens, torch.int32, 0, capacity + 1, " (the slots' capacity)")
    _check_committed(key_cache, seq_slots, seq_lens, "seq_lens")
