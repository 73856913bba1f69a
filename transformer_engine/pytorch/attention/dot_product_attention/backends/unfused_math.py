"""Pure-PyTorch attention math: the backend that runs everywhere and the one the others are
checked against.

Shape legend: B = batch, H = query heads, HG = key/value heads, SQ/SKV = lengths, D = head dim,
T = packed tokens, R = query rows of one chunk.

Equivalent, per sequence and head (``allowed`` from :mod:`..masks`, rows with no allowed key
give 0)::

    scores = scores_hook(q @ k.T * scale (+ bias))          # [SQ, SKV]
    probs  = softmax(scores where allowed else -inf)        # vanilla
           = exp(scores) / (exp(sink) + sum(exp(scores)))   # off-by-one (sink = 0), learnable
    out    = probs_hook(dropout(probs)) @ v
    max_logit[h] = max over batch, queries and allowed keys of scores   # return_max_logit

Where P lives: :class:`.unfused_probs.Probabilities` forms it (in place of the scores) and
:func:`_attend` consumes it; ``probs_hook`` (identity by default) sees it between the two, after
dropout, as [B, H, R, SKV] in float32 (float64 for float64 inputs), and returns a tensor of that
shape: an autograd Function there sees P forward and dP backward (FP8 emulation quantizes
there). It is called once per chunk (per sequence on the CPU THD path), and once more per chunk
when a checkpointed chunk is recomputed in the backward. ``scores_hook`` (None by default) sees
the masked scores just before they become P, [B, HG, G, R, SKV], only where autograd records:
it must return them unchanged, as the same tensor (an autograd Function that marks them dirty,
since P is formed in their place), and sees dS, their gradient, in the backward: what FP8
attention calls dP and quantizes (the FP8 emulation, fp8/quantize.py).

Memory: queries are processed in chunks. ``NVTE_UNFUSED_ATTN_MAX_SCORES`` (default 2**26
elements, 256 MB in float32) bounds the score-sized memory one chunk holds at once: without
gradients one score matrix (the scores become P in place); with gradients two, as the backward
turns P into dS in place while dP arrives (dropout adds two more: its output and its mask), so
training chunks are half as tall. With gradients every chunk of a call that is not small (more
than budget/8 score elements over all its sequences), one chunk included, runs under
``torch.utils.checkpoint``: autograd keeps only q, k, v and the outputs between forward and
backward, and the backward recomputes one chunk at a time. So a packed batch's peak follows its
longest sequence (on the GPU, its gathered [B, S] batch), never the sum over its sequences, and
one long sequence's forward+backward peaks near the budget, not at several score matrices.

THD runs two ways with the same math. On the CPU, where reading offsets costs nothing, it loops
over sequences, so memory follows the real lengths and padded rows are never read. On a GPU it
gathers sequences into a [B, S] batch with device-side indices: no host sync, CUDA-graph safe.
S is the declared max_seqlen capped by the packed tensor's row count (no sequence is longer
than the tensor holding it), so a huge declared max_seqlen with few tokens stays small.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ..environment import UNFUSED_MAX_SCORES, UNFUSED_THD_GATHER, compiling
from ..masks import UNBOUNDED
from ..prepare.inputs import AttentionInputs
from ..prepare.packed_seqs import PackedSeqs
from .unfused_probs import probabilities
from .unfused_terms import AlibiTerm, add_bias, alibi_bias, band, group_heads, max_logit as scores_max_logit, rows_of

# [B, H, R, SKV] probabilities -> the same shape; see the module docstring.
ProbsHook = Callable[[torch.Tensor], torch.Tensor]


# (first query row, end row) -> (allowed [B'|1, H'|1, rows, SKV] bool or None, bias or None)
RowMasks = Callable[[int, int], Tuple[Optional[torch.Tensor], Union[None, torch.Tensor, AlibiTerm]]]

MAX_SCORES = UNFUSED_MAX_SCORES
DEFAULT_MAX_SCORES = 1 << 26
# Score-sized tensors a chunk holds at its peak (measured with tests' PeakMemory): the scores,
# turned into P in place, without gradients; P (turned into dS in place) and dP in a
# checkpointed backward; dropout adds its output and its mask (a float tensor on the CPU).
FORWARD_SCORE_COPIES = 1
BACKWARD_SCORE_COPIES = 2
DROPOUT_SCORE_COPIES = 2
# A call whose scores total at most budget / _SMALL_CALL elements is not checkpointed: autograd
# keeps its P (small by definition), and the call skips checkpointing's host cost (measured 2.5x
# on a 5-sequence THD forward+backward: 3.3 -> 8.5 ms of CPU time), which small calls feel.
_SMALL_CALL = 8


@dataclass(frozen=True, eq=False)
class _ChunkCall:
    """What every chunk of one call shares."""

    inp: AttentionInputs
    training: bool
    dtype: torch.dtype  # float32, or float64 for float64 inputs: the reference computes accurately
    sink: Optional[torch.Tensor]  # [H] sink logit, None for the vanilla softmax
    probs_hook: Optional[ProbsHook]
    scores_hook: Optional[ProbsHook] = None
    recompute: bool = False  # every chunk under torch.utils.checkpoint (see _with_recompute)

    @property
    def drops(self) -> bool:
        return self.inp.dropout_p > 0.0 and self.training


def unfused_attention(inp: AttentionInputs, training: bool, probs_hook: Optional[ProbsHook] = None,
                      scores_hook: Optional[ProbsHook] = None) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Run attention; returns [B, SQ, H, Dv] (dense) or [T, H, Dv] (THD), and with
    ``inp.return_max_logit`` also the max logit ([H], float32/float64): (out, max_logit).
    ``probs_hook`` sees the probabilities before they multiply V, ``scores_hook`` the scores
    before they become the probabilities (module docstring)."""
    dtype = torch.float64 if inp.q.dtype == torch.float64 else torch.float32
    call = _ChunkCall(inp, training, dtype, _sink(inp, inp.q.shape[-2]), probs_hook, scores_hook)
    # The reference computes in float32/float64 even inside a torch.autocast region (whose
    # matmuls would otherwise run in bf16/fp16 and overflow the masked fill).
    with torch.autocast(inp.q.device.type, enabled=False):
        out, max_logit = _dispatch(call)
    if inp.return_max_logit:
        return out, max_logit
    return out


