"""cuDNN 9 SDPA through nvidia-cudnn-frontend's graph API: the support declaration, the
translation of a call into graph-op arguments (:class:`_CudnnKernel`, the kernel interface of
:mod:`..kernel_problem`), the registered ops ``cudnn_fwd``/``cudnn_bwd``, and the graphs they
build and cache.

The cuDNN ops write into caller-provided buffers (``out``; ``dq``/``dk``/``dv``) and leave every
row they do not run untouched: gaps, the tail, and the rows of sequences run with length 0
(probed with NaN-filled buffers on the H200: benchmarks/results/2026-12-03-h200/s4/). So, as
with FA4, the calls for several mask policies share one set of buffers and the caller zeroes
only the rows no sequence owns. THD runs through ragged offsets.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch

from .kernel_problem import KernelProblem, KernelRun, RowSpan, ScoreFeatures
from ..prepare.inputs import AttentionInputs
from ..selection.support import SOFTMAX_TYPES, BackendSupport, Reason, bias_thd_reasons
from . import kernel_ops
from .kernel_autograd import run_kernel
from .varlen import plan_varlen


class FusedAttention(BackendSupport):
    """cuDNN 9 SDPA through nvidia-cudnn-frontend's graph API (THD via ragged offsets)."""

    NAME = "FusedAttention"
    ENV_VARS = ("NVTE_FUSED_ATTN",)
    LIBRARY = "cudnn_frontend"
    MIN_COMPUTE_CAPABILITY = (8, 0)
    MAX_HEAD_DIM = 256
    SUPPORTS_PAD_BETWEEN_SEQS = True
    SUPPORTS_PER_SEQ_POLICY = True
    SUPPORTS_DROPOUT = True
    SUPPORTED_BIAS_TYPES = frozenset({"no_bias", "post_scale_bias", "alibi"})
    # Attention sinks through sdpa's sink_token / sdpa_backward's dSink_token (off-by-one is a
    # sink of 0); the cuDNN version rules are in _sink_reasons.
    SUPPORTED_SOFTMAX_TYPES = frozenset(SOFTMAX_TYPES)
    NOTES = {
        "core_attention_bias_type": "cuDNN adds a bias after scaling only",
        # A fact for whoever wires it: cudnn-frontend 1.32's sdpa can output score_max.
        "return_max_logit": "cuDNN's score_max output is not wired here yet",
    }
    CP_COMM_TYPES = frozenset({"p2p", "all_gather", "a2a", "a2a+p2p"})

    @classmethod
    def _check_special(cls, params, libs):
        cc = params.compute_capability
        out = []
        if cc is not None and cc[0] == 8 and max(params.head_dim_qk, params.head_dim_v) > 128:
            out.append(Reason("head_dim_qk", str(params.head_dim_qk), "<= 128 on sm8x"))
        if params.qkv_format == "thd" and params.head_dim_qk == 256 and params.head_dim_v != 256:
            # Probed on the H200 (benchmarks/results/2026-12-03-h200/probe_cudnn.log): non-finite
            # results for THD at (256, 128); dense layouts and every other pair probed are fine.
            out.append(Reason("head_dim_v", f"{params.head_dim_v} with head_dim_qk=256 in thd", "256 with head_dim_qk=256 in thd"))
        return (out + _probed_backward_reasons(params) + bias_thd_reasons(params) + _cudnn_feature_reasons(params)
                + _sink_reasons(params, libs))

    @staticmethod
    def run(inp: AttentionInputs, training: bool) -> torch.Tensor:
        return run_kernel(_CudnnKernel, inp, plan_varlen(inp, always_lengths=True) if inp.is_thd else None, training)


SINK_MIN_CUDNN = 91300  # sink_token in sdpa and sdpa_backward
SINK_THD_BACKWARD_MIN_CUDNN = 92600  # sink_token with ragged offsets in sdpa_backward
SINK_MIN_FRONTEND = (1, 32)  # the frontend release sink_token / dSink_token were run with


def _release(version: Optional[str]) -> Tuple[int, ...]:
    """(major, minor) of a version string such as "1.32.0"; (0,) where it cannot be read."""
    try:
        return tuple(int(part) for part in (version or "").split(".")[:2])
    except ValueError:
        return (0,)


