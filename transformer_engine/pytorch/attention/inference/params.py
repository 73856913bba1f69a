"""TE's ``InferenceParams``: the KV caches of a model's attention layers and the per-step
bookkeeping (``pre_step`` on the host, then ``step`` once per layer on the device)."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Dict, Tuple

import torch

from . import checks
from .append import TokenPositions, token_positions
from .batch import check_step_dict
from .managers import KVCacheManager, NonPagedKVCacheManager, SlotCacheManager, check_layer_number
from .paged import PagedKVCacheManager, gather_pages
from .record import KVCacheStep
from .staging import StagedTensor, cache_device

# Rows of the per-step length buffer, each [max_batch_size + 1] int32 (0 past the batch).
_STEP_LENS, _CACHED_LENS, _PRE_STEP_LENS, _CU_Q, _CU_KV = range(5)


class InferenceParams:
    """KV caching for inference (TE's API): one cache per attention layer, non-paged
    ([max_batch_size, max_sequence_length, H, D] per layer) or paged (pools of
    ``total_num_pages`` pages of ``page_size`` tokens and a page table).

    Each step::

        inference_params.pre_step(OrderedDict(zip(seq_ids, step_lens)))  # host bookkeeping
        out = model(..., inference_params=inference_params)  # each layer calls step()

    ``pre_step``: an id not cached yet joins (its step is its prefill), a cached id advances by
    its step length, a cached id left out is finished and freed. Batch row ``i`` of the step is
    the ``i``-th id of the dict, so the step's q/k/v list sequences in that order (TE's order,
    continuing sequences first and then new ones, is one such order). Each step's lengths and
    offsets go to device tensors of fixed shapes, copied in place, so a step can be captured in
    a CUDA graph and replayed as sequences grow, join and finish.

    TE's arguments keep their meaning; beyond TE: ``total_num_pages`` may be smaller than
    ``max_batch_size * max_sequence_length // page_size`` (a step that needs more pages than are
    free raises), a continuing sequence may advance by more than one token (chunked prefill),
    and ``device`` (default: the current CUDA device, or the CPU without CUDA).
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int, num_heads_kv: int = None,
                 head_dim_k: int = None, dtype: torch.dtype = None, head_dim_v: int = None, is_paged: bool = False,
                 total_num_pages: int = None, page_size: int = None, max_ctx_len: int = None, qkv_format: str = "bshd",
                 custom_cache_manager: type = None, device=None) -> None:
        self.max_batch_size = checks.positive_int("max_batch_size", max_batch_size)
        self.max_sequence_length = checks.positive_int("max_sequence_length", max_sequence_length)
        checks.check_required(num_heads_kv, head_dim_k, dtype)
        self.num_heads_kv = checks.positive_int("num_heads_kv", num_heads_kv)
        self.head_dim_k = checks.positive_int("head_dim_k", head_dim_k)
        self.head_dim_v = checks.positive_int("head_dim_v", head_dim_v, optional=True) or self.head_dim_k
        self.dtype = dtype
        self.is_paged = bool(is_paged)
        checks.check_paging(self.is_paged, total_num_pages, page_size, self.max_sequence_length)
        self.total_num_pages = total_num_pages if self.is_paged else None
        self.page_size = page_size if self.is_paged else None
        self.input_qkv_format = checks.check_qkv_format(qkv_format)
        self.max_ctx_len = checks.check_ctx_len(max_ctx_len, qkv_format, self.max_sequence_length)
        if self.max_batch_size * self.max_sequence_length >= 2**31:
            raise ValueError("max_batch_size * max_sequence_length must be < 2**31 (int32 offsets)")
        self.device = cache_device(device)
        self.cache_manager = self._make_manager(custom_cache_manager)
        self.cache_qkv_format = "bshd"
        self.sequences: "OrderedDict" = OrderedDict()
        self.sequences_pre_step: "OrderedDict" = OrderedDict()
        self.batch_size = 0
        self._lens = StagedTensor((5, self.max_batch_size + 1), torch.int32, self.device)
        lens = self._lens.device_tensor
        self.cu_seqlens_q, self.cu_seqlens_kv = lens[_CU_Q], lens[_CU_KV]
        self.pre_step_seqlens = lens[_PRE_STEP_LENS, : self.max_batch_size]
        self._step_lens: Tuple[int, ...] = ()
        self._offsets: Dict[Tuple[int, int], torch.Tensor] = {}
        self._positions: Dict[tuple, TokenPositions] = {}  # this step's, by (format, token shape)

    def _make_manager(self, custom_cache_manager) -> KVCacheManager:
        if self.is_paged:
            cls = custom_cache_manager or PagedKVCacheManager
            kwargs = dict(total_num_pages=self.total_num_pages, page_size=self.page_size, num_heads=self.num_heads_kv,
                          head_dim_k=self.head_dim_k, dtype=self.dtype, max_batch_size=self.max_batch_size,
                          max_seqlen=self.max_sequence_length, head_dim_v=self.head_dim_v)
        else:
            cls = custom_cache_manager or NonPagedKVCacheManager
            kwargs = dict(max_batch_size=self.max_batch_size, max_seqlen=self.max_sequence_length,
                          num_heads=self.num_heads_kv, head_dim_k=self.head_dim_k, dtype=self.dtype,
                          head_dim_v=self.head_dim_v)
        if not (isinstance(cls, type) and issubclass(cls, KVCacheManager)):
            raise TypeError(f"custom_cache_manager must be a subclass of KVCacheManager; got {cls!r}")
        if issubclass(cls, SlotCacheManager):  # TE's own signatures have no device
            kwargs["device"] = self.device
        manager = cls(**kwargs)
        if self.is_paged and not hasattr(manager, "page_table"):
            raise TypeError(
                f"custom_cache_manager {cls.__name__} has no attribute page_table; is_paged=True needs it "
                f"([max_batch_size, max_sequence_length // page_size] int32, each batch row's pages)"
            )
        return manager

    @property
    def output_qkv_format(self) -> str:
        return self.input_qkv_format if self.input_qkv_format == "bshd" else f"{self.input_qkv_format}_2bshd"

    def __repr__(self) -> str:
        layout = (f"total_pages={self.total_num_pages}, page_size={self.page_size}" if self.is_paged
                  else f"max_batch_size={self.max_batch_size}, max_seqlen={self.max_sequence_length}")
        return (f"InferenceParams(dtype={self.dtype}, is_paged={self.is_paged}, {layout}, num_heads={self.num_heads_kv}, "
                f"head_dim_k={self.head_dim_k}, head_dim_v={self.head_dim_v})")

    def reset(self) -> None:
        """Forget every sequence (pages return to the pool); the layers' caches stay allocated."""
        self.cache_manager.reset()
        self.sequences, self.sequences_pre_step, self.batch_size, self._step_lens = OrderedDict(), OrderedDict(), 0, ()
        self._positions = {}
        self._lens.host_for_write().zero_()
        self._lens.upload()

    def allocate_memory(self, layer_number: int) -> None:
        """Make layer ``layer_number``'s cache: non-paged K/V [max_batch_size,
        max_sequence_length, num_heads_kv, head_dim_k/v]; paged [total_num_pages, page_size,
        num_heads_kv, head_dim_k/v]."""
        self.cache_manager.allocate_memory(layer_number)

    def pre_step(self, step_dict: "OrderedDict") -> None:
        """Update the cached sequences for the next step (``step_dict``: sequence id -> new
        tokens this step, in batch order) and copy the step's lengths to the device."""
        step_dict = check_step_dict(step_dict, self.max_batch_size, self.max_ctx_len)
        sequences = self.cache_manager.pre_step(step_dict)
        self._check_manager_sequences(sequences, step_dict)
        step_lens = [step_dict[seq] for seq in sequences]
        self.sequences, self.batch_size, self._step_lens = sequences, len(sequences), tuple(step_lens)
        self.sequences_pre_step = OrderedDict((seq, n - s) for (seq, n), s in zip(sequences.items(), step_lens))
        self._positions = {}  # the previous step's
        self._write_lengths(step_lens, list(sequences.values()))

    def _check_manager_sequences(self, sequences, step_dict) -> None:
        # A custom manager's answer must describe this step, or every offset below would be wrong.
        if set(sequences) != set(step_dict) or any(
            not step_dict[s] <= n <= self.max_sequence_length for s, n in sequences.items()
        ):
            raise ValueError(
                f"cache_manager.pre_step must return the step's sequences with cached lengths of at least "
                f"their step length and at most max_sequence_length={self.max_sequence_length}; "
                f"got {dict(sequences)} for step_dict {dict(step_dict)}"
            )

    def _write_lengths(self, step_lens, cached_lens) -> None:
        pad = [0] * (self.max_batch_size + 1 - len(step_lens))
        cu_q = list(itertools.accumulate(step_lens, initial=0))
        cu_kv = list(itertools.accumulate(cached_lens, initial=0))
        rows = [None] * 5
        rows[_STEP_LENS] = step_lens + pad
        rows[_CACHED_LENS] = cached_lens + pad
        rows[_PRE_STEP_LENS] = [n - s for n, s in zip(cached_lens, step_lens)] + pad
        rows[_CU_Q] = cu_q + [cu_q[-1]] * (len(pad) - 1)
        rows[_CU_KV] = cu_kv + [cu_kv[-1]] * (len(pad) - 1)
        self._lens.host_for_write().copy_(torch.tensor(rows, dtype=torch.int32))
        self._lens.upload()

    def step_positions(self, qkv_format: str, token_shape) -> TokenPositions:
        """Where this step's tokens land (:func:`.append.token_positions` over the step's device
        lengths) for inputs of ``qkv_format`` and ``token_shape`` (their shape without the last
        two dims): made once per step and shape, then read by the rotary embeddings and every
        layer's append. Neither kept nor reused while a CUDA graph is captured (the graph must
        compute them from the lengths each replay copies in; tensors made in a capture hold
        nothing until a replay) or torch.compile traces."""
        key = (qkv_format, tuple(token_shape))
        if self._capturing() or torch.compiler.is_compiling():
            return token_positions(self.cu_seqlens_q, self.cu_seqlens_kv, qkv_format, token_shape)
        where = self._positions.get(key)
        if where is None:
            where = token_positions(self.cu_seqlens_q, self.cu_seqlens_kv, qkv_format, token_shape)
            self._positions[key] = where
        return where

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def get_seqlens_pre_step(self) -> torch.Tensor:
        """[max_batch_size] int32 on the device: each batch row's cached length before this step,
        the position of its first new token (rotary embeddings start there); 0 past the batch."""
        return self.pre_step_seqlens

    def step(self, layer_number: int, new_k: torch.Tensor, new_v: torch.Tensor, qkv_format: str) -> KVCacheStep:
        """Append the step's K/V (``qkv_format`` bshd [B, Sq, Hkv, D], sbhd [Sq, B, Hkv, D] or thd
        [T, Hkv, D]; padding tokens are never stored) to layer ``layer_number``'s cache, with no
        host sync, and return the cache and what attention over it needs (:class:`KVCacheStep`)."""
        self._check_step(layer_number, new_k, new_v, qkv_format)
        self.input_qkv_format = qkv_format
        # The built-in managers append at the step's positions, computed once per step (not per
        # layer); a custom manager, or one that overrides step, gets TE's arguments.
        if type(self.cache_manager).step is SlotCacheManager.step:
            where = self.step_positions(qkv_format, new_k.shape[:-2])
            k_cache, v_cache = self.cache_manager.append(layer_number, new_k, new_v, where, qkv_format)
        else:
            k_cache, v_cache = self.cache_manager.step(layer_number, new_k, new_v, self.cu_seqlens_q, self.cu_seqlens_kv,
                                                       qkv_format)
        return self._record(k_cache, v_cache, qkv_format, new_k.shape)

    def _check_step(self, layer_number, new_k, new_v, qkv_format) -> None:
        check_layer_number(layer_number, self.cache_manager.cache)
        checks.check_qkv_format(qkv_format)
        if qkv_format == "thd" and self.max_ctx_len is None:
            raise ValueError("qkv_format='thd' needs max_ctx_len (the queries' bound), which InferenceParams was not given")
        checks.check_new_kv(new_k, new_v, qkv_format, dtype=self.dtype, num_heads=self.num_heads_kv,
                            head_dims=(self.head_dim_k, self.head_dim_v), device=self.device)
        checks.check_token_dims(new_k.shape[:-2], qkv_format, self._step_lens, self.max_batch_size)

    def _record(self, k_cache, v_cache, qkv_format: str, shape) -> KVCacheStep:
        b, sq = (self.max_batch_size, self.max_ctx_len) if qkv_format == "thd" else checks.batch_and_seq(shape, qkv_format)
        lens = self._lens.device_tensor
        cu_q = self.cu_seqlens_q[: b + 1]
        return KVCacheStep(
            k_cache=k_cache,
            v_cache=v_cache,
            page_table=self.cache_manager.page_table[:b] if self.is_paged else None,
            cu_seqlens_q=cu_q,
            cu_seqlens_kv=self.cu_seqlens_kv[: b + 1],
            cu_seqlens_q_padded=cu_q if qkv_format == "thd" else self._strided_offsets(b, sq),
            cu_seqlens_kv_padded=None if self.is_paged else self._strided_offsets(b, self.max_sequence_length),
            seqlens_q=lens[_STEP_LENS, :b],
            seqlens_kv=lens[_CACHED_LENS, :b],
            max_seqlen_q=sq,
            max_seqlen_kv=self.max_sequence_length,
            qkv_format=qkv_format,
            rows_all_valid=self._rows_all_valid(qkv_format, shape, b, sq),
        )

    def _rows_all_valid(self, qkv_format: str, shape, batch: int, sq: int) -> bool:
        lens = self._step_lens
        if qkv_format == "thd":
            return sum(lens) == shape[0]
        return len(lens) == batch and all(n == sq for n in lens)

    def _strided_offsets(self, batch: int, stride: int) -> torch.Tensor:
        """[batch+1] int32 ``b * stride``: made once per shape and kept (constant, so a captured
        graph may read it)."""
        key = (batch, stride)
        if key in self._offsets:
            return self._offsets[key]
        offsets = torch.arange(0, (batch + 1) * stride, stride, dtype=torch.int32, device=self.device)
        if self._capturing():
            return offsets  # filled by the graph's replays only: not for eager steps to reuse
        self._offsets[key] = offsets
        return offsets

    def convert_paged_to_nonpaged(self, layer_number: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_number``'s K/V of the current batch gathered through the page table:
        [batch_size, max_sequence_length, num_heads_kv, head_dim_k/v] (new tensors)."""
        check_layer_number(layer_number, self.cache_manager.cache)
        k_cache, v_cache = self.cache_manager.cache[layer_number]
        if not self.is_paged:
            return k_cache[: self.batch_size].clone(), v_cache[: self.batch_size].clone()
        return gather_pages(k_cache, v_cache, self.cache_manager.page_table[: self.batch_size])
