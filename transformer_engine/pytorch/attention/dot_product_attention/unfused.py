"""Pure-PyTorch attention math: the backend that runs everywhere and the one the others are
checked against.

Shape legend: B = batch, H = query heads, HG = key/value heads, SQ/SKV = lengths, D = head dim,
T = packed tokens.

Equivalent, per sequence and head (``allowed`` from :mod:`.masks`, rows with no allowed key
give 0)::

    scores = q @ k.T * scale (+ bias)            # [SQ, SKV]
    probs  = softmax(scores where allowed else -inf)
    out    = dropout(probs) @ v

THD runs two ways with the same math. On the CPU, where reading offsets costs nothing, it loops
over sequences, so memory follows sum(s_i^2) and padded rows are never read. On a GPU it
gathers sequences into a [B, max_s] batch with device-side indices: no host sync, CUDA-graph
safe, at the cost of B * max_s^2 memory (it is the fallback there, not the fast path).
"""

from __future__ import annotations

import math
import os
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .masks import band_allowed
from .params import AttentionInputs
from .thd import PackedSeqs

IntOrTensor = Union[int, torch.Tensor]


def unfused_attention(inp: AttentionInputs, training: bool) -> torch.Tensor:
    """Run attention; returns [B, SQ, H, Dv] (dense) or [T, H, Dv] (THD)."""
    if not inp.is_thd:
        return _dense(inp, training)
    # Under torch.compile the gathered path traces (the per-sequence loop reads offsets).
    per_sequence = inp.q.device.type == "cpu" and not torch.compiler.is_compiling()
    if per_sequence and os.getenv("NVTE_UNFUSED_THD_GATHER", "0") != "1":
        return _thd_per_sequence(inp, training)
    return _thd_gathered(inp, training)


