"""Packed-sequence (THD) metadata: offsets, lengths and per-token facts, all sync-free.

Shape legend: T = total tokens of the packed tensor, B = number of sequences.

``cu_seqlens`` holds cumulative VALID lengths; ``cu_seqlens_padded`` holds cumulative PHYSICAL
offsets (each slot = a sequence followed by its padding). For ``a a a _ b b _ _ c c c c _``::

    cu_seqlens        = [0, 3, 5, 9]
    cu_seqlens_padded = [0, 4, 8, 13]

Everything here reads only shapes on the host; values stay on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .environment import Switch


def check_cu_seqlens(name: str, t: Optional[torch.Tensor], batch_size: Optional[int] = None) -> None:
    """Host-only checks of a cu_seqlens tensor: type, rank, dtype and length."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D int32 tensor of length batch_size+1; got {type(t).__name__}")
    if t.dim() != 1 or t.dtype != torch.int32 or t.numel() < 1:
        raise ValueError(
            f"{name} must be a 1-D int32 tensor of length batch_size+1; got shape {tuple(t.shape)}, dtype {t.dtype}"
        )
    if batch_size is not None and t.numel() != batch_size + 1:
        raise ValueError(
            f"{name} must have length batch_size+1 = {batch_size + 1} like the other cu_seqlens; got {t.numel()}"
        )


def infer_pad_between_seqs(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: Optional[torch.Tensor],
    cu_seqlens_kv_padded: Optional[torch.Tensor],
) -> bool:
    """Upstream's sync-free inference: gaps exist unless the padded offsets are absent or are
    the very same tensors as the unpadded ones (identity, not values: comparing values syncs)."""

    def same(padded, plain):
        return padded is None or padded is plain

    return not (same(cu_seqlens_q_padded, cu_seqlens_q) and same(cu_seqlens_kv_padded, cu_seqlens_kv))


_VALIDATE = Switch("NVTE_ATTN_VALIDATE")


def validation_enabled() -> bool:
    """Value checks that need a device-to-host sync run only when NVTE_ATTN_VALIDATE=1."""
    return _VALIDATE.get("0") == "1"


@dataclass(frozen=True)
class PackedSeqs:
    """One side (queries or keys/values) of a packed batch.

    ``offsets`` are the physical starts ([B+1]); they are ``cu_seqlens`` itself when the batch
    has no gaps. ``max_seqlen`` is a Python int bounding every valid length.
    """

    cu_seqlens: torch.Tensor
    offsets: torch.Tensor
    max_seqlen: int
    total_tokens: int

    @property
    def batch_size(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def has_gaps(self) -> bool:
        return self.offsets is not self.cu_seqlens

    def seqlens(self) -> torch.Tensor:
        """Valid length of each sequence, [B] int32 (one op: diff costs less host time than two
        slices and a subtraction)."""
        return torch.diff(self.cu_seqlens)

    def token_seq_ids(self) -> torch.Tensor:
        """Sequence index of each token row, [T] int64; rows past the last slot get B."""
        rows = torch.arange(self.total_tokens, device=self.offsets.device, dtype=torch.int32)
        return torch.searchsorted(self.offsets, rows, right=True) - 1

    def token_valid(self) -> torch.Tensor:
        """[T] bool: True on rows that hold a token of some sequence (not gaps, not the tail)."""
        rows = torch.arange(self.total_tokens, device=self.offsets.device, dtype=torch.int64)
        seq = self.token_seq_ids().clamp(0, max(self.batch_size - 1, 0))
        if self.batch_size == 0:
            return torch.zeros_like(rows, dtype=torch.bool)
        start = self.offsets.long()[seq]
        length = self.seqlens().long()[seq]
        return (rows >= start) & (rows < start + length)

    def validate_values(self, name: str) -> None:
        """Debug-only checks (they sync): monotonic offsets, slots large enough, within T."""
        lengths = self.seqlens()
        if bool((lengths < 0).any()):
            raise ValueError(f"{name} must be non-decreasing; got {self.cu_seqlens.tolist()}")
        slots = self.offsets[1:] - self.offsets[:-1]
        if bool((slots < lengths).any()):
            raise ValueError(
                f"{name}_padded slots must hold each sequence: slots {slots.tolist()}, lengths {lengths.tolist()}"
            )
        if int(self.offsets[-1]) > self.total_tokens:
            raise ValueError(
                f"{name} ends at token {int(self.offsets[-1])} but the tensor has {self.total_tokens} tokens"
            )
        if lengths.numel() and int(lengths.max()) > self.max_seqlen:
            raise ValueError(f"max_seqlen for {name} is {self.max_seqlen} but a sequence has {int(lengths.max())}")


def make_packed(
    name: str,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: Optional[torch.Tensor],
    pad_between_seqs: bool,
    max_seqlen: Optional[int],
    total_tokens: int,
) -> PackedSeqs:
    """Build one side's metadata. ``max_seqlen`` is derived (with a sync) only when absent."""
    if pad_between_seqs and cu_seqlens_padded is None:
        raise ValueError(f"pad_between_seqs=True needs {name}_padded (the physical offsets); got None")
    offsets = cu_seqlens_padded if (pad_between_seqs and cu_seqlens_padded is not cu_seqlens) else cu_seqlens
    if max_seqlen is None:
        # Upstream does the same .item(); callers on the hot path pass it as an int.
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    elif not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < 0:
        raise TypeError(
            f"max_seqlen for {name} must be a non-negative Python int; got {max_seqlen!r} "
            f"(a tensor would force a device-to-host sync)"
        )
    return PackedSeqs(cu_seqlens, offsets, max_seqlen, total_tokens)
