"""flash-attn-4 (``flash_attn.cute``): its support declaration, the translation of a call into
its arguments (:class:`_FA4Kernel`, the kernel interface of :mod:`.kernel_problem`) and the
registered ops around the library.

The FA4 ops write into caller-provided buffers (``out``/``lse``, ``dq``/``dk``/``dv``): FA4 leaves
the rows it skips unwritten, so the calls for several mask policies share one set of buffers
and :class:`_FA4Kernel` zeroes the rows no sequence owns afterwards (``gap_rows.zero_gap_rows``;
context parallelism zeroes its uncovered rows itself). With ``return_lse`` False, no LSE
buffer and no input that requires grad, FA4 runs its inference variant, which stores no
log-sum-exp. Eager calls of the module's problems skip the ops' argument lists: each run's static
keywords are built once per problem (:func:`_statics`, by the builders the op bodies use) and the
call's tensors added to a copy; their first run hands the library no buffer (FA4 allocates them,
as its own entry does, instead of validating ours) and later runs get the first run's.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

import torch

from .kernel_problem import KernelProblem, KernelRun, RowSpan, ScoreFeatures
from ..prepare.inputs import AttentionInputs
from ..selection.libraries import compute_capability
from ..selection.support import SOFTMAX_TYPES, Reason
from . import kernel_ops
from .fa4_kv import run_fa4_kv_cache
from .flash_common import FlashAttention, mask_args
from .kernel_autograd import bind_kernel, run_kernel
from ..environment import compiling
from .varlen import plan_varlen


_INTERFACE = "flash_attn.cute.interface"


def _library():
    """flash-attn-4's interface module, imported on first use. Later calls find it in
    sys.modules: an import statement costs about 1 us a call (measured on a CPU core)."""
    return sys.modules.get(_INTERFACE) or importlib.import_module(_INTERFACE)


def _opt(w: int) -> Optional[int]:
    return None if w < 0 else w


def _shared_kwargs(cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, max_seqlen_q, max_seqlen_kv, softmax_scale, causal,
                   window_left, window_right) -> dict:
    """The keywords ``_flash_attn_fwd`` and ``_flash_attn_bwd`` (flash-attn-4 4.0.0b36) share:
    those of one run of a problem, the same on every call of it (see :func:`_launch_fwd`)."""
    varlen = cu_seqlens_q is not None
    return {
        "cu_seqlens_q": cu_seqlens_q,
        "cu_seqlens_k": cu_seqlens_kv,
        "seqused_q": seqused_q,
        "seqused_k": seqused_kv,
        "max_seqlen_q": max_seqlen_q if varlen else None,
        "max_seqlen_k": max_seqlen_kv if varlen else None,
        "softmax_scale": softmax_scale,
        "causal": causal,
        "window_size_left": _opt(window_left),
        "window_size_right": _opt(window_right),
    }


def _fwd_static(cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, max_seqlen_q, max_seqlen_kv, softmax_scale, causal,
                window_left, window_right, num_splits: Optional[int], device: torch.device) -> dict:
    """The forward's keywords of one run that name none of the call's tensors."""
    kwargs = _shared_kwargs(cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, max_seqlen_q, max_seqlen_kv, softmax_scale,
                            causal, window_left, window_right)
    if num_splits is not None and _split_hint(device):
        kwargs["num_splits"] = num_splits
    return kwargs


def _launch_fwd(static: dict, q, k, v, out, lse, learnable_sink, return_lse: Optional[bool] = None) -> tuple:
    """``_flash_attn_fwd`` with one run's static keywords and the call's tensors; returns its
    (out, lse). Private and by keyword: the public ``flash_attn_func`` / ``flash_attn_varlen_func``
    run their own autograd and take no output buffers. ``out`` / ``lse`` None: the library
    allocates them (the LSE where ``return_lse`` or an input requires grad). ``return_lse``: ask
    for the LSE (None: whether ``lse`` is given; a given LSE buffer always asks). False with no
    LSE buffer and no input requiring grad runs the inference variant (no LSE store). The sink
    is passed only when given (FA4 releases before the sink backward lack the keyword)."""
    kwargs = static.copy()
    kwargs["q"], kwargs["k"], kwargs["v"] = q, k, v
    kwargs["return_lse"] = lse is not None or bool(return_lse)
    kwargs["out"], kwargs["lse"] = out, lse
    if learnable_sink is not None:
        kwargs["learnable_sink"] = learnable_sink
    return _library()._flash_attn_fwd(**kwargs)[:2]


def fa4_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_kv: Optional[torch.Tensor],
    seqused_q: Optional[torch.Tensor],
    seqused_kv: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_kv: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    learnable_sink: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
) -> None:
    """``learnable_sink`` [H] float32: one extra logit per head in each softmax denominator
    (after scaling), with no value; None for the vanilla softmax. ``num_splits``: TE's split-KV
    hint (0: the library's heuristic), passed where FA4 has split-KV (:func:`_split_hint`)."""
    static = _fwd_static(cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, max_seqlen_q, max_seqlen_kv, softmax_scale, causal,
                         window_left, window_right, num_splits, q.device)
    _launch_fwd(static, q, k, v, out, lse, learnable_sink)


def _split_hint(device: torch.device) -> bool:
    """Whether FA4 takes ``num_splits`` on this device: its split-KV forward exists on the
    majors :attr:`FlashAttentionV4.NUM_SPLITS_MAJORS` names (4.0.0b36 asserts "SplitKV not
    supported on SM 9.0", and its heuristic, num_splits=0, may choose a split there too).
    Elsewhere the hint is dropped, as a performance hint may be. Off CUDA (the CPU stand-ins
    of the tests) it is passed, so the tests see it arrive."""
    if device.type != "cuda":
        return True
    major = compute_capability(device.index if device.index is not None else torch.cuda.current_device())[0]
    return major in FlashAttentionV4.NUM_SPLITS_MAJORS


def _fa4_fwd_fake(q, k, v, out, lse, *args) -> None:
    return None


kernel_ops.register("fa4_fwd", fa4_fwd, ("out", "lse"), _fa4_fwd_fake)


def _bwd_static(cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, max_seqlen_q, max_seqlen_kv, softmax_scale, causal,
                window_left, window_right) -> dict:
    """The backward's keywords of one run that name none of the call's tensors."""
    kwargs = _shared_kwargs(cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, max_seqlen_q, max_seqlen_kv, softmax_scale,
                            causal, window_left, window_right)
    kwargs["softcap"] = 0.0  # no logit soft-capping (TE has none)
    return kwargs


def _launch_bwd(static: dict, dout, q, k, v, out, lse, dq, dk, dv, deterministic: bool, learnable_sink):
    """``_flash_attn_bwd`` (private: no public backward takes gradient buffers) with one run's
    static keywords and the call's tensors; returns what it returns (dq, dk, dv and, with a
    sink, dsink). ``dq`` / ``dk`` / ``dv`` None: the library allocates them."""
    kwargs = static.copy()
    kwargs["q"], kwargs["k"], kwargs["v"], kwargs["out"], kwargs["dout"], kwargs["lse"] = q, k, v, out, dout, lse
    kwargs["deterministic"], kwargs["dq"], kwargs["dk"], kwargs["dv"] = deterministic, dq, dk, dv
    if learnable_sink is not None:
        kwargs["learnable_sink"] = learnable_sink
    return _library()._flash_attn_bwd(**kwargs)


def fa4_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_kv: Optional[torch.Tensor],
    seqused_q: Optional[torch.Tensor],
    seqused_kv: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_kv: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    deterministic: bool,
) -> None:
    """dQ/dK/dV into the caller's buffers (vanilla softmax)."""
    static = _bwd_static(cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, max_seqlen_q, max_seqlen_kv, softmax_scale, causal,
                         window_left, window_right)
    _launch_bwd(static, dout, q, k, v, out, lse, dq, dk, dv, deterministic, None)


