"""Fake quantization: FP8 casts with a scale, as autograd Functions at attention's six FP8 points.

Equivalent, for one tensor ``x`` and its scale (no host sync anywhere)::

    amax = max |x|                                  # recorded into the step's amax slot
    scale = state scale (delayed)  |  fp8_max / amax (current)
    x8 = cast(clamp(x * scale, -fp8_max, fp8_max))  # torch.float8_e4m3fn / float8_e5m2, saturating
    x' = float(x8) * (1 / scale)                    # float32, what the next GEMM sees

The points, as cuDNN's FP8 SDPA places them (and TE's unfused emulation)::

    forward : Q, K, V (one scale)  ->  S = softmax(Q K^T) after dropout (row-relative)  ->  O
    backward: dO                   ->  dP = dL/d(Q K^T)                   ->  dQ, dK, dV (one scale)

Each Function quantizes in one direction only and passes the other straight through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from .state import FP32_MAX


def scaled_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fp8_max: float) -> torch.Tensor:
    """``x`` cast to FP8 with ``scale``, saturating as TE's casts: the bytes the kernels read."""
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fp8_max: float) -> torch.Tensor:
    """``x`` cast to FP8 with ``scale`` (:func:`scaled_cast`) and back, in float32."""
    return scaled_cast(x, scale, dtype, fp8_max).float() * torch.reciprocal(scale)


def current_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """TE's scale from a current amax: ``fp8_max / amax``; 1 for an amax of 0, inf or NaN;
    FP32_MAX where the quotient overflows."""
    amax = amax.float()
    scale = torch.full_like(amax, fp8_max) / amax  # a true division, not a reciprocal times fp8_max
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)
    return torch.where((amax == 0) | ~torch.isfinite(amax), torch.ones_like(scale), scale)


def amax_of(tensors: Sequence[torch.Tensor], rows: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """max |t| over ``tensors`` (float32, 0-d); ``rows[i]`` ([T] bool, THD) limits tensor i to
    the rows a sequence owns, so gaps and the tail (unspecified memory) never set a scale."""
    parts = []
    for t, valid in zip(tensors, rows):
        a = t.detach().abs().float()
        if valid is not None:
            a = torch.where(valid.view(-1, *([1] * (a.dim() - 1))), a, torch.zeros((), device=a.device))
        parts.append(a.amax() if a.numel() else a.new_zeros(()))
    return torch.stack(parts).amax()


@dataclass(frozen=True)
class Quantizer:
    """How one of the six tensors is quantized: its FP8 ``dtype`` and largest value, its
    ``scale`` (delayed scaling: a 0-d float32 tensor, read when used; None: current scaling,
    computed from the tensor itself) and, unless None, the 1-D amax buffer and ``slot`` its amax
    is max-accumulated into."""

    dtype: torch.dtype
    fp8_max: float
    scale: Optional[torch.Tensor]
    amax_buffer: Optional[torch.Tensor] = None
    slot: int = 0

    def __call__(self, tensors: Sequence[torch.Tensor], rows: Sequence[Optional[torch.Tensor]]) -> Tuple[torch.Tensor, ...]:
        """``tensors`` quantized with one shared scale, dequantized to float32."""
        with torch.no_grad():
            amax = amax_of(tensors, rows)
            if self.amax_buffer is not None:
                self.amax_buffer[self.slot] = torch.maximum(self.amax_buffer[self.slot], amax)
            scale = self.scale if self.scale is not None else current_scale(amax, self.fp8_max)
            return tuple(fake_quantize(t, scale, self.dtype, self.fp8_max) for t in tensors)


def _present(grads, rows):
    pairs = [(g, r) for g, r in zip(grads, rows) if g is not None]
    return [g for g, _ in pairs], [r for _, r in pairs]


class QuantizeQKV(torch.autograd.Function):
    """Forward: Q, K, V with one scale (float32 out). Backward: dQ, dK, dV with one scale (when
    the call quantizes its backward), cast back to the inputs' dtypes; the last DotProductAttention
    step of the backward, so the call's end-of-backward work (:meth:`FP8Context.finish_backward`)
    runs here."""

    @staticmethod
    def forward(ctx, q, k, v, fp8, rows_q, rows_kv):
        ctx.fp8, ctx.rows, ctx.dtypes = fp8, (rows_q, rows_kv, rows_kv), (q.dtype, k.dtype, v.dtype)
        return fp8.qkv((q, k, v), ctx.rows)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        grads = [dq, dk, dv]
        if ctx.fp8.backward_fp8:
            present, rows = _present(grads, ctx.rows)
            quantized = iter(ctx.fp8.dqkv(present, rows))
            grads = [None if g is None else next(quantized) for g in grads]
        grads = [None if g is None else g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)]
        ctx.fp8.finish_backward()
        return (*grads, None, None, None)


