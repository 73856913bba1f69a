"""Attention modules."""

from .dot_product_attention import DotProductAttention, backend_scope
from .inference import InferenceParams
from .multi_head_attention import MultiheadAttention

__all__ = ["DotProductAttention", "InferenceParams", "MultiheadAttention", "backend_scope"]