def _sink_reasons(params, libs) -> List[Reason]:
    """cudnn-frontend's rules for sink_token: cuDNN 9.13 or newer, 9.26 for the ragged (THD)
    backward (older ones read out of bounds there), and not for a single query row (its
    decode-only mode); an unknown cuDNN version runs none."""
    if params.softmax_type == "vanilla":
        return []
    if params.max_seqlen_q == 1:
        return [Reason("softmax_type", f"{params.softmax_type!r} with max_seqlen_q=1",
                       "vanilla, or max_seqlen_q > 1 (cuDNN's decode-only mode takes no sink)")]
    if _release(libs.cudnn_frontend) < SINK_MIN_FRONTEND:
        return [Reason("softmax_type", f"{params.softmax_type!r} with cudnn-frontend {libs.cudnn_frontend}",
                       "vanilla, or cudnn-frontend >= 1.32 (the first release sink_token was tested with here)")]
    have = libs.cudnn
    need, why = SINK_MIN_CUDNN, "sinks"
    if params.qkv_format == "thd" and params.requires_grad:
        need, why = SINK_THD_BACKWARD_MIN_CUDNN, "sinks in the thd backward"
    if have is not None and have >= need:
        return []
    return [Reason("softmax_type", f"{params.softmax_type!r} with cuDNN {_cudnn_name(have)}",
                   f"vanilla, or cuDNN >= {_cudnn_name(need)} ({why})")]


def _cudnn_name(version: Optional[int]) -> str:
    if version is None:
        return "of unknown version"
    return f"{version // 10000}.{version // 100 % 100}"


def _probed_backward_reasons(params) -> List[Reason]:
    """Backward configurations cuDNN (9.19, frontend 1.32) runs without an error but gets wrong,
    found by TE's configuration matrix on the H200 (benchmarks/results/2026-12-03-h200/
    te_matrix.log); the forward of each is right, so they are refused only with gradients."""
    if not params.requires_grad:
        return []
    out = []
    if params.qkv_layout in ("t3hd", "th3d"):
        # The ragged backward reads a packed q (token stride 3*H*D) wrongly: dQ off by ~80%.
        out.append(Reason("qkv_layout", f"{params.qkv_layout} with gradients",
                          "thd_thd_thd, thd_t2hd or thd_th2d (cuDNN's ragged backward gets dQ wrong for a packed q)"))
    top_left = any(s.mask_type.is_causal and not s.mask_type.bottom_right for s in params.mask_specs)
    if top_left and params.max_seqlen_q == 1 < params.max_seqlen_kv:
        # Decode-shaped top-left causal (one query row sees key 0 only): dQ/dK came back ~1e24.
        out.append(Reason("attn_mask_type", "top-left causal with max_seqlen_q=1 < max_seqlen_kv and gradients",
                          "bottom-right causal, or max_seqlen_q > 1 (cuDNN's backward returns garbage there)"))
    return out


def _cudnn_feature_reasons(params) -> List[Reason]:
    """cuDNN's rules for bias, ALiBi and dropout (cudnn-frontend's SDPA validation)."""
    alibi = params.core_attention_bias_type == "alibi"
    features = [name for name, on in (("a bias", params.core_attention_bias_type == "post_scale_bias"), ("ALiBi", alibi),
                                      ("dropout", params.attention_dropout > 0 and params.is_training)) if on]
    if not features:
        return []
    out = []
    for spec in params.mask_specs:
        # Bottom-right bands cannot carry them; where sq == skv the band runs top-left instead.
        if spec.mask_type.bottom_right and spec.has_band and not params.same_lengths:
            out.append(Reason("attn_mask_type", f"{spec.mask_type.value} with {' and '.join(features)}",
                              "top-left masks, or sq == skv known for every sequence"))
        if alibi and spec.right != 0:
            out.append(Reason("attn_mask_type", f"{spec.mask_type.value}, window {spec.window} with alibi",
                              "causal masks (cuDNN's ALiBi needs a right bound of 0)"))
    if alibi and params.alibi_slopes_shape is not None:
        out.append(Reason("alibi_slopes", f"shape {params.alibi_slopes_shape}", "None (cuDNN computes the standard slopes)"))
    if alibi and not params.same_lengths:
        # cuDNN's ALiBi is slope * (j - i) under its causal mask; the reference's
        # -slope * |j - i - (skv - sq)| agrees with it (up to a per-row constant, which softmax
        # drops) where sq == skv.
        out.append(Reason("sequence lengths", "sq != skv possible with alibi",
                          "sq == skv for every sequence (self-attention sharing cu_seqlens, or dense without padding)"))
    return out


