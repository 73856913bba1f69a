"""``QuantizedTensor``: the base of TE's FP8/FP4 tensors, as a stand-in."""

from __future__ import annotations

from typing import Any

import torch

from .._placeholder import not_provided


class QuantizedTensor(torch.Tensor):
    """Importable, subclassable and usable in ``isinstance``; constructing one raises."""

    te_name = "transformer_engine.pytorch.tensor.QuantizedTensor"

    def __new__(cls, *args: Any, **kwargs: Any):
        raise not_provided(cls.te_name)
