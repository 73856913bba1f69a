"""The per-sequence arithmetic the stand-ins share (float64): a forward that returns each
row's log-sum-exp, and a backward from a given log-sum-exp, FlashAttention's written out (the
libraries' backwards take the forward's LSE or stats; context parallelism hands them the FINAL
one of its merged steps); and cuDNN's FP8 forward and backward, with the quantizations between
the products where the H200 puts them."""

from __future__ import annotations

import torch

from ..reference import scores

TILE = 16  # the stand-ins' tile along the sequence: K/V rows up to the next multiple enter the products


def tile_end(start: int, n: int, limit: int) -> int:
    """One past the last row a whole-tile read of rows [start, start + n) touches (<= limit)."""
    return min(start + -(-n // TILE) * TILE, limit)


def widen(ok: torch.Tensor, m: int) -> torch.Tensor:
    """[n, m0] -> [n, m]: a mask over the first m0 keys, the rest of a tile masked out."""
    out = torch.zeros(ok.shape[0], m, dtype=torch.bool)
    out[:, : ok.shape[1]] = ok
    return out


def _with_sink(s: torch.Tensor, sink) -> torch.Tensor:
    if sink is None:
        return s
    return torch.cat([s, sink.double().view(-1, 1, 1).expand(-1, s.shape[1], 1)], dim=-1)


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(s - lse); 0 in a row whose lse is -inf (nothing scored) or +inf (cuDNN's marker)."""
    finite = torch.isfinite(lse).unsqueeze(-1)
    return torch.where(finite, torch.exp(s - torch.where(finite, lse.unsqueeze(-1), 0.0)), 0.0)


def _repeat(t: torch.Tensor, h: int) -> torch.Tensor:
    return t.double().repeat_interleave(h // t.shape[1], dim=1)


def forward(q, k, v, ok, scale, bias=None, sink=None):
    """q [n, h, d], k/v [m, hg, *], ok [n, m] -> out [n, h, dv], lse [h, n] (float64). Masked
    scores are replaced, not added, so NaN in a masked K row vanishes; NaN in any V row the
    products read does not (its probability is 0, and 0 * NaN = NaN)."""
    s = scores(q, k, ok, scale, bias)
    lse = torch.logsumexp(_with_sink(s, sink), dim=-1)
    return torch.einsum("hnm,mhd->nhd", _probs(s, lse), _repeat(v, q.shape[1])), lse


def max_and_sum_exp(q, k, ok, scale, bias=None, sink=None):
    """The row max of the scores (the sink's logit included, as cuDNN's score max) and the row
    sum of exp(score - max): [h, n] each."""
    s = _with_sink(scores(q, k, ok, scale, bias), sink)
    row_max = s.amax(dim=-1)
    safe = torch.where(torch.isfinite(row_max), row_max, 0.0)
    return row_max, torch.exp(s - safe.unsqueeze(-1)).sum(dim=-1)


def _p_and_ds(dout, q, k, v, out, lse, scale, ok, bias=None):
    """P = exp(S - lse) and dS = P * (dO V^T - rowsum(dO * O)) (the gradient of the scaled
    scores), [h, n, m] each, and rowsum(dO * O) [h, n]."""
    p = _probs(scores(q, k, ok, scale, bias), lse.double())
    do = dout.double()
    delta = (do * out.double()).sum(-1).t()  # [h, n]: rowsum(dO * O)
    return p, p * (torch.einsum("nhd,mhd->hnm", do, _repeat(v, q.shape[1])) - delta.unsqueeze(-1)), delta


def _products(ds, p, dout, q, k, scale):
    """dq [n, h, d], dk/dv [m, hg, *] from dS and P (GQA: summed over each group)."""
    h, hg = q.shape[1], k.shape[1]
    dq = torch.einsum("hnm,mhd->nhd", ds, _repeat(k, h)) * scale
    dk = (torch.einsum("hnm,nhd->mhd", ds, q.double()) * scale).unflatten(1, (hg, h // hg)).sum(2)
    dv = torch.einsum("hnm,nhd->mhd", p, dout.double()).unflatten(1, (hg, h // hg)).sum(2)
    return dq, dk, dv


def backward(dout, q, k, v, out, lse, ok, scale, bias=None, sink=None):
    """dq [n, h, d], dk/dv [m, hg, *], dscores [h, n, m] (= dbias) and dsink [h] or None, from
    the given out and lse."""
    p, ds, delta = _p_and_ds(dout, q, k, v, out, lse, scale, ok, bias)
    dsink = None
    if sink is not None:
        p_sink = _probs(sink.double().view(-1, 1).expand_as(lse).unsqueeze(-1), lse.double()).squeeze(-1)
        dsink = -(p_sink * delta).sum(-1)
    return (*_products(ds, p, dout, q, k, scale), ds, dsink)


# ------------------------------------------------------------------ cuDNN's FP8 graphs


def forward_fp8(q, k, v, ok, scale, quantize_s):
    """cuDNN's FP8 forward of one sequence (q/k/v dequantized): each row's exp(s - rowmax)
    (largest value 1) goes through ``quantize_s`` before P V, the row sum divides after, as the
    H200 computes it. -> out [n, h, dv] (unquantized), lse [h, n] and the normalized P [h, n, m]
    (whose max is amax_s). A row that sees no key gives NaN: the caller leaves it unwritten."""
    s = scores(q, k, ok, scale)
    row_max, sum_exp = max_and_sum_exp(q, k, ok, scale)
    e = _probs(s, row_max)
    out = torch.einsum("hnm,mhd->nhd", quantize_s(e), _repeat(v, q.shape[1])) / sum_exp.t().unsqueeze(-1)
    return out, row_max + torch.log(sum_exp), e / sum_exp.unsqueeze(-1)


def backward_fp8(dout, q, k, v, out, lse, ok, scale, quantize_s, quantize_dp):
    """cuDNN's FP8 backward of one sequence (every input dequantized, ``out`` the FP8 O): the
    normalized P recomputed from the stats and quantized for dV, dP (the gradient of Q K^T,
    attn_scale included) quantized for dQ and dK. -> dq, dk, dv (unquantized) and dP [h, n, m]."""
    p, ds, _ = _p_and_ds(dout, q, k, v, out, lse, scale, ok)
    dp = ds * scale
    return (*_products(quantize_dp(dp), quantize_s(p), dout, q, k, 1.0), dp)
