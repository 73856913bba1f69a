"""The float64 oracle of every test: attention written out as plainly as possible, one sequence
at a time, from TE's documented semantics. It shares no code with the package.

TE's rules, as this file spells them:

- ``attention_mask`` aside, a mask is a band around a diagonal. ``causal`` and ``padding_causal``
  put the diagonal top-left (query i sees keys j <= i); every other mask, windows and ALiBi
  included, puts it bottom-right (j <= i + skv - sq). A causal mask has right bound 0.
- ``window_size=(left, right)``: key j is visible to query i when
  ``i + shift - left <= j <= i + shift + right``; -1 leaves that side unbounded.
- ALiBi adds ``-slope * |j - i - shift|`` with the same diagonal; the standard slopes are
  ALiBi's geometric ones.
- A sink (``softmax_type`` off-by-one / learnable) is one more logit per head in every softmax
  denominator, with no value vector.
- A query that sees no key (and has no sink) gives 0, with no NaN in any gradient.

Dropout is not modelled: tests with dropout check what a correct dropout must satisfy instead.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

TOP_LEFT_MASKS = ("causal", "padding_causal")


# ------------------------------------------------------------------------------------ masks


def band(n: int, m: int, left: int, right: int, shift: int) -> torch.Tensor:
    """[n, m] bool: key j visible to query i when i + shift - left <= j <= i + shift + right
    (-1: that side unbounded). The libraries' masks are all of this form."""
    i = torch.arange(n).view(n, 1)
    j = torch.arange(m).view(1, m)
    ok = torch.ones(n, m, dtype=torch.bool)
    if right >= 0:
        ok &= j <= i + shift + right
    if left >= 0:
        ok &= j >= i + shift - left
    return ok


def diagonal_shift(n: int, m: int, mask: str) -> int:
    """Where query 0's diagonal meets the keys: 0 top-left, skv - sq bottom-right."""
    return 0 if mask in TOP_LEFT_MASKS else m - n


def allowed_matrix(n: int, m: int, mask: str = "no_mask", window=None) -> torch.Tensor:
    """[n, m] bool: which keys each of ``n`` queries may see among ``m``, by TE's rules."""
    left, right = window if window is not None else (-1, -1)
    if "causal" in mask:
        right = 0
    return band(n, m, left, right, diagonal_shift(n, m, mask))


# ------------------------------------------------------------------------------------ ALiBi


def standard_slopes(h: int) -> torch.Tensor:
    """ALiBi's geometric slopes (Press et al.): for a power of two n, 2^(-8i/n), i = 1..n;
    otherwise those of the largest power of two below h, then every other slope of twice it."""
    def geometric(n):
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]

    p = 2 ** int(math.floor(math.log2(h)))
    return torch.tensor(geometric(p) + geometric(2 * p)[0::2][: h - p], dtype=torch.float64)


def alibi_bias(n: int, m: int, mask: str, slopes: torch.Tensor) -> torch.Tensor:
    """[h, n, m]: -slope * |j - i - shift|, the diagonal placed as the mask places it."""
    i = torch.arange(n, dtype=torch.float64).view(n, 1)
    j = torch.arange(m, dtype=torch.float64).view(1, m)
    distance = (j - i - diagonal_shift(n, m, mask)).abs().to(slopes.device)
    return -slopes.double().view(-1, 1, 1) * distance


# ------------------------------------------------------------------------------------ one sequence


def scores(q, k, allowed, scale, bias=None) -> torch.Tensor:
    """[h, n, m] float64: the scaled scores (+ bias), -inf where not allowed; k repeated per
    query head for GQA (query head i reads kv head i // (h // hg))."""
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.einsum("nhd,mhd->hnm", q.double(), k) * scale
    if bias is not None:
        s = s + bias.double().to(s.device)
    return s.masked_fill(~allowed.to(s.device), -math.inf)


