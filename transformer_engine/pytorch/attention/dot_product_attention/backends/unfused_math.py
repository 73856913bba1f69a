"""Pure-PyTorch attention math: the backend that runs everywhere and the one the others are
checked against.

Shape legend: B = batch, H = query heads, HG = key/value heads, SQ/SKV = lengths, D = head dim,
T = packed tokens.

Equivalent, per sequence and head (``allowed`` from :mod:`.masks`, rows with no allowed key
give 0)::

    scores = q @ k.T * scale (+ bias)            # [SQ, SKV]
    probs  = softmax(scores where allowed else -inf)        # vanilla
           = exp(scores) / (exp(sink) + sum(exp(scores)))   # off-by-one (sink = 0), learnable
    out    = dropout(probs) @ v
    max_logit[h] = max over batch, queries and allowed keys of scores   # return_max_logit

Memory: queries are processed in chunks whose score matrix holds at most
``NVTE_UNFUSED_ATTN_MAX_SCORES`` elements (default 2**26, 256 MB in float32). With more than
one chunk and gradients on, each chunk runs under ``torch.utils.checkpoint``: autograd keeps only
q, k, v (and the outputs), and the backward recomputes one chunk's scores at a time. One chunk
(small problems) runs exactly the unchunked math.

THD runs two ways with the same math. On the CPU, where reading offsets costs nothing, it loops
over sequences, so memory follows the real lengths and padded rows are never read. On a GPU it
gathers sequences into a [B, S] batch with device-side indices: no host sync, CUDA-graph safe.
S is the declared max_seqlen capped by the packed tensor's row count (no sequence is longer
than the tensor holding it), so a huge declared max_seqlen with few tokens stays small.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ..environment import UNFUSED_MAX_SCORES, UNFUSED_THD_GATHER, compiling
from ..masks import UNBOUNDED, band_allowed
from ..prepare.inputs import AttentionInputs
from ..prepare.packed_seqs import PackedSeqs

IntOrTensor = Union[int, torch.Tensor]
# (first query row, end row) -> (allowed [B'|1, H'|1, rows, SKV] bool or None, bias or None)
RowMasks = Callable[[int, int], Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]

MAX_SCORES = UNFUSED_MAX_SCORES
DEFAULT_MAX_SCORES = 1 << 26


def unfused_attention(inp: AttentionInputs, training: bool) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Run attention; returns [B, SQ, H, Dv] (dense) or [T, H, Dv] (THD), and with
    ``inp.return_max_logit`` also the max logit ([H], float32/float64): (out, max_logit)."""
    if not inp.is_thd:
        out, max_logit = _dense(inp, training)
    else:
        # Under torch.compile the gathered path traces (the per-sequence loop reads offsets).
        per_sequence = inp.q.device.type == "cpu" and not compiling()
        if per_sequence and UNFUSED_THD_GATHER.get("0") != "1":
            out, max_logit = _thd_per_sequence(inp, training)
        else:
            out, max_logit = _thd_gathered(inp, training)
    if inp.return_max_logit:
        return out, max_logit
    return out


def max_scores_per_chunk() -> int:
    """The score-matrix budget of one chunk, in elements (``NVTE_UNFUSED_ATTN_MAX_SCORES``)."""
    raw = MAX_SCORES.get(str(DEFAULT_MAX_SCORES))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"NVTE_UNFUSED_ATTN_MAX_SCORES must be a positive int (score elements per chunk); got {raw!r}")
    return value


