"""TransformerEngine-compatible PyTorch modules.

Attention (``DotProductAttention``, ``MultiheadAttention``) is implemented; so are the pieces
around it that training code relies on (``distributed.CudaRNGStatesTracker``,
``fp8.fp8_autocast(enabled=False)``). The other TE modules exported here (``Linear``,
``LayerNormLinear``, ``GroupedLinear``, ``LayerNorm``, ``RMSNorm``, ``ops``, ``router``) are
importable, subclassable stand-ins that raise ``NotImplementedError`` when used.
"""

from . import distributed, fp8, ops, router, tensor
from .attention import DotProductAttention, MultiheadAttention
from .attention.inference import InferenceParams, KVCacheManager, NonPagedKVCacheManager, PagedKVCacheManager
from .fp8 import fp8_autocast, fp8_model_init
from .module import GroupedLinear, LayerNorm, LayerNormLinear, Linear, RMSNorm
from .attention.dot_product_attention.cp.partition import (
    gather_context_parallel,
    get_cp_partition_indices,
    partition_for_context_parallel,
)

__all__ = [
    "DotProductAttention",
    "MultiheadAttention",
    "InferenceParams",
    "KVCacheManager",
    "NonPagedKVCacheManager",
    "PagedKVCacheManager",
    "GroupedLinear",
    "LayerNorm",
    "LayerNormLinear",
    "Linear",
    "RMSNorm",
    "distributed",
    "fp8",
    "fp8_autocast",
    "fp8_model_init",
    "ops",
    "router",
    "tensor",
    "gather_context_parallel",
    "get_cp_partition_indices",
    "partition_for_context_parallel",
]
