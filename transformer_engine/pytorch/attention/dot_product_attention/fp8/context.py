"""One DotProductAttention call's FP8 context: read from the FP8 region, carried by the prepared
call (``AttentionInputs.fp8``), used by the backend that runs it.

:func:`fp8_call_context` is the module's entry: None outside an FP8 region, or when the region's
recipe does not ask for FP8 attention (``fp8_dpa``); otherwise it makes or adopts the module's
:class:`~.state.DPAFP8State`, registers it for the delayed-scaling update, and returns an
:class:`FP8Context` with one :class:`~.quantize.Quantizer` per FP8 tensor:

=========  ===========  ==========================  ===================================
tensor     direction    DelayedScaling              Float8CurrentScaling
=========  ===========  ==========================  ===================================
Q, K, V    forward      state scale, slot META_QKV  from the tensors' amax
S          forward      state scale, slot META_S    state scale (delayed, see below)
O          forward      state scale, slot META_O    from the tensor's amax
dO         backward     state scale, slot META_DO   from the tensor's amax
dP         backward     state scale, slot META_DP   state scale (delayed)
dQ, dK, dV backward     state scale, slot META_DQKV from the tensors' amax
=========  ===========  ==========================  ===================================

Under current scaling S and dP keep delayed scaling, as TE does: a fused kernel forms them and
needs their scales before it can see their amax. The state then follows a ``DelayedScaling``
built from ``NVTE_DPA_FP8DS_AMAX_HISTLEN`` (1), ``NVTE_DPA_FP8DS_AMAX_ALGO`` ("most_recent") and
``NVTE_DPA_FP8DS_REDUCE_AMAX`` (1), TE's variables and defaults.

Current scaling and causality (TE issue #3248): one amax over all of Q, K and V (and over all of
O) lets a later token's magnitude change the rounding of earlier tokens' values, so a causal
output is not exactly independent of future tokens. That is what the per-tensor recipe (and
cuDNN's per-tensor descales) define, and it is kept; delayed scaling has no such dependence
(its scales come from earlier steps), so it is the recipe to use where exact causality matters.

What a GPU backend takes from the context: ``qkv``/``s``/``o`` (forward) and ``do``/``dp``/
``dqkv`` (backward) give each tensor's FP8 dtype, scale (descale = 1 / scale) and amax slot;
forward amaxes go to ``fwd_amax`` and reach the history through :meth:`FP8Context.finish_forward`,
backward amaxes go straight to the backward history; :meth:`FP8Context.finish_backward` ends the
backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .....common.recipe import DelayedScaling, Recipe
from ....distributed import in_fp8_activation_recompute_phase, is_fp8_activation_recompute_enabled
from ....quantization import FP8GlobalStateManager, get_fp8_max, get_fp8_torch_dtype
from ..environment import (DPA_FP8DS_AMAX_ALGO, DPA_FP8DS_AMAX_HISTLEN, DPA_FP8DS_REDUCE_AMAX, FP8_DPA_BWD,
                           compiling)
from .quantize import Quantizer
from .state import META_DO, META_DP, META_DQKV, META_O, META_QKV, META_S, NUM_FWD_SLOTS, DPAFP8State


class _Progress:
    """Mutable per call: whether the forward amaxes reached the history (a recomputed forward,
    under checkpointing, must not record them into the next step's row)."""

    __slots__ = ("forward_recorded",)

    def __init__(self, recorded: bool) -> None:
        self.forward_recorded = recorded


@dataclass(frozen=True, eq=False)
class FP8Context:
    """The FP8 facts of one call (see the module docstring for the quantizers)."""

    recipe: Recipe
    state: DPAFP8State
    qkv: Quantizer
    s: Quantizer
    o: Quantizer
    do: Quantizer
    dp: Quantizer
    dqkv: Quantizer
    backward_fp8: bool  # NVTE_FP8_DPA_BWD != "0": dO, dP, dQKV are quantized
    reduce_backward: bool  # the region's first FP8 module: its backward ends with the backward update
    fwd_amax: torch.Tensor  # [9] this call's forward amaxes
    progress: _Progress

    @property
    def key(self) -> tuple:
        """Host facts of the call's FP8 mode, for the fast path's key."""
        return (type(self.recipe).__name__, self.qkv.dtype, self.do.dtype, self.backward_fp8)

    def finish_forward(self) -> None:
        """Max the call's forward amaxes into the history's row 0, once per call."""
        if self.progress.forward_recorded:
            return
        self.progress.forward_recorded = True
        row = self.state.fwd.amax_history[0]
        torch.maximum(row, self.fwd_amax, out=row)  # in place: one launch

    def finish_backward(self) -> None:
        """End of the call's backward: the region's first module updates the backward scales."""
        if self.reduce_backward:
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)


def fp8_call_context(module: Any, inputs: Sequence[Any]) -> Optional[FP8Context]:
    """The FP8 context of a ``module`` call whose first tensor among ``inputs`` gives the device,
    or None when attention runs in high precision (no FP8 region, or a recipe without
    ``fp8_dpa``; calibration regions too: attention records no statistics there, as in TE)."""
    if not FP8GlobalStateManager.is_fp8_enabled():
        return None
    recipe = FP8GlobalStateManager.get_fp8_recipe()
    if not (recipe.fp8_dpa or recipe.fp8_mha):
        return None
    _refuse_unsupported(module, recipe)
    device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), None)
    if device is None:
        return None  # no input tensor: the argument checks name what is missing
    state = _module_state(module, recipe, device)
    FP8GlobalStateManager.register_delayed_scaling(state, state.recipe, FP8GlobalStateManager.get_fp8_group(), device)
    recomputing = in_fp8_activation_recompute_phase()
    fwd_scale = _forward_scales(state, recomputing, module.training)
    fwd_amax = torch.zeros(NUM_FWD_SLOTS, dtype=torch.float32, device=device)
    return _build(recipe, state, fwd_scale, fwd_amax, _reduce_backward(recomputing), _Progress(recomputing))


