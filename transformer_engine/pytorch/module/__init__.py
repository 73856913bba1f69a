"""TE's non-attention modules: importable, subclassable stand-ins (see ``_placeholder``)."""

from .base import TransformerEngineBaseModule
from .grouped_linear import GroupedLinear
from .layernorm import LayerNorm
from .layernorm_linear import LayerNormLinear
from .linear import Linear
from .rmsnorm import RMSNorm

__all__ = ["TransformerEngineBaseModule", "GroupedLinear", "LayerNorm", "LayerNormLinear", "Linear", "RMSNorm"]
