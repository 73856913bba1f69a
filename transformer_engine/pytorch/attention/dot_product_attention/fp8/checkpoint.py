"""FP8 metadata in checkpoints, in TE's serialized shape.

TE pickles a dict into a uint8 tensor (an empty uint8 tensor when the module has no FP8 state)::

    {"recipe": DelayedScaling(...),              # pickled by class path
     "scale_fwd": [9], "amax_history_fwd": [L, 9], "scale_bwd": [6], "amax_history_bwd": [L, 6],
     "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": 3, "fp8_max_fwd": ..., ...}}

The tensors are written from the CPU and loaded onto the CPU; the module's next FP8 call moves
them to its inputs' device. TE 1.x states (no ``"recipe"``; ``scale_inv_*`` entries) load as
``DelayedScaling()``, as TE loads them. Recipes other than delayed scaling carry no tensors. A TE
pickle may name record classes this package lacks (``QParams``/``MMParams`` inside a pickled
``Float8CurrentScaling`` among ``extra_fp8_variables["local_recipes"]``): they load as
:class:`_TERecord`, keeping their fields, and a state whose recipe is one of them is not used.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Optional

import torch

from .....common.recipe import DelayedScaling, Recipe
from .state import NUM_BWD_SLOTS, NUM_FWD_SLOTS, DPAFP8State, ScalingState

NUM_GEMMS = 3  # TE's DotProductAttention keeps the FP8 metadata of a three-GEMM module


def serialize(state: Optional[DPAFP8State]) -> torch.Tensor:
    """``state`` as TE's extra-state tensor (uint8; empty without FP8 state). Copies the tensors to
    the host: a device sync, as in TE (checkpointing is off the hot path)."""
    if state is None:
        return torch.empty(0, dtype=torch.uint8)
    fmt = state.recipe.fp8_format.value
    payload = {
        "recipe": state.recipe,
        "scale_fwd": state.fwd.scale.detach().cpu(),
        "amax_history_fwd": state.fwd.amax_history.detach().cpu(),
        "scale_bwd": state.bwd.scale.detach().cpu(),
        "amax_history_bwd": state.bwd.amax_history.detach().cpu(),
        "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": NUM_GEMMS, "fp8_max_fwd": fmt.max_fwd,
                                "fp8_max_bwd": fmt.max_bwd},
    }
    return torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8)


def deserialize(data: bytes) -> Optional[DPAFP8State]:
    """The FP8 state in an extra state's bytes (TE's pickle, or TE 1.x's ``torch.save`` stream),
    on the CPU; None when they hold none this package can run (unreadable, not TE's dict, or a
    recipe without delayed-scaling tensors): the caller keeps such bytes as they are."""
    payload = _read(data)
    if not isinstance(payload, dict):
        return None
    if "recipe" not in payload:  # TE 1.x: delayed scaling was the only recipe, and the default
        payload = {k: v for k, v in payload.items() if k not in ("scale_inv_fwd", "scale_inv_bwd")}
        payload["recipe"] = DelayedScaling()
    recipe = payload["recipe"]
    if not isinstance(recipe, Recipe) or not recipe.delayed():
        return None  # TE stores tensors for delayed scaling only
    fwd = _scaling(payload, "fwd", NUM_FWD_SLOTS)
    bwd = _scaling(payload, "bwd", NUM_BWD_SLOTS)
    if fwd.amax_history.shape[0] != bwd.amax_history.shape[0]:
        raise ValueError(f"amax_history_fwd and amax_history_bwd must have the same length; got "
                         f"{fwd.amax_history.shape[0]} and {bwd.amax_history.shape[0]}")
    return DPAFP8State(recipe, fwd, bwd)


class _TERecord:
    """A TE class this package does not define, as unpickled: its fields, kept (not used)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        try:
            return super().find_class(module, name)
        except AttributeError:
            if module.split(".")[0] == "transformer_engine":
                return _TERecord
            raise


def _read(data: bytes) -> Any:
    try:
        if data[:4] == b"PK\x03\x04":  # torch.save's zip: TE 1.x's io.BytesIO format
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        return _Unpickler(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001  (not a state this package can read: kept as bytes by the caller)
        return None


def _scaling(payload: dict, side: str, slots: int) -> ScalingState:
    scale, history = payload.get(f"scale_{side}"), payload.get(f"amax_history_{side}")
    if not isinstance(scale, torch.Tensor) or tuple(scale.shape) != (slots,):
        raise ValueError(f"scale_{side} must be a float32 tensor of shape ({slots},); got "
                         f"{tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__}")
    if not isinstance(history, torch.Tensor) or history.dim() != 2 or history.shape[1] != slots or history.shape[0] < 1:
        raise ValueError(f"amax_history_{side} must be a float32 tensor of shape (L, {slots}); got "
                         f"{tuple(history.shape) if isinstance(history, torch.Tensor) else type(history).__name__}")
    return ScalingState(scale.detach().float().cpu().clone(), history.detach().float().cpu().clone())
