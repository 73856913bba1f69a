"""TE's quantization recipes: the records an FP8 region (``transformer_engine.pytorch.autocast``)
runs with.

Field names, defaults and class paths follow TE 2.10. The class paths matter beyond imports: TE
checkpoints pickle the recipe (``transformer_engine.common.recipe.DelayedScaling``, its
``Format`` member as ``Format(_FormatHelper(max_fwd, max_bwd))``), and the same stream loads
here; a pickle from a TE release with more or fewer fields loads too (missing fields take their
defaults).

``DelayedScaling`` and ``Float8CurrentScaling`` drive FP8 attention (see
:mod:`transformer_engine.pytorch.quantization`). The block-scaled recipes (MXFP8, FP8 block
scaling, NVFP4) and ``CustomRecipe`` are kept as records: entering an FP8 region with one raises
``NotImplementedError`` naming it.

TE's recipes are pydantic dataclasses, which ignore keyword arguments that are not fields;
megatron-core relies on that (its ``TEDelayedScaling`` passes ``override_linear_precision``,
``params_dtype`` and ``device``). Those TE-caller arguments are accepted and ignored here too;
any other unknown keyword is a ``TypeError``, so a misspelt field is not silently dropped.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable, NamedTuple, Optional, Tuple, Union

# Keywords TE's callers pass that TE's (pydantic) records drop: accepted and ignored.
IGNORED_TE_KWARGS = frozenset({"override_linear_precision", "interval", "params_dtype", "device"})
AMAX_COMPUTE_ALGOS = ("max", "most_recent")


class _FormatHelper(NamedTuple):
    """The largest finite value of a format in the forward and the backward pass (TE's name:
    pickled ``Format`` members refer to it)."""

    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """FP8/FP4 data formats. HYBRID: E4M3 in the forward pass, E5M2 in the backward pass."""

    E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


class Recipe:
    """Base of the recipe records; the class methods tell the recipe kinds apart, as in TE."""

    @classmethod
    def delayed(cls) -> bool:
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def mxfp8(cls) -> bool:
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def nvfp4(cls) -> bool:
        return issubclass(cls, NVFP4BlockScaling)

    @classmethod
    def custom(cls) -> bool:
        return issubclass(cls, CustomRecipe)

    def __setstate__(self, state: dict) -> None:
        # A pickle from another TE release may lack fields this one has: they take their defaults.
        for f in fields(self):
            if f.name not in state and f.default is not MISSING:
                state[f.name] = f.default
        self.__dict__.update(state)


def _te_record(cls):
    """``dataclass(cls)`` whose ``__init__`` drops :data:`IGNORED_TE_KWARGS` first."""
    cls = dataclass(cls)
    generated = cls.__init__

    @functools.wraps(generated)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name in IGNORED_TE_KWARGS.intersection(kwargs):
            del kwargs[name]
        generated(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def _check_fp8_format(fmt: Any, allowed: Tuple[Format, ...] = (Format.E4M3, Format.HYBRID)) -> None:
    if fmt not in allowed:
        names = ", ".join(f"Format.{f.name}" for f in allowed)
        raise ValueError(f"fp8_format must be one of {names}; got {fmt!r}")


def _check_bools(record: Any, *names: str) -> None:
    for name in names:
        value = getattr(record, name)
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool; got {value!r}")


@_te_record
class DelayedScaling(Recipe):
    """Per-tensor scaling from an amax history of earlier steps.

    Each scale is ``fp8_max / amax / 2**margin``, where amax is the largest entry of the last
    ``amax_history_len`` steps' amaxes (``"max"``), the last one (``"most_recent"``), or
    ``amax_compute_algo(history)``; updated when the FP8 region exits (forward tensors) and at the
    end of the backward (backward tensors). ``reduce_amax``: take the amaxes' maximum over the
    region's ``amax_reduction_group`` first. ``fp8_dpa``: attention runs in FP8 (bf16/fp16 in and
    out); ``fp8_mha``: FP8 tensors handed between the projections and attention.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_fp8_format(self.fp8_format)
        if isinstance(self.margin, bool) or not isinstance(self.margin, int):
            raise TypeError(f"margin must be an int; got {self.margin!r}")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be a positive int; got {self.amax_history_len!r}")
        if not callable(self.amax_compute_algo) and self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"amax_compute_algo must be 'max', 'most_recent' or a callable; got {self.amax_compute_algo!r}")
        if self.scaling_factor_compute_algo is not None and not callable(self.scaling_factor_compute_algo):
            raise TypeError(f"scaling_factor_compute_algo must be None or a callable; got {self.scaling_factor_compute_algo!r}")
        _check_bools(self, "reduce_amax", "fp8_dpa", "fp8_mha")


@_te_record
class Float8CurrentScaling(Recipe):
    """Per-tensor scaling from the current tensor's amax (``fp8_max / amax``)."""

    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_fp8_format(self.fp8_format)
        _check_bools(self, "fp8_dpa", "fp8_mha")


@_te_record
class MXFP8BlockScaling(Recipe):
    """MXFP8: one power-of-two scale per 32 consecutive values (TE runs it on Blackwell)."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_fp8_format(self.fp8_format)


@_te_record
class Float8BlockScaling(Recipe):
    """FP8 with one scale per block (1x128 activations, 128x128 weights by default)."""

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_fp8_format(self.fp8_format)


@_te_record
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 values with one scale per 16 values (TE runs it on Blackwell)."""

    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False


@_te_record
class CustomRecipe(Recipe):
    """A recipe whose quantizers come from a user factory."""

    qfactory: Optional[Callable] = None
    fp8_dpa: bool = False
    fp8_mha: bool = False
