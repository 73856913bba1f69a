"""TE's older module path of the FP8 state (``transformer_engine.pytorch.fp8``), which
megatron-core 0.16 imports (``FP8GlobalStateManager``, ``fp8_autocast``). As in TE 2.10, the
names live in :mod:`transformer_engine.pytorch.quantization`; this module is their old address.
"""

from .quantization import (  # noqa: F401
    FP8GlobalStateManager,
    autocast,
    check_fp8_support,
    check_recipe_support,
    fp8_autocast,
    fp8_model_init,
    get_default_recipe,
    get_fp8_max,
    get_fp8_torch_dtype,
    quantized_model_init,
)
from ..common.recipe import DelayedScaling, Float8CurrentScaling, Format, Recipe  # noqa: F401

__all__ = ["FP8GlobalStateManager", "fp8_autocast", "fp8_model_init"]
