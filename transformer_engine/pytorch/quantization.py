"""FP8 regions and the process-wide FP8 state: TE 2.10's ``transformer_engine.pytorch.quantization``.

``autocast(enabled, calibrating, recipe, amax_reduction_group)`` opens a region in which
``DotProductAttention`` runs in FP8 when the recipe asks for it (``fp8_dpa=True``); the older
name ``fp8_autocast(enabled, calibrating, fp8_recipe, fp8_group)`` still works and warns, as in
TE 2.10 (``transformer_engine.pytorch.fp8`` keeps the old module path).

Delayed scaling, as TE does it: each module that quantized in a region registered its scale and
amax-history tensors here once; when the outermost region exits with gradients enabled, the
forward amaxes of every registered module are reduced (``torch.distributed.all_reduce`` MAX over
the region's group, if ``recipe.reduce_amax``) and each module updates its history and scales on
the device (no host sync). The backward tensors are updated at the end of the backward of the
region's first FP8 module (:meth:`FP8GlobalStateManager.reduce_and_update_fp8_tensors` with
``forward=False``). A registrant implements ``amax_row(forward) -> Tensor`` (this step's amaxes)
and ``apply_update(reduced, forward)``; the arithmetic lives with the state
(``attention/dot_product_attention/fp8/state.py``).

FP8 is available on a CUDA device of compute capability 8.9 or newer, or anywhere with
``NVTE_UnfusedDPA_Emulate_FP8=1`` (the unfused backend then emulates the FP8 kernels). Recipes
nothing here runs (MXFP8, FP8 block scaling, NVFP4, custom factories) are refused by name when a
region is entered with them.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from dataclasses import dataclass, fields
from typing import Any, ContextManager, Dict, List, Optional, Tuple, Union

import torch

from ..common.recipe import DelayedScaling, Format, Recipe
from ._placeholder import not_provided

__all__ = ["autocast", "fp8_autocast", "quantized_model_init", "fp8_model_init", "is_fp8_available",
           "is_mxfp8_available", "is_fp8_block_scaling_available", "is_nvfp4_available", "get_default_recipe"]

FP8_MIN_COMPUTE_CAPABILITY = (8, 9)
_RUNS_HERE = "FP8 attention here runs DelayedScaling or Float8CurrentScaling"
_NOT_RUN_HERE = {
    "MXFP8BlockScaling": "MXFP8 needs Blackwell (sm100) tensor cores in TE",
    "NVFP4BlockScaling": "NVFP4 needs Blackwell (sm100) tensor cores in TE",
    "Float8BlockScaling": "FP8 block scaling is a GEMM recipe (TE's attention refuses it)",
    "CustomRecipe": "a quantizer factory's quantizers cannot be honoured by this package's attention",
}


def check_fp8_support() -> Tuple[bool, str]:
    """(available, why not): a CUDA device of compute capability >= 8.9, or the unfused emulation."""
    # Imported here: the attention package imports this module, so a top-level import would be a cycle.
    from .attention.dot_product_attention.environment import FP8_EMULATE

    if FP8_EMULATE.get("0") == "1":
        return True, ""
    if not torch.cuda.is_available():
        return False, ("FP8 needs a CUDA device of compute capability 8.9 or newer (no CUDA device here); "
                       "NVTE_UnfusedDPA_Emulate_FP8=1 emulates FP8 attention in the unfused backend on any device")
    cc = torch.cuda.get_device_capability()
    if cc < FP8_MIN_COMPUTE_CAPABILITY:
        return False, (f"FP8 needs compute capability 8.9 or newer; this device is sm{cc[0]}{cc[1]} "
                       "(NVTE_UnfusedDPA_Emulate_FP8=1 emulates FP8 attention in the unfused backend)")
    return True, ""


def _not_here(recipe_name: str) -> Tuple[bool, str]:
    return False, f"{recipe_name} is not implemented by te-attention ({_NOT_RUN_HERE[recipe_name]}); {_RUNS_HERE}"


def check_recipe_support(recipe: Recipe) -> None:
    """Raise ``NotImplementedError`` (a ``RuntimeError``, which TE raises) naming why ``recipe``
    cannot run here."""
    if not recipe.float8_per_tensor_scaling():
        kinds = (("MXFP8BlockScaling", recipe.mxfp8), ("NVFP4BlockScaling", recipe.nvfp4),
                 ("Float8BlockScaling", recipe.float8_block_scaling), ("CustomRecipe", recipe.custom))
        name = next((n for n, is_kind in kinds if is_kind()), None)
        raise NotImplementedError(_not_here(name)[1] if name else f"recipe {type(recipe).__name__} is not supported; {_RUNS_HERE}")
    available, reason = check_fp8_support()
    if not available:
        raise NotImplementedError(reason)


def get_fp8_torch_dtype(recipe: Recipe, fprop_tensor: bool = True) -> torch.dtype:
    """E4M3 for every tensor of an E4M3 recipe and the forward tensors of HYBRID; else E5M2."""
    if recipe.fp8_format == Format.E4M3 or (recipe.fp8_format == Format.HYBRID and fprop_tensor):
        return torch.float8_e4m3fn
    return torch.float8_e5m2


def get_fp8_max(recipe: Recipe, fprop_tensor: bool = True) -> float:
    """The largest finite value of :func:`get_fp8_torch_dtype` (448 or 57344)."""
    return float(Format.E4M3.value.max_fwd if get_fp8_torch_dtype(recipe, fprop_tensor) == torch.float8_e4m3fn
                 else Format.E5M2.value.max_fwd)


def recipe_config(recipe: Recipe) -> tuple:
    """A hashable key of a recipe's fields (recipes are mutable dataclasses, so unhashable):
    two recipes that quantize alike share it."""
    return (type(recipe).__qualname__,) + tuple((f.name, getattr(recipe, f.name)) for f in fields(recipe))


@dataclass
class _RegionState:
    """What one autocast region set; restored when it exits."""

    enabled: bool = False
    calibrating: bool = False
    recipe: Optional[Recipe] = None
    group: Any = None
    graph: bool = False


class FP8GlobalStateManager:
    """TE's process-wide FP8 state: the region stack and the delayed-scaling registry."""

    _region = _RegionState()
    _depth = 0
    _first_module = False
    # (recipe_config, id(group), device) -> (recipe, group, [weakref to registrant]), and each
    # registrant's key (weak: a module that is gone leaves the reductions).
    _registry: Dict[tuple, Tuple[Recipe, Any, List[weakref.ref]]] = {}
    _key_of: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()

    @classmethod
    def reset(cls) -> None:
        """Forget every region and registrant (TE's name; tests start from a clean state)."""
        cls._region, cls._depth, cls._first_module = _RegionState(), 0, False
        cls._registry, cls._key_of = {}, weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ queries TE callers make

    @classmethod
    def is_fp8_available(cls) -> Tuple[bool, str]:
        return check_fp8_support()

    @classmethod
    def is_mxfp8_available(cls) -> Tuple[bool, str]:
        return _not_here("MXFP8BlockScaling")

    @classmethod
    def is_fp8_block_scaling_available(cls) -> Tuple[bool, str]:
        return _not_here("Float8BlockScaling")

    @classmethod
    def is_nvfp4_available(cls) -> Tuple[bool, str]:
        return _not_here("NVFP4BlockScaling")

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls._region.enabled

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return cls._region.calibrating

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return cls._region.graph

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return False  # quantized_model_init(enabled=True) is refused: no FP8 parameters exist here

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        # TE answers with its default recipe outside an FP8 region; so does this.
        return cls._region.recipe if cls._region.recipe is not None else get_default_recipe()

    @classmethod
    def get_fp8_group(cls) -> Any:
        return cls._region.group

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """True for the first caller in the outermost region only (that module's backward, the
        last one to run, updates the backward scales)."""
        first, cls._first_module = cls._first_module, False
        return first

    @classmethod
    def peek_first_fp8_module(cls) -> bool:
        """What :meth:`is_first_fp8_module` would answer, without taking it."""
        return cls._first_module

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: Any) -> None:
        """Accepted and ignored: there are no FP8 weights whose update could be skipped."""

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls) -> Any:
        return None

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta: Any) -> None:
        raise not_provided("transformer_engine.pytorch.quantization.FP8GlobalStateManager.add_fp8_tensors_to_global_buffer "
                           "(TE's fp8_meta dictionaries; this package's attention registers with register_delayed_scaling)")

    # ------------------------------------------------------------------ delayed scaling

    @classmethod
    def register_delayed_scaling(cls, registrant: Any, recipe: Recipe, group: Any, device: torch.device) -> None:
        """Take part in the reductions of ``recipe``'s amaxes over ``group``: once per registrant
        (a registrant whose recipe, group or device changed moves to the new key)."""
        key = (recipe_config(recipe), id(group), device)
        old = cls._key_of.get(registrant)
        if old == key:
            return
        if old in cls._registry:
            refs = cls._registry[old][2]
            refs[:] = [r for r in refs if r() is not registrant]
        cls._registry.setdefault(key, (recipe, group, []))[2].append(weakref.ref(registrant))
        cls._key_of[registrant] = key

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """Reduce this step's amaxes (MAX over each key's group when its recipe says so) and let
        every registrant update its history and scales. Device work only: no host sync."""
        for key in list(cls._registry):
            recipe, group, refs = cls._registry[key]
            live = [r() for r in refs]
            live = [s for s in live if s is not None]
            if not live:
                del cls._registry[key]
                continue
            refs[:] = [weakref.ref(s) for s in live]
            rows = [s.amax_row(forward) for s in live]
            reducing = recipe.reduce_amax and _group_size(group) > 1
            # One registrant and no reduction: its own row (the update reads it before writing).
            amax = rows[0] if len(rows) == 1 and not reducing else torch.cat(rows)
            if reducing:
                torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
            for state, part in zip(live, amax.split([r.numel() for r in rows])):
                state.apply_update(part, forward)

    # ------------------------------------------------------------------ regions

    @classmethod
    def _enter(cls, region: _RegionState) -> _RegionState:
        saved, cls._region = cls._region, region
        if cls._depth == 0:
            cls._first_module = True
        cls._depth += 1
        return saved

    @classmethod
    def _exit(cls, saved: _RegionState, region: _RegionState, failed: bool) -> None:
        cls._region = saved
        cls._depth -= 1
        # As TE: forward amaxes are reduced when the outermost region exits, in training (grad
        # enabled) and outside CUDA-graph capture; not after an exception (the step is void).
        if region.enabled and cls._depth == 0 and not region.graph and torch.is_grad_enabled() and not failed:
            cls.reduce_and_update_fp8_tensors(forward=True)