def _fa4_bwd_fake(dout, q, k, v, out, lse, dq, dk, dv, *args) -> None:
    return None


kernel_ops.register("fa4_bwd", fa4_bwd, ("dq", "dk", "dv"), _fa4_bwd_fake)


def fa4_bwd_sink(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_kv: Optional[torch.Tensor],
    seqused_q: Optional[torch.Tensor],
    seqused_kv: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_kv: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    deterministic: bool,
    learnable_sink: torch.Tensor,
    dsink: torch.Tensor,
) -> None:
    """:func:`fa4_bwd` with the forward's ``learnable_sink``; this call's sink gradient is ADDED
    to ``dsink`` (calls for several mask policies each reduce over their own rows). A separate op,
    not optional arguments of fa4_bwd: a mutated argument that may be None does not trace under
    torch.compile (the vanilla backward failed there when dsink was one)."""
    static = _bwd_static(cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, max_seqlen_q, max_seqlen_kv, softmax_scale, causal,
                         window_left, window_right)
    dsink.add_(_launch_bwd(static, dout, q, k, v, out, lse, dq, dk, dv, deterministic, learnable_sink)[3])


def _fa4_bwd_sink_fake(dout, q, k, v, out, lse, dq, dk, dv, *args) -> None:
    return None


kernel_ops.register("fa4_bwd_sink", fa4_bwd_sink, ("dq", "dk", "dv", "dsink"), _fa4_bwd_sink_fake)