class _CudnnKernel:
    """The kernel interface (:mod:`..kernel_problem`) on the cuDNN graph ops: run offsets as
    ragged offsets, valid lengths as per-sequence lengths; stats are [B, H, SQ, 1] float32, one
    tensor per run.

    cuDNN leaves the rows it does not run untouched, so the runs of all policies write their own
    rows of one output (and one dQ/dK/dV), and only the rows no sequence owns are zeroed, by
    ``zero_gap_rows``, where the problem names them (context parallelism zeroes its uncovered
    rows itself). No memset per run and no combining pass: each cost a launch and a pass over
    the whole tensor per policy (earlier combines: a ``where`` over row owners, then a sum of
    zero-filled per-run buffers; benchmarks/results/2026-12-03-h200/s3/README.md)."""

    SANITIZE_GAPS = False

    @staticmethod
    def forward(q, k, v, problem: KernelProblem, features: ScoreFeatures, need_stats: bool):
        # need_stats is not used: the graphs always generate stats (an inference variant would be
        # a second cached graph per configuration, for a store of [B, H, SQ] floats).
        empty = _runs_cover_every_row(problem)
        out = _buffer(q, (*q.shape[:-1], v.shape[-1]), empty)
        stats = [kernel_ops.ops.cudnn_fwd(q, k, v, out, *_run_args(problem, run), *features.cudnn_args())
                 for run in problem.runs]
        if empty and problem.rows_q is not None:  # a zero-filled buffer's unowned rows are 0 already
            kernel_ops.ops.zero_gap_rows(out, *problem.rows_q, -1)
        return out, stats

    @staticmethod
    def backward(dout, q, k, v, out, stats, problem: KernelProblem, features: ScoreFeatures, need_dbias: bool):
        det = torch.are_deterministic_algorithms_enabled()
        empty = _runs_cover_every_row(problem)
        dq, dk, dv = (_buffer(t, t.shape, empty) for t in (q, k, v))
        grads = [kernel_ops.ops.cudnn_bwd(dout, q, k, v, out, st, dq, dk, dv, *_run_args(problem, run), det,
                                          *features.cudnn_args(), need_dbias, features.need_dsink)
                 for run, st in zip(problem.runs, stats)]
        if empty and problem.rows_q is not None:
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


def _buffer(like: torch.Tensor, shape, empty: bool) -> torch.Tensor:
    """An output or gradient buffer for the runs to write into: empty where the runs write every
    row or the rows they leave are zeroed afterwards (:func:`_runs_cover_every_row`), else
    zero-filled."""
    if empty:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


def _runs_cover_every_row(problem: KernelProblem) -> bool:
    """Whether every row a run does not write is a row no sequence owns, zeroed afterwards.

    cuDNN leaves a query row that sees no key unwritten in the output (it writes dQ, dK and dV
    as zeros where a side is empty; benchmarks/results/2026-12-03-h200/s4/), so that holds where
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
    return (run.offsets_q, run.offsets_kv, len_q, len_kv, run.batch_size, problem.max_seqlen_q,
            problem.max_seqlen_kv, problem.softmax_scale, causal, left, right, bottom_right)




# ------------------------------------------------------------------ the registered ops


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
    and returns stats [B, H, SQ, 1] float32.

    ``bias`` [B|1, H|1, SQ, SKV] is added after scaling; ``alibi`` adds cuDNN's own ALiBi (its
    standard slopes; needs a causal mask); ``dropout_p`` > 0 drops probabilities with the
    Philox stream of ``rng`` (int64 [seed, offset]), which the backward must receive again;
    ``sink`` (float32 [H]) is one extra logit per head in every softmax denominator."""
    varlen, padded = offsets_q is not None, seqlens_q is not None
    b, sq, skv = batch_size, max(max_seqlen_q, 1), max(max_seqlen_kv, 1)
    band = _band_kwargs(causal, window_left, window_right, bottom_right)
    features = (bias, alibi, dropout_p, sink)
    stats = q.new_empty(stats_shape(q, batch_size, max_seqlen_q), dtype=torch.float32)
    key = ("fwd", q.dtype, b, sq, skv, q.shape[1:], k.shape[1:], v.shape[1:], q.stride(), k.stride(), v.stride(),
           out.stride(), softmax_scale, _band_key(band), varlen, padded, _feature_key(*features), q.device)
    pack = {_UID["q"]: q, _UID["k"]: k, _UID["v"]: v, _UID["o"]: out, _UID["stats"]: stats}
    ragged = _ragged_sources(offsets_q, offsets_kv, dict(q=q, k=k, v=v, o=out)) if varlen else {}
    pack.update(_metadata_pack(seqlens_q, seqlens_kv, ragged))
    pack.update(_feature_pack(bias, rng, dropout_p, sink))
    build = lambda h: _build_fwd(h, q, k, v, out, b, sq, skv, softmax_scale, band, varlen, padded, features)  # noqa: E731
    _run_graph(key, build, pack, q.device)
    return stats


