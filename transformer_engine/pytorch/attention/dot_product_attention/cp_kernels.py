"""The local kernel interface context parallelism is written on, and its three implementations.

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
from typing import Tuple

import torch

from .backends import kernel_ops
from .backends.cudnn import stats_shape
from .backends.flash_common import fa_mask_args
from .masks import AttnMaskType, MaskSpec


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


def _rows_zero(t: torch.Tensor, covered: torch.Tensor) -> torch.Tensor:
    return torch.where(covered.view(-1, *([1] * (t.dim() - 1))), t, torch.zeros((), dtype=t.dtype, device=t.device))


# ---------------------------------------------------------------------------------- unfused


class UnfusedCPKernel:
    """Plain PyTorch, float32 (float64 for float64 inputs), explicit backward from the LSE.

    Scores are [HG, G, TQ, TK] for the whole call: memory grows with TQ * TK, which is fine on
    the CPU tests and as a GPU fallback at small sizes."""

    @staticmethod
    def _allowed(qs: RowSpan, ks: RowSpan, mask: StepMask) -> torch.Tensor:
        allowed = (qs.seq[:, None] == ks.seq[None, :]) & qs.covered[:, None] & ks.covered[None, :]
        if mask.causal:
            diag = qs.pos + (ks.lengths.long() - qs.lengths.long())[qs.seq]
            kpos = ks.pos[None, :]
            allowed = allowed & (kpos <= diag[:, None])
            if mask.window_left >= 0:
                allowed = allowed & (kpos >= diag[:, None] - mask.window_left)
        return allowed

    @staticmethod
    def _scores(q, k, allowed, scale):
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        tq, h, d = q.shape
        hg = k.shape[1]
        qf = q.to(dtype).permute(1, 0, 2).reshape(hg, h // hg, tq, d)
        kf = k.to(dtype).permute(1, 0, 2).unsqueeze(1)  # [HG, 1, TK, D]
        s = (qf @ kf.transpose(-1, -2)) * scale
        return s.masked_fill(~allowed, float("-inf")), qf, kf

    @staticmethod
    def _probs(s, lse):
        hg, g, tq, _ = s.shape
        lse = lse.to(s.dtype).reshape(hg, g, tq, 1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0, lse))
        return torch.where(torch.isinf(lse), 0, p)

    @classmethod
    def forward(cls, q, k, v, qs, ks, mask, scale) -> Tuple[torch.Tensor, torch.Tensor]:
        s, _, _ = cls._scores(q, k, cls._allowed(qs, ks, mask), scale)
        hg, g, tq, _ = s.shape
        lse = torch.logsumexp(s, dim=-1, keepdim=True)  # -inf on rows with no allowed key
        p = cls._probs(s, lse)
        vf = v.to(s.dtype).permute(1, 0, 2).unsqueeze(1)
        out = (p @ vf).reshape(hg * g, tq, -1).permute(1, 0, 2)
        # float32 LSE (float64 for float64 inputs, so the tests can hold float64 tolerances)
        return out.to(q.dtype), lse.reshape(hg * g, tq).to(torch.float64 if q.dtype == torch.float64 else torch.float32)

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, qs, ks, mask, scale):
        s, qf, kf = cls._scores(q, k, cls._allowed(qs, ks, mask), scale)
        hg, g, tq, _ = s.shape
        p = cls._probs(s, lse)
        vf = v.to(s.dtype).permute(1, 0, 2).unsqueeze(1)
        do = dout.to(s.dtype).permute(1, 0, 2).reshape(hg, g, tq, -1)
        o = out.to(s.dtype).permute(1, 0, 2).reshape(hg, g, tq, -1)
        delta = (do * o).sum(-1, keepdim=True)
        ds = p * (do @ vf.transpose(-1, -2) - delta)
        dq = (ds @ kf) * scale
        dk = ((ds.transpose(-1, -2) @ qf) * scale).sum(1)
        dv = (p.transpose(-1, -2) @ do).sum(1)
        dq = dq.reshape(hg * g, tq, -1).permute(1, 0, 2)
        return dq.to(q.dtype), dk.permute(1, 0, 2).to(k.dtype), dv.permute(1, 0, 2).to(v.dtype)


# ---------------------------------------------------------------------------------- FA4


def _fa_window(mask: StepMask) -> Tuple[bool, int, int]:
    spec = MaskSpec(AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT if mask.causal else AttnMaskType.PADDING,
                    (mask.window_left, 0) if mask.causal else (-1, -1))
    return fa_mask_args(spec)


class FA4CPKernel:
    """flash_attn.cute through the registered ops: span starts as ``cu_seqlens``, lengths as
    ``seqused``; its varlen LSE is [H, T] by physical row, which is this interface's layout.
    FA4 leaves skipped rows unwritten, so they are set to 0 / -inf here."""

    @staticmethod
    def forward(q, k, v, qs, ks, mask, scale):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        kernel_ops.ops.fa4_fwd(q, k, v, out, lse, qs.offsets, ks.offsets, qs.lengths, ks.lengths, qs.max_len, ks.max_len, scale,
                    *_fa_window(mask))
        lse = torch.where(qs.covered.view(1, -1), lse, float("-inf"))
        return _rows_zero(out, qs.covered), lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, qs, ks, mask, scale):
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        # The kernel reads lse of covered rows only; -inf elsewhere is never read.
        kernel_ops.ops.fa4_bwd(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, qs.offsets, ks.offsets, qs.lengths, ks.lengths,
                    qs.max_len, ks.max_len, scale, *_fa_window(mask), torch.are_deterministic_algorithms_enabled())
        return _rows_zero(dq, qs.covered), _rows_zero(dk, ks.covered), _rows_zero(dv, ks.covered)


# ---------------------------------------------------------------------------------- cuDNN


class CudnnCPKernel:
    """cuDNN graph SDPA: span starts as ragged offsets, lengths as per-sequence lengths. Its
    stats are [B, H, SQ, 1] by position in the span; they are moved to/from [H, TQ] by a
    gather (sync-free)."""

    @staticmethod
    def _args(qs, ks, mask, scale):
        left, right = (mask.window_left, 0) if mask.causal else (-1, -1)
        # Bottom-right: the diagonal sits at the span's last key (spans of q and kv differ).
        return (qs.offsets, ks.offsets, qs.lengths, ks.lengths, qs.lengths.numel(), qs.max_len, ks.max_len, scale,
                mask.causal, left, right, True)

    @staticmethod
    def _stat_index(qs: RowSpan, b: int, sq: int) -> torch.Tensor:
        """[TQ] flat index into [B, SQ] of each row's stat (clamped where not covered)."""
        return qs.seq * sq + qs.pos.clamp(0, sq - 1)

    @classmethod
    def forward(cls, q, k, v, qs, ks, mask, scale):
        out, stats = kernel_ops.ops.cudnn_fwd(q, k, v, *cls._args(qs, ks, mask, scale))
        b, h, sq, _ = stats.shape
        flat = stats.view(b, h, sq).permute(1, 0, 2).reshape(h, b * sq)
        lse = flat[:, cls._stat_index(qs, b, sq)]
        lse = torch.where(qs.covered.view(1, -1), lse, float("-inf"))
        return _rows_zero(out, qs.covered), lse

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, qs, ks, mask, scale):
        b, sq = qs.lengths.numel(), max(qs.max_len, 1)
        h = q.shape[1]
        index = qs.offsets.long()[:-1].view(b, 1) + torch.arange(sq, device=q.device).view(1, sq)
        index = index.clamp(0, q.shape[0] - 1)
        stats = lse[:, index.flatten()].view(h, b, sq).permute(1, 0, 2).reshape(*stats_shape(q, b, sq)).contiguous()
        dout = dout if dout.stride() == out.stride() else dout.contiguous()
        dq, dk, dv, *_ = kernel_ops.ops.cudnn_bwd(dout, q, k, v, out, stats, *cls._args(qs, ks, mask, scale),
                                      torch.are_deterministic_algorithms_enabled())
        return _rows_zero(dq, qs.covered), _rows_zero(dk, ks.covered), _rows_zero(dv, ks.covered)


KERNELS = {
    "UnfusedDotProductAttention": UnfusedCPKernel,
    "FlashAttention v4": FA4CPKernel,
    "FusedAttention": CudnnCPKernel,
}
