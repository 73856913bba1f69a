"""What :meth:`InferenceParams.step` returns: one layer's cache after the append, and the
metadata an attention call over it needs (device tensors of fixed shapes, Python-int bounds).

Shape legend: B = batch rows of the step (the input's batch dim for bshd/sbhd, max_batch_size for
thd), S = max_sequence_length, Sq = the step's query bound (the input's sequence dim for
bshd/sbhd, max_ctx_len for thd), P = total_num_pages, Hkv = KV heads, D/Dv = head dims.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .checks import batch_and_seq


class KVCacheStep(NamedTuple):
    """One layer's KV cache after a step's K/V were appended (what ``step`` returns).

    TE's ``step`` returns the tuple ``(k_cache, v_cache, cu_seqlens_q, cu_seqlens_kv,
    max_sequence_length, output_qkv_format)``; the same facts are fields here, with what a THD
    attention call over the cache needs besides:

    - queries: :meth:`queries_as_thd` gives the step's queries as [B*Sq, H, D] (bshd, sbhd)
      or as given (thd); sequence ``b``'s queries start at ``cu_seqlens_q_padded[b]`` and
      ``seqlens_q[b]`` of them are valid. :meth:`output_from_thd` turns the output back.
    - keys/values, non-paged: ``k_cache``/``v_cache`` [B, S, Hkv, D] (rows in batch order);
      :attr:`k_cache_thd` views them as [B*S, Hkv, D] with ``cu_seqlens_kv_padded = b*S``
      and ``seqlens_kv[b]`` valid tokens per sequence (padding between sequences).
    - keys/values, paged: page pools ``k_cache``/``v_cache`` [P, page_size, Hkv, D] and
      ``page_table`` [B, S // page_size] int32; sequence ``b``'s token ``j`` is at
      ``k_cache[page_table[b, j // page_size], j % page_size]``.

    Rows past the batch have length 0 on both sides. ``max_seqlen_q``/``max_seqlen_kv`` are
    fixed bounds (Sq and S), never read from the device.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: Optional[torch.Tensor]  # [B, S // page_size] int32; None for a non-paged cache
    cu_seqlens_q: torch.Tensor  # [B+1] int32: cumulative step lengths
    cu_seqlens_kv: torch.Tensor  # [B+1] int32: cumulative cached lengths after the append
    cu_seqlens_q_padded: torch.Tensor  # [B+1] int32: offsets in queries_as_thd(query)
    cu_seqlens_kv_padded: Optional[torch.Tensor]  # [B+1] int32 b*S: offsets in k_cache_thd; None when paged
    seqlens_q: torch.Tensor  # [B] int32: step lengths (0 past the batch)
    seqlens_kv: torch.Tensor  # [B] int32: cached lengths after the append (0 past the batch)
    max_seqlen_q: int
    max_seqlen_kv: int
    qkv_format: str  # the format of the step's inputs: bshd, sbhd or thd
    # Every query row of queries_as_thd holds one of the step's tokens (no padding, no batch rows
    # past the batch, no thd tail): a host fact of pre_step, so kernels that leave unowned rows
    # unwritten may skip zeroing them. Not for a CUDA graph: it replays as the batch changes.
    rows_all_valid: bool = False

    @property
    def batch_size(self) -> int:
        return self.seqlens_q.shape[0]

    @property
    def is_paged(self) -> bool:
        return self.page_table is not None

    @property
    def output_qkv_format(self) -> str:
        """TE's name for the input/cache format pair: bshd, sbhd_2bshd or thd_2bshd."""
        return "bshd" if self.qkv_format == "bshd" else f"{self.qkv_format}_2bshd"

    @property
    def k_cache_thd(self) -> torch.Tensor:
        return self._cache_thd(self.k_cache)

    @property
    def v_cache_thd(self) -> torch.Tensor:
        return self._cache_thd(self.v_cache)

    def _cache_thd(self, cache: torch.Tensor) -> torch.Tensor:
        if self.is_paged:
            raise ValueError("a paged cache has no THD view; read it through page_table")
        return cache.flatten(0, 1)

    def queries_as_thd(self, query: torch.Tensor) -> torch.Tensor:
        """The step's queries ([B, Sq, H, D] bshd, [Sq, B, H, D] sbhd, [T, H, D] thd) as rows of a
        packed tensor whose sequence offsets are ``cu_seqlens_q_padded`` (sbhd is transposed,
        a copy)."""
        if self.qkv_format == "thd":
            return query
        b, sq = batch_and_seq(query.shape, self.qkv_format)
        if (b, sq) != (self.batch_size, self.max_seqlen_q):
            raise ValueError(
                f"query has batch {b} and sequence length {sq} ({self.qkv_format}); the step's keys "
                f"and values had {self.batch_size} and {self.max_seqlen_q}"
            )
        if self.qkv_format == "sbhd":
            query = query.transpose(0, 1)
        return query.reshape(b * sq, *query.shape[2:])

    def output_from_thd(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output over :meth:`queries_as_thd`'s rows ([rows, H, Dv]) in the step's
        input format ([B, Sq, H, Dv], [Sq, B, H, Dv] or [T, H, Dv])."""
        if self.qkv_format == "thd":
            return out
        dense = out.reshape(self.batch_size, self.max_seqlen_q, *out.shape[1:])
        return dense if self.qkv_format == "bshd" else dense.transpose(0, 1)
