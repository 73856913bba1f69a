"""FusedAttention in FP8: cuDNN's ``sdpa_fp8`` / ``sdpa_fp8_backward`` around the call's FP8 context
(``AttentionInputs.fp8``, :class:`...fp8.context.FP8Context`; delayed scaling, the one recipe
cuDNN's FP8 path runs here: :mod:`.fp8_rules`).

Forward, as the unfused emulation quantizes (slots are TE's: QKV=2, O=3, S=8)::

    Q, K, V  -> E4M3 with the QKV scale, one amax (a declared qkv_layer / kv_layer: ONE cast of
                the packed buffer, q/k/v zero-copy views of its FP8 copy)
    sdpa_fp8 -> O (E4M3, scale of slot O), stats, amax_s -> slot S, amax_o -> slot O (S quantized
                with the slot's scale capped at fp8_max: fp8.quantize.kernel_s_scale)
    out       = float32(O) / scale_O in the inputs' dtype; then ``finish_forward``

Backward (``NVTE_FP8_DPA_BWD`` unset or 1; dO=3, dP=5, dQKV=0 in the backward slots)::

    dO -> the backward FP8 type (E5M2 for HYBRID) with the dO scale, amax into the backward row
    sdpa_fp8_backward (the forward's FP8 Q, K, V, O, stats and scales) -> dQ, dK, dV in FP8
    (packed into one buffer for a declared layer), amax_dp -> slot dP, max of the dQ/dK/dV
    amaxes -> slot dQKV; gradients = float32(dX) / scale_dQKV; then ``finish_backward``

Only the FP8 tensors (and the stats) are kept for the backward. ``NVTE_FP8_DPA_BWD=0`` runs the
forward above and the ordinary cuDNN backward from the high-precision q, k, v, the dequantized
O and the FP8 forward's stats, as TE does (on the H200 those gradients are within 0.0003-0.001 of
the value range of float64 ones: ``test_gpu_fp8.py``, benchmarks/results/fp8_accuracy_*.jsonl).

cuDNN's dP is the gradient of Q K^T (attn_scale included); the emulation's (and TE's unfused
one's) is the gradient of the scaled scores. Each quantizes the same numbers (a scale from its
own history absorbs the factor), but slot dP of a cuDNN state holds softmax_scale times the
emulation's amaxes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .. import kernel_ops
from ..kernel_autograd import module_problem
from ..kernel_problem import KernelProblem, ScoreFeatures
from ..varlen import plan_varlen
from ...fp8.emulation import valid_rows
from ...fp8.quantize import kernel_s_scale
from ...prepare.inputs import AttentionInputs
from .fp8_cast import cast_fp8, dequantize, view_like
from .fp8_graphs import BWD_SCALARS, FWD_SCALARS
from .kernel import _CudnnKernel, _run_args, _runs_cover_every_row
from . import fp8_ops  # noqa: F401  (registers the FP8 ops kernel_ops.ops dispatches to)

_FWD_ROW = {name: i for i, name in enumerate(FWD_SCALARS)}
_BWD_ROW = {name: i for i, name in enumerate(BWD_SCALARS)}


@dataclass(frozen=True)
class _View:
    """Where a tensor sits in a packed buffer: its shape, strides and element offset."""

    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class PackedGrads:
    """A declared layer's geometry, so the backward writes dQ/dK/dV (or dK/dV) as views of one
    FP8 buffer shaped like it and dequantizes that buffer once. No tensor is kept: the forward's
    high-precision inputs are not held for an FP8 backward."""

    kind: str  # "qkv" or "kv"
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    views: Tuple[_View, ...]  # q, k, v (qkv) or k, v (kv)


@dataclass(frozen=True)
class FP8Call:
    """The non-tensor half of one FP8 call: the problem, the FP8 context, the packed geometry
    (None: separate tensors) and the inputs' dtype."""

    problem: KernelProblem
    fp8: Any
    packed: Optional[PackedGrads]
    dtype: torch.dtype

    def run_args(self) -> tuple:
        """The one run's offsets, lengths, sizes, scale, causal flag and alignment."""
        oq, okv, lq, lkv, b, sq, skv, scale, causal, _, _, bottom_right = _run_args(self.problem, self.problem.runs[0])
        return oq, okv, lq, lkv, b, sq, skv, scale, causal, bottom_right


def run_fp8(inp: AttentionInputs, training: bool) -> torch.Tensor:
    """The output of an FP8 call on cuDNN (see the module docstring); sync-free."""
    fp8 = inp.fp8
    problem = module_problem(inp, plan_varlen(inp, always_lengths=True) if inp.is_thd else None)
    layer = _declared_layer(inp)
    q8, k8, v8 = quantize_inputs(inp, layer)
    leaves = _leaves(inp, layer)
    call = FP8Call(problem, fp8, _packed_grads(inp, layer), inp.q.dtype)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in leaves)):
        out = _forward(call, q8, k8, v8)[0]
    elif fp8.backward_fp8:
        out = _FP8Attention.apply(call, q8, k8, v8, *leaves)
    else:
        out = _FP8ForwardF16Backward.apply(call, q8, k8, v8, inp.q, inp.k, inp.v)
    fp8.finish_forward()
    return out