def _cudnn_fwd_fake(q, k, v, out, offsets_q, offsets_kv, seqlens_q, seqlens_kv, batch_size, max_seqlen_q, *args):
    return q.new_empty(stats_shape(q, batch_size, max_seqlen_q), dtype=torch.float32)


kernel_ops.register("cudnn_fwd", cudnn_fwd, ("out",), _cudnn_fwd_fake)


def stats_shape(q: torch.Tensor, batch_size: int, max_seqlen_q: int) -> Tuple[int, int, int, int]:
    return (batch_size, q.shape[-2], max(max_seqlen_q, 1), 1)


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
    band = _band_kwargs(causal, window_left, window_right, bottom_right)
    features = (bias, alibi, dropout_p, sink)
    key = ("bwd", q.dtype, b, sq, skv, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), out.stride(),
           dq.stride(), dk.stride(), dv.stride(), softmax_scale, _band_key(band), varlen, padded, deterministic,
           _feature_key(*features), dbias is not None, dsink is not None, q.device)
    pack = {_UID["q"]: q, _UID["k"]: k, _UID["v"]: v, _UID["o"]: out, _UID["do"]: dout, _UID["stats"]: stats,
            _UID["dq"]: dq, _UID["dk"]: dk, _UID["dv"]: dv}
    pack.update(_feature_pack(bias, rng, dropout_p, sink))
    if dbias is not None:
        pack[_UID["dbias"]] = dbias
    if dsink is not None:
        pack[_UID["dsink"]] = dsink.view(_sink_dims(dsink))
    ragged = _ragged_sources(offsets_q, offsets_kv, dict(q=q, k=k, v=v, o=out, do=dout, dq=dq, dk=dk, dv=dv)) if varlen else {}
    pack.update(_metadata_pack(seqlens_q, seqlens_kv, ragged))
    build = lambda h: _build_bwd(h, q, k, v, out, dout, dq, dk, dv, (dbias, dsink), b, sq, skv, softmax_scale, band,  # noqa: E731
                                 varlen, padded, deterministic, features)
    _run_graph(key, build, pack, q.device)
    return tuple(t if t is not None else q.new_empty(0) for t in (dbias, dsink))


def _cudnn_bwd_fake(dout, q, k, v, out, stats, dq, dk, dv, offsets_q, offsets_kv, seqlens_q, seqlens_kv, batch_size, max_seqlen_q,
                    max_seqlen_kv, softmax_scale, causal, window_left, window_right, bottom_right, deterministic, bias=None,
                    rng=None, alibi=False, dropout_p=0.0, sink=None, need_dbias=False, need_dsink=False):
    dbias = bias.new_empty(bias.shape) if need_dbias and bias is not None else q.new_empty(0)
    dsink = sink.new_empty(sink.shape, dtype=torch.float32) if need_dsink and sink is not None else q.new_empty(0)
    return dbias, dsink


kernel_ops.register("cudnn_bwd", cudnn_bwd, ("dq", "dk", "dv"), _cudnn_bwd_fake)


# ------------------------------------------------------------------ graphs: building and caching

_UID = dict(q=1, k=2, v=3, o=4, stats=5, do=6, dq=7, dk=8, dv=9, len_q=10, len_kv=11, rq=12, rk=13, rv=14, ro=15, rdq=16, rdk=17, rdv=18, rdo=19,
            bias=20, dbias=21, seed=22, offset=23, sink=24, dsink=25)
# Built graphs by configuration, least recently used first; bounded, since each holds cuDNN
# plans and a training run with many shapes (or a per-batch max_seqlen) keeps making new ones.
_graphs: "OrderedDict[tuple, tuple]" = OrderedDict()
MAX_GRAPHS = 256
_graph_lock = threading.Lock()
_handles = threading.local()


