"""The unfused backend's kernel interface (``backends/kernel_problem.py``): plain PyTorch, the
same call shape as FA4's and cuDNN's kernels, so context parallelism wraps all three alike.

Shape legend: TQ/TK = rows of q / kv (a dense [B, S, H, D] problem runs as B*S rows),
H = query heads, HG = key/value heads, G = H / HG, D/Dv = head dims.

It runs plain softmax attention (no bias, ALiBi, dropout or sink: the module's unfused path,
``unfused_math``, carries those) in float32, float64 for float64 inputs, with an explicit
backward from the saved LSE. The scores are one [HG, G, TQ, TK] matrix for the whole problem,
every run's mask or-ed into it: memory grows with TQ * TK, which suits its callers (the span
calls of context parallelism on the CPU, and a GPU fallback at small sizes). No host syncs.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..masks import AttnMaskType, band_allowed
from .kernel_problem import KernelProblem, KernelRun, RowSpan, ScoreFeatures


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _side(offsets: Optional[torch.Tensor], lengths: Optional[torch.Tensor], rows: int, dense_len: int, batch: int, device):
    """(sequence, position, covered, length) of each of ``rows`` rows of one side of a run;
    a dense side (``offsets`` None) is ``batch`` slots of ``dense_len`` rows."""
    r = torch.arange(rows, device=device, dtype=torch.int64)
    if offsets is None:
        starts = torch.arange(batch + 1, device=device, dtype=torch.int64) * dense_len
    else:
        starts = offsets.long()
    lengths = torch.diff(starts) if lengths is None else lengths.long()
    b = max(starts.numel() - 1, 1)
    seq = (torch.searchsorted(starts, r, right=True) - 1).clamp(0, b - 1)
    pos = r - starts[seq]
    covered = (pos >= 0) & (pos < lengths[seq]) & (r < starts[-1]) if lengths.numel() else r < 0
    return seq, pos, covered, lengths


def run_allowed(run: KernelRun, tq: int, tk: int, sq: int, skv: int, device) -> torch.Tensor:
    """[TQ, TK] bool: key row j is visible to query row i in this run (same sequence, both
    rows inside their sequence, inside the band). Causal top-left masks put the diagonal at
    the first key; every other band is aligned to the last key (bottom-right)."""
    spec = run.spec
    if spec.mask_type is AttnMaskType.ARBITRARY:
        raise NotImplementedError("the unfused kernel interface runs band masks; attn_mask_type='arbitrary' takes the module path")
    seq_q, pos_q, cov_q, len_q = _side(run.offsets_q, run.seqused_q, tq, sq, run.batch_size, device)
    seq_k, pos_k, cov_k, len_k = _side(run.offsets_kv, run.seqused_kv, tk, skv, run.batch_size, device)
    shift = (len_k - len_q)[seq_q].view(-1, 1) if spec.mask_type.bottom_right else 0
    band = band_allowed(pos_q.view(-1, 1), pos_k.view(1, -1), shift, spec.left, spec.right)
    return (seq_q.view(-1, 1) == seq_k.view(1, -1)) & cov_q.view(-1, 1) & cov_k.view(1, -1) & band


def problem_allowed(problem: KernelProblem, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Every run's visible pairs, or-ed (runs own disjoint sequences)."""
    dense = not problem.varlen
    tq, tk = (q.shape[0] * q.shape[1], k.shape[0] * k.shape[1]) if dense else (q.shape[0], k.shape[0])
    sq, skv = (q.shape[1], k.shape[1]) if dense else (0, 0)
    allowed = None
    for run in problem.runs:
        mine = run_allowed(run, tq, tk, sq, skv, q.device)
        allowed = mine if allowed is None else allowed | mine
    return allowed


def _no_features(features: ScoreFeatures) -> None:
    used = [name for name, on in (("a bias", features.bias is not None), ("ALiBi", features.alibi),
                                  ("dropout", features.dropout_p > 0), ("a sink", features.sink is not None)) if on]
    if used:
        raise NotImplementedError(f"the unfused kernel interface runs plain softmax attention; got {', '.join(used)} "
                                  "(the module's unfused path runs them)")


