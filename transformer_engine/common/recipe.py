"""TE's quantization recipes, as configuration records.

A recipe only describes how FP8/FP4 training would scale tensors; this package runs no
quantized computation, so the records are accepted and stored (megatron-core subclasses
``DelayedScaling`` and builds the others from its config), and entering
``fp8_autocast(enabled=True, fp8_recipe=...)`` raises ``NotImplementedError``.
Field names and defaults follow TE's recipes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Tuple, Union


class _FormatMax(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """FP8/FP4 data formats: the largest finite value of each, forward and backward."""

    E2M1 = _FormatMax(6.0, 6.0)
    E4M3 = _FormatMax(448.0, 448.0)
    E5M2 = _FormatMax(57344.0, 57344.0)
    HYBRID = _FormatMax(448.0, 57344.0)  # E4M3 forward, E5M2 backward


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


def _check_fp8_format(fmt: Any, allowed: Tuple[Format, ...]) -> None:
    if fmt not in allowed:
        names = ", ".join(f"Format.{f.name}" for f in allowed)
        raise ValueError(f"fp8_format must be one of {names}; got {fmt!r}")


@dataclass
class DelayedScaling(Recipe):
    """Per-tensor scaling from an amax history of earlier steps."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_fp8_format(self.fp8_format, (Format.E4M3, Format.HYBRID))


@dataclass
class Float8CurrentScaling(Recipe):
    """Per-tensor scaling from the current tensor's amax."""

    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_fp8_format(self.fp8_format, (Format.E4M3, Format.HYBRID))


@dataclass
class MXFP8BlockScaling(Recipe):
    """MXFP8: one power-of-two scale per 32 consecutive values."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_fp8_format(self.fp8_format, (Format.E4M3, Format.HYBRID))


@dataclass
class Float8BlockScaling(Recipe):
    """FP8 with one scale per block (1x128 activations, 128x128 weights by default)."""

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_fp8_format(self.fp8_format, (Format.E4M3, Format.HYBRID))


@dataclass
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 values with one scale per 16 values."""

    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclass
class CustomRecipe(Recipe):
    """A recipe whose quantizers come from a user factory."""

    qfactory: Optional[Callable] = None
    fp8_dpa: bool = False
    fp8_mha: bool = False
