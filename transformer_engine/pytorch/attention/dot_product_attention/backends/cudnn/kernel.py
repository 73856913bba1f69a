"""The kernel interface (:mod:`..kernel_problem`) on the cuDNN ops: :class:`_CudnnKernel`, the
one place a kernel problem and its score features become cuDNN op arguments.

The cuDNN ops write into caller-provided buffers (``out``; ``dq``/``dk``/``dv``) and leave every
row they do not run untouched: gaps, the tail, and the rows of sequences run with length 0
(probed with NaN-filled buffers on the H200: benchmarks/results/2026-12-03-h200/ at 2f8a113 in git history: s4/). So, as
with FA4, the calls for several mask policies share one set of buffers and the caller zeroes
only the rows no sequence owns. THD runs through ragged offsets.
"""

from __future__ import annotations

import torch

from .. import kernel_ops
from ...environment import compiling
from ...prepare.metadata_cache import derived_from
from ..kernel_problem import KernelProblem, KernelRun, RowSpan, ScoreFeatures
from .ops import stats_shape  # (importing .ops registers the cuDNN ops kernel_ops.ops dispatches to)


class _CudnnKernel:
    """The kernel interface (:mod:`..kernel_problem`) on the cuDNN graph ops: run offsets as
    ragged offsets, valid lengths as per-sequence lengths; stats are [B, H, SQ, 1] float32, one
    tensor per run.

    cuDNN leaves the rows it does not run untouched, so the runs of all policies write their own
    rows of one output (and one dQ/dK/dV), and only the rows no sequence owns are zeroed, by
    ``zero_gap_rows``, where the problem names them (context parallelism zeroes its uncovered
    rows itself). No memset per run and no combining pass: each cost a launch and a pass over
    the whole tensor per policy (earlier combines: a ``where`` over row owners, then a sum of
    zero-filled per-run buffers; benchmarks/results/2026-12-03-h200/ at 2f8a113 in git history: s3/README.md).

    With ``features.max_logit`` (a float32 [H] buffer) each run also reports its max logit,
    and the buffer ends as the max over the runs."""

    SANITIZE_GAPS = False
    RETURNS_MAX_LOGIT = True

    @staticmethod
    def forward(q, k, v, problem: KernelProblem, features: ScoreFeatures, need_stats: bool):
        # need_stats is not used: the graphs always generate stats (an inference variant would be
        # a second cached graph per configuration, for a store of [B, H, SQ] floats).
        empty = _runs_cover_every_row(problem)
        out = _buffer(q, empty, (*q.shape[:-1], v.shape[-1]))
        if features.max_logit is None:
            stats = [kernel_ops.ops.cudnn_fwd(q, k, v, out, *_run_args(problem, run), *feature_args(features))
                     for run in problem.runs]
        else:
            stats = []
            for run in problem.runs:
                run_stats, run_max = kernel_ops.ops.cudnn_fwd_max(q, k, v, out, *_run_args(problem, run), *feature_args(features))
                stats.append(run_stats)
                torch.maximum(features.max_logit, run_max, out=features.max_logit)
        if empty and problem.zeroes_rows:  # a zero-filled buffer's unowned rows are 0 already
            kernel_ops.ops.zero_gap_rows(out, *problem.rows_q, -1)
        return out, stats

    @staticmethod
    def backward(dout, q, k, v, out, stats, problem: KernelProblem, features: ScoreFeatures, need_dbias: bool):
        det = torch.are_deterministic_algorithms_enabled()
        empty = _runs_cover_every_row(problem)
        dq, dk, dv = _buffer(q, empty), _buffer(k, empty), _buffer(v, empty)
        grads = [kernel_ops.ops.cudnn_bwd(dout, q, k, v, out, st, dq, dk, dv, *_run_args(problem, run), det,
                                          *feature_args(features), need_dbias, features.need_dsink)
                 for run, st in zip(problem.runs, stats)]
        if empty and problem.zeroes_rows:
            kernel_ops.ops.zero_gap_rows_qkv(dq, dk, dv, *problem.rows_q, *problem.rows_kv, -1)
        dbias = grads[0][0] if need_dbias else None  # a bias never meets per-sequence policies
        dsink = None
        if features.need_dsink:
            # Each policy's run reduces the sink gradient over its own rows: the sum is the whole.
            dsink = grads[0][1]
            for _, part in grads[1:]:
                dsink = dsink + part
        return dq, dk, dv, dbias, dsink

    @staticmethod
    def stats_to_rows(stats, qs: RowSpan) -> torch.Tensor:
        """[H, TQ]: each row's stat, gathered from [B, H, SQ, 1] by (sequence, position in its
        span); rows outside the spans get a clamped neighbour (the caller masks them)."""
        b, h, sq, _ = stats[0].shape
        flat = stats[0].view(b, h, sq).permute(1, 0, 2).reshape(h, b * sq)
        return flat[:, qs.seq * sq + qs.pos.clamp(0, sq - 1)]

    @staticmethod
    def stats_from_rows(lse: torch.Tensor, qs: RowSpan, q: torch.Tensor) -> list:
        """The inverse gather: [H, TQ] -> [B, H, SQ, 1] by the spans' starts (sync-free)."""
        b, sq = qs.lengths.numel(), max(qs.max_len, 1)
        h = q.shape[1]
        index = qs.offsets.long()[:-1].view(b, 1) + torch.arange(sq, device=q.device).view(1, sq)
        index = index.clamp(0, q.shape[0] - 1)
        return [lse[:, index.flatten()].view(h, b, sq).permute(1, 0, 2).reshape(*stats_shape(q, b, sq)).contiguous()]


