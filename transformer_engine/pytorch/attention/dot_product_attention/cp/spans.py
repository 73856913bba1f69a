"""The span interface context parallelism calls: :class:`SpanAdapter` over the selected
backend's kernel interface (its declaration's ``KERNEL``, ``backends/kernel_problem.py``; FA4,
cuDNN and the unfused backend have one), made by :func:`span_kernel`.

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
from functools import lru_cache
from typing import Any, Tuple

import torch

from ..backends import backend_label
from ..backends.kernel_problem import NO_FEATURES, KernelProblem, KernelRun, RowSpan
from ..masks import AttnMaskType, MaskSpec


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


@lru_cache(maxsize=256)
def step_spec(mask: StepMask) -> MaskSpec:
    """The mask policy of a span call: bottom-right causal with its left window, or full.
    Cached: a schedule asks for the same few masks on every step."""
    if mask.causal:
        return MaskSpec(AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT, (mask.window_left, 0))
    return MaskSpec(AttnMaskType.PADDING, (-1, -1))


def span_problem(qs: RowSpan, ks: RowSpan, mask: StepMask, scale: float) -> KernelProblem:
    """One span call as a one-run varlen problem: span starts as offsets, span lengths as
    valid lengths. Rows outside the spans are zeroed by :class:`SpanAdapter` (``covered``)."""
    run = KernelRun(0, step_spec(mask), qs.offsets, ks.offsets, qs.lengths, ks.lengths, qs.lengths.numel())
    return KernelProblem((run,), qs.max_len, ks.max_len, scale, True)


class SpanAdapter:
    """The span interface over a backend's kernel interface (``kernel``: forward, backward,
    stats_to_rows, stats_from_rows): rows outside the spans come out 0 (out, gradients) and
    -inf (LSE) here, once for every backend."""

    def __init__(self, kernel: Any):
        self.kernel = kernel

    def forward(self, q, k, v, qs: RowSpan, ks: RowSpan, mask: StepMask, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        out, stats = self.kernel.forward(q, k, v, span_problem(qs, ks, mask, scale), NO_FEATURES, True)
        lse = torch.where(qs.covered.view(1, -1), self.kernel.stats_to_rows(stats, qs), float("-inf"))
        return rows_zero(out, qs.covered), lse

    def backward(self, dout, q, k, v, out, lse, qs: RowSpan, ks: RowSpan, mask: StepMask, scale: float):
        stats = self.kernel.stats_from_rows(lse, qs, q)
        dout = dout if dout.stride() == out.stride() else dout.contiguous()
        dq, dk, dv, _, _ = self.kernel.backward(dout, q, k, v, out, stats, span_problem(qs, ks, mask, scale), NO_FEATURES,
                                                False)
        return rows_zero(dq, qs.covered), rows_zero(dk, ks.covered), rows_zero(dv, ks.covered)


@lru_cache(maxsize=None)
def _adapter(kernel: type) -> SpanAdapter:
    return SpanAdapter(kernel)


def span_kernel(backend: type, comm_type: str) -> SpanAdapter:
    """The span interface over ``backend``'s kernel interface (one adapter per kernel class).
    A backend without one (a scope forcing it past its declaration) is refused by name."""
    if backend.KERNEL is None:
        raise NotImplementedError(f"cp_comm_type={comm_type!r} runs its steps on a backend's kernel interface (FA4, cuDNN or "
                                  f"the unfused backend); {backend_label(backend)} has none (use cp_comm_type='a2a')")
    return _adapter(backend.KERNEL)
