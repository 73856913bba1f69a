"""An independent float64 reference, written as plainly as possible, one sequence at a time.

It shares no code with the package: the mask rule is spelled out here from TE's semantics.
"""

from __future__ import annotations

import math

import torch


def allowed_matrix(sq: int, skv: int, mask_type: str, window=None) -> torch.Tensor:
    """[sq, skv] bool: which keys query i may see (TE semantics, written out longhand)."""
    causal = "causal" in mask_type
    bottom_right = mask_type not in ("causal", "padding_causal")
    offset = skv - sq if bottom_right else 0
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    ok = torch.ones(sq, skv, dtype=torch.bool)
    for i in range(sq):
        for j in range(skv):
            if right >= 0 and j > i + offset + right:
                ok[i, j] = False
            if left >= 0 and j < i + offset - left:
                ok[i, j] = False
    return ok


def attend_one(q, k, v, allowed, scale, bias=None):
    """q [sq, h, d], k/v [skv, hg, d] -> [sq, h, dv] in float64; rows with no key give 0."""
    q, k, v = q.double(), k.double(), v.double()
    sq, h, _ = q.shape
    hg = k.shape[1]
    out = torch.zeros(sq, h, v.shape[-1], dtype=torch.float64)
    for head in range(h):
        kh = head // (h // hg)
        scores = q[:, head] @ k[:, kh].T * scale
        if bias is not None:
            scores = scores + bias[head].double()
        scores = scores.masked_fill(~allowed, -math.inf)
        probs = torch.softmax(scores, dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0)
        out[:, head] = probs @ v[:, kh]
    return out


def reference_thd(q, k, v, cu_q, cu_kv, off_q, off_kv, mask_types, windows, scale):
    """Packed reference: ``mask_types``/``windows`` are per-sequence lists. Rows outside any
    sequence are 0."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for i in range(len(cu_q) - 1):
        n, m = int(cu_q[i + 1] - cu_q[i]), int(cu_kv[i + 1] - cu_kv[i])
        a, c = int(off_q[i]), int(off_kv[i])
        if n == 0:
            continue
        allowed = allowed_matrix(n, m, mask_types[i], windows[i])
        out[a : a + n] = attend_one(q[a : a + n], k[c : c + m], v[c : c + m], allowed, scale)
    return out


def reference_dense(q, k, v, mask_type, window, scale, len_q=None, len_kv=None, arbitrary=None, bias=None):
    """[b, s, h, d] reference; padding is given as per-batch valid lengths (right padding)."""
    b, sq = q.shape[:2]
    skv = k.shape[1]
    out = torch.zeros(b, sq, q.shape[2], v.shape[-1], dtype=torch.float64)
    for i in range(b):
        n = sq if len_q is None else int(len_q[i])
        m = skv if len_kv is None else int(len_kv[i])
        allowed = allowed_matrix(n, m, mask_type, window)
        bias_i = None
        if bias is not None:
            bias_i = bias[i if bias.shape[0] > 1 else 0].expand(q.shape[2], sq, skv)[:, :n, :m]
        if arbitrary is not None:
            allowed = allowed & ~arbitrary[i if arbitrary.shape[0] > 1 else 0, 0, :n, :m]
        out[i, :n] = attend_one(q[i, :n], k[i, :m], v[i, :m], allowed, scale, bias_i)
    return out
