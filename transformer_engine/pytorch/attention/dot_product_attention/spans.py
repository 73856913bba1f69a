"""The span interface every GPU backend and the unfused one implement for context parallelism
(``UnfusedSpanKernel``, ``FA4SpanKernel``, ``CudnnSpanKernel``, each in its backend's file;
``cp_kernels.KERNELS`` maps a selection to one).

Shape legend: TQ/TK = rows of the local q / kv tensors, B = sequences, H = query heads,
HG = key/value heads, D/Dv = head dims.

One call says, per sequence b, "query rows ``[qs.offsets[b], qs.offsets[b] + qs.lengths[b])``
attend key rows ``[ks.offsets[b], ks.offsets[b] + ks.lengths[b])``" under a plain mask: full,
or causal aligned bottom-right (to the last key of the span) with an optional left window.
That is enough to express every ring step and every all-gather chunk without a host sync::

    forward(q, k, v, qs, ks, mask, scale)                 -> out [TQ, H, Dv], lse [H, TQ] fp32
    backward(dout, q, k, v, out, lse, qs, ks, mask, scale) -> dq, dk, dv

Rows outside the spans: ``out`` 0, ``lse`` -inf, gradients 0. The backward takes the FINAL
(merged) ``out``/``lse`` of the whole attention, so each step's gradients are exact parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowSpan:
    """One side of a call: per-sequence row ranges and which rows of the tensor they cover."""

    offsets: torch.Tensor  # [B+1] int32, non-decreasing (span starts; the last entry bounds them)
    lengths: torch.Tensor  # [B] int32
    max_len: int  # a host bound on every length
    seq: torch.Tensor  # [T] int64 sequence of each row (clamped)
    covered: torch.Tensor  # [T] bool

    @property
    def pos(self) -> torch.Tensor:
        rows = torch.arange(self.seq.numel(), device=self.seq.device)
        return rows - self.offsets.long()[self.seq]


def make_span(slot_starts: torch.Tensor, shift: torch.Tensor, lengths: torch.Tensor, total_rows: int, max_len: int) -> RowSpan:
    """Spans ``[slot_starts[b] + shift[b], + lengths[b])`` of a tensor with ``total_rows`` rows."""
    starts = slot_starts[:-1] + shift
    offsets = torch.cat([starts, slot_starts[-1:]]).to(torch.int32)
    rows = torch.arange(total_rows, device=starts.device, dtype=torch.int64)
    b = max(starts.numel(), 1)
    seq = (torch.searchsorted(offsets.long(), rows, right=True) - 1).clamp(0, b - 1)
    rel = rows - offsets.long()[seq]
    covered = (rel >= 0) & (rel < lengths.long()[seq]) if starts.numel() else rows < 0
    return RowSpan(offsets, lengths.to(torch.int32), max(min(max_len, total_rows), 1), seq, covered)


@dataclass(frozen=True)
class StepMask:
    """Full attention, or causal aligned to the last key with an optional left window."""

    causal: bool = False
    window_left: int = -1


def rows_zero(t: torch.Tensor, covered: torch.Tensor) -> torch.Tensor:
    return torch.where(covered.view(-1, *([1] * (t.dim() - 1))), t, torch.zeros((), dtype=t.dtype, device=t.device))
