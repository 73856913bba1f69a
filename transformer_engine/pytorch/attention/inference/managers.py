"""TE's KV-cache managers: the interface :class:`InferenceParams` drives (``KVCacheManager``, the
base of a ``custom_cache_manager``), what the built-in managers share, and the non-paged cache.

Each layer's K and V live in one buffer of token slots [N + 1, H, D]: the N slots in TE's cache
layout (viewed as ``cache[layer_number]``) and one scratch slot, where the step's padding tokens
are written, so that a whole step is one scatter of fixed shape per tensor.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Optional, Tuple

import torch

from .append import TokenPositions, token_positions, write_tokens
from .batch import StepPlan, check_step_dict, plan_step
from .checks import batch_and_seq
from .staging import StagedTensor, cache_device


class KVCacheManager:
    """The cache manager interface (TE's base class; a ``custom_cache_manager`` subclasses it).

    ``cache[layer_number]`` is the layer's ``(k_cache, v_cache)``; ``sequences`` maps each cached
    sequence id to its cached length, in batch order. ``pre_step`` returns ``sequences`` after
    the step; ``step`` appends one layer's new K/V and returns ``(k_cache, v_cache)``."""

    def __init__(self) -> None:
        self.cache: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.sequences: "OrderedDict" = OrderedDict()

    def reset(self) -> None:
        self.sequences = OrderedDict()

    def allocate_memory(self, layer_number: int) -> None:
        raise NotImplementedError(f"{type(self).__name__}.allocate_memory: a cache manager allocates each layer's cache")

    def pre_step(self, step_dict: "OrderedDict") -> "OrderedDict":
        raise NotImplementedError(f"{type(self).__name__}.pre_step: a cache manager updates its sequences")

    def step(self, layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format):
        raise NotImplementedError(f"{type(self).__name__}.step: a cache manager appends the step's K/V")


def check_layer_number(layer_number, cache) -> None:
    """A layer number that has a cache: set (DotProductAttention's ``layer_number``) and allocated."""
    if layer_number is None:
        raise ValueError("layer_number is None; KV caching keeps one cache per layer (set DotProductAttention's layer_number)")
    if layer_number not in cache:
        raise ValueError(
            f"layer_number={layer_number!r} has no KV cache; allocated: {sorted(cache)} "
            f"(call inference_params.allocate_memory({layer_number!r}) first)"
        )


class SlotCacheManager(KVCacheManager):
    """What the built-in managers share: token-slot buffers, ``pre_step`` from a :class:`StepPlan`
    and a device-side append. Subclasses say where a token goes (``_slots``), what a step does
    to their layout (``_apply``) and which part of the cache a step returns (``_step_caches``)."""

    def __init__(self, *, slot_rows: Tuple[int, int], max_batch_size: int, max_seqlen: int, num_heads: int,
                 head_dim_k: int, dtype: torch.dtype, head_dim_v: Optional[int], device) -> None:
        super().__init__()
        self.max_batch_size = max_batch_size
        self.max_seqlen = max_seqlen
        self.num_heads = num_heads
        self.head_dim_k = head_dim_k
        self.head_dim_v = head_dim_v if head_dim_v is not None else head_dim_k
        self.dtype = dtype
        self.device = cache_device(device)
        self._slot_rows = slot_rows  # (rows, tokens per row) of TE's layout
        self._stores: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def allocate_memory(self, layer_number: int) -> None:
        if layer_number in self.cache:
            raise ValueError(f"layer_number={layer_number!r} already has a KV cache; allocate_memory makes one per layer")
        rows, per_row = self._slot_rows
        stores = tuple(
            torch.zeros(rows * per_row + 1, self.num_heads, d, dtype=self.dtype, device=self.device)
            for d in (self.head_dim_k, self.head_dim_v)
        )
        self._stores[layer_number] = stores
        self.cache[layer_number] = tuple(s[:-1].view(rows, per_row, *s.shape[1:]) for s in stores)
        for t in (*stores, *self.cache[layer_number]):
            # Written in place every step: torch.compile's CUDA graphs must keep these addresses.
            torch._dynamo.mark_static_address(t)

    def pre_step(self, step_dict: "OrderedDict") -> "OrderedDict":
        plan = plan_step(self.sequences, check_step_dict(step_dict, self.max_batch_size), self.max_seqlen)
        self._apply(plan)
        self.sequences = plan.sequences
        return self.sequences

    def step(self, layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format):
        """Append the step's K/V (checked by :meth:`InferenceParams.step`) to the layer's cache
        without a host sync: one scatter per tensor, padding tokens to the scratch slot."""
        where = token_positions(cu_new_seqlens, cu_cached_seqlens, qkv_format, new_k.shape[:-2])
        return self.append(layer_number, new_k, new_v, where, qkv_format)

    def append(self, layer_number, new_k, new_v, where: TokenPositions, qkv_format: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """:meth:`step` at positions already computed (:meth:`InferenceParams.step_positions`)."""
        check_layer_number(layer_number, self.cache)
        slots = self._slots(where)
        for store, new in zip(self._stores[layer_number], (new_k, new_v)):
            write_tokens(store, slots, where.valid, new.reshape(-1, *new.shape[-2:]))
        return self._step_caches(layer_number, qkv_format, new_k.shape)

    def _apply(self, plan: StepPlan) -> None:
        raise NotImplementedError

    def _slots(self, where: TokenPositions) -> torch.Tensor:
        raise NotImplementedError

    def _step_caches(self, layer_number: int, qkv_format: str, shape) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class NonPagedKVCacheManager(SlotCacheManager):
    """One row of ``max_seqlen`` tokens per batch row: ``cache[layer] = (k, v)``, each
    [max_batch_size, max_seqlen, H, D]. Row ``i`` holds the ``i``-th sequence of the current
    step, so rows move when the batch order changes (only the rows that move, in ``pre_step``)."""

    def __init__(self, max_batch_size: int, max_seqlen: int, num_heads: int, head_dim_k: int, dtype: torch.dtype,
                 head_dim_v: Optional[int] = None, device=None) -> None:
        super().__init__(slot_rows=(max_batch_size, max_seqlen), max_batch_size=max_batch_size, max_seqlen=max_seqlen,
                         num_heads=num_heads, head_dim_k=head_dim_k, dtype=dtype, head_dim_v=head_dim_v, device=device)
        self._moves = StagedTensor((2, max_batch_size), torch.int64, self.device)

    def _apply(self, plan: StepPlan) -> None:
        moves = plan.moves
        if not moves or not self.cache:
            return
        host = self._moves.host_for_write()
        host[:, : len(moves)] = torch.tensor(moves, dtype=torch.int64).t()
        self._moves.upload()
        src, dst = self._moves.device_tensor[:, : len(moves)]
        for pair in self.cache.values():
            for cache in pair:
                cache.index_copy_(0, dst, cache.index_select(0, src))  # the copy first: rows may swap

    def _slots(self, where: TokenPositions) -> torch.Tensor:
        return where.rows * self.max_seqlen + where.pos

    def _step_caches(self, layer_number: int, qkv_format: str, shape) -> Tuple[torch.Tensor, torch.Tensor]:
        b = self.max_batch_size if qkv_format == "thd" else batch_and_seq(shape, qkv_format)[0]
        k, v = self.cache[layer_number]
        return k[:b], v[:b]