def _handle(device: torch.device):
    import cudnn

    cache = getattr(_handles, "by_device", None)
    if cache is None:
        cache = _handles.by_device = {}
    if device not in cache:
        with torch.cuda.device(device):
            cache[device] = cudnn.create_handle()
    cudnn.set_stream(handle=cache[device], stream=torch.cuda.current_stream(device).cuda_stream)
    return cache[device]


def _desc(t: torch.Tensor, varlen: bool, s_max: int) -> Tuple[List[int], List[int]]:
    """cuDNN's [B, H, S, D] dims and strides for a [T, H, D] (varlen) or [B, S, H, D] tensor.

    Varlen batch strides are placeholders: ragged offsets give each sequence's base."""
    if varlen:
        st, sh, sd = t.stride()
        return [0, t.shape[1], s_max, t.shape[2]], [s_max * st, sh, st, sd]
    sb, ss, sh, sd = t.stride()
    return [t.shape[0], t.shape[2], t.shape[1], t.shape[3]], [sb, sh, ss, sd]


def _band_kwargs(causal: bool, window_left: int, window_right: int, bottom_right: bool) -> dict:
    import cudnn

    right = 0 if causal else window_right
    return dict(
        diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT if bottom_right else cudnn.diagonal_alignment.TOP_LEFT,
        # cuDNN's left bound counts the diagonal itself: left = window_left + 1.
        diagonal_band_left_bound=None if window_left < 0 else window_left + 1,
        diagonal_band_right_bound=None if right < 0 else right,
    )


def _dims(t: torch.Tensor, varlen: bool, s_max: int, b: int) -> Tuple[List[int], List[int]]:
    """:func:`_desc` with the batch dim of a varlen tensor set to the sequence count."""
    dims, strides = _desc(t, varlen, s_max)
    if varlen:
        dims[0] = b
    return dims, strides


def _set_ragged(g, tensors: dict, names: Tuple[str, ...], b: int) -> None:
    """Give each named graph input its ragged offsets (uid name "r" + its name)."""
    for name in names:
        tensors[name].set_ragged_offset(_ragged(g, "r" + name, b))


def _declare_output(g, gt, name: str, ref: torch.Tensor, s_max: int, b: int, varlen: bool) -> None:
    """Set a graph output's uid, dims and strides from the torch tensor it is written into."""
    dims, strides = _dims(ref, varlen, s_max, b)
    if varlen:
        gt.set_ragged_offset(_ragged(g, "r" + name, b))
    gt.set_uid(_UID[name]).set_output(True).set_dim(dims).set_stride(strides)


def _stats_layout(b: int, h: int, sq: int) -> Tuple[List[int], List[int]]:
    """Stats stay dense [B, H, SQ, 1] float32 even for THD: the backward then needs no ragged stats."""
    return [b, h, sq, 1], [h * sq, sq, 1, 1]


def _sdpa_kwargs(t: dict, scale: float, varlen: bool, padded: bool, band: dict) -> dict:
    """What sdpa and sdpa_backward take alike: scale, per-sequence lengths and the mask band."""
    return dict(attn_scale=scale, use_padding_mask=varlen or padded, seq_len_q=t.get("len_q"), seq_len_kv=t.get("len_kv"),
                **band)


def _graph_tensors(g, tensors: dict, b: int, varlen: bool, s: dict) -> dict:
    """Declare q/k/v-like graph inputs; ``tensors`` maps uid name -> (torch tensor, s_max)."""
    import cudnn

    out = {}
    for name, (t, s_max) in tensors.items():
        dims, strides = _dims(t, varlen, s_max, b)
        out[name] = g.tensor(name=name, dim=dims, stride=strides, data_type=_dtype(t.dtype), uid=_UID[name])
    if varlen or s.get("padded"):
        for name in ("len_q", "len_kv"):
            out[name] = g.tensor(name=name, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32, uid=_UID[name])
    return out


def _ragged(g, name: str, b: int):
    import cudnn

    return g.tensor(name=name, dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64, uid=_UID[name])


