"""TE 1.x's location of ``Float8Tensor`` (still imported by megatron-core)."""

from .tensor.float8_tensor import Float8Tensor

__all__ = ["Float8Tensor"]
