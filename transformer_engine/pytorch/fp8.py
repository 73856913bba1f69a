"""FP8 global state and ``fp8_autocast``: real, with FP8 always off.

This package runs attention in bf16/fp16/fp32 only. ``FP8GlobalStateManager`` therefore reports
FP8 as unavailable and disabled, ``fp8_autocast(enabled=False)`` is a no-op context, and asking
for FP8 (``enabled=True`` or ``calibrating=True``) raises ``NotImplementedError`` when called, so
a model never silently trains in a precision it did not ask for.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional, Tuple

from ..common.recipe import DelayedScaling, Recipe
from ._placeholder import not_provided

FP8_UNAVAILABLE = "te-attention implements attention in bf16/fp16/fp32 only; it has no FP8 execution"


class FP8GlobalStateManager:
    """TE's class-level FP8 state, queried by callers: FP8 is never enabled here."""

    @classmethod
    def is_fp8_available(cls) -> Tuple[bool, str]:
        return False, FP8_UNAVAILABLE

    @classmethod
    def is_mxfp8_available(cls) -> Tuple[bool, str]:
        return False, FP8_UNAVAILABLE

    @classmethod
    def is_fp8_block_scaling_available(cls) -> Tuple[bool, str]:
        return False, FP8_UNAVAILABLE

    @classmethod
    def is_nvfp4_available(cls) -> Tuple[bool, str]:
        return False, FP8_UNAVAILABLE

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return False

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return False

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return False

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        return False

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        # TE answers with its default recipe outside an FP8 region; so does this.
        return DelayedScaling()

    @classmethod
    def get_fp8_group(cls) -> Any:
        return None

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """Nothing to reduce: no FP8 tensor is ever registered."""

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: Any) -> None:
        """Accepted and ignored: there are no FP8 weights whose update could be skipped."""

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls) -> Any:
        return None

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta: Any) -> None:
        raise not_provided("transformer_engine.pytorch.fp8.FP8GlobalStateManager.add_fp8_tensors_to_global_buffer")


def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Optional[Recipe] = None,
    fp8_group: Any = None,
    _graph: bool = False,
) -> ContextManager[None]:
    """A region where TE modules would run in FP8: only ``enabled=False`` is supported (no-op)."""
    if enabled or calibrating:
        raise NotImplementedError(
            f"fp8_autocast(enabled={enabled}, calibrating={calibrating}) is not implemented: te-attention "
            "has no FP8 execution (accepted: enabled=False, calibrating=False)"
        )
    return contextlib.nullcontext()


def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None, **kwargs: Any) -> ContextManager[None]:
    """Creating FP8-only parameters: only ``enabled=False`` is supported (no-op)."""
    if enabled:
        raise NotImplementedError(
            "fp8_model_init(enabled=True) is not implemented: te-attention has no FP8 parameters (accepted: enabled=False)")
    return contextlib.nullcontext()