def _dispatch(call: _ChunkCall):
    inp = call.inp
    if not inp.is_thd:
        out, max_logit = _dense(call)
    else:
        # Under torch.compile the gathered path traces (the per-sequence loop reads offsets).
        per_sequence = inp.q.device.type == "cpu" and not compiling()
        if per_sequence and UNFUSED_THD_GATHER.get("0") != "1":
            out, max_logit = _thd_per_sequence(call)
        else:
            out, max_logit = _thd_gathered(call)
    return out, max_logit


def max_scores_per_chunk() -> int:
    """The score-sized memory budget of one chunk, in elements (``NVTE_UNFUSED_ATTN_MAX_SCORES``)."""
    raw = MAX_SCORES.get(str(DEFAULT_MAX_SCORES))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"NVTE_UNFUSED_ATTN_MAX_SCORES must be a positive int (score elements per chunk); got {raw!r}")
    return value


def _core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: _ChunkCall, masks: RowMasks
          ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q [B, H, SQ, D], k/v [B, HG, SKV, D] -> (out [B, H, SQ, Dv], max logit [H] or None).

    ``masks(r0, r1)`` gives the allowed pairs and the bias of query rows [r0, r1), built per
    chunk so that no [SQ, SKV]-sized mask or bias exists either.
    """
    b, h, sq, _ = q.shape
    copies = BACKWARD_SCORE_COPIES if call.recompute else FORWARD_SCORE_COPIES
    copies += DROPOUT_SCORE_COPIES if call.drops else 0
    step = max(1, max_scores_per_chunk() // (copies * max(1, b * h * k.shape[2])))
    outs, maxes = [], []
    # Split, not sliced: a slice's backward builds a zero-filled q-sized gradient per chunk.
    for r0, q_rows in zip(range(0, max(sq, 1), step), q.split(step, dim=2)):  # sq = 0: one empty chunk
        args = (q_rows, k, v, call, masks, r0)
        if call.recompute:
            # The RNG state is restored for the recomputation only when dropout draws from it.
            out, mx = torch.utils.checkpoint.checkpoint(_attend, *args, use_reentrant=False,
                                                        preserve_rng_state=call.drops)
        else:
            out, mx = _attend(*args)
        outs.append(out)
        maxes.append(mx)
    if len(outs) == 1:
        return outs[0], maxes[0]
    max_logit = torch.stack(maxes).amax(dim=0) if call.inp.return_max_logit else None
    return torch.cat(outs, dim=2), max_logit


def _with_recompute(call: _ChunkCall, score_elements: int) -> _ChunkCall:
    """``call`` set to checkpoint its chunks when autograd records it and its scores
    (``score_elements`` in all, over every sequence) are not small (``_SMALL_CALL``)."""
    inp = call.inp
    leaves = (inp.q, inp.k, inp.v, inp.bias, inp.alibi_slopes, inp.softmax_offset)
    records = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in leaves)
    # Recomputing dropout restores the generator's state, which a CUDA generator cannot report
    # while a graph is being captured: there autograd keeps P instead (a host query, no sync).
    capturing = call.drops and inp.q.is_cuda and torch.cuda.is_current_stream_capturing()
    small = score_elements <= max_scores_per_chunk() // _SMALL_CALL
    return replace(call, recompute=records and not capturing and not small)


def _sink(inp: AttentionInputs, h: int) -> Optional[torch.Tensor]:
    """The per-head sink logit [H] (0 for off-by-one), or None for the vanilla softmax."""
    if inp.softmax_type == "vanilla":
        return None
    if inp.softmax_offset is None:
        raise ValueError(f"softmax_type={inp.softmax_type!r} needs the per-head softmax_offset; got None")
    return inp.softmax_offset.reshape(h)


def _attend(q, k, v, call: _ChunkCall, masks: RowMasks, r0: int):
    """Query rows [r0, r0 + R) of :func:`_core` (``q`` holds just those rows). Half inputs are
    computed in float32: this is the reference, accuracy first. GQA groups query heads over their
    shared key head instead of copying K/V. Scores are scaled, biased and masked in place
    (autograd saves none of them)."""
    inp, dtype = call.inp, call.dtype
    b, h, rows, d = q.shape
    hg, skv = k.shape[1], k.shape[2]
    allowed, bias = masks(r0, r0 + rows)
    qf = q.to(dtype).reshape(b, hg, h // hg, rows, d)
    kf, vf = k.to(dtype).unsqueeze(2), v.to(dtype).unsqueeze(2)
    scores = qf @ kf.transpose(-1, -2)  # [B, HG, G, R, SKV]
    if inp.bias_type == "pre_scale_bias":
        add_bias(scores, bias, hg, dtype).mul_(inp.softmax_scale)
    else:
        add_bias(scores.mul_(inp.softmax_scale), bias, hg, dtype)
    row_ok = None
    if allowed is not None:
        allowed = group_heads(allowed, hg)
        scores.masked_fill_(allowed.logical_not(), torch.finfo(dtype).min)
        row_ok = allowed.any(dim=-1, keepdim=True)
    # TE's max logit: scaled, biased, masked scores, before the sink joins; no gradient.
    max_logit = scores_max_logit(scores.detach(), h) if inp.return_max_logit else None
    sink = None if call.sink is None else call.sink.to(dtype).view(1, hg, h // hg, 1, 1)
    if call.scores_hook is not None and scores.requires_grad:
        scores = call.scores_hook(scores)
    probs = probabilities(scores, row_ok, sink, call.recompute)
    if inp.dropout_p > 0.0:
        probs = F.dropout(probs, p=inp.dropout_p, training=call.training)
    if call.probs_hook is not None:
        probs = call.probs_hook(probs.reshape(b, h, rows, skv)).reshape(b, hg, h // hg, rows, skv)
    out = probs @ vf
    return out.reshape(b, h, rows, v.shape[-1]).to(q.dtype), max_logit


# ---------------------------------------------------------------------------- dense (bshd)


def _dense(call: _ChunkCall):
    inp = call.inp
    q, k, v = (t.transpose(1, 2) for t in (inp.q, inp.k, inp.v))
    b, h, sq, _ = q.shape
    skv = k.shape[2]
    call = _with_recompute(call, b * h * sq * skv)
    shift = _lengths(inp.kv_valid, b, skv, q.device) - _lengths(inp.q_valid, b, sq, q.device)
    band_shift = shift if inp.mask.mask_type.bottom_right else 0

    def masks(r0: int, r1: int):
        allowed = None
        if inp.mask.has_band:
            allowed = band(inp.mask.left, inp.mask.right, band_shift, r0, r1, skv, q.device)
        allowed = _and(allowed, None if inp.kv_valid is None else inp.kv_valid[:, None, None, :])
        allowed = _and(allowed, None if inp.q_valid is None else inp.q_valid[:, None, r0:r1, None])
        allowed = _and(allowed, None if inp.arbitrary_mask is None else ~rows_of(inp.arbitrary_mask, r0, r1))
        if allowed is not None and allowed.dim() == 2:
            allowed = allowed.view(1, 1, r1 - r0, skv)
        bias = rows_of(inp.bias, r0, r1)
        if inp.bias_type == "alibi":
            bias = alibi_bias(inp.alibi_slopes, h, r0, r1, skv, band_shift, call.dtype, q.device)
        return allowed, bias

    out, max_logit = _core(q, k, v, call, masks)
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


def _thd_gathered(call: _ChunkCall):
    """Sync-free THD: gather each sequence into a [B, S] slot, attend, scatter back."""
    inp = call.inp
    pq, pk = inp.packed_q, inp.packed_kv
    b, sq, skv = pq.batch_size, gathered_slot_length(pq), gathered_slot_length(pk)
    call = _with_recompute(call, b * inp.q.shape[1] * sq * skv)
    q_rows, q_ok = _slot_rows(pq, sq)
    kv_rows, kv_ok = _slot_rows(pk, skv)
    q, k, v = (_gather(t, rows, ok) for t, rows, ok in ((inp.q, q_rows, q_ok), (inp.k, kv_rows, kv_ok), (inp.v, kv_rows, kv_ok)))
    len_q = pq.seqlens().long().view(b, 1, 1, 1)
    len_kv = pk.seqlens().long().view(b, 1, 1, 1)
    left, right, br, _ = (x.view(b, 1, 1, 1) for x in _seq_bands(inp, q.device))
    shift = len_kv - len_q
    band_shift = torch.where(br, shift, 0)

    def masks(r0: int, r1: int):
        allowed = band(left, right, band_shift, r0, r1, skv, q.device)
        allowed = allowed & q_ok[:, None, r0:r1, None] & kv_ok[:, None, None, :]
        bias = None
        if inp.bias_type == "alibi":
            bias = alibi_bias(inp.alibi_slopes, q.shape[1], r0, r1, skv, band_shift, call.dtype, q.device)
        return allowed, bias

    out, max_logit = _core(q, k, v, call, masks)  # [B, H, SQ, Dv]
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


def _thd_per_sequence(call: _ChunkCall):
    """CPU THD: a loop over sequences; reading offsets is free on the host. With gradients each
    sequence's chunks are checkpointed, so autograd keeps no sequence's scores."""
    inp = call.inp
    pq, pk = inp.packed_q, inp.packed_kv
    q_start, q_len = pq.offsets.tolist(), pq.seqlens().tolist()
    kv_start, kv_len = pk.offsets.tolist(), pk.seqlens().tolist()
    call = _with_recompute(call, inp.q.shape[1] * sum(n * m for n, m in zip(q_len, kv_len)))
    left, right, br, _ = (x.tolist() for x in _seq_bands(inp, inp.q.device))
    h, dv = inp.q.shape[1], inp.v.shape[-1]
    qs = _sequence_rows(inp.q, q_start, q_len)
    ks, vs = (_sequence_rows(t, kv_start, kv_len) for t in (inp.k, inp.v))
    pieces, maxes, cursor = [], [], 0
    for i in range(pq.batch_size):
        n, m = q_len[i], kv_len[i]
        if q_start[i] > cursor:
            pieces.append(inp.q.new_zeros(q_start[i] - cursor, h, dv))
        cursor = q_start[i] + n
        if n == 0:
            continue
        q, k, v = (t[i].transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs))
        out, mx = _core(q, k, v, call, _sequence_masks(call, i, left[i], right[i], m - n, br[i], m, h))
        pieces.append(out[0].transpose(0, 1))
        maxes.append(mx)
    if pq.total_tokens > cursor:
        pieces.append(inp.q.new_zeros(pq.total_tokens - cursor, h, dv))
    out = torch.cat(pieces, dim=0) if pieces else inp.q.new_zeros(0, h, dv)
    if not maxes:
        # No sequence read q, k or v (each one read makes full gradients through the split):
        # empty slices sum to exactly 0 yet tie them to the output, so their gradients are zero
        # tensors, not None.
        out = out + sum(t[:0].sum() for t in (inp.q, inp.k, inp.v))
    return out, _max_over_sequences(maxes, call, h) if inp.return_max_logit else None


def _sequence_rows(t: torch.Tensor, starts, lengths) -> Tuple[torch.Tensor, ...]:
    """Each sequence's rows of ``t`` [T, ..] as views from one ``split`` (offsets are ordered
    and disjoint, checked on the CPU): its backward is one concatenation, where slicing would
    build a zero-filled [T, ..] gradient per sequence."""
    sizes, cursor = [], 0
    for start, n in zip(starts, lengths):
        sizes += [start - cursor, n]
        cursor = start + n
    sizes.append(t.shape[0] - cursor)
    return torch.split(t, sizes)[1::2]


def _sequence_masks(call: _ChunkCall, i: int, left: int, right: int, shift: int, bottom_right: bool, m: int, h: int
                    ) -> RowMasks:
    inp, device = call.inp, call.inp.q.device
    slopes = inp.alibi_slopes
    if slopes is not None and slopes.dim() == 2:
        slopes = slopes[i : i + 1]

    diag_shift = shift if bottom_right else 0

    def masks(r0: int, r1: int):
        allowed = band(left, right, diag_shift, r0, r1, m, device).view(1, 1, r1 - r0, m)
        bias = alibi_bias(slopes, h, r0, r1, m, diag_shift, call.dtype, device) if inp.bias_type == "alibi" else None
        return allowed, bias

    return masks


def _max_over_sequences(maxes, call: _ChunkCall, h: int) -> torch.Tensor:
    """The max logit over every sequence; no sequence at all gives the dtype's lowest value
    (what a fully masked head gives: nothing was allowed)."""
    if maxes:
        return torch.stack(maxes).amax(dim=0)
    return torch.full((h,), torch.finfo(call.dtype).min, dtype=call.dtype, device=call.inp.q.device)