class QuantizeOutput(torch.autograd.Function):
    """Forward: O. Backward: dO (when the call quantizes its backward)."""

    @staticmethod
    def forward(ctx, out, fp8, rows_q):
        ctx.fp8, ctx.rows = fp8, (rows_q,)
        return fp8.o((out,), ctx.rows)[0]

    @staticmethod
    def backward(ctx, grad):
        if ctx.fp8.backward_fp8:
            grad = ctx.fp8.do((grad,), ctx.rows)[0]
        return grad, None, None


class QuantizeScoresGrad(torch.autograd.Function):
    """Forward: the scores Q K^T pass unchanged, as the same tensor (the unfused math forms P in
    their place, so they are marked dirty rather than viewed). Backward: dP, their gradient,
    quantized."""

    @staticmethod
    def forward(ctx, scores, fp8):
        ctx.fp8 = fp8
        ctx.mark_dirty(scores)
        return scores

    @staticmethod
    def backward(ctx, grad):
        if ctx.fp8.backward_fp8:
            grad = ctx.fp8.dp((grad,), (None,))[0].to(grad.dtype)
        return grad, None


def kernel_s_scale(quantizer: Quantizer) -> torch.Tensor:
    """The S scale the FP8 kernels quantize with: the state's, at most ``fp8_max``.

    cuDNN's FP8 forward (a flash kernel) quantizes each row's ``exp(s - rowmax)``, whose largest
    value is 1, before dividing by the row sum; the amax it reports (and delayed scaling scales
    from) is that of the normalized softmax, below 1 wherever a row sees several keys. The
    recipe's ``fp8_max / amax_s`` then saturates the row's largest entries: on the H200 a
    non-causal call of 2 x 512 tokens came out 4.6e-2 of the range from float64 uncapped, 5.0e-3
    capped (benchmarks/attention/probe_fp8_softmax_scale.py; its run is in benchmarks/results/).
    Capped at ``fp8_max`` nothing saturates; the state keeps TE's scale."""
    return torch.clamp(quantizer.scale, max=quantizer.fp8_max)


def quantize_probs(quantizer: Quantizer, probs: torch.Tensor) -> torch.Tensor:
    """S as the FP8 kernels quantize it (see :func:`kernel_s_scale`): the amax of the softmax
    recorded, each row divided by its largest entry, cast with the capped scale, multiplied back."""
    with torch.no_grad():
        amax = amax_of((probs,), (None,))
        quantizer.amax_buffer[quantizer.slot] = torch.maximum(quantizer.amax_buffer[quantizer.slot], amax)
        row_max = probs.detach().float().amax(-1, keepdim=True) if probs.numel() else probs.float()
        row_max = torch.where(row_max > 0, row_max, torch.ones((), device=probs.device))
        return fake_quantize(probs / row_max, kernel_s_scale(quantizer), quantizer.dtype, quantizer.fp8_max) * row_max


class QuantizeProbs(torch.autograd.Function):
    """Forward: S, the softmax output after dropout, quantized (:func:`quantize_probs`).
    Backward: passes through."""

    @staticmethod
    def forward(ctx, probs, fp8):
        return quantize_probs(fp8.s, probs).to(probs.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@dataclass(frozen=True)
class UnfusedHooks:
    """The two quantization points inside the unfused math (``unfused_math``'s ``scores_hook``
    and ``probs_hook``): the scores just before the softmax (dP in the backward), the
    probabilities after dropout, just before ``probs @ V`` (S in the forward)."""

    fp8: object  # the call's FP8Context

    def scores(self, scores: torch.Tensor) -> torch.Tensor:
        return QuantizeScoresGrad.apply(scores, self.fp8)

    def probs(self, probs: torch.Tensor) -> torch.Tensor:
        return QuantizeProbs.apply(probs, self.fp8)
