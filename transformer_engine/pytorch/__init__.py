"""TransformerEngine-compatible PyTorch modules (attention)."""

from .attention import DotProductAttention, MultiheadAttention

__all__ = ["DotProductAttention", "MultiheadAttention"]