def _dtype(dtype: torch.dtype):
    import cudnn

    return {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[dtype]


def _round64(n: int) -> int:
    return (n + 63) // 64 * 64


def _ragged_rows(t: torch.Tensor) -> int:
    """Rows of a dense [T, H, D] tensor that span ``t``'s ragged (element) offsets. cuDNN's
    backward indexes its dQ accumulator with q's ragged offsets but sizes it in rows of H*D, so
    a packed q (t3hd/th3d: a row stride of 3*H*D) needs 3x the rows: sized by T alone it wrote
    out of bounds (an illegal instruction on the H200, probe_cudnn.log). Sized so, it no longer
    crashes, but dQ still comes out wrong (te_matrix.log), so selection refuses those layouts
    with gradients (_probed_backward_reasons); this stays as the guard against the crash."""
    per_row = t.shape[1] * t.shape[2]
    return -(-t.shape[0] * t.stride(0) // per_row)


def _finish(g):
    import cudnn

    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, g.get_workspace_size()


def _cached(key, build):
    with _graph_lock:
        hit = _graphs.get(key)
        if hit is not None:
            _graphs.move_to_end(key)
            return hit
        hit = _graphs[key] = build()
        while len(_graphs) > MAX_GRAPHS:
            _graphs.popitem(last=False)
    return hit


def _new_graph(dtype, handle):
    import cudnn

    return cudnn.pygraph(
        handle=handle,
        io_data_type=_dtype(dtype),
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
    )


def _build_fwd(handle, q, k, v, o, b, sq, skv, scale, band, varlen, padded, features):
    import cudnn

    g = _new_graph(q.dtype, handle)
    t = _graph_tensors(g, dict(q=(q, sq), k=(k, skv), v=(v, skv)), b, varlen, dict(padded=padded))
    if varlen:
        _set_ragged(g, t, ("q", "k", "v"), b)
    o_t, stats_t = g.sdpa(name="sdpa", q=t["q"], k=t["k"], v=t["v"], generate_stats=True,
                          **_sdpa_kwargs(t, scale, varlen, padded, band), **_feature_kwargs(g, *features))
    _declare_output(g, o_t, "o", o, sq, b, varlen)
    dims, strides = _stats_layout(b, q.shape[-2], sq)
    stats_t.set_uid(_UID["stats"]).set_output(True).set_dim(dims).set_stride(strides).set_data_type(cudnn.data_type.FLOAT)
    return _finish(g)


def _band_key(band: dict) -> tuple:
    return tuple(sorted((n, str(x)) for n, x in band.items()))


def _sink_dims(sink: torch.Tensor) -> List[int]:
    return [1, sink.shape[0], 1, 1]  # cuDNN's sink_token is [1, H, 1, 1] float32


def _sink_tensor(g, name: str, sink: torch.Tensor):
    import cudnn

    dims = _sink_dims(sink)
    return g.tensor(name=name, dim=dims, stride=[dims[1], 1, 1, 1], data_type=cudnn.data_type.FLOAT, uid=_UID[name])


def _feature_kwargs(g, bias: Optional[torch.Tensor], alibi: bool, dropout_p: float, sink: Optional[torch.Tensor]) -> dict:
    """sdpa / sdpa_backward arguments for a post-scale bias, ALiBi, dropout and the sink logits."""
    import cudnn

    kwargs = {}
    if bias is not None:
        kwargs["bias"] = g.tensor(name="bias", dim=list(bias.shape), stride=list(bias.stride()), data_type=_dtype(bias.dtype),
                                  uid=_UID["bias"])
    if alibi:
        kwargs["use_alibi_mask"] = True
    if dropout_p > 0:
        seed, offset = (g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64, uid=_UID[n])
                        for n in ("seed", "offset"))
        kwargs["dropout"] = (dropout_p, seed, offset)
    if sink is not None:
        kwargs["sink_token"] = _sink_tensor(g, "sink", sink)
    return kwargs


def _feature_pack(bias: Optional[torch.Tensor], rng: Optional[torch.Tensor], dropout_p: float,
                  sink: Optional[torch.Tensor]) -> dict:
    """The device tensors behind :func:`_feature_kwargs`; ``rng`` is int64 [seed, offset]."""
    pack = {}
    if bias is not None:
        pack[_UID["bias"]] = bias
    if dropout_p > 0:
        if rng is None or rng.numel() != 2:
            raise ValueError("cuDNN dropout needs rng = int64 [seed, offset] on the device")
        pack[_UID["seed"]], pack[_UID["offset"]] = rng[0:1].view(1, 1, 1, 1), rng[1:2].view(1, 1, 1, 1)
    if sink is not None:
        if sink.dtype != torch.float32 or sink.dim() != 1:
            raise ValueError(f"cuDNN's sink must be float32 [H]; got {sink.dtype} {tuple(sink.shape)}")
        pack[_UID["sink"]] = sink.contiguous().view(_sink_dims(sink))
    return pack


def _feature_key(bias: Optional[torch.Tensor], alibi: bool, dropout_p: float, sink: Optional[torch.Tensor]) -> tuple:
    return (None if bias is None else (tuple(bias.shape), bias.stride(), bias.dtype), alibi, dropout_p,
            None if sink is None else sink.shape[0])


def _run_graph(key, build, pack: dict, device) -> None:
    """Build (once per key) and execute a cuDNN graph on torch's current stream."""
    handle = _handle(device)
    g, ws = _cached(key, lambda: build(handle))
    workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device=device)
    g.execute(pack, workspace, handle=handle)


