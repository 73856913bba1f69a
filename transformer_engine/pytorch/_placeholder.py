"""Importable stand-ins for TransformerEngine names outside attention.

This package implements TE's attention modules only. Code such as megatron-core imports and
subclasses TE's linear layers, fusible ops, router kernels and FP8 tensors at import time,
so those names exist here; using one (constructing it, or calling it) raises a
``NotImplementedError`` that names it, rather than pretending to work.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch


def not_provided(te_name: str) -> NotImplementedError:
    """The error every stand-in raises when it is used."""
    return NotImplementedError(
        f"{te_name} is not implemented by te-attention, which implements TransformerEngine's "
        "attention modules (DotProductAttention, MultiheadAttention) only; the name exists so "
        "that code importing or subclassing it loads. Use a torch.nn / framework-local layer instead."
    )


class PlaceholderModule(torch.nn.Module):
    """Base of the stand-in modules: a subclass sets ``te_name``; constructing it raises."""

    te_name: ClassVar[str] = "this TransformerEngine module"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise not_provided(self.te_name)


def placeholder_function(te_name: str) -> Callable[..., Any]:
    """A function named like TE's that raises when called."""

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise not_provided(te_name)

    short = te_name.rsplit(".", 1)[-1]
    stand_in.__name__ = stand_in.__qualname__ = short
    stand_in.__doc__ = f"Stand-in for {te_name}; calling it raises NotImplementedError."
    return stand_in