def default_alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """The standard geometric ALiBi slopes (float32, [H]), extended for non-power-of-2 H.
    Computed on ``device`` from host constants: a tensor made from a Python list and moved to
    CUDA would be a blocking copy (a sync, and a break in CUDA-graph capture)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    i = torch.arange(num_heads, dtype=torch.float64, device=device)
    base = torch.exp2(-8.0 * (i + 1) / closest)
    extra = torch.exp2(-4.0 * (2 * (i - closest) + 1) / closest)  # heads past the power of two
    return torch.where(i < closest, base, extra).float()


def _core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inp: AttentionInputs, training: bool, masks: RowMasks
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q [B, H, SQ, D], k/v [B, HG, SKV, D] -> (out [B, H, SQ, Dv], max logit [H] or None).

    ``masks(r0, r1)`` gives the allowed pairs and the bias of query rows [r0, r1), built per
    chunk so that no [SQ, SKV]-sized mask or bias exists either.
    """
    b, h, sq, _ = q.shape
    step = max(1, max_scores_per_chunk() // max(1, b * h * k.shape[2]))
    sink = _sink(inp, h)
    if step >= sq:
        return _attend(q, k, v, inp, training, masks, sink, 0, sq)
    recompute = torch.is_grad_enabled()
    # The RNG state is restored for the recomputation only when dropout draws from it.
    keep_rng = inp.dropout_p > 0.0 and training
    outs, maxes = [], []
    for r0 in range(0, sq, step):
        args = (q, k, v, inp, training, masks, sink, r0, min(r0 + step, sq))
        if recompute:
            out, mx = torch.utils.checkpoint.checkpoint(_attend, *args, use_reentrant=False, preserve_rng_state=keep_rng)
        else:
            out, mx = _attend(*args)
        outs.append(out)
        maxes.append(mx)
    max_logit = torch.stack(maxes).amax(dim=0) if inp.return_max_logit else None
    return torch.cat(outs, dim=2), max_logit


def _sink(inp: AttentionInputs, h: int) -> Optional[torch.Tensor]:
    """The per-head sink logit [H] (0 for off-by-one), or None for the vanilla softmax."""
    if inp.softmax_type == "vanilla":
        return None
    if inp.softmax_offset is None:
        raise ValueError(f"softmax_type={inp.softmax_type!r} needs the per-head softmax_offset; got None")
    return inp.softmax_offset.reshape(h)


def _attend(q, k, v, inp: AttentionInputs, training: bool, masks: RowMasks, sink, r0: int, r1: int):
    """Query rows [r0, r1) of :func:`_core`. Half inputs are computed in float32: this is the
    reference, accuracy first. GQA groups query heads over their shared key head instead of
    copying K/V."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, h, _, d = q.shape
    hg, rows = k.shape[1], r1 - r0
    allowed, bias = masks(r0, r1)
    qf = q[:, :, r0:r1].to(dtype).reshape(b, hg, h // hg, rows, d)
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
    # TE's max logit: scaled, biased, masked scores, before the sink joins; no gradient.
    max_logit = _max_logit(scores.detach(), h) if inp.return_max_logit else None
    if sink is None:
        probs = torch.softmax(scores, dim=-1)
        if allowed is not None:
            # A row with no allowed key softmaxes to uniform over "min": zero it, like the kernels.
            probs = probs.masked_fill(~allowed, 0.0)
    else:
        # The sink is one more logit in the denominator with no value: a row with no allowed
        # key puts all its weight there and comes out 0, with no special case.
        lse = torch.logaddexp(torch.logsumexp(scores, dim=-1, keepdim=True), sink.to(dtype).view(1, hg, h // hg, 1, 1))
        probs = torch.exp(scores - lse)
    if inp.dropout_p > 0.0:
        probs = F.dropout(probs, p=inp.dropout_p, training=training)
    out = probs @ vf
    return out.reshape(b, h, rows, v.shape[-1]).to(q.dtype), max_logit


def _max_logit(scores: torch.Tensor, h: int) -> torch.Tensor:
    """[B, HG, G, R, SKV] -> [H]; the dtype's lowest value where nothing was scored (no keys),
    as for a fully masked head."""
    if scores.numel() == 0:
        return torch.full((h,), torch.finfo(scores.dtype).min, dtype=scores.dtype, device=scores.device)
    return scores.amax(dim=(0, 3, 4)).reshape(h)


def _group_heads(t: torch.Tensor, hg: int) -> torch.Tensor:
    """[B', H'|1, SQ, SKV] -> [B', HG, G|1, SQ, SKV] to line up with grouped query heads."""
    if t.shape[1] == 1:
        return t.unsqueeze(1)
    return t.reshape(t.shape[0], hg, t.shape[1] // hg, *t.shape[2:])


def _band(
    spec_left: IntOrTensor, spec_right: IntOrTensor, shift: IntOrTensor, r0: int, r1: int, skv: int, device
) -> torch.Tensor:
    """[.., R, SKV] bool for query rows [r0, r1) from per-batch (or scalar) band bounds shaped
    [B, 1, 1, 1]."""
    qi = torch.arange(r0, r1, device=device).view(r1 - r0, 1)
    kj = torch.arange(skv, device=device).view(1, skv)
    return band_allowed(qi, kj, shift, spec_left, spec_right)


def _alibi_bias(
    slopes: Optional[torch.Tensor], h: int, r0: int, r1: int, skv: int, shift: IntOrTensor, device
) -> torch.Tensor:
    """-slope * |j - i - shift| for query rows [r0, r1). As in TE, ALiBi follows the mask's
    diagonal: ``shift`` is skv - sq (per sequence) for bottom-right masks and 0 for the top-left
    ones (causal, padding_causal)."""
    if slopes is None:
        slopes = default_alibi_slopes(h, device)
    slopes = slopes.to(device=device, dtype=torch.float64)  # exact positions; _attend casts
    slopes = slopes.view(-1, h, 1, 1) if slopes.dim() == 2 else slopes.view(1, h, 1, 1)
    qi = torch.arange(r0, r1, device=device).view(r1 - r0, 1)
    kj = torch.arange(skv, device=device).view(1, skv)
    return -slopes * (kj - qi - shift).abs().to(torch.float64)


def _rows_of(t: Optional[torch.Tensor], r0: int, r1: int) -> Optional[torch.Tensor]:
    """Rows [r0, r1) of a [.., SQ|1, SKV] tensor (a broadcast row dim stays as it is)."""
    if t is None or t.shape[-2] == 1:
        return t
    return t[..., r0:r1, :]


# ---------------------------------------------------------------------------- dense (bshd)


def _dense(inp: AttentionInputs, training: bool):
    q, k, v = (t.transpose(1, 2) for t in (inp.q, inp.k, inp.v))
    b, h, sq, _ = q.shape
    skv = k.shape[2]
    shift = _lengths(inp.kv_valid, b, skv, q.device) - _lengths(inp.q_valid, b, sq, q.device)
    band_shift = shift if inp.mask.mask_type.bottom_right else 0

    def masks(r0: int, r1: int):
        allowed = None
        if inp.mask.has_band:
            allowed = _band(inp.mask.left, inp.mask.right, band_shift, r0, r1, skv, q.device)
        allowed = _and(allowed, None if inp.kv_valid is None else inp.kv_valid[:, None, None, :])
        allowed = _and(allowed, None if inp.q_valid is None else inp.q_valid[:, None, r0:r1, None])
        allowed = _and(allowed, None if inp.arbitrary_mask is None else ~_rows_of(inp.arbitrary_mask, r0, r1))
        if allowed is not None and allowed.dim() == 2:
            allowed = allowed.view(1, 1, r1 - r0, skv)
        bias = _rows_of(inp.bias, r0, r1)
        if inp.bias_type == "alibi":
            bias = _alibi_bias(inp.alibi_slopes, h, r0, r1, skv, band_shift, q.device)
        return allowed, bias

    out, max_logit = _core(q, k, v, inp, training, masks)
    return out.transpose(1, 2), max_logit


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
    """Per-sequence band as [B] tensors: left, right, bottom-right flag, and 'any band'.

    Built on the device from host constants (a tensor made from a Python list and moved to CUDA
    would be a blocking copy: a sync). A sequence no policy claims (an out-of-range id, unchecked
    on CUDA) keeps left = -UNBOUNDED: it attends nothing and comes out 0. (The FA4 and cuDNN
    kernels run it in no call, so its rows stay unwritten there: wrong but bounded, like all
    unchecked bad metadata.)"""
    b = inp.packed_q.batch_size

    def full(value, dtype=torch.int64):
        return torch.full((b,), value, dtype=dtype, device=device)

    if inp.policies is None:
        s = inp.mask
        return full(s.left), full(s.right), full(s.mask_type.bottom_right, torch.bool), full(s.has_band, torch.bool)
    index = inp.policies.policy_of_seq
    left, right, br, band = full(-UNBOUNDED), full(0), full(False, torch.bool), full(True, torch.bool)
    for p, s in enumerate(inp.policies.specs):
        mine = index == p
        left = torch.where(mine, s.left, left)
        right = torch.where(mine, s.right, right)
        br = torch.where(mine, s.mask_type.bottom_right, br)
        band = torch.where(mine, s.has_band, band)
    return left, right, br, band


def gathered_slot_length(p: PackedSeqs) -> int:
    """Slot length of the gathered path: the declared max_seqlen, capped by the tensor's rows
    (a sequence cannot be longer than the tensor that holds it; a host fact, no sync)."""
    return max(min(p.max_seqlen, p.total_tokens), 1)


def _thd_gathered(inp: AttentionInputs, training: bool):
    """Sync-free THD: gather each sequence into a [B, S] slot, attend, scatter back."""
    pq, pk = inp.packed_q, inp.packed_kv
    b, sq, skv = pq.batch_size, gathered_slot_length(pq), gathered_slot_length(pk)
    q_rows, q_ok = _slot_rows(pq, sq)
    kv_rows, kv_ok = _slot_rows(pk, skv)
    q, k, v = (_gather(t, rows, ok) for t, rows, ok in ((inp.q, q_rows, q_ok), (inp.k, kv_rows, kv_ok), (inp.v, kv_rows, kv_ok)))
    len_q = pq.seqlens().long().view(b, 1, 1, 1)
    len_kv = pk.seqlens().long().view(b, 1, 1, 1)
    left, right, br, _ = (x.view(b, 1, 1, 1) for x in _seq_bands(inp, q.device))
    shift = len_kv - len_q
    band_shift = torch.where(br, shift, 0)

    def masks(r0: int, r1: int):
        allowed = _band(left, right, band_shift, r0, r1, skv, q.device)
        allowed = allowed & q_ok[:, None, r0:r1, None] & kv_ok[:, None, None, :]
        bias = None
        if inp.bias_type == "alibi":
            bias = _alibi_bias(inp.alibi_slopes, q.shape[1], r0, r1, skv, band_shift, q.device)
        return allowed, bias

    out, max_logit = _core(q, k, v, inp, training, masks)  # [B, H, SQ, Dv]
    out = out.transpose(1, 2).reshape(b * sq, *out.shape[1:2], out.shape[-1])
    # Invalid slots write to a dummy row past the end, dropped afterwards: no boolean indexing.
    total = pq.total_tokens
    dest = torch.where(q_ok.flatten(), q_rows.flatten(), total)
    full = out.new_zeros(total + 1, *out.shape[1:]).index_copy(0, dest, out)
    return full[:total], max_logit


def _slot_rows(p: PackedSeqs, s: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """[B, S] token-row index of each slot position (0 where invalid) and its validity."""
    pos = torch.arange(s, device=p.offsets.device, dtype=torch.int64).view(1, s)
    ok = pos < p.seqlens().long().view(-1, 1)
    rows = p.offsets[:-1].long().view(-1, 1) + pos
    return torch.where(ok, rows, 0), ok


def _gather(t: torch.Tensor, rows: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [B, H, S, D]; invalid positions are 0 (so NaN in gaps never enters)."""
    b, s = rows.shape
    if t.shape[0] == 0:  # no rows to read (index 0 would be out of range); the sum keeps t in the graph
        return t.new_zeros(b, t.shape[1], s, t.shape[2]) + t.sum()
    g = t.index_select(0, rows.flatten()).view(b, s, *t.shape[1:])
    g = torch.where(ok.view(b, s, 1, 1), g, torch.zeros((), dtype=t.dtype, device=t.device))
    return g.transpose(1, 2)


def _thd_per_sequence(inp: AttentionInputs, training: bool):
    """CPU THD: a loop over sequences; reading offsets is free on the host."""
    pq, pk = inp.packed_q, inp.packed_kv
    q_start, q_len = pq.offsets.tolist(), pq.seqlens().tolist()
    kv_start, kv_len = pk.offsets.tolist(), pk.seqlens().tolist()
    left, right, br, _ = (x.tolist() for x in _seq_bands(inp, inp.q.device))
    h, dv = inp.q.shape[1], inp.v.shape[-1]
    pieces, maxes, cursor = [], [], 0
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
        out, mx = _core(q, k, v, inp, training, _sequence_masks(inp, i, left[i], right[i], m - n, br[i], m, h, q.device))
        pieces.append(out[0].transpose(0, 1))
        maxes.append(mx)
    if pq.total_tokens > cursor:
        pieces.append(inp.q.new_zeros(pq.total_tokens - cursor, h, dv))
    # Empty slices sum to exactly 0 yet tie q, k and v to the output, so their gradients are
    # zero tensors (not None) even when no sequence reads them.
    anchor = sum(t[:0].sum() for t in (inp.q, inp.k, inp.v))
    out = torch.cat(pieces, dim=0) + anchor if pieces else inp.q.new_zeros(0, h, dv) + anchor
    return out, _max_over_sequences(maxes, inp, h) if inp.return_max_logit else None


def _sequence_masks(inp: AttentionInputs, i: int, left: int, right: int, shift: int, bottom_right: bool, m: int, h: int,
                    device) -> RowMasks:
    slopes = inp.alibi_slopes
    if slopes is not None and slopes.dim() == 2:
        slopes = slopes[i : i + 1]

    def masks(r0: int, r1: int):
        allowed = _band(left, right, shift if bottom_right else 0, r0, r1, m, device).view(1, 1, r1 - r0, m)
        bias = _alibi_bias(slopes, h, r0, r1, m, shift if bottom_right else 0, device) if inp.bias_type == "alibi" else None
        return allowed, bias

    return masks


def _max_over_sequences(maxes, inp: AttentionInputs, h: int) -> torch.Tensor:
    """The max logit over every sequence; no sequence at all gives the dtype's lowest value
    (what a fully masked head gives: nothing was allowed)."""
    if maxes:
        return torch.stack(maxes).amax(dim=0)
    dtype = torch.float64 if inp.q.dtype == torch.float64 else torch.float32
    return torch.full((h,), torch.finfo(dtype).min, dtype=dtype, device=inp.q.device)