def _group_size(group: Any) -> int:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    return torch.distributed.get_world_size(group=group)


class autocast:  # noqa: N801  (TE's name)
    """A region in which TE modules run quantized; ``DotProductAttention`` runs FP8 attention
    when ``recipe.fp8_dpa`` is set.

    ``enabled``: quantize. ``calibrating``: record statistics without quantizing (attention, as in
    TE, records none). ``recipe``: ``DelayedScaling`` (default) or ``Float8CurrentScaling``.
    ``amax_reduction_group``: the process group over which delayed-scaling amaxes are reduced
    (None: the default group, once ``torch.distributed`` is initialized). Regions nest; the
    outermost one's exit updates the forward scales.

    >>> with autocast(recipe=DelayedScaling(fp8_dpa=True)):
    ...     out = dpa(q, k, v)
    """

    __slots__ = ("_region", "_saved")

    def __init__(self, enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
                 amax_reduction_group: Any = None, _graph: bool = False) -> None:
        for name, value in (("enabled", enabled), ("calibrating", calibrating)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool; got {value!r}")
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a transformer_engine.common.recipe.Recipe or None; got {type(recipe).__name__}")
        recipe = recipe if recipe is not None else get_default_recipe()
        if enabled or calibrating:
            check_recipe_support(recipe)
        self._region = _RegionState(enabled, calibrating, recipe, amax_reduction_group, bool(_graph))
        self._saved: Optional[_RegionState] = None

    def __enter__(self) -> "autocast":
        self._saved = FP8GlobalStateManager._enter(self._region)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        FP8GlobalStateManager._exit(self._saved, self._region, failed=exc_type is not None)


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[Recipe] = None,
                 fp8_group: Any = None, _graph: bool = False) -> autocast:
    """TE's older name of :class:`autocast` (deprecated in TE 2.10, which warns likewise)."""
    warnings.warn("fp8_autocast is deprecated; use autocast(enabled=..., calibrating=..., recipe=..., "
                  "amax_reduction_group=...)", DeprecationWarning, stacklevel=2)
    return autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group, _graph=_graph)


