"""Attention modules."""

from .dot_product_attention import DotProductAttention, backend_scope
from .multi_head_attention import MultiheadAttention

__all__ = ["DotProductAttention", "MultiheadAttention", "backend_scope"]