_Q_SIDE = frozenset({"q", "o", "do", "dq"})  # tensors with query rows (the others have key rows)


def _ragged_sources(offsets_q: torch.Tensor, offsets_kv: torch.Tensor, tensors: dict) -> dict:
    """{ragged uid name: (token offsets, the tensor whose token stride scales them)}."""
    return {"r" + name: (offsets_q if name in _Q_SIDE else offsets_kv, t) for name, t in tensors.items()}


def _metadata_pack(seqlens_q, seqlens_kv, ragged: dict) -> dict:
    """Per-sequence lengths, and ragged offsets (int64 ELEMENT offsets: token offset times
    that tensor's token stride) for varlen calls."""
    pack = {}
    if seqlens_q is not None:
        pack[_UID["len_q"]] = seqlens_q.int().view(-1, 1, 1, 1)
        pack[_UID["len_kv"]] = seqlens_kv.int().view(-1, 1, 1, 1)
    # Tensors sharing offsets and token stride share one offset tensor: each costs two launches,
    # and a backward names eight (one of them, typically).
    made: Dict[Tuple[int, int], torch.Tensor] = {}
    for name, (offsets, t) in ragged.items():
        key = (id(offsets), t.stride(0))
        if key not in made:
            made[key] = (offsets.long() * t.stride(0)).view(-1, 1, 1, 1)
        pack[_UID[name]] = made[key]
    return pack


def _build_bwd(handle, q, k, v, o, do, dq, dk, dv, grads, b, sq, skv, scale, band, varlen, padded, deterministic, features):
    """``grads`` = (dbias, dsink): the optional gradient outputs (None = not asked for)."""
    import cudnn

    g = _new_graph(q.dtype, handle)
    t = _graph_tensors(g, dict(q=(q, sq), k=(k, skv), v=(v, skv), o=(o, sq), do=(do, sq)), b, varlen, dict(padded=padded))
    dims, strides = _stats_layout(b, q.shape[-2], sq)
    stats = g.tensor(name="stats", dim=dims, stride=strides, data_type=cudnn.data_type.FLOAT, uid=_UID["stats"])
    if varlen:
        _set_ragged(g, t, ("q", "k", "v", "o", "do"), b)
    # Sizes the ragged dQ accumulator; rounded up as cuDNN's own THD path does.
    extra = dict(max_total_seq_len_q=_round64(_ragged_rows(q)), max_total_seq_len_kv=_round64(_ragged_rows(k))) if varlen else {}
    extra.update(_feature_kwargs(g, *features))
    dbias, dsink = grads
    if dbias is not None:
        extra["dBias"] = g.tensor(name="dbias", dim=list(dbias.shape), stride=list(dbias.stride()), data_type=_dtype(dbias.dtype),
                                  uid=_UID["dbias"])
    if dsink is not None:
        extra["dSink_token"] = _sink_tensor(g, "dsink", dsink)
    dq_t, dk_t, dv_t = g.sdpa_backward(name="sdpa_backward", q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"], stats=stats,
                                       use_deterministic_algorithm=deterministic,
                                       **_sdpa_kwargs(t, scale, varlen, padded, band), **extra)
    for name, gt, ref, s_max in (("dq", dq_t, dq, sq), ("dk", dk_t, dk, skv), ("dv", dv_t, dv, skv)):
        _declare_output(g, gt, name, ref, s_max, b, varlen)
    return _finish(g)


FusedAttention.KERNEL = _CudnnKernel  # the declaration names its kernel interface (defined after the class)
