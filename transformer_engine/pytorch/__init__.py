"""TransformerEngine-compatible PyTorch modules (attention)."""

from .attention import DotProductAttention, MultiheadAttention
from .attention.dot_product_attention.cp_partition import (
    gather_context_parallel,
    get_cp_partition_indices,
    partition_for_context_parallel,
)

__all__ = [
    "DotProductAttention",
    "MultiheadAttention",
    "gather_context_parallel",
    "get_cp_partition_indices",
    "partition_for_context_parallel",
]
