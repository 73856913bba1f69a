"""DotProductAttention's FP8 scales and amax histories, in TE's slot layout, and the
delayed-scaling update.

TE gives DotProductAttention the FP8 metadata of a three-GEMM module: 9 forward and 6 backward
slots (``FP8FwdTensors`` / ``FP8BwdTensors``), of which attention uses six. The layout is kept
so that a checkpoint's ``scale_fwd`` [9], ``amax_history_fwd`` [L, 9], ``scale_bwd`` [6] and
``amax_history_bwd`` [L, 6] mean the same here and in TE.

A history's row 0 collects the current step's amaxes (each quantization takes the maximum with
what is there, as TE's cast kernels do: see quantize.Quantizer); the update rolls it into the window and recomputes the
scales, on the device, as TE's fused kernel does (see :func:`delayed_update`).
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Deque

import torch

from .....common.recipe import DelayedScaling
from ....quantization import get_fp8_max

NUM_FWD_SLOTS, NUM_BWD_SLOTS = 9, 6
# Forward: GEMM1_OUTPUT, GEMM2_INPUT, GEMM3_OUTPUT of FP8FwdTensors.
META_QKV, META_O, META_S = 2, 3, 8
# Backward: GRAD_OUTPUT1, GRAD_INPUT2, GRAD_INPUT3 of FP8BwdTensors.
META_DQKV, META_DO, META_DP = 0, 3, 5
FP32_MAX = torch.finfo(torch.float32).max


class ScalingState:
    """One direction's ``scale`` [N] and ``amax_history`` [L, N] (float32, one device)."""

    def __init__(self, scale: torch.Tensor, amax_history: torch.Tensor) -> None:
        self.scale = scale
        self.amax_history = amax_history

    @classmethod
    def fresh(cls, slots: int, history_len: int, device) -> "ScalingState":
        """Scales 1 and an empty history, as TE starts them."""
        return cls(torch.ones(slots, dtype=torch.float32, device=device),
                   torch.zeros(history_len, slots, dtype=torch.float32, device=device))

    def resize_history(self, history_len: int) -> None:
        """TE's adjust_amax_history_length: keep the first ``history_len`` rows, or pad zero
        rows at the end (the window order is TE's business; only the length changes)."""
        h = self.amax_history
        if h.shape[0] > history_len:
            self.amax_history = h[:history_len].clone()
        elif h.shape[0] < history_len:
            self.amax_history = torch.cat([h, h.new_zeros(history_len - h.shape[0], h.shape[1])])

    def to(self, device) -> None:
        self.scale = self.scale.to(device)
        self.amax_history = self.amax_history.to(device)


def _window_amax(history: torch.Tensor, last: torch.Tensor, algo) -> torch.Tensor:
    """The amax a scale is computed from, TE's fused kernel's way: ``"max"`` over the window that
    ``last`` completes (NaN entries ignored, as fmaxf does), ``"most_recent"``: ``last``."""
    if algo == "most_recent":
        return last
    window = torch.cat([history[1:], last[None]])
    return torch.where(torch.isnan(window), torch.zeros_like(window), window).amax(dim=0)


