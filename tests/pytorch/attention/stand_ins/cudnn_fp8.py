"""A CPU stand-in for the FP8 cuDNN ops (``cudnn_fp8_fwd``, ``cudnn_fp8_bwd``) and the BF16
backward op (``cudnn_bwd``, for NVTE_FP8_DPA_BWD=0): the computation cudnn-frontend's FP8 graphs
describe, written out per sequence in float32 from the FP8 inputs and the scalar tables, so
FusedAttention's FP8 wiring (casts, scales, slots, packing, dequantization) runs on the CPU.

It records every call's arguments. It writes only the rows it runs, as cuDNN does.
"""

from __future__ import annotations

import torch

from transformer_engine.pytorch.attention.dot_product_attention.backends import gap_rows
from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.fp8_graphs import (BWD_SCALARS,
                                                                                                  FWD_SCALARS)

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_F = {n: i for i, n in enumerate(FWD_SCALARS)}
_B = {n: i for i, n in enumerate(BWD_SCALARS)}


def cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m = FP8_MAX[dtype]
    return (x.float() * scale).clamp(-m, m).to(dtype)


def fake(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return cast(x, scale, dtype).float() / scale


def _rows(offsets, lengths, i: int, s: int):
    """(first row, count) of sequence i: varlen from offsets/lengths, dense from lengths."""
    start = 0 if offsets is None else int(offsets[i])
    n = s if lengths is None else int(lengths[i])
    return start, n


def _seq(t: torch.Tensor, i: int, start: int, n: int, varlen: bool) -> torch.Tensor:
    """[H, n, D] float32 of sequence i (its first n rows)."""
    rows = t[start:start + n] if varlen else t[i, start:start + n]
    return rows.float().transpose(0, 1)


def _mask(n: int, m: int, causal: bool, bottom_right: bool) -> torch.Tensor:
    """[n, m] True where attention is NOT allowed."""
    i = torch.arange(n).view(-1, 1)
    j = torch.arange(m).view(1, -1)
    shift = m - n if bottom_right else 0
    return (j > i + shift) if causal else torch.zeros(n, m, dtype=torch.bool)


def _probs(q, k, scale: float, causal: bool, bottom_right: bool):
    """P [H, n, m] and the LSE [H, n] of q [H, n, D] against k [HG, m, D] (GQA repeat)."""
    k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(_mask(q.shape[1], k.shape[1], causal, bottom_right), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0), lse


class FP8CudnnStandIn:
    zero_gap_rows = staticmethod(gap_rows.zero_gap_rows)
    zero_gap_rows_qkv = staticmethod(gap_rows.zero_gap_rows_qkv)

    def __init__(self):
        self.fwd, self.bwd, self.f16_bwd = [], [], []

    def cudnn_fp8_fwd(self, q8, k8, v8, o8, scalars, amaxes, oq, okv, lq, lkv, b, mq, mkv, scale, causal, bottom_right):
        self.fwd.append(dict(q8=q8, k8=k8, v8=v8, o8=o8, scalars=scalars.clone(), causal=causal, bottom_right=bottom_right,
                             offsets=(oq, okv), lengths=(lq, lkv), batch_size=b))
        t = scalars[:, 0]
        varlen = oq is not None
        stats = torch.zeros(b, q8.shape[-2], max(mq, 1), 1)
        amax_s = amax_o = torch.zeros(())
        for i in range(b):
            sq, n = _rows(oq, lq, i, q8.shape[1] if not varlen else mq)
            sk, m = _rows(okv, lkv, i, k8.shape[1] if not varlen else mkv)
            q = _seq(q8, i, sq, n, varlen) * t[_F["descale_qkv"]]
            k, v = (_seq(x, i, sk, m, varlen) * t[_F["descale_qkv"]] for x in (k8, v8))
            p, lse = _probs(q, k, scale, causal, bottom_right)
            amax_s = torch.maximum(amax_s, p.amax() if p.numel() else amax_s)
            m = p.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) if p.numel() else p  # exp(s - rowmax) is quantized
            o = (fake(p / m, t[_F["scale_s"]], torch.float8_e4m3fn) * m) @ v.repeat_interleave(q.shape[0] // v.shape[0], dim=0)
            amax_o = torch.maximum(amax_o, o.abs().amax() if o.numel() else amax_o)
            rows = cast(o.transpose(0, 1), t[_F["scale_o"]], o8.dtype)
            if varlen:
                o8[sq:sq + n] = rows
            else:
                o8[i, :n] = rows
                o8[i, n:] = 1.0  # the H200's FP8 forward writes rows past a dense length: the caller clears them
            stats[i, :, :n, 0] = lse
        amaxes[0, 0], amaxes[1, 0] = amax_s, amax_o
        return stats

    def cudnn_fp8_bwd(self, do8, q8, k8, v8, o8, stats, dq8, dk8, dv8, scalars, amaxes, lq, lkv, b, mq, mkv, scale, causal,
                      bottom_right):
        self.bwd.append(dict(do8=do8, q8=q8, k8=k8, v8=v8, o8=o8, dq8=dq8, dk8=dk8, dv8=dv8, scalars=scalars.clone()))
        t = scalars[:, 0]
        found = torch.zeros(4)
        for i in range(b):
            n = q8.shape[1] if lq is None else int(lq[i])
            m = k8.shape[1] if lkv is None else int(lkv[i])
            grads = self._bwd_one(t, [x[i, :r].float().transpose(0, 1) for x, r in ((q8, n), (k8, m), (v8, m), (o8, n), (do8, n))],
                                  stats[i, :, :n, 0], scale, causal, bottom_right, found, do8.dtype)
            for buf, g, r in zip((dq8, dk8, dv8), grads, (n, m, m)):
                buf[i, :r] = cast(g.transpose(0, 1), t[_B["scale_dqkv"]], buf.dtype)
        amaxes[:, 0] = found

    @staticmethod
    def _bwd_one(t, seqs, lse, scale, causal, bottom_right, found, do_dtype):
        """dQ, dK, dV of one sequence, cuDNN's FP8 graph's way; raises ``found`` to the amaxes."""
        q, k, v, o, do = seqs
        q, k, v = (x * t[_B["descale_qkv"]] for x in (q, k, v))
        o, do = o * t[_B["descale_o"]], do * t[_B["descale_do"]]
        rep = q.shape[0] // k.shape[0]
        kr, vr = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
        scores = ((q @ kr.transpose(-1, -2)) * scale).masked_fill(_mask(q.shape[1], k.shape[1], causal, bottom_right), float("-inf"))
        p = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        dv = fake(p, t[_B["scale_s"]], torch.float8_e4m3fn).transpose(-1, -2) @ do
        dp = p * (do @ vr.transpose(-1, -2) - (do * o).sum(-1, keepdim=True)) * scale
        dp8 = fake(dp, t[_B["scale_dp"]], do_dtype)
        dq, dk = dp8 @ kr, dp8.transpose(-1, -2) @ q
        fold = lambda g: g.view(k.shape[0], rep, *g.shape[1:]).sum(1)  # noqa: E731  (GQA: sum over the group)
        dk, dv = fold(dk), fold(dv)
        for j, g in enumerate((dq, dk, dv, dp)):
            found[j] = torch.maximum(found[j], g.abs().amax())
        return dq, dk, dv

    def cudnn_bwd(self, dout, q, k, v, out, stats, dq, dk, dv, *args):
        """The BF16 backward (NVTE_FP8_DPA_BWD=0): float32 from the given stats, dense only."""
        self.f16_bwd.append(dict(dout=dout, q=q, k=k, v=v, out=out, stats=stats, args=args))
        scale, causal, bottom_right = args[7], args[8], args[11]
        for i in range(q.shape[0]):
            qs, ks, vs, os_, ds = (x[i].float().transpose(0, 1) for x in (q, k, v, out, dout))
            rep = qs.shape[0] // ks.shape[0]
            kr, vr = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
            sc = ((qs @ kr.transpose(-1, -2)) * scale).masked_fill(_mask(qs.shape[1], ks.shape[1], causal, bottom_right), float("-inf"))
            p = torch.exp(sc - stats[i, :, :, 0].unsqueeze(-1)).nan_to_num(0.0)
            ds_ = p * (ds @ vr.transpose(-1, -2) - (ds * os_).sum(-1, keepdim=True)) * scale
            fold = lambda g: g.view(ks.shape[0], rep, *g.shape[1:]).sum(1)  # noqa: E731
            dq[i] = (ds_ @ kr).transpose(0, 1).to(dq.dtype)
            dk[i] = fold(ds_.transpose(-1, -2) @ qs).transpose(0, 1).to(dk.dtype)
            dv[i] = fold(p.transpose(-1, -2) @ ds).transpose(0, 1).to(dv.dtype)
        return q.new_empty(0), q.new_empty(0)
