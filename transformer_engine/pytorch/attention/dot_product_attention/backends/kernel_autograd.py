"""The module's autograd around the kernels that write into caller buffers (FA4, cuDNN).

A kernel adapter (``_FA4Kernel``, ``_CudnnKernel``) has ``forward(q, k, v, features, inp,
plan, calls, need_stats) -> (out, stats)`` and ``backward(dout, q, k, v, out, stats, features,
need_dbias, inp, plan, calls) -> (dq, dk, dv, dbias, dsink)``; :func:`run_kernel` runs one with
the NaN guard, the bias and sink in the kernels' form, and dropout's Philox state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from ..params import AttentionInputs
from .varlen import VarlenCall, VarlenPlan, _gap_guard, _zero_spill_rows, _zero_spill_rows_in_place


@dataclass
class ScoreFeatures:
    """What a kernel adds on the way from scores to output: a post-scale ``bias`` (already in
    the inputs' dtype), ALiBi, dropout with its Philox ``rng`` (int64 [seed, offset], drawn
    once per forward from torch's generator and reused by the backward, so both see one mask),
    and the attention ``sink`` logits (float32 [H]; off-by-one passes zeros)."""

    bias: Optional[torch.Tensor] = None
    alibi: bool = False
    dropout_p: float = 0.0
    rng: Optional[torch.Tensor] = None
    sink: Optional[torch.Tensor] = None
    need_dsink: bool = False  # backward only: whether the sink's gradient is wanted

    def cudnn_args(self) -> tuple:
        return self.bias, self.rng, self.alibi, self.dropout_p, self.sink


def _draw_rng(device: torch.device) -> torch.Tensor:
    # On the device, from torch's generator: no host sync, CUDA graphs capture it, and
    # torch.manual_seed makes a run repeatable.
    return torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=device)


@dataclass
class KernelCall:
    """The non-tensor half of one kernel run: who translates the arguments (``kernel``), the
    inputs and THD plan, the NaN guard mode, and the score features' flags. One object, so the
    autograd.Function gets five arguments instead of eleven (each costs host time in apply)."""

    kernel: Any
    inp: AttentionInputs
    plan: Optional[VarlenPlan]
    guard: str
    need_stats: bool
    alibi: bool
    dropout_p: float

    def forward(self, q, k, v, bias, sink):
        """(q, k, v as the kernel read them, out, rng, stats)."""
        if self.guard == "copy":
            q, k, v = _zero_spill_rows(self.inp, *(t.clone() for t in (q, k, v)))
        rng = _draw_rng(q.device) if self.dropout_p > 0 else None
        features = ScoreFeatures(bias, self.alibi, self.dropout_p, rng, sink)
        out, stats = self.kernel.forward(q, k, v, features, self.inp, self.plan, _calls(self.inp, self.plan), self.need_stats)
        return q, k, v, out, rng, stats


class _KernelAttention(torch.autograd.Function):
    """FA4 and cuDNN through their custom ops; ``call.kernel`` translates the arguments and
    decides how the calls of several policies are combined (see each kernel class)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sink, call: KernelCall):
        q, k, v, out, rng, stats = call.forward(q, k, v, bias, sink)
        ctx.call = call
        ctx.save_for_backward(q, k, v, out, bias, rng, sink, *stats)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, bias, rng, sink, *stats = ctx.saved_tensors
        call = ctx.call
        dout = dout if dout.stride() == out.stride() else dout.contiguous()
        features = ScoreFeatures(bias, call.alibi, call.dropout_p, rng, sink, need_dsink=ctx.needs_input_grad[4])
        dq, dk, dv, dbias, dsink = call.kernel.backward(dout, q, k, v, out, stats, features, ctx.needs_input_grad[3],
                                                        call.inp, call.plan, _calls(call.inp, call.plan))
        if not ctx.needs_input_grad[4]:
            dsink = None
        return dq, dk, dv, dbias, dsink, None  # nothing for ``call``


def run_kernel(kernel, inp: AttentionInputs, plan: Optional[VarlenPlan], training: bool) -> torch.Tensor:
    guard = _gap_guard(plan, kernel)
    if guard == "inplace":
        _zero_spill_rows_in_place(inp)
    bias = _kernel_bias(inp)
    # The sink logits in float32 (what FA4 and cuDNN take), [H]; the cast keeps the gradient path.
    sink = None if inp.softmax_type == "vanilla" else inp.softmax_offset.reshape(-1).float().contiguous()
    # Without gradients FA4 may skip its log-sum-exp (``needs_input_grad`` ignores no_grad).
    need_stats = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (inp.q, inp.k, inp.v, bias, sink))
    call = KernelCall(kernel, inp, plan, guard, need_stats, inp.bias_type == "alibi", inp.dropout_p if training else 0.0)
    if not need_stats:  # nothing to differentiate: skip autograd.Function.apply (~10 us of host time)
        return call.forward(inp.q, inp.k, inp.v, bias, sink)[3]
    return _KernelAttention.apply(inp.q, inp.k, inp.v, bias, sink, call)


def _kernel_bias(inp: AttentionInputs) -> Optional[torch.Tensor]:
    """The post-scale bias as the kernels take it: the inputs' dtype, contiguous, and a
    [1, 1, 1, SKV] row expanded over the queries (autograd sums dBias back into the row)."""
    if inp.bias_type != "post_scale_bias":
        return None
    bias = inp.bias.to(inp.q.dtype)
    if bias.shape[2] != inp.q.shape[1]:
        bias = bias.expand(1, 1, inp.q.shape[1], bias.shape[3])
    return bias.contiguous()


def _calls(inp: AttentionInputs, plan: Optional[VarlenPlan]) -> List[VarlenCall]:
    return plan.calls if plan is not None else [VarlenCall(0, inp.mask, None, None)]
