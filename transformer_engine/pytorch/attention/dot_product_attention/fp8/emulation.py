"""The unfused backend's FP8 emulation (``NVTE_UnfusedDPA_Emulate_FP8=1``): the pure-PyTorch math
run with the FP8 kernels' quantization points, on any device.

Q, K, V are quantized with one scale and dequantized to float32, the unfused math runs on them
with S and dP quantized inside (:class:`~.quantize.UnfusedHooks`), and O is quantized before the
cast back to the inputs' dtype; the backward quantizes dO, dP and dQKV. With
``NVTE_FP8_DPA_BWD=0`` the forward values are the FP8 ones and the backward is the
high-precision one from the high-precision inputs (TE's F16 backward after an FP8 forward; TE's
kernel also reuses the FP8 forward's softmax statistics, which this does not).

Packed (THD) calls take amaxes over the rows a sequence owns only: gaps and the tail are
unspecified memory and must not set a scale. Dense padded calls take them over the whole tensors,
as the GPU kernels do.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional, Tuple

import torch

from ..prepare.inputs import AttentionInputs
from .quantize import QuantizeOutput, QuantizeQKV, UnfusedHooks

Run = Callable[..., object]  # unfused_math.unfused_attention(inp, training, probs_hook=, scores_hook=)


def run_emulated(inp: AttentionInputs, training: bool, run: Run):
    """``run(inp, training)`` (the unfused math) as FP8 attention per ``inp.fp8``; returns what
    ``run`` returns (the output, or (output, max logit))."""
    fp8 = inp.fp8
    rows = valid_rows(inp)
    if fp8.backward_fp8:
        result = _quantized(inp, training, run, rows)
    else:
        result = _fp8_forward_high_precision_backward(inp, training, run, rows)
    fp8.finish_forward()
    return result


def valid_rows(inp: AttentionInputs) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """THD: the [T] rows sequences own on the q and kv sides (amaxes skip the others); dense: None."""
    if not inp.is_thd:
        return None, None
    return inp.packed_q.token_valid(), inp.packed_kv.token_valid()


def _split(result):
    return (result[0], result[1:]) if isinstance(result, tuple) else (result, None)


def _join(out, rest):
    return out if rest is None else (out, *rest)


def _quantized(inp: AttentionInputs, training: bool, run: Run, rows):
    """The FP8 pipeline: QKV -> (S, dP inside) -> O, each quantized where the kernels do."""
    fp8 = inp.fp8
    q, k, v = QuantizeQKV.apply(inp.q, inp.k, inp.v, fp8, *rows)
    hooks = UnfusedHooks(fp8)
    inner = dataclasses.replace(inp, q=q, k=k, v=v, fp8=None)
    out, rest = _split(run(inner, training, probs_hook=hooks.probs, scores_hook=hooks.scores))
    return _join(QuantizeOutput.apply(out, fp8, rows[0]).to(inp.q.dtype), rest)


class _ValuesFrom(torch.autograd.Function):
    """Forward: ``values``; backward: the gradient goes to ``graph``."""

    @staticmethod
    def forward(ctx, graph, values):
        return values.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _fp8_forward_high_precision_backward(inp: AttentionInputs, training: bool, run: Run, rows):
    """NVTE_FP8_DPA_BWD=0: the FP8 forward's values, the high-precision graph's gradients. Both
    passes draw the same dropout mask (the RNG state is replayed for the second)."""
    with _same_random_draws(inp, training) as replay:
        high, _ = _split(run(dataclasses.replace(inp, fp8=None), training))
        replay()
        with torch.no_grad():
            low, rest = _split(_quantized(inp, training, run, rows))
    return _join(_ValuesFrom.apply(high, low), rest)


@contextlib.contextmanager
def _same_random_draws(inp: AttentionInputs, training: bool):
    """Yields ``replay()``, which puts the generator back where it was on entry (only when dropout
    draws from it)."""
    if not (training and inp.dropout_p > 0):
        yield lambda: None
        return
    cuda = inp.q.device.type == "cuda"
    state = torch.cuda.get_rng_state(inp.q.device) if cuda else torch.get_rng_state()

    def replay() -> None:
        if cuda:
            torch.cuda.set_rng_state(state, inp.q.device)
        else:
            torch.set_rng_state(state)

    yield replay