def default_alibi_slopes(num_heads: int) -> torch.Tensor:
    """The standard geometric ALiBi slopes (float32, [H]), extended for non-power-of-2 H."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = [2 ** (-8.0 * (i + 1) / closest) for i in range(closest)]
    if closest < num_heads:
        extra = [2 ** (-4.0 * (2 * i + 1) / closest) for i in range(num_heads - closest)]
        base += extra
    return torch.tensor(base, dtype=torch.float32)


def _core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: Optional[torch.Tensor],
    inp: AttentionInputs,
    bias: Optional[torch.Tensor],
    training: bool,
) -> torch.Tensor:
    """q [B, H, SQ, D], k/v [B, HG, SKV, D]; ``allowed``/``bias`` broadcast to [B|1, H|1, SQ, SKV].

    GQA groups query heads over their shared key head instead of copying K/V. Half inputs are
    computed in float32: this is the reference, accuracy first.
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, h, sq, d = q.shape
    hg = k.shape[1]
    qf = q.to(dtype).reshape(b, hg, h // hg, sq, d)
    kf, vf = k.to(dtype).unsqueeze(2), v.to(dtype).unsqueeze(2)
    scores = qf @ kf.transpose(-1, -2)
    if bias is not None and inp.bias_type == "pre_scale_bias":
        scores = (scores + _group_heads(bias.to(dtype), hg)) * inp.softmax_scale
    else:
        scores = scores * inp.softmax_scale
        if bias is not None:
            scores = scores + _group_heads(bias.to(dtype), hg)
    if allowed is not None:
        allowed = _group_heads(allowed, hg)
        scores = scores.masked_fill(~allowed, torch.finfo(dtype).min)
    probs = torch.softmax(scores, dim=-1)
    if allowed is not None:
        # A row with no allowed key softmaxes to uniform over "min": zero it, like the kernels.
        probs = probs.masked_fill(~allowed, 0.0)
    if inp.dropout_p > 0.0:
        probs = F.dropout(probs, p=inp.dropout_p, training=training)
    out = probs @ vf
    return out.reshape(b, h, sq, v.shape[-1]).to(q.dtype)


def _group_heads(t: torch.Tensor, hg: int) -> torch.Tensor:
    """[B', H'|1, SQ, SKV] -> [B', HG, G|1, SQ, SKV] to line up with grouped query heads."""
    if t.shape[1] == 1:
        return t.unsqueeze(1)
    return t.reshape(t.shape[0], hg, t.shape[1] // hg, *t.shape[2:])


def _band(
    spec_left: IntOrTensor, spec_right: IntOrTensor, shift: IntOrTensor, sq: int, skv: int, device
) -> torch.Tensor:
    """[.., SQ, SKV] bool from per-batch (or scalar) band bounds shaped [B, 1, 1, 1]."""
    qi = torch.arange(sq, device=device).view(sq, 1)
    kj = torch.arange(skv, device=device).view(1, skv)
    return band_allowed(qi, kj, shift, spec_left, spec_right)


def _alibi_bias(
    slopes: Optional[torch.Tensor], h: int, sq: int, skv: int, shift: IntOrTensor, device
) -> torch.Tensor:
    """-slope * |j - i - shift| with the bottom-right shift (skv - sq per sequence)."""
    if slopes is None:
        slopes = default_alibi_slopes(h)
    slopes = slopes.to(device=device, dtype=torch.float64)  # exact positions; _core casts
    slopes = slopes.view(-1, h, 1, 1) if slopes.dim() == 2 else slopes.view(1, h, 1, 1)
    qi = torch.arange(sq, device=device).view(sq, 1)
    kj = torch.arange(skv, device=device).view(1, skv)
    return -slopes * (kj - qi - shift).abs().to(torch.float64)


# ---------------------------------------------------------------------------- dense (bshd)


def _dense(inp: AttentionInputs, training: bool) -> torch.Tensor:
    q, k, v = (t.transpose(1, 2) for t in (inp.q, inp.k, inp.v))
    b, h, sq, _ = q.shape
    skv = k.shape[2]
    len_q = _lengths(inp.q_valid, b, sq, q.device)
    len_kv = _lengths(inp.kv_valid, b, skv, q.device)
    shift = len_kv - len_q
    allowed = None
    if inp.mask.has_band:
        band_shift = shift if inp.mask.mask_type.bottom_right else 0
        allowed = _band(inp.mask.left, inp.mask.right, band_shift, sq, skv, q.device)
    allowed = _and(allowed, None if inp.kv_valid is None else inp.kv_valid[:, None, None, :])
    allowed = _and(allowed, None if inp.q_valid is None else inp.q_valid[:, None, :, None])
    allowed = _and(allowed, None if inp.arbitrary_mask is None else ~inp.arbitrary_mask)
    if allowed is not None and allowed.dim() == 2:
        allowed = allowed.view(1, 1, sq, skv)
    bias = inp.bias
    if inp.bias_type == "alibi":
        bias = _alibi_bias(inp.alibi_slopes, h, sq, skv, shift, q.device)
    out = _core(q, k, v, allowed, inp, bias, training)
    return out.transpose(1, 2)


def _lengths(valid: Optional[torch.Tensor], b: int, s: int, device) -> torch.Tensor:
    if valid is None:
        return torch.full((b, 1, 1, 1), s, dtype=torch.int64, device=device)
    return valid.sum(dim=1).view(b, 1, 1, 1)


def _and(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if a is None:
        return b
    if b is None:
        return a
    return a & b


# ---------------------------------------------------------------------------- THD


def _seq_bands(inp: AttentionInputs, device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence band as [B] tensors: left, right, bottom-right flag, and 'any band'."""
    specs = inp.policies.specs if inp.policies is not None else (inp.mask,)
    table = torch.tensor(
        [[s.left, s.right, int(s.mask_type.bottom_right), int(s.has_band)] for s in specs],
        dtype=torch.int64,
    ).to(device)
    b = inp.packed_q.batch_size
    index = inp.policies.policy_of_seq if inp.policies is not None else torch.zeros(b, dtype=torch.int64, device=device)
    rows = table[index]
    return rows[:, 0], rows[:, 1], rows[:, 2].bool(), rows[:, 3].bool()


def _thd_gathered(inp: AttentionInputs, training: bool) -> torch.Tensor:
    """Sync-free THD: gather each sequence into a [B, max_s] slot, attend, scatter back."""
    pq, pk = inp.packed_q, inp.packed_kv
    b, sq, skv = pq.batch_size, max(pq.max_seqlen, 1), max(pk.max_seqlen, 1)
    q_rows, q_ok = _slot_rows(pq, sq)
    kv_rows, kv_ok = _slot_rows(pk, skv)
    q, k, v = (_gather(t, rows, ok) for t, rows, ok in ((inp.q, q_rows, q_ok), (inp.k, kv_rows, kv_ok), (inp.v, kv_rows, kv_ok)))
    len_q = pq.seqlens().long().view(b, 1, 1, 1)
    len_kv = pk.seqlens().long().view(b, 1, 1, 1)
    left, right, br, _ = (x.view(b, 1, 1, 1) for x in _seq_bands(inp, q.device))
    shift = len_kv - len_q
    allowed = _band(left, right, torch.where(br, shift, 0), sq, skv, q.device)
    allowed = allowed & q_ok[:, None, :, None] & kv_ok[:, None, None, :]
    bias = None
    if inp.bias_type == "alibi":
        bias = _alibi_bias(inp.alibi_slopes, q.shape[1], sq, skv, shift, q.device)
    out = _core(q, k, v, allowed, inp, bias, training)  # [B, H, SQ, Dv]
    out = out.transpose(1, 2).reshape(b * sq, *out.shape[1:2], out.shape[-1])
    # Invalid slots write to a dummy row past the end, dropped afterwards: no boolean indexing.
    total = pq.total_tokens
    dest = torch.where(q_ok.flatten(), q_rows.flatten(), total)
    full = out.new_zeros(total + 1, *out.shape[1:]).index_copy(0, dest, out)
    return full[:total]


def _slot_rows(p: PackedSeqs, s: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """[B, S] token-row index of each slot position (0 where invalid) and its validity."""
    pos = torch.arange(s, device=p.offsets.device, dtype=torch.int64).view(1, s)
    ok = pos < p.seqlens().long().view(-1, 1)
    rows = p.offsets[:-1].long().view(-1, 1) + pos
    return torch.where(ok, rows, 0), ok


def _gather(t: torch.Tensor, rows: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [B, H, S, D]; invalid positions are 0 (so NaN in gaps never enters)."""
    b, s = rows.shape
    g = t.index_select(0, rows.flatten()).view(b, s, *t.shape[1:])
    g = torch.where(ok.view(b, s, 1, 1), g, torch.zeros((), dtype=t.dtype, device=t.device))
    return g.transpose(1, 2)


def _thd_per_sequence(inp: AttentionInputs, training: bool) -> torch.Tensor:
    """CPU THD: a loop over sequences; reading offsets is free on the host."""
    pq, pk = inp.packed_q, inp.packed_kv
    q_start, q_len = pq.offsets.tolist(), pq.seqlens().tolist()
    kv_start, kv_len = pk.offsets.tolist(), pk.seqlens().tolist()
    left, right, br, _ = (x.tolist() for x in _seq_bands(inp, inp.q.device))
    h, dv = inp.q.shape[1], inp.v.shape[-1]
    pieces, cursor = [], 0
    for i in range(pq.batch_size):
        n, m = q_len[i], kv_len[i]
        if q_start[i] > cursor:
            pieces.append(inp.q.new_zeros(q_start[i] - cursor, h, dv))
        cursor = q_start[i] + n
        if n == 0:
            continue
        q = inp.q[q_start[i] : cursor].transpose(0, 1).unsqueeze(0)
        k = inp.k[kv_start[i] : kv_start[i] + m].transpose(0, 1).unsqueeze(0)
        v = inp.v[kv_start[i] : kv_start[i] + m].transpose(0, 1).unsqueeze(0)
        shift = m - n
        allowed = _band(left[i], right[i], shift if br[i] else 0, n, m, q.device).view(1, 1, n, m)
        bias = None
        if inp.bias_type == "alibi":
            slopes = inp.alibi_slopes
            if slopes is not None and slopes.dim() == 2:
                slopes = slopes[i : i + 1]
            bias = _alibi_bias(slopes, h, n, m, shift, q.device)
        pieces.append(_core(q, k, v, allowed, inp, bias, training)[0].transpose(0, 1))
    if pq.total_tokens > cursor:
        pieces.append(inp.q.new_zeros(pq.total_tokens - cursor, h, dv))
    # Empty slices sum to exactly 0 yet tie q, k and v to the output, so their gradients are
    # zero tensors (not None) even when no sequence reads them.
    anchor = sum(t[:0].sum() for t in (inp.q, inp.k, inp.v))
    return torch.cat(pieces, dim=0) + anchor if pieces else inp.q.new_zeros(0, h, dv) + anchor
