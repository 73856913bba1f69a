"""``transformer_engine.pytorch.ops``: importable stand-ins (this package implements attention only)."""

from .basic import (AllGather, AllReduce, BasicLinear, Bias, GEGLU, GELU, LayerNorm, ReGLU, ReLU, ReduceScatter, RMSNorm,
                    SiLU, SwiGLU)
from .op import BasicOperation, FusibleOperation
from .sequential import Sequential

__all__ = ["AllGather", "AllReduce", "BasicLinear", "BasicOperation", "Bias", "FusibleOperation", "GEGLU", "GELU",
           "LayerNorm", "ReGLU", "ReLU", "ReduceScatter", "RMSNorm", "Sequential", "SiLU", "SwiGLU"]