# ---------------------------------------------------------------------------------- the inputs


def _declared_layer(inp: AttentionInputs) -> Optional[torch.Tensor]:
    """The declared qkv_layer / kv_layer when the record's q/k/v (k/v) are still views of it
    (a record derived with other tensors is not) and, in THD, one set of valid rows covers
    the whole buffer."""
    layer = inp.packed_layer
    if inp.packing is None or layer is None:
        return None
    views = (inp.q, inp.k, inp.v) if inp.packing == "qkv" else (inp.k, inp.v)
    base = layer.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != base for t in views):
        return None
    if inp.is_thd and inp.packing == "qkv" and not (inp.packed_q.offsets is inp.packed_kv.offsets and inp.same_lengths):
        return None
    return layer


def quantize_inputs(inp: AttentionInputs, layer: Optional[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """Q, K, V in FP8 with the QKV quantizer (one scale, one amax slot), as views of one cast
    of ``layer`` where the call declared it."""
    quantizer = inp.fp8.qkv
    rows_q, rows_kv = valid_rows(inp)
    if layer is None:
        return cast_fp8(inp.q, quantizer, rows_q), cast_fp8(inp.k, quantizer, rows_kv), cast_fp8(inp.v, quantizer, rows_kv)
    if inp.packing == "qkv":
        buf = cast_fp8(layer, quantizer, rows_q)
        return tuple(view_like(buf, layer, t) for t in (inp.q, inp.k, inp.v))
    buf = cast_fp8(layer, quantizer, rows_kv)
    return cast_fp8(inp.q, quantizer, rows_q), view_like(buf, layer, inp.k), view_like(buf, layer, inp.v)


def _leaves(inp: AttentionInputs, layer: Optional[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """The tensors gradients go to: the declared layer in place of its views."""
    if layer is None:
        return inp.q, inp.k, inp.v
    return (layer,) if inp.packing == "qkv" else (inp.q, layer)


def _packed_grads(inp: AttentionInputs, layer: Optional[torch.Tensor]) -> Optional[PackedGrads]:
    if layer is None:
        return None
    views = (inp.q, inp.k, inp.v) if inp.packing == "qkv" else (inp.k, inp.v)
    return PackedGrads(inp.packing, tuple(layer.shape), layer.stride(),
                       tuple(_View(tuple(t.shape), t.stride(), t.storage_offset() - layer.storage_offset()) for t in views))


# ---------------------------------------------------------------------------------- forward


def _table(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """float32 [N, 4]: value i in row i, column 0 (each row starts on 16 bytes)."""
    return F.pad(torch.stack(list(values)).float().unsqueeze(1), (0, 3))


def _forward_table(fp8) -> torch.Tensor:
    """FWD_SCALARS from the call's forward scales (a copy taken at the call: a recomputed
    forward and the backward see the scales this forward used)."""
    s_qkv, s_s, s_o = fp8.qkv.scale, kernel_s_scale(fp8.s), fp8.o.scale
    inv = torch.reciprocal(torch.stack([s_qkv, s_s, s_o]))
    return _table([inv[0], inv[1], s_s, s_o, inv[2]])


def _forward(call: FP8Call, q8, k8, v8) -> Tuple[torch.Tensor, ...]:
    """(out in the inputs' dtype, O in FP8, stats, the forward scalar table)."""
    fp8, problem = call.fp8, call.problem
    empty = _runs_cover_every_row(problem)
    o8 = _new((*q8.shape[:-1], v8.shape[-1]), fp8.o.dtype, q8.device, zeros=not empty)
    table = _forward_table(fp8)
    amaxes = torch.empty(2, 4, dtype=torch.float32, device=q8.device)
    stats = kernel_ops.ops.cudnn_fp8_fwd(q8, k8, v8, o8, table, amaxes, *call.run_args())
    for i, slot in enumerate((fp8.s.slot, fp8.o.slot)):  # integer slots: views, no index tensor to upload
        fp8.fwd_amax[slot] = torch.maximum(fp8.fwd_amax[slot], amaxes[i, 0])
    out = dequantize(o8, table[_FWD_ROW["descale_o"], 0], call.dtype)
    if empty and problem.zeroes_rows:  # THD rows no sequence owns: 0, as in the BF16 path
        kernel_ops.ops.zero_gap_rows(out, *problem.rows_q, -1)
    return _padded_rows_zeroed(call, out), o8, stats, table


def _padded_rows_zeroed(call: FP8Call, t: torch.Tensor) -> torch.Tensor:
    """Dense padding: ``t`` (bshd order) with the rows past each sequence's query length set to 0.
    cuDNN's FP8 forward writes those rows on the H200 (its BF16 graph leaves them alone), so the
    output is cleared there and so is dO before the backward (their dQ and their share of dK/dV
    are then 0)."""
    problem = call.problem
    len_q = problem.runs[0].seqused_q
    if problem.varlen or len_q is None:
        return t
    rows = torch.arange(t.shape[1], device=t.device) < len_q.view(-1, 1)
    return torch.where(rows.view(*rows.shape, *([1] * (t.dim() - 2))), t, torch.zeros((), dtype=t.dtype, device=t.device))


class _FP8Attention(torch.autograd.Function):
    """FP8 forward and FP8 backward. Takes the FP8 q/k/v (cast outside, no gradient) and the
    leaves the gradients go to (q, k, v, or the declared layer in place of its views)."""

    @staticmethod
    def forward(ctx, call: FP8Call, q8, k8, v8, *leaves):
        out, o8, stats, table = _forward(call, q8, k8, v8)
        ctx.call = call
        ctx.save_for_backward(q8, k8, v8, o8, stats, table)
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = _backward(ctx.call, dout, *ctx.saved_tensors)
        return (None, None, None, None, *grads)


class _FP8ForwardF16Backward(torch.autograd.Function):
    """NVTE_FP8_DPA_BWD=0: the FP8 forward, then cuDNN's high-precision backward from q, k, v,
    the dequantized output and the FP8 forward's stats."""

    @staticmethod
    def forward(ctx, call: FP8Call, q8, k8, v8, q, k, v):
        out, _, stats, _ = _forward(call, q8, k8, v8)
        ctx.call = call
        ctx.save_for_backward(q, k, v, out, stats)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, stats = ctx.saved_tensors
        dout = dout if dout.stride() == out.stride() else dout.contiguous()
        dq, dk, dv, _, _ = _CudnnKernel.backward(dout, q, k, v, out, [stats], ctx.call.problem, ScoreFeatures(), False)
        return None, None, None, None, dq, dk, dv


# ---------------------------------------------------------------------------------- backward


def _backward_table(fwd_table: torch.Tensor, fp8) -> torch.Tensor:
    """BWD_SCALARS: the forward's Q/K/V, O and S scalars, the backward scales now."""
    f = fwd_table[:, 0]
    s_do, s_dp, s_dqkv = fp8.do.scale, fp8.dp.scale, fp8.dqkv.scale
    inv = torch.reciprocal(torch.stack([s_do, s_dp, s_dqkv]))
    return _table([f[_FWD_ROW["descale_qkv"]], f[_FWD_ROW["descale_o"]], f[_FWD_ROW["descale_s"]], f[_FWD_ROW["scale_s"]],
                   inv[0], inv[1], s_dqkv, s_dp, inv[2]])


def _new(shape, dtype: torch.dtype, device, zeros: bool) -> torch.Tensor:
    """A contiguous buffer: zero-filled where the kernel may leave rows unwritten."""
    return (torch.zeros if zeros else torch.empty)(shape, dtype=dtype, device=device)


def _grad_buffers(call: FP8Call, q8, k8, v8, dtype, zeros: bool):
    """FP8 dQ, dK, dV for the kernel, and the packed buffer they are views of (or None)."""
    packed = call.packed
    if packed is None:
        return tuple(_new(t.shape, dtype, t.device, zeros) for t in (q8, k8, v8)) + (None,)
    buf = torch.empty_strided(packed.shape, packed.stride, dtype=dtype, device=q8.device)
    if zeros:
        buf.zero_()
    views = [buf.as_strided(g.shape, g.stride, buf.storage_offset() + g.offset) for g in packed.views]
    if packed.kind == "kv":
        views = [_new(q8.shape, dtype, q8.device, zeros)] + views
    return (*views, buf)


def _backward(call: FP8Call, dout, q8, k8, v8, o8, stats, fwd_table) -> Tuple[torch.Tensor, ...]:
    fp8, problem = call.fp8, call.problem
    dout = _padded_rows_zeroed(call, dout)
    dout = dout if dout.stride() == o8.stride() else dout.contiguous()
    do8 = cast_fp8(dout, fp8.do)
    table = _backward_table(fwd_table, fp8)
    dq8, dk8, dv8, buf = _grad_buffers(call, q8, k8, v8, fp8.dqkv.dtype, not _runs_cover_every_row(problem))
    amaxes = torch.empty(4, 4, dtype=torch.float32, device=q8.device)
    _, _, lq, lkv, b, sq, skv, scale, causal, bottom_right = call.run_args()
    kernel_ops.ops.cudnn_fp8_bwd(do8, q8, k8, v8, o8, stats, dq8, dk8, dv8, table, amaxes, lq, lkv, b, sq, skv, scale, causal,
                                 bottom_right)
    row = fp8.dqkv.amax_buffer
    row[fp8.dqkv.slot] = torch.maximum(row[fp8.dqkv.slot], amaxes[:3, 0].amax())
    row[fp8.dp.slot] = torch.maximum(row[fp8.dp.slot], amaxes[3, 0])
    descale = table[_BWD_ROW["descale_dqkv"], 0]
    if buf is None:
        grads = tuple(dequantize(g, descale, call.dtype) for g in (dq8, dk8, dv8))
    elif call.packed.kind == "qkv":
        grads = (dequantize(buf, descale, call.dtype),)
    else:
        grads = (dequantize(dq8, descale, call.dtype), dequantize(buf, descale, call.dtype))
    fp8.finish_backward()
    return grads
