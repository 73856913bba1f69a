"""The registered cuDNN ops (``te_attn::cudnn_fwd``, ``cudnn_fwd_max``, ``cudnn_bwd``) and their
shape-only fakes: each builds (once per configuration, :mod:`.graphs`) and runs one cudnn-frontend
graph, writing into caller-provided buffers.

Shared arguments: q/k/v/out are [T, H, D] (varlen: ``offsets_*`` are the [B+1] start offsets of
the sequences, ``seqlens_*`` their [B] valid lengths) or [B, S, H, D] (dense: offsets None,
lengths None or [B] for a padded batch); ``window_*`` is (left, right) with -1 unbounded;
``bottom_right`` aligns the band to the last key. ``bias`` [B|1, H|1, SQ, SKV] is added after
scaling; ``alibi`` adds cuDNN's own ALiBi (its standard slopes; needs a causal mask);
``dropout_p`` > 0 drops probabilities with the Philox stream of ``rng`` (int64 [seed, offset]),
which the backward must receive again; ``sink`` (float32 [H]) is one extra logit per head in
every softmax denominator.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import kernel_ops
from . import graphs
from .graphs import UID


def stats_shape(q: torch.Tensor, batch_size: int, max_seqlen_q: int) -> Tuple[int, int, int, int]:
    return (batch_size, q.shape[-2], max(max_seqlen_q, 1), 1)


def _forward(q, k, v, out, offsets_q, offsets_kv, seqlens_q, seqlens_kv, batch_size, max_seqlen_q, max_seqlen_kv, softmax_scale,
             causal, window_left, window_right, bottom_right, bias, rng, alibi, dropout_p, sink,
             with_max: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The body of both forward ops: (stats, max logit [H] or None)."""
    varlen, padded = offsets_q is not None, seqlens_q is not None
    b, sq, skv = batch_size, max(max_seqlen_q, 1), max(max_seqlen_kv, 1)
    band, band_key = graphs.band(causal, window_left, window_right, bottom_right)
    features = (bias, alibi, dropout_p, sink)
    key = ("fwd", q.dtype, b, sq, skv, q.shape[1:], k.shape[1:], v.shape[1:], q.stride(), k.stride(), v.stride(),
           out.stride(), softmax_scale, band_key, varlen, padded, graphs.feature_key(*features), with_max, q.device)
    pack = {UID["q"]: q, UID["k"]: k, UID["v"]: v, UID["o"]: out}
    shape = stats_shape(q, batch_size, max_seqlen_q)
    if with_max:
        # -inf first: rows the graph leaves unwritten (beyond the lengths, or seeing no key)
        # then count as "no score" in the max and in the stats derived below (which ignore
        # their sum of exponents).
        row_max = torch.full(shape, float("-inf"), dtype=torch.float32, device=q.device)
        sum_exp = torch.empty(shape, dtype=torch.float32, device=q.device)
        pack[UID["max"]], pack[UID["sum_exp"]] = row_max, sum_exp
    else:
        stats = q.new_empty(shape, dtype=torch.float32)
        pack[UID["stats"]] = stats
    ragged = graphs.ragged_sources(offsets_q, offsets_kv, dict(q=q, k=k, v=v, o=out)) if varlen else {}
    pack.update(graphs.metadata_pack(seqlens_q, seqlens_kv, ragged))
    pack.update(graphs.feature_pack(bias, rng, dropout_p, sink))
    build = lambda h: graphs.build_fwd(h, q, k, v, out, b, sq, skv, softmax_scale, band, varlen, padded, features,  # noqa: E731
                                       with_max)
    graphs.run_graph(key, build, pack, q.device)
    if not with_max:
        return stats, None
    return _stats_of(row_max, sum_exp), _max_over_rows(row_max, seqlens_q)


