"""The span kernels context parallelism runs, by selected backend: :class:`.spans.SpanAdapter`
over FA4's and cuDNN's kernel interface, and the unfused reference's own span kernel (below)."""

from __future__ import annotations

from typing import Tuple

import torch

from ..backends.cudnn import _CudnnKernel
from ..backends.fa4 import _FA4Kernel
from ..backends.kernel_problem import RowSpan
from .spans import SpanAdapter, StepMask

class UnfusedSpanKernel:
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


KERNELS = {
    "UnfusedDotProductAttention": UnfusedSpanKernel,
    "FlashAttention v4": SpanAdapter(_FA4Kernel),
    "FusedAttention": SpanAdapter(_CudnnKernel),
}