def feature_args(features: ScoreFeatures) -> tuple:
    """The score features as the cuDNN ops take them: bias, rng, alibi, dropout_p, sink."""
    return features.bias, features.rng, features.alibi, features.dropout_p, features.sink


def _buffer(like: torch.Tensor, empty: bool, shape=None) -> torch.Tensor:
    """An output or gradient buffer for the runs to write into (``like``'s shape unless
    ``shape`` is given; contiguous): empty where the runs write every row or the rows they leave
    are zeroed afterwards (:func:`_runs_cover_every_row`), else zero-filled. Without a shape the
    ``*_like`` forms: they parse their arguments in half the host time of ``torch.empty(shape,
    dtype=, device=)`` (0.9 against 1.8 us on a CPU core)."""
    if shape is None:
        if empty:
            return torch.empty_like(like, memory_format=torch.contiguous_format)
        return torch.zeros_like(like, memory_format=torch.contiguous_format)
    if empty:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


def _runs_cover_every_row(problem: KernelProblem) -> bool:
    """Whether every row a run does not write is a row no sequence owns, zeroed afterwards.

    cuDNN leaves a query row that sees no key unwritten in the output (it writes dQ, dK and dV
    as zeros where a side is empty; benchmarks/results/2026-12-03-h200/ at 2f8a113 in git history: s4/), so that holds where
    each row sees a key: packed rows of the module's problems (``rows_q``/``rows_kv``, zeroed by
    ``zero_gap_rows``) whose runs share one lengths tensor for queries and keys (sq == skv per
    sequence, each row sees its own diagonal), and dense problems without valid lengths and
    either no band or sq == skv. Elsewhere (cross attention, dense padding, bands with
    sq != skv, the span calls of context parallelism) a row may see no key: zero-filled."""
    if problem.varlen:
        return problem.rows_q is not None and all(
            r.seqused_q is not None and r.seqused_kv is r.seqused_q for r in problem.runs)
    return all(r.seqused_q is None and (not r.spec.has_band or problem.max_seqlen_q == problem.max_seqlen_kv)
               for r in problem.runs)


def _run_args(problem: KernelProblem, run: KernelRun) -> tuple:
    """cudnn_fwd's and cudnn_bwd's arguments from offsets_q to bottom_right for one run."""
    causal = run.spec.mask_type.is_causal
    left, right = run.spec.window
    # Where every sequence has sq == skv the two alignments coincide; top-left is the one cuDNN
    # combines with bias, ALiBi and dropout.
    bottom_right = run.spec.mask_type.bottom_right and run.spec.has_band and not problem.same_lengths
    len_q, len_kv = run.seqused_q, run.seqused_kv
    if problem.varlen and len_q is None:
        # KernelRun's "None: up to the next offset"; cuDNN's ragged graphs always read lengths.
        # (The module's plans and the span calls pass them: plan_varlen(always_lengths=True).)
        len_q, len_kv = (o[1:] - o[:-1] for o in (run.offsets_q, run.offsets_kv))
    offsets_q, offsets_kv = _offsets64(run) if problem.varlen else (None, None)
    return (offsets_q, offsets_kv, len_q, len_kv, run.batch_size, problem.max_seqlen_q,
            problem.max_seqlen_kv, problem.softmax_scale, causal, left, right, bottom_right)


def _offsets64(run: KernelRun) -> tuple:
    """The run's offsets as int64, which the ops scale into cuDNN's element offsets: converted
    once per forward and kept on the run for the backward (eager; under torch.compile the ops
    convert them, as they convert int32 offsets anywhere)."""
    if compiling():
        return run.offsets_q, run.offsets_kv
    got = run.derived.get("offsets64")
    if got is None:
        q64 = _int64(run.offsets_q)
        got = run.derived["offsets64"] = (q64, q64 if run.offsets_kv is run.offsets_q else _int64(run.offsets_kv))
    return got


def _int64(offsets: torch.Tensor) -> torch.Tensor:
    # Offsets bounded by made_safe are remembered across calls, and their int64 form with them.
    return derived_from(offsets, "int64", offsets.long)
