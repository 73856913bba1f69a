"""The module's autograd around the kernels that write into caller buffers (FA4, cuDNN), on the
kernel interface of :mod:`.kernel_problem`: :func:`run_kernel` describes the prepared call as
one :class:`KernelProblem` (runs from the THD plan) and runs the backend's ``forward`` and
``backward`` with the NaN guard, the bias and sink in the kernels' form, dropout's Philox
state, and TE's max logit where the kernel returns one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import torch

from .kernel_problem import NO_FEATURES, KernelProblem, KernelRun, ScoreFeatures
from ..environment import compiling
from ..prepare.inputs import AttentionInputs
from ..prepare.metadata_cache import derived_from, owns
from .varlen import VarlenPlan, gap_guard, packed_rows, zero_spill_rows, zero_spill_rows_in_place


def _features(bias, alibi: bool, dropout_p: float, rng, sink, need_dsink: bool = False, max_logit=None) -> ScoreFeatures:
    """The call's score features; the shared empty record where there are none (most calls:
    one object less to build per forward and backward)."""
    if bias is None and sink is None and rng is None and max_logit is None and not alibi and not dropout_p:
        return NO_FEATURES
    return ScoreFeatures(bias, alibi, dropout_p, rng, sink, need_dsink=need_dsink, max_logit=max_logit)


def _draw_rng(device: torch.device) -> torch.Tensor:
    # On the device, from torch's generator: no host sync, CUDA graphs capture it, and
    # torch.manual_seed makes a run repeatable.
    return torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=device)


@dataclass
class KernelCall:
    """The non-tensor half of one kernel run: who translates the arguments (``kernel``), the
    problem, the NaN guard mode, and the score features' flags. One object, so the
    autograd.Function gets five arguments instead of eleven (each costs host time in apply)."""

    kernel: Any
    problem: KernelProblem
    guard: str
    need_stats: bool
    alibi: bool
    dropout_p: float
    max_logit: bool = False  # return TE's max logit (kernels whose class sets RETURNS_MAX_LOGIT)

    def forward(self, q, k, v, bias, sink):
        """(q, k, v as the kernel read them, out, rng, stats, max logit [H] float32 or None)."""
        if self.guard == "copy":
            q, k, v = zero_spill_rows(self.problem.rows_q, self.problem.rows_kv, *(t.clone() for t in (q, k, v)))
        rng = _draw_rng(q.device) if self.dropout_p > 0 else None
        max_logit = torch.full((q.shape[-2],), float("-inf"), dtype=torch.float32, device=q.device) if self.max_logit else None
        features = _features(bias, self.alibi, self.dropout_p, rng, sink, max_logit=max_logit)
        out, stats = self.kernel.forward(q, k, v, self.problem, features, self.need_stats)
        if max_logit is not None:
            # Nothing scored (no key anywhere) gives float32's lowest value, as the unfused
            # reference does for a fully masked head.
            max_logit = max_logit.clamp_min(torch.finfo(torch.float32).min)
        return q, k, v, out, rng, stats, max_logit


class _KernelAttention(torch.autograd.Function):
    """FA4 and cuDNN through their custom ops; ``call.kernel`` translates the arguments and
    runs the calls of several policies into one set of buffers (see each kernel class)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sink, call: KernelCall):
        q, k, v, out, rng, stats, max_logit = call.forward(q, k, v, bias, sink)
        ctx.call = call
        ctx.save_for_backward(q, k, v, out, bias, rng, sink, *stats)
        if max_logit is None:
            return out
        ctx.mark_non_differentiable(max_logit)  # TE's max logit carries no gradient
        return out, max_logit

    @staticmethod
    def backward(ctx, dout, *_no_grad_for_the_max_logit):
        q, k, v, out, bias, rng, sink, *stats = ctx.saved_tensors
        call, needs = ctx.call, ctx.needs_input_grad
        dout = dout if dout.stride() == out.stride() else dout.contiguous()
        features = _features(bias, call.alibi, call.dropout_p, rng, sink, need_dsink=needs[4])
        dq, dk, dv, dbias, dsink = call.kernel.backward(dout, q, k, v, out, stats, call.problem, features, needs[3])
        return dq, dk, dv, dbias, dsink if needs[4] else None, None  # nothing for ``call``


# autograd.Function's C entry bound to _KernelAttention. Eager calls outside functorch transforms
# take it: ``Function.apply``'s Python layer only adds functorch's handling there (unwrapping
# dead wrappers, binding defaults for setup_context), about 2.4 us a call on a CPU core. Under
# torch.compile and functorch the public apply runs, as they expect.
_C_APPLY = getattr(torch._C._FunctionBase, "__dict__", {}).get("apply")
_C_APPLY = _C_APPLY.__get__(None, _KernelAttention) if _C_APPLY is not None else None