class FlashAttentionV4(FlashAttention):
    """flash-attn-4 (``flash_attn.cute``): Hopper and Blackwell, JIT-compiled CuTe kernels."""

    VERSION = 4
    ENV_VARS = ("NVTE_FLASH_ATTN", "NVTE_FLASH_ATTN_V4")
    LIBRARY = "flash_attn_4"
    COMPUTE_CAPABILITY_MAJORS = frozenset({9, 10})
    SUPPORTS_PAD_BETWEEN_SEQS = True
    SUPPORTS_PER_SEQ_POLICY = True
    # flash-attn-4 (4.0.0b36) takes ``learnable_sink`` [H] in the forward and returns its
    # gradient from the backward (dense and varlen, sm90 and sm10x); off-by-one is a sink of 0.
    SUPPORTED_SOFTMAX_TYPES = frozenset(SOFTMAX_TYPES)
    NOTES = {**{field: note for field, note in FlashAttention.NOTES.items() if field != "softmax_type"},
             "fp8": "flash-attn-4 (4.0.0b36) has no FP8 attention path"}
    CP_COMM_TYPES = frozenset({"p2p", "all_gather", "a2a", "a2a+p2p"})
    # flash-attn-4 4.0.0b36 runs split-KV on sm10x/sm11x only (fa4_fwd drops the hint elsewhere).
    NUM_SPLITS_MAJORS = frozenset({10})
    # KV caches through page_table / seqused_k (fa4_kv.py); page sizes probed on the H200: 16, 64,
    # 128 and 256 (benchmarks/attention/probe_fp8_paged_kv.py).
    SUPPORTS_KV_CACHE = True
    SUPPORTS_PAGED_KV_CACHE = True
    KV_PAGE_SIZE_MULTIPLE = 16
    run_kv_cache = staticmethod(run_fa4_kv_cache)

    @classmethod
    def _check_special(cls, params, libs):
        cc = params.compute_capability
        dims = (params.head_dim_qk, params.head_dim_v)
        if cc is not None and cc[0] == 10 and max(dims) > 128 and dims != (256, 256):
            return [Reason("head_dim_qk", str(params.head_dim_qk), "<= 128 or (256, 256) on sm10x")]
        if cc is not None and cc[0] == 10 and dims == (256, 256) and params.softmax_type != "vanilla" and params.requires_grad:
            return [Reason("softmax_type", repr(params.softmax_type),
                           "vanilla with head dim 256 on sm10x when gradients are needed (FA4's dedicated hd256 backward has no sink)")]
        if cc is not None and cc[0] == 9 and params.requires_grad and dims[0] != dims[1]:
            # Probed on the H200 (benchmarks/results/2026-12-03-h200/ at 2f8a113 in git history: probe_fa4.log): the forward
            # runs, the backward refuses (GQA) or exceeds shared memory at launch.
            return [Reason("head_dim_v", f"{dims[1]} != head_dim_qk={dims[0]} with gradients",
                           "head_dim_v == head_dim_qk for the backward on sm9x (the forward alone runs either)")]
        return []

    @staticmethod
    def run(inp: AttentionInputs, training: bool) -> torch.Tensor:
        return run_kernel(_FA4Kernel, inp, plan_varlen(inp) if inp.is_thd else None, training)

    @classmethod
    def bind(cls, inp: AttentionInputs, training: bool):
        if not inp.is_thd:
            return None
        plan = plan_varlen(inp)
        return plan, bind_kernel(_FA4Kernel, inp, plan, training)