def delayed_update(state: ScalingState, reduced: torch.Tensor, recipe: DelayedScaling, fp8_max: float) -> None:
    """Roll this step's amaxes into the history and recompute the scales, in place, on the device.

    ``reduced`` [N]: this step's amaxes after the group reduction (the history's row 0 where it
    is 0). A slot whose amax is 0 did not quantize this step: its history and scale stay. Else
    the history rolls (row i takes row i+1, the last row takes the new amax, row 0 is cleared)
    and ``scale = fp8_max / 2**margin / amax`` for a finite, positive amax (the old scale
    otherwise; FP32_MAX where the quotient overflows). A callable ``amax_compute_algo`` gets the
    history with the new amax in row 0 and is applied to every slot, as TE's unfused update does;
    a callable ``scaling_factor_compute_algo(amax, scale, fp8_max, recipe)`` replaces the formula.
    """
    history, scale = state.amax_history, state.scale
    if _one_launch(history, recipe):
        _launch_update(history, reduced, scale, recipe, fp8_max)
        return
    last = torch.where(reduced != 0, reduced, history[0])
    rolled = torch.cat([history[1:], last[None]])
    rolled[0] = 0
    if callable(recipe.amax_compute_algo):
        current = history.clone()
        current[0] = last
        amax = recipe.amax_compute_algo(current)
        history.copy_(rolled)
    else:
        ran = last != 0
        amax = torch.where(ran, _window_amax(history, last, recipe.amax_compute_algo), torch.zeros_like(last))
        history.copy_(torch.where(ran, rolled, history))
    if recipe.scaling_factor_compute_algo is not None:
        scale.copy_(recipe.scaling_factor_compute_algo(amax, scale, fp8_max, recipe))
        return
    # A true division (python_number / tensor would multiply by a rounded reciprocal).
    scaled_max = torch.full_like(amax, fp8_max * 2.0 ** (-recipe.margin))
    new = torch.where(torch.isfinite(amax) & (amax > 0), scaled_max / amax, scale)
    scale.copy_(torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new))


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether Triton imports (the FP8 casts and the scale update have one-launch kernels)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _one_launch(history: torch.Tensor, recipe: DelayedScaling) -> bool:
    """Whether the Triton kernel (:mod:`.update_kernel`) runs the update: on CUDA, for the
    built-in algorithms (a callable recipe hook runs in PyTorch)."""
    return (history.is_cuda and history.is_contiguous() and not callable(recipe.amax_compute_algo)
            and recipe.scaling_factor_compute_algo is None and triton_available())


def _launch_update(history: torch.Tensor, reduced: torch.Tensor, scale: torch.Tensor, recipe: DelayedScaling,
                   fp8_max: float) -> None:
    from .update_kernel import delayed_update as kernel

    n = history.shape[1]
    kernel[(1,)](history, reduced.contiguous(), scale, n, history.shape[0], fp8_max * 2.0 ** (-recipe.margin), FP32_MAX,
                 WINDOW_MAX=recipe.amax_compute_algo == "max", BLOCK_L=min(128, _pow2(history.shape[0])), BLOCK_N=_pow2(n))


def _pow2(n: int) -> int:
    """The power of two >= n, at least 16 (Triton's smallest comfortable block)."""
    return max(16, 1 << (n - 1).bit_length())


class DPAFP8State:
    """A DotProductAttention's FP8 state: the delayed-scaling recipe its scales follow (the
    region's ``DelayedScaling``; under ``Float8CurrentScaling``, the delayed recipe S and dP keep)
    and its forward and backward :class:`ScalingState`. It registers with the
    ``FP8GlobalStateManager`` (``amax_row``/``apply_update``), which reduces and updates it."""

    def __init__(self, recipe: DelayedScaling, fwd: ScalingState, bwd: ScalingState) -> None:
        self.recipe = recipe
        self.fwd = fwd
        self.bwd = bwd
        # Forward scales kept for an activation-recompute rerun (TE's recompute buffer), oldest first.
        self.recompute_scales: Deque[torch.Tensor] = deque()

    @classmethod
    def fresh(cls, recipe: DelayedScaling, device) -> "DPAFP8State":
        n = recipe.amax_history_len
        return cls(recipe, ScalingState.fresh(NUM_FWD_SLOTS, n, device), ScalingState.fresh(NUM_BWD_SLOTS, n, device))

    @property
    def device(self) -> torch.device:
        return self.fwd.scale.device

    def adopt(self, recipe: DelayedScaling, device) -> None:
        """Follow a new region's recipe and device: TE keeps the tensors and only adjusts the
        history length."""
        self.recipe = recipe
        for side in (self.fwd, self.bwd):
            if side.scale.device != device:
                side.to(device)
            side.resize_history(recipe.amax_history_len)

    def amax_row(self, forward: bool) -> torch.Tensor:
        return (self.fwd if forward else self.bwd).amax_history[0]

    def apply_update(self, reduced: torch.Tensor, forward: bool) -> None:
        delayed_update(self.fwd if forward else self.bwd, reduced, self.recipe, get_fp8_max(self.recipe, forward))