def _refuse_unsupported(module: Any, recipe: Recipe) -> None:
    if recipe.fp8_mha:
        raise NotImplementedError(
            f"{type(recipe).__name__}(fp8_mha=True) is not implemented: FP8 multi-head attention hands FP8 tensors "
            "(TE's Float8Tensor) from the QKV projection through attention to the output projection, and this "
            "package's projections are bf16/fp16 layers with no FP8 tensor to take or hand on. Use fp8_dpa=True, "
            "fp8_mha=False (FP8 inside attention, high precision in and out)")
    cp = module.cp_config if getattr(module, "cp_group", None) is not None else None
    if cp is not None and cp.size > 1:
        raise NotImplementedError("FP8 attention (fp8_dpa=True) with context parallelism is not implemented; "
                                  "run FP8 attention without cp_group, or context parallelism in bf16/fp16")
    if compiling():
        raise NotImplementedError("FP8 attention (fp8_dpa=True) under torch.compile is not supported "
                                  "(TE refuses delayed scaling there too); run it eagerly")


def _state_recipe(recipe: Recipe) -> DelayedScaling:
    """The delayed-scaling recipe the module's scales follow."""
    if recipe.delayed():
        return recipe
    algo = DPA_FP8DS_AMAX_ALGO.get("most_recent")
    raw_len = DPA_FP8DS_AMAX_HISTLEN.get("1")
    if not raw_len.isdigit() or int(raw_len) < 1:
        raise ValueError(f"NVTE_DPA_FP8DS_AMAX_HISTLEN must be a positive int; got {raw_len!r}")
    return DelayedScaling(fp8_format=recipe.fp8_format, amax_history_len=int(raw_len), amax_compute_algo=algo,
                          reduce_amax=DPA_FP8DS_REDUCE_AMAX.get("1") == "1", fp8_dpa=recipe.fp8_dpa,
                          fp8_mha=recipe.fp8_mha)


def _module_state(module: Any, recipe: Recipe, device: torch.device) -> DPAFP8State:
    """The module's state, made on first use and adopted by later regions (restored from a
    checkpoint or not): TE keeps the tensors and adjusts the history length."""
    state_recipe = _state_recipe(recipe)
    state = getattr(module, "_fp8_state", None)
    if state is None:
        state = DPAFP8State.fresh(state_recipe, device)
        module._fp8_state = state
    else:
        state.adopt(state_recipe, device)
    return state


def _forward_scales(state: DPAFP8State, recomputing: bool, training: bool) -> torch.Tensor:
    """The forward scales this call uses: a copy taken now, so that a recomputed forward (which
    runs after the region updated the scales) quantizes as the first one did. Under activation
    recompute (megatron's), the first run stashes its copy and the rerun takes it back, as TE's
    recompute buffer does."""
    if recomputing and state.recompute_scales:
        return state.recompute_scales.popleft()
    scales = state.fwd.scale.clone()
    if not recomputing and training and is_fp8_activation_recompute_enabled():
        state.recompute_scales.append(scales)
    return scales


def _reduce_backward(recomputing: bool) -> bool:
    if not torch.is_grad_enabled():
        return False
    # TE: a recomputed forward reads the flag without taking it from the region's next module.
    return FP8GlobalStateManager.peek_first_fp8_module() if recomputing else FP8GlobalStateManager.is_first_fp8_module()


def _build(recipe: Recipe, state: DPAFP8State, fwd_scale: torch.Tensor, fwd_amax: torch.Tensor, reduce_backward: bool,
           progress: _Progress) -> FP8Context:
    fwd = (get_fp8_torch_dtype(recipe, True), get_fp8_max(recipe, True))
    bwd = (get_fp8_torch_dtype(recipe, False), get_fp8_max(recipe, False))
    bwd_row, bwd_scale = state.bwd.amax_history[0], state.bwd.scale
    delayed = recipe.delayed()

    def tensor_wise(side, scale, buffer, slot):  # delayed: the state's scale and slot; current: from the tensor
        return Quantizer(*side, scale[slot], buffer, slot) if delayed else Quantizer(*side, None)

    return FP8Context(
        recipe, state,
        qkv=tensor_wise(fwd, fwd_scale, fwd_amax, META_QKV),
        s=Quantizer(*fwd, fwd_scale[META_S], fwd_amax, META_S),
        o=tensor_wise(fwd, fwd_scale, fwd_amax, META_O),
        do=tensor_wise(bwd, bwd_scale, bwd_row, META_DO),
        dp=Quantizer(*bwd, bwd_scale[META_DP], bwd_row, META_DP),
        dqkv=tensor_wise(bwd, bwd_scale, bwd_row, META_DQKV),
        backward_fp8=FP8_DPA_BWD.get("1") != "0",
        reduce_backward=reduce_backward, fwd_amax=fwd_amax, progress=progress)