class _FA4Kernel:
    """The kernel interface (:mod:`.kernel_problem`) on flash_attn.cute (FA4): run offsets as
    cu_seqlens, valid lengths as seqused_q/k; the log-sum-exp is [H, T] (varlen) or [B, H, S]
    (dense).

    FA4 leaves the rows it skips unwritten in the forward and in dQ/dK/dV, so the runs of all
    policies write their own rows of one buffer each, and only the rows no sequence owns (gaps,
    the tail) are zeroed, by ``zero_gap_rows`` (where the problem names them: context
    parallelism zeroes its uncovered rows itself): no memset of the whole buffer, no combining
    pass (the GPU tests assert those zeros, and that skipped rows of other policies stay 0)."""

    SANITIZE_GAPS = True
    RETURNS_MAX_LOGIT = False  # FA4 returns the log-sum-exp only (selection keeps return_max_logit away)

    @staticmethod
    def forward(q, k, v, problem: KernelProblem, features: ScoreFeatures, need_lse: bool):
        """(out, [lse or None]); features: FA4 declares none but the sink."""
        if problem.host is None or compiling() or not problem.runs:  # (no runs: a batch of no sequences)
            out, lse = _FA4Kernel._op_forward(q, k, v, problem, features, need_lse)
        else:
            # Eager calls of the module's problems: the library allocates the buffers on the
            # first run and later runs (other policies) write into those. A buffer handed to
            # _flash_attn_fwd is validated there (shape, dtype and device asserts, layout checks),
            # a cost on top of our own allocation (benchmarks/results/host_bench_c2ba625.md).
            out = lse = None
            for static in _statics(problem, "fwd", q.device):
                out, lse = _launch_fwd(static, q, k, v, out, lse, features.sink, need_lse)
        if problem.zeroes_rows:
            kernel_ops.ops.zero_gap_rows(out, *problem.rows_q, -1)
        return out, [lse]

    @staticmethod
    def _op_forward(q, k, v, problem: KernelProblem, features: ScoreFeatures, need_lse: bool) -> tuple:
        """The forward through the registered op (torch.compile, the span calls of context
        parallelism; a problem of no runs only allocates): buffers allocated here, as the op's
        schema mutates them."""
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = None
        if need_lse:  # without it FA4 runs its inference variant (no LSE store)
            shape = (q.shape[-2], q.shape[0]) if problem.varlen else (q.shape[0], q.shape[2], q.shape[1])
            lse = q.new_empty(shape, dtype=torch.float32)
        for run in problem.runs:
            # The sink is always passed (None without one): a traced custom op needs every
            # argument its schema names, the mutated ones above all (dsink in the backward).
            kernel_ops.ops.fa4_fwd(q, k, v, out, lse, *_run_args(problem, run), problem.softmax_scale, *mask_args(run.spec),
                                   learnable_sink=features.sink, num_splits=problem.num_splits)
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, stats, problem: KernelProblem, features: ScoreFeatures, need_dbias: bool):
        # Each policy's run adds the sum over its own rows into dsink (FA4 reduces
        # -exp(sink - lse) * rowsum(dO * O) over the rows it runs).
        dsink = None if features.sink is None else torch.zeros_like(features.sink)
        det = torch.are_deterministic_algorithms_enabled()
        if problem.host is None or compiling() or not problem.runs:
            # empty_like with an explicit contiguous format: torch.empty(shape, dtype=, device=)'s
            # result at 0.9 instead of 1.8 us an allocation (argument parsing; on a CPU core).
            dq = torch.empty_like(q, memory_format=torch.contiguous_format)
            dk = torch.empty_like(k, memory_format=torch.contiguous_format)
            dv = torch.empty_like(v, memory_format=torch.contiguous_format)
            bwd, sink_args = (kernel_ops.ops.fa4_bwd, ()) if dsink is None else (kernel_ops.ops.fa4_bwd_sink, (features.sink, dsink))
            for run in problem.runs:
                bwd(dout, q, k, v, out, stats[0], dq, dk, dv, *_run_args(problem, run), problem.softmax_scale,
                    *mask_args(run.spec), det, *sink_args)
        else:
            # Allocated by the library's first run, as the forward's output: empty_like(q) there
            # keeps a dense q's strides (an sbhd call's dQ comes in q's own layout, as from FA4's
            # own entry; the op route above makes it contiguous).
            dq = dk = dv = None
            for static in _statics(problem, "bwd", q.device):
                grads = _launch_bwd(static, dout, q, k, v, out, stats[0], dq, dk, dv, det, features.sink)
                dq, dk, dv = grads[:3]
                if dsink is not None:
                    dsink.add_(grads[3])
        if problem.zeroes_rows:
            kernel_ops.ops.zero_gap_rows_qkv(dq, dk, dv, *problem.rows_q, *problem.rows_kv, -1)
        return dq, dk, dv, None, dsink

    @staticmethod
    def stats_to_rows(stats, qs: RowSpan) -> torch.Tensor:
        """The varlen LSE is already [H, TQ] by physical row."""
        return stats[0]

    @staticmethod
    def stats_from_rows(lse: torch.Tensor, qs: RowSpan, q: torch.Tensor) -> list:
        return [lse.contiguous()]  # the kernel reads the rows it runs; -inf elsewhere is never read


