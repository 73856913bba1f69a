"""``transformer_engine.pytorch.tensor``: quantized tensor classes, as stand-ins.

No FP8 tensor is ever created by this package, so ``isinstance(t, QuantizedTensor)`` is False for
every tensor (which is what callers such as megatron's ``is_float8tensor`` ask); constructing one
raises ``NotImplementedError``.
"""

from .quantized_tensor import QuantizedTensor
from .float8_tensor import Float8Tensor

__all__ = ["QuantizedTensor", "Float8Tensor"]