def run_kernel(kernel, inp: AttentionInputs, plan: Optional[VarlenPlan],
               training: bool) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The output, or (output, max logit [H] float32) where ``inp.return_max_logit`` asks for it
    and the kernel returns one (a kernel forced past its declaration gives the output alone)."""
    guard = gap_guard(plan, kernel)
    if guard == "inplace":
        zero_spill_rows_in_place(inp)
    bias = _kernel_bias(inp) if inp.bias_type == "post_scale_bias" else None
    # The sink logits in float32 (what FA4 and cuDNN take), [H]; the cast keeps the gradient path.
    sink = None if inp.softmax_type == "vanilla" else inp.softmax_offset.reshape(-1).float().contiguous()
    return launch(_call_for(kernel, inp, plan, guard, bias, sink, training), inp.q, inp.k, inp.v, bias, sink)


def bind_kernel(kernel, inp: AttentionInputs, plan: Optional[VarlenPlan], training: bool) -> Optional[KernelCall]:
    """The KernelCall :func:`run_kernel` makes for ``inp``, where a later call with the same
    remembered plan and fast-path recipe runs as ``launch(call, q, k, v)`` (see
    ``prepare/fast_path.bound_call``); None where such a call needs more than its q/k/v: a
    NaN-guard write, a bias or sink tensor, the max logit, or a plan that is not remembered. A
    kernel with the NaN guard binds a batch with gaps only once every row is known owned: the
    guard's mode is read per call (NVTE_FLASH_ATTN_SANITIZE_GAPS), and the fact never turns
    back to unknown, so the guard stays off for every later call of the binding."""
    if (plan is None or inp.bias_type == "post_scale_bias" or inp.softmax_type != "vanilla" or inp.return_max_logit
            or not owns(plan) or (kernel.SANITIZE_GAPS and plan.has_gaps and not plan.every_row_owned())):
        return None
    return _call_for(kernel, inp, plan, gap_guard(plan, kernel), None, None, training)


def _call_for(kernel, inp: AttentionInputs, plan: Optional[VarlenPlan], guard: str, bias, sink, training: bool) -> KernelCall:
    # Without gradients FA4 may skip its log-sum-exp (``needs_input_grad`` ignores no_grad).
    q, k, v = inp.q, inp.k, inp.v
    need_stats = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                              or (bias is not None and bias.requires_grad)
                                              or (sink is not None and sink.requires_grad))
    max_logit = inp.return_max_logit and kernel.RETURNS_MAX_LOGIT
    return _kernel_call(kernel, inp, plan, guard, need_stats, inp.dropout_p if training else 0.0, max_logit)


def launch(call: KernelCall, q, k, v, bias=None, sink=None) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Run ``call`` on these tensors: through the autograd Function where gradients are needed."""
    if not call.need_stats:  # nothing to differentiate: skip autograd.Function.apply (~10 us of host time)
        _, _, _, out, _, _, top = call.forward(q, k, v, bias, sink)
        return (out, top) if call.max_logit else out
    if _C_APPLY is None or compiling() or torch._C._are_functorch_transforms_active():
        return _KernelAttention.apply(q, k, v, bias, sink, call)
    return _C_APPLY(q, k, v, bias, sink, call)


def _kernel_call(kernel, inp: AttentionInputs, plan: Optional[VarlenPlan], guard: str, need_stats: bool, dropout_p: float,
                 max_logit: bool) -> KernelCall:
    """The call's KernelCall; for a remembered THD plan (prepare/metadata_cache.py) the one an
    earlier call made with the same plan and flags (nothing changes a KernelCall once made, and
    its problem reads only the plan, the plan's sides and the flags in the key)."""
    alibi = inp.bias_type == "alibi"
    owned = plan is not None and plan.every_row_owned()  # read once: the key and the problem agree

    def make() -> KernelCall:
        return KernelCall(kernel, module_problem(inp, plan, owned), guard, need_stats, alibi, dropout_p, max_logit)

    if plan is None or not owns(plan):
        return make()
    key = ("call", kernel, guard, need_stats, alibi, dropout_p, max_logit, inp.softmax_scale, inp.same_lengths, inp.num_splits,
           owned)
    return derived_from(plan, key, make)


def _kernel_bias(inp: AttentionInputs) -> Optional[torch.Tensor]:
    """The post-scale bias as the kernels take it: the inputs' dtype, contiguous, and a
    [1, 1, 1, SKV] row expanded over the queries (autograd sums dBias back into the row)."""
    bias = inp.bias.to(inp.q.dtype)
    if bias.shape[2] != inp.q.shape[1]:
        bias = bias.expand(1, 1, inp.q.shape[1], bias.shape[3])
    return bias.contiguous()


def module_problem(inp: AttentionInputs, plan: Optional[VarlenPlan], every_row_owned: Optional[bool] = None) -> KernelProblem:
    """The prepared call as a kernel problem: the plan's runs (THD) or one dense run.
    ``every_row_owned``: the plan's rows fact as the caller read it (None: read it here)."""
    if plan is None:
        b, sq, skv = inp.q.shape[0], inp.q.shape[1], inp.k.shape[1]
        lengths = (None, None)
        if inp.q_valid is not None or inp.kv_valid is not None:
            lengths = (_dense_lengths(inp.q_valid, b, sq, inp.q.device), _dense_lengths(inp.kv_valid, b, skv, inp.q.device))
        run = KernelRun(0, inp.mask, None, None, *lengths, b)
        return KernelProblem((run,), sq, skv, inp.softmax_scale, False, inp.same_lengths, num_splits=inp.num_splits, host={})
    pq, pk = inp.packed_q, inp.packed_kv
    return KernelProblem(plan.calls, pq.max_seqlen, pk.max_seqlen, inp.softmax_scale, True, inp.same_lengths,
                         *packed_rows(inp), num_splits=inp.num_splits,
                         every_row_owned=plan.every_row_owned() if every_row_owned is None else every_row_owned, host={})


def _dense_lengths(valid: Optional[torch.Tensor], b: int, s: int, device) -> torch.Tensor:
    """[B] int32 valid lengths of a dense batch from its [B, S] mask of valid positions."""
    if valid is None:
        return torch.full((b,), s, dtype=torch.int32, device=device)
    return valid.sum(dim=1, dtype=torch.int32)