def _stats_of(row_max: torch.Tensor, sum_exp: torch.Tensor) -> torch.Tensor:
    """The backward's stats (each row's log-sum-exp) from the row max and sum of exponents, as
    cuDNN forms them. A row with no score (max -inf) gets +inf, which makes every probability
    the backward recomputes for it exp(-inf) = 0: no gradient from a row that attends nothing."""
    return torch.where(torch.isfinite(row_max), row_max + torch.log(sum_exp), float("inf"))


def _max_over_rows(row_max: torch.Tensor, seqlens_q: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, H, SQ, 1] -> [H]: the max over the sequences' valid rows (rows at or past a
    sequence's length hold whatever the graph left there and are left out), -inf where there
    is none. No host sync: the lengths stay on the device."""
    if seqlens_q is not None:
        positions = torch.arange(row_max.shape[2], device=row_max.device).view(1, 1, -1, 1)
        row_max = row_max.masked_fill(positions >= seqlens_q.view(-1, 1, 1, 1), float("-inf"))
    return row_max.amax(dim=(0, 2, 3))


def cudnn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    offsets_q: Optional[torch.Tensor],
    offsets_kv: Optional[torch.Tensor],
    seqlens_q: Optional[torch.Tensor],
    seqlens_kv: Optional[torch.Tensor],
    batch_size: int,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    bias: Optional[torch.Tensor] = None,
    rng: Optional[torch.Tensor] = None,
    alibi: bool = False,
    dropout_p: float = 0.0,
    sink: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Writes ``out`` (like q, head dim of v) in the rows it runs, leaving the others untouched,
    and returns stats [B, H, SQ, 1] float32 (each row's log-sum-exp, for the backward)."""
    return _forward(q, k, v, out, offsets_q, offsets_kv, seqlens_q, seqlens_kv, batch_size, max_seqlen_q, max_seqlen_kv,
                    softmax_scale, causal, window_left, window_right, bottom_right, bias, rng, alibi, dropout_p, sink, False)[0]


def _cudnn_fwd_fake(q, k, v, out, offsets_q, offsets_kv, seqlens_q, seqlens_kv, batch_size, max_seqlen_q, *args):
    return q.new_empty(stats_shape(q, batch_size, max_seqlen_q), dtype=torch.float32)


kernel_ops.register("cudnn_fwd", cudnn_fwd, ("out",), _cudnn_fwd_fake)


