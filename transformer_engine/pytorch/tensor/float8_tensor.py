"""``Float8Tensor``: TE's per-tensor-scaled FP8 tensor, as a stand-in."""

from .quantized_tensor import QuantizedTensor


class Float8Tensor(QuantizedTensor):
    """Importable, subclassable and usable in ``isinstance``; constructing one raises."""

    te_name = "transformer_engine.pytorch.tensor.float8_tensor.Float8Tensor"
