"""Where each token lives under context parallelism (the "zigzag" split), sync-free.

Shape legend: B = sequences, T = tokens of a packed tensor, P = ranks sharing the sequence.

Every slot of ``cu_seqlens_padded`` (THD), or the whole sequence (bshd/sbhd, one slot per
batch entry), is cut into 2P equal chunks; rank r holds chunks r and 2P-1-r, in sequence
order. Causal work per rank is then balanced: an early chunk (little work) is paired with a
late one (much work). For P = 2 and one slot of 8 tokens ``0..7``::

    chunks   [0 1] [2 3] [4 5] [6 7]
    rank 0:  [0 1]             [6 7]     -> local rows 0 1 6 7
    rank 1:        [2 3] [4 5]           -> local rows 2 3 4 5

Padding sits at the end of each slot, so each rank's valid rows of a sequence form a prefix of
its local slot; local slot offsets are ``cu_seqlens_padded // P``. Rows past the last slot
(a tail) are split evenly and kept in order.

The public helpers (``get_cp_partition_indices``, ``partition_for_context_parallel``,
``gather_context_parallel``) let a data loader build each rank's share and undo it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class ZigzagLayout:
    """The rows one rank holds. ``slots`` are the global padded offsets ([B+1] int64) and
    ``lengths`` the global valid lengths ([B] int64); ``size``/``rank`` the split."""

    slots: torch.Tensor
    lengths: torch.Tensor
    size: int
    rank: int

    @property
    def chunk(self) -> torch.Tensor:
        """[B] chunk length of each slot (slot length / 2P)."""
        return torch.diff(self.slots) // (2 * self.size)

    @property
    def local_offsets(self) -> torch.Tensor:
        """[B+1] start of each local slot in the rank's tensor."""
        return self.slots // self.size

    def chunk_valid(self, index) -> torch.Tensor:
        """[B] valid tokens of chunk ``index`` (an int or a [B] tensor) of every slot."""
        c = self.chunk
        return (self.lengths - index * c).clamp(0, None).minimum(c)

    def first_valid(self, rank: Optional[int] = None) -> torch.Tensor:
        return self.chunk_valid(self.rank if rank is None else rank)

    def second_valid(self, rank: Optional[int] = None) -> torch.Tensor:
        return self.chunk_valid(2 * self.size - 1 - (self.rank if rank is None else rank))

    def local_valid(self, rank: Optional[int] = None) -> torch.Tensor:
        """[B] valid rows of each local slot (a prefix of it) on ``rank`` (default: this one)."""
        return self.first_valid(rank) + self.second_valid(rank)

    def end_of_chunk(self, index: int) -> torch.Tensor:
        """[B] valid tokens of each sequence up to the end of chunk ``index`` (for causal)."""
        return self.lengths.minimum((index + 1) * self.chunk)

    def seq_of_local_rows(self, total_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """([T] slot index, clamped to [0, B-1]; [T] position inside the local slot) per row."""
        rows = torch.arange(total_rows, device=self.slots.device, dtype=torch.int64)
        offsets = self.local_offsets
        b = max(offsets.numel() - 1, 1)
        seq = (torch.searchsorted(offsets, rows, right=True) - 1).clamp(0, b - 1)
        return seq, rows - offsets[seq]

    def slot_positions(self, total_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """([T] slot index; [T] position of each local row inside its global slot): the rank's
        rows are chunk ``rank`` of each slot, then chunk ``2 * size - 1 - rank``."""
        seq, u = self.seq_of_local_rows(total_rows)
        c = self.chunk[seq]
        return seq, torch.where(u < c, self.rank * c + u, (2 * self.size - 1 - self.rank) * c + u - c)

    def global_rows(self, total_rows: int) -> torch.Tensor:
        """[T] global row of each local row (tail rows: this rank's share of the tail)."""
        seq, pos = self.slot_positions(total_rows)
        rows = torch.arange(total_rows, device=self.slots.device, dtype=torch.int64)
        local_end = self.slots[-1] // self.size
        in_tail = rows >= local_end
        tail = self.slots[-1] + self.rank * (total_rows - local_end) + (rows - local_end)
        return torch.where(in_tail, tail, self.slots[seq] + pos)


def positions_of_local_rows(slots: torch.Tensor, lengths: torch.Tensor, size: int, rank: int, total_rows: int) -> torch.Tensor:
    """[T] position inside its sequence of each of rank ``rank``'s local rows (the global
    position, e.g. for rotary embeddings); 0 on padding and tail rows. Sync-free."""
    if lengths.numel() == 0:
        return torch.zeros(total_rows, dtype=torch.int64, device=slots.device)
    layout = ZigzagLayout(slots, lengths, size, rank)
    seq, pos = layout.slot_positions(total_rows)
    rows = torch.arange(total_rows, device=slots.device, dtype=torch.int64)
    inside = (rows < layout.local_offsets[-1]) & (pos < lengths[seq])
    return torch.where(inside, pos, 0)


def dense_positions(local_len: int, size: int, rank: int, device) -> torch.Tensor:
    """[S_local] global positions of a rank's rows of a bshd/sbhd sequence (chunks r, 2P-1-r)."""
    return _dense_indices(local_len * size, size, rank, device)


def source_of_global_rows(slots: torch.Tensor, size: int, global_rows: torch.Tensor, local_total: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rank, local row) holding each global row under a ``size``-way split; tail rows follow
    ``global_rows``' rule (each rank holds an equal, ordered share of the tail)."""
    b = max(slots.numel() - 1, 1)
    seq = (torch.searchsorted(slots, global_rows, right=True) - 1).clamp(0, b - 1)
    c = (torch.diff(slots) // (2 * size))[seq].clamp_min(1)
    x = global_rows - slots[seq]
    k = x // c
    rank = torch.where(k < size, k, 2 * size - 1 - k)
    local = slots[seq] // size + (x - k * c) + torch.where(k < size, 0, c)
    end = slots[-1]
    tail = global_rows - end
    tail_share = local_total - end // size
    in_tail = global_rows >= end
    rank = torch.where(in_tail, tail // max_one(tail_share), rank)
    local = torch.where(in_tail, end // size + tail % max_one(tail_share), local)
    return rank, local


def max_one(t):
    return t.clamp_min(1) if isinstance(t, torch.Tensor) else max(t, 1)


def check_slots(name: str, slots: torch.Tensor, size: int, check_values: bool) -> None:
    """Slot lengths must divide by 2P. Reading them needs the values: always on the CPU, on
    CUDA only when asked (NVTE_ATTN_VALIDATE=1), since it is a device-to-host sync."""
    if not check_values:
        return
    lengths = torch.diff(slots.long())
    bad = lengths % (2 * size) != 0
    if bool(bad.any()):
        raise ValueError(
            f"{name}: every slot length must be divisible by 2 x cp size = {2 * size} under context "
            f"parallelism; got slot lengths {lengths.tolist()}"
        )


def _check_split(cp_size: int, cp_rank: int) -> None:
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int; got {cp_size!r}")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, {cp_size}); got {cp_rank!r}")


def get_cp_partition_indices(cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Rows of a packed THD tensor (``total_tokens`` rows) that rank ``cp_rank`` holds, in its
    local order: ``x_local = x.index_select(0, idx)``. int64, length total_tokens // cp_size.

    The tensor's values are read (slot lengths must divide by 2 x cp_size): meant for data
    loaders, not the attention hot path."""
    _check_split(cp_size, cp_rank)
    if not isinstance(cu_seqlens_padded, torch.Tensor) or cu_seqlens_padded.dim() != 1:
        raise TypeError(f"cu_seqlens_padded must be a 1-D integer tensor; got {type(cu_seqlens_padded).__name__}")
    total = int(total_tokens)
    if total % cp_size:
        raise ValueError(f"total_tokens must be divisible by cp_size={cp_size}; got {total}")
    slots = cu_seqlens_padded.long()
    check_slots("cu_seqlens_padded", slots, cp_size, True)
    if total < int(slots[-1]):
        raise ValueError(f"total_tokens={total} is smaller than cu_seqlens_padded[-1]={int(slots[-1])}")
    layout = ZigzagLayout(slots, torch.diff(slots), cp_size, cp_rank)
    return layout.global_rows(total // cp_size)


def _dense_indices(seq_len: int, cp_size: int, cp_rank: int, device) -> torch.Tensor:
    if seq_len % (2 * cp_size):
        raise ValueError(f"the sequence length must be divisible by 2 x cp_size = {2 * cp_size}; got {seq_len}")
    c = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c, device=device)
    return torch.cat([first, second])


def _seq_dim(qkv_format: str, seq_dim: Optional[int]) -> int:
    if seq_dim is not None:
        return seq_dim
    dims = {"thd": 0, "sbhd": 0, "bshd": 1}
    if qkv_format not in dims:
        raise ValueError(f"qkv_format must be one of thd, bshd, sbhd; got {qkv_format!r}")
    return dims[qkv_format]


def partition_for_context_parallel(
    x: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    qkv_format: str = "thd",
    cu_seqlens_padded: Optional[torch.Tensor] = None,
    seq_dim: Optional[int] = None,
) -> torch.Tensor:
    """The share of ``x`` that rank ``cp_rank`` passes to attention under context parallelism.

    ``qkv_format='thd'``: x is [T, ...] (or the token dim is ``seq_dim``) and
    ``cu_seqlens_padded`` gives the slots. ``'bshd'``/``'sbhd'``: the sequence dim (1 / 0, or
    ``seq_dim``) is split. Inverse: :func:`gather_context_parallel`."""
    _check_split(cp_size, cp_rank)
    dim = _seq_dim(qkv_format, seq_dim)
    if qkv_format == "thd":
        if cu_seqlens_padded is None:
            raise ValueError("qkv_format='thd' needs cu_seqlens_padded (the slots to split); got None")
        idx = get_cp_partition_indices(cu_seqlens_padded.to(x.device), x.shape[dim], cp_size, cp_rank)
    else:
        idx = _dense_indices(x.shape[dim], cp_size, cp_rank, x.device)
    return x.index_select(dim, idx)


def gather_context_parallel(
    parts: Sequence[torch.Tensor],
    qkv_format: str = "thd",
    cu_seqlens_padded: Optional[torch.Tensor] = None,
    seq_dim: Optional[int] = None,
) -> torch.Tensor:
    """Inverse of :func:`partition_for_context_parallel`: ``parts[r]`` is rank r's share; returns
    the tensor in global token order."""
    if not parts:
        raise ValueError("parts must hold one tensor per rank; got none")
    cp_size = len(parts)
    dim = _seq_dim(qkv_format, seq_dim)
    local = parts[0].shape[dim]
    out = parts[0].new_empty(*parts[0].shape[:dim], local * cp_size, *parts[0].shape[dim + 1 :])
    for rank, part in enumerate(parts):
        if qkv_format == "thd":
            if cu_seqlens_padded is None:
                raise ValueError("qkv_format='thd' needs cu_seqlens_padded (the slots to split); got None")
            idx = get_cp_partition_indices(cu_seqlens_padded.to(part.device), local * cp_size, cp_size, rank)
        else:
            idx = _dense_indices(local * cp_size, cp_size, rank, part.device)
        out.index_copy_(dim, idx, part)
    return out


def thd_get_partitioned_indices(cu_seqlens: torch.Tensor, total_tokens, world_size: int, rank: int) -> torch.Tensor:
    """``transformer_engine_torch.thd_get_partitioned_indices``: megatron-core's THD batch split.

    ``cu_seqlens`` are the PADDED offsets (every slot divisible by 2 x world_size);
    ``total_tokens`` an int or a 0-d tensor. Returns the rows this rank holds, with
    ``cu_seqlens``' dtype, length total_tokens // world_size."""
    total = int(total_tokens)
    return get_cp_partition_indices(cu_seqlens, total, int(world_size), int(rank)).to(cu_seqlens.dtype)