def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False) -> ContextManager[None]:
    """Creating FP8-only parameters: only ``enabled=False`` is supported (a no-op)."""
    if enabled:
        raise NotImplementedError("quantized_model_init(enabled=True) / fp8_model_init(enabled=True) is not implemented: "
                                  "te-attention has no FP8 parameters (its modules keep bf16/fp16/fp32 weights); "
                                  "accepted: enabled=False")
    return contextlib.nullcontext()


def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                   preserve_high_precision_init_val: bool = False) -> ContextManager[None]:
    """TE's older name of :func:`quantized_model_init` (no warning: megatron-core 0.16 calls it)."""
    return quantized_model_init(enabled, recipe, preserve_high_precision_init_val)


def get_default_recipe() -> Recipe:
    """``DelayedScaling()``: TE's default on Hopper (TE picks MXFP8 on Blackwell, which this
    package does not run)."""
    return DelayedScaling()


def is_fp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return check_fp8_support() if return_reason else check_fp8_support()[0]


def is_mxfp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return FP8GlobalStateManager.is_mxfp8_available() if return_reason else False


def is_fp8_block_scaling_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return FP8GlobalStateManager.is_fp8_block_scaling_available() if return_reason else False


def is_nvfp4_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return FP8GlobalStateManager.is_nvfp4_available() if return_reason else False