def _rows(t: torch.Tensor, varlen: bool) -> torch.Tensor:
    return t if varlen else t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def _grouped(t: torch.Tensor, hg: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, H, D] -> [HG, H/HG, T, D] in ``dtype`` (query heads h*G..h*G+G-1 share kv head h)."""
    rows, h, d = t.shape
    return t.to(dtype).permute(1, 0, 2).reshape(hg, h // hg, rows, d)


class UnfusedKernel:
    """The kernel interface in plain PyTorch (see the module docstring). ``stats`` is ``[lse]``,
    lse [H, TQ] by row (-inf on rows that see no key), so the row form is the stats itself."""

    @staticmethod
    def _probs(q, k, problem: KernelProblem, lse: Optional[torch.Tensor] = None):
        """(probabilities [HG, G, TQ, TK], lse [HG, G, TQ, 1], q and k grouped) in the
        accumulation dtype; from the given ``lse`` (the backward's) or a fresh one."""
        dtype = _acc_dtype(q)
        qr, kr = _rows(q, problem.varlen), _rows(k, problem.varlen)
        hg = kr.shape[1]
        qf = _grouped(qr, hg, dtype)
        kf = kr.to(dtype).permute(1, 0, 2).unsqueeze(1)  # [HG, 1, TK, D]
        s = (qf @ kf.transpose(-1, -2)) * problem.softmax_scale
        s = s.masked_fill(~problem_allowed(problem, q, k), float("-inf"))
        if lse is None:
            lse = torch.logsumexp(s, dim=-1, keepdim=True)  # -inf on rows with no visible key
        else:
            lse = lse.to(dtype).reshape(hg, -1, qr.shape[0], 1)
        empty = torch.isinf(lse)
        p = torch.where(empty, 0, torch.exp(s - torch.where(empty, 0, lse)))
        return p, lse, qf, kf

    @classmethod
    def forward(cls, q, k, v, problem: KernelProblem, features: ScoreFeatures, need_lse: bool) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        _no_features(features)
        p, lse, _, _ = cls._probs(q, k, problem)
        hg, g, tq, _ = p.shape
        vf = _rows(v, problem.varlen).to(p.dtype).permute(1, 0, 2).unsqueeze(1)
        out = (p @ vf).reshape(hg * g, tq, -1).permute(1, 0, 2).to(q.dtype)
        out = out if problem.varlen else out.reshape(*q.shape[:2], *out.shape[1:])
        return out, [lse.reshape(hg * g, tq)]

    @classmethod
    def backward(cls, dout, q, k, v, out, stats, problem: KernelProblem, features: ScoreFeatures, need_dbias: bool):
        """dq, dk, dv from ``out`` and its LSE (under context parallelism the FINAL ones, so each
        call's gradients are exact parts of the whole); no bias or sink gradients (None)."""
        _no_features(features)
        p, _, qf, kf = cls._probs(q, k, problem, stats[0])
        hg, g, tq, _ = p.shape
        dtype = p.dtype
        vf = _rows(v, problem.varlen).to(dtype).permute(1, 0, 2).unsqueeze(1)
        do = _grouped(_rows(dout, problem.varlen), hg, dtype)
        o = _grouped(_rows(out, problem.varlen), hg, dtype)
        delta = (do * o).sum(-1, keepdim=True)
        ds = p * (do @ vf.transpose(-1, -2) - delta)
        dq = ((ds @ kf) * problem.softmax_scale).reshape(hg * g, tq, -1).permute(1, 0, 2)
        dk = ((ds.transpose(-1, -2) @ qf) * problem.softmax_scale).sum(1).permute(1, 0, 2)
        dv = (p.transpose(-1, -2) @ do).sum(1).permute(1, 0, 2)
        grads = [t.to(like.dtype).reshape(like.shape) for t, like in ((dq, q), (dk, k), (dv, v))]
        return grads[0], grads[1], grads[2], None, None

    @staticmethod
    def stats_to_rows(stats: List[torch.Tensor], qs: RowSpan) -> torch.Tensor:
        return stats[0]

    @staticmethod
    def stats_from_rows(lse: torch.Tensor, qs: RowSpan, q: torch.Tensor) -> List[torch.Tensor]:
        return [lse]