def cudnn_fwd_max(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    offsets_q: Optional[torch.Tensor],
    offsets_kv: Optional[torch.Tensor],
    seqlens_q: Optional[torch.Tensor],
    seqlens_kv: Optional[torch.Tensor],
    batch_size: int,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    bias: Optional[torch.Tensor] = None,
    rng: Optional[torch.Tensor] = None,
    alibi: bool = False,
    dropout_p: float = 0.0,
    sink: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`cudnn_fwd` that also returns the max logit of this call, float32 [H]: the max over
    its sequences' valid rows and allowed keys of the scores cuDNN's softmax takes (scaled,
    biased, masked), -inf where it scored nothing. A separate op rather than a flag: the two
    return different things, and a traced op's schema is fixed."""
    stats, max_logit = _forward(q, k, v, out, offsets_q, offsets_kv, seqlens_q, seqlens_kv, batch_size, max_seqlen_q,
                                max_seqlen_kv, softmax_scale, causal, window_left, window_right, bottom_right, bias, rng, alibi,
                                dropout_p, sink, True)
    return stats, max_logit


def _cudnn_fwd_max_fake(q, k, v, out, offsets_q, offsets_kv, seqlens_q, seqlens_kv, batch_size, max_seqlen_q, *args):
    stats = q.new_empty(stats_shape(q, batch_size, max_seqlen_q), dtype=torch.float32)
    return stats, q.new_empty(q.shape[-2], dtype=torch.float32)


kernel_ops.register("cudnn_fwd_max", cudnn_fwd_max, ("out",), _cudnn_fwd_max_fake)


def cudnn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    stats: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    offsets_q: Optional[torch.Tensor],
    offsets_kv: Optional[torch.Tensor],
    seqlens_q: Optional[torch.Tensor],
    seqlens_kv: Optional[torch.Tensor],
    batch_size: int,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    deterministic: bool,
    bias: Optional[torch.Tensor] = None,
    rng: Optional[torch.Tensor] = None,
    alibi: bool = False,
    dropout_p: float = 0.0,
    sink: Optional[torch.Tensor] = None,
    need_dbias: bool = False,
    need_dsink: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Writes ``dq``/``dk``/``dv`` (contiguous, q's/k's/v's shapes) in the rows it runs, leaving
    the others untouched, and returns dbias (like ``bias`` when ``need_dbias``) and dsink
    (float32 [H] when ``need_dsink``; else each is an empty tensor); ``dout`` needs ``out``'s
    strides. ``bias``, ``rng``, ``alibi``, ``dropout_p`` and ``sink`` must be those of the
    forward."""
    varlen, padded = offsets_q is not None, seqlens_q is not None
    dbias = torch.zeros(bias.shape, dtype=bias.dtype, device=bias.device) if need_dbias and bias is not None else None
    dsink = torch.zeros(sink.shape, dtype=torch.float32, device=sink.device) if need_dsink and sink is not None else None
    b, sq, skv = batch_size, max(max_seqlen_q, 1), max(max_seqlen_kv, 1)
    band, band_key = graphs.band(causal, window_left, window_right, bottom_right)
    features = (bias, alibi, dropout_p, sink)
    key = ("bwd", q.dtype, b, sq, skv, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), out.stride(),
           dq.stride(), dk.stride(), dv.stride(), softmax_scale, band_key, varlen, padded, deterministic,
           graphs.feature_key(*features), dbias is not None, dsink is not None, q.device)
    pack = {UID["q"]: q, UID["k"]: k, UID["v"]: v, UID["o"]: out, UID["do"]: dout, UID["stats"]: stats,
            UID["dq"]: dq, UID["dk"]: dk, UID["dv"]: dv}
    pack.update(graphs.feature_pack(bias, rng, dropout_p, sink))
    if dbias is not None:
        pack[UID["dbias"]] = dbias
    if dsink is not None:
        pack[UID["dsink"]] = dsink.view(graphs.sink_dims(dsink))
    ragged = graphs.ragged_sources(offsets_q, offsets_kv, dict(q=q, k=k, v=v, o=out, do=dout, dq=dq, dk=dk, dv=dv)) if varlen else {}
    pack.update(graphs.metadata_pack(seqlens_q, seqlens_kv, ragged))
    build = lambda h: graphs.build_bwd(h, q, k, v, out, dout, dq, dk, dv, (dbias, dsink), b, sq, skv, softmax_scale,  # noqa: E731
                                       band, varlen, padded, deterministic, features)
    graphs.run_graph(key, build, pack, q.device)
    return tuple(t if t is not None else q.new_empty(0) for t in (dbias, dsink))


def _cudnn_bwd_fake(dout, q, k, v, out, stats, dq, dk, dv, offsets_q, offsets_kv, seqlens_q, seqlens_kv, batch_size, max_seqlen_q,
                    max_seqlen_kv, softmax_scale, causal, window_left, window_right, bottom_right, deterministic, bias=None,
                    rng=None, alibi=False, dropout_p=0.0, sink=None, need_dbias=False, need_dsink=False):
    dbias = bias.new_empty(bias.shape) if need_dbias and bias is not None else q.new_empty(0)
    dsink = sink.new_empty(sink.shape, dtype=torch.float32) if need_dsink and sink is not None else q.new_empty(0)
    return dbias, dsink


kernel_ops.register("cudnn_bwd", cudnn_bwd, ("dq", "dk", "dv"), _cudnn_bwd_fake)
