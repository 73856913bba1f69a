"""TransformerEngine-compatible PyTorch modules.

Attention (``DotProductAttention``, ``MultiheadAttention``) is implemented, FP8 attention
included (``autocast``/``fp8_autocast`` with ``DelayedScaling`` or ``Float8CurrentScaling`` and
``fp8_dpa=True``); so are the pieces around it that training code relies on
(``distributed.CudaRNGStatesTracker``, the FP8 state). The other TE modules exported here (``Linear``,
``LayerNormLinear``, ``GroupedLinear``, ``LayerNorm``, ``RMSNorm``, ``ops``, ``router``) are
importable, subclassable stand-ins that raise ``NotImplementedError`` when used.
"""

from . import distributed, fp8, ops, quantization, router, tensor
from .attention import DotProductAttention, MultiheadAttention
from .attention.inference import InferenceParams, KVCacheManager, NonPagedKVCacheManager, PagedKVCacheManager
from .quantization import (autocast, fp8_autocast, fp8_model_init, get_default_recipe, is_fp8_available,
                           is_fp8_block_scaling_available, is_mxfp8_available, is_nvfp4_available, quantized_model_init)
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
    "autocast",
    "fp8_autocast",
    "fp8_model_init",
    "quantized_model_init",
    "get_default_recipe",
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_mxfp8_available",
    "is_nvfp4_available",
    "quantization",
    "ops",
    "router",
    "tensor",
    "gather_context_parallel",
    "get_cp_partition_indices",
    "partition_for_context_parallel",
]