def probabilities(q, k, allowed, scale, bias=None, sink=None) -> torch.Tensor:
    """[h, n, m] float64: the softmax of :func:`scores` over each query's keys; with a ``sink``
    [h], one more logit per head in the denominator (its own column dropped); a query that sees
    no key (and has no sink) gets a row of 0."""
    s = scores(q, k, allowed, scale, bias)
    if sink is not None:
        column = sink.double().to(s.device).view(-1, 1, 1).expand(-1, s.shape[1], 1)
        s = torch.cat([s, column], dim=-1)
    live = torch.isfinite(s).any(dim=-1, keepdim=True)
    probs = torch.softmax(torch.where(live, s, 0.0), dim=-1) * live
    return probs if sink is None else probs[..., :-1]


def attend_one(q, k, v, allowed, scale, bias=None, sink=None) -> torch.Tensor:
    """q [n, h, d], k/v [m, hg, d|dv] -> [n, h, dv] float64. ``allowed`` [n, m] bool, ``bias``
    [h, n, m] (after scaling), ``sink`` [h] (one more logit per head, no value) or None."""
    probs = probabilities(q, k, allowed, scale, bias, sink)
    v = v.double().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.einsum("hnm,mhd->nhd", probs, v)


def max_logit_one(q, k, allowed, scale, bias=None) -> torch.Tensor:
    """[h]: the largest allowed scaled score (+ bias) per head; -inf where none is allowed."""
    s = scores(q, k, allowed, scale, bias)
    return s.flatten(1).amax(dim=1) if s[0].numel() else s.new_full((q.shape[1],), -math.inf)


# ------------------------------------------------------------------------------------ batches

def _per_seq(value, b: int) -> list:
    """A per-sequence list as given, or one value for every sequence."""
    return list(value) if isinstance(value, list) else [value] * b


def reference_thd(q, k, v, cu_q, cu_kv, off_q, off_kv, masks, windows, scale, sink=None,
                  slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Packed [T, h, d] -> [T, h, dv] float64. Sequence i has cu[i+1] - cu[i] tokens from row
    off[i]; ``masks`` / ``windows`` are one per sequence (a list) or one for all; rows outside
    every sequence are 0. ``slopes`` [h]: ALiBi."""
    b = len(cu_q) - 1
    masks, windows = _per_seq(masks, b), _per_seq(windows, b)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64, device=q.device)
    for i in range(b):
        n, m = int(cu_q[i + 1]) - int(cu_q[i]), int(cu_kv[i + 1]) - int(cu_kv[i])
        a, c = int(off_q[i]), int(off_kv[i])
        if n == 0:
            continue
        bias = None if slopes is None else alibi_bias(n, m, masks[i], slopes)
        out[a : a + n] = attend_one(q[a : a + n], k[c : c + m], v[c : c + m], allowed_matrix(n, m, masks[i], windows[i]),
                                    scale, bias, sink)
    return out


def reference_dense(q, k, v, mask, window, scale, len_q=None, len_kv=None, arbitrary=None, bias=None, slopes=None,
                    sink=None) -> torch.Tensor:
    """[b, s, h, d] -> [b, sq, h, dv] float64. Padding as per-entry valid lengths (the padded
    rows of the output are 0); ``arbitrary`` [b|1, 1, sq, skv] True = masked out; ``bias``
    [b|1, h|1, sq, skv] or [1, 1, 1, skv]; ``slopes`` [h] or [b, h]: ALiBi."""
    b, sq, h = q.shape[:3]
    skv = k.shape[1]
    out = torch.zeros(b, sq, h, v.shape[-1], dtype=torch.float64, device=q.device)
    for i in range(b):
        n = sq if len_q is None else int(len_q[i])
        m = skv if len_kv is None else int(len_kv[i])
        ok = allowed_matrix(n, m, mask, window)
        if arbitrary is not None:
            ok = ok & ~arbitrary[i if arbitrary.shape[0] > 1 else 0, 0, :n, :m].cpu()
        bias_i = None
        if bias is not None:
            bias_i = bias[i if bias.shape[0] > 1 else 0].expand(h, sq, skv)[:, :n, :m]
        elif slopes is not None:
            bias_i = alibi_bias(n, m, mask, slopes[i] if slopes.dim() == 2 else slopes)
        out[i, :n] = attend_one(q[i, :n], k[i, :m], v[i, :m], ok, scale, bias_i, sink)
    return out