def _statics(problem: KernelProblem, direction: str, device: torch.device) -> list:
    """The static keywords of each of the problem's runs for ``direction`` ("fwd" or "bwd"),
    built on the problem's first call that way and kept in ``problem.host``: eager calls of a
    remembered problem skip the registered op's argument list and the dict building (about
    1.5 us a forward and a backward on a CPU core). The dicts come from the op bodies' own
    builders, so both routes pass the library the same keywords."""
    made = problem.host.get(direction)
    if made is None:
        if direction == "fwd":
            made = [_fwd_static(*_run_args(problem, run), problem.softmax_scale, *mask_args(run.spec), problem.num_splits, device)
                    for run in problem.runs]
        else:
            made = [_bwd_static(*_run_args(problem, run), problem.softmax_scale, *mask_args(run.spec)) for run in problem.runs]
        problem.host[direction] = made  # one assignment: another thread sees all runs or none
    return made


def _run_args(problem: KernelProblem, run: KernelRun) -> tuple:
    """cu_seqlens_q/kv, seqused_q/kv, max_seqlen_q/kv of one run (fa4_fwd's and fa4_bwd's order)."""
    return (run.offsets_q, run.offsets_kv, run.seqused_q, run.seqused_kv, problem.max_seqlen_q, problem.max_seqlen_kv)


FlashAttentionV4.KERNEL = _FA4Kernel  # the declaration names its kernel interface (defined after the class)
