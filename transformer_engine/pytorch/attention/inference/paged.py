"""TE's paged KV cache: page pools shared by all sequences, and a page table per batch row."""

from __future__ import annotations

import logging
from collections import deque
from typing import Dict, Hashable, List, Optional, Tuple

import torch

from .append import TokenPositions
from .batch import StepPlan
from .managers import SlotCacheManager
from .staging import StagedTensor


def gather_pages(k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Page pools [P, page_size, Hkv, D] read through ``page_table`` [B, pages] as dense
    [B, pages * page_size, Hkv, D] tensors (new tensors)."""
    pages = page_table.long()
    return tuple(c[pages].flatten(1, 2) for c in (k_cache, v_cache))


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class PagedKVCacheManager(SlotCacheManager):
    """Pages of ``page_size`` tokens from one pool per layer: ``cache[layer] = (k, v)``, each
    [total_num_pages, page_size, H, D]. ``page_table`` [max_batch_size, max_seqlen // page_size]
    int32 lists each batch row's pages in order (0 past a sequence's last page, as in TE); a
    sequence gets pages as it grows and returns them when it finishes.

    A step that needs more pages than are free raises before anything changes, so no sequence's
    pages are ever handed to another while it holds them."""

    def __init__(self, total_num_pages: int, page_size: int, num_heads: int, head_dim_k: int, dtype: torch.dtype,
                 max_batch_size: int, max_seqlen: int, head_dim_v: Optional[int] = None, device=None) -> None:
        super().__init__(slot_rows=(total_num_pages, page_size), max_batch_size=max_batch_size, max_seqlen=max_seqlen,
                         num_heads=num_heads, head_dim_k=head_dim_k, dtype=dtype, head_dim_v=head_dim_v, device=device)
        self.total_num_pages = total_num_pages
        self.page_size = page_size
        self.max_pages_per_seq = max_seqlen // page_size
        self.free_pages: "deque[int]" = deque(range(total_num_pages))
        self.allocated_pages: Dict[Hashable, List[int]] = {}
        self._table = StagedTensor((max_batch_size, self.max_pages_per_seq), torch.int32, self.device)
        self.page_table = self._table.device_tensor

    def reset(self) -> None:
        super().reset()
        self.free_pages = deque(range(self.total_num_pages))
        self.allocated_pages = {}
        self._table.host_for_write().zero_()
        self._table.upload()

    def get_sequence_count(self) -> int:
        return len(self.sequences)

    def get_sequence_lengths(self) -> List[int]:
        return list(self.sequences.values())

    def has_free_page(self) -> bool:
        return len(self.free_pages) > 0

    def get_page_list(self, seq: Hashable) -> List[int]:
        """The pages of cached sequence ``seq``, in token order."""
        if seq not in self.allocated_pages:
            raise ValueError(f"sequence id {seq!r} is not in the KV cache; cached ids: {list(self.sequences)}")
        return list(self.allocated_pages[seq])

    def get_page_count(self, seq: Hashable) -> int:
        return len(self.get_page_list(seq))

    def print_cache(self) -> None:
        """Log (debug level) the pool's use and each batch row's pages."""
        log = logging.getLogger("PagedKVCacheManager")
        used = self.total_num_pages - len(self.free_pages)
        log.debug("pages: %d total, %d used, %d free", self.total_num_pages, used, len(self.free_pages))
        for row, (seq, length) in enumerate(self.sequences.items()):
            log.debug("row %d: sequence %r, %d tokens, pages %s", row, seq, length, self.allocated_pages[seq])

    def _apply(self, plan: StepPlan) -> None:
        self._check_pool(plan)
        for seq in plan.finished:
            self.free_pages.extend(self.allocated_pages.pop(seq))
        table = self._table.host_for_write()
        before = table.clone() if plan.moves else table  # rows may trade places
        for row, (seq, old_row, length) in enumerate(zip(plan.seq_ids, plan.old_rows, plan.cached_lens)):
            pages = self.allocated_pages.setdefault(seq, [])
            if old_row is None:
                table[row].zero_()
            elif old_row != row:
                table[row] = before[old_row]
            new = [self.free_pages.popleft() for _ in range(pages_for(length, self.page_size) - len(pages))]
            if new:
                table[row, len(pages) : len(pages) + len(new)] = torch.tensor(new, dtype=torch.int32)
                pages.extend(new)
        table[plan.batch_size :].zero_()
        self._table.upload()

    def _check_pool(self, plan: StepPlan) -> None:
        held = {seq: len(self.allocated_pages.get(seq, ())) for seq in plan.seq_ids}
        need = sum(pages_for(n, self.page_size) - held[seq] for seq, n in zip(plan.seq_ids, plan.cached_lens))
        free = len(self.free_pages) + sum(len(self.allocated_pages[seq]) for seq in plan.finished)
        if need > free:
            raise ValueError(
                f"total_num_pages={self.total_num_pages} is too small for this step: it needs {need} more pages "
                f"of page_size={self.page_size} tokens and {free} are free (after freeing the finished sequences "
                f"{list(plan.finished)})"
            )

    def _slots(self, where: TokenPositions) -> torch.Tensor:
        page = self.page_table[where.rows, where.pos // self.page_size].long()
        return page * self.page_size + where.pos % self.page_size

    def _step_caches(self, layer_number: int, qkv_format: str, shape) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.cache[layer_number]
