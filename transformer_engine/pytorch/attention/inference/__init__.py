"""KV caching for inference: TE's ``InferenceParams`` and its cache managers, the record a step
returns, and attention over a cache in plain PyTorch (the reference).

Module map: ``params.py`` (InferenceParams), ``managers.py`` (the manager interface, the
non-paged cache), ``paged.py`` (the paged cache), ``batch.py`` (a step's host bookkeeping),
``append.py`` (where a step's tokens land, on the device), ``record.py`` (KVCacheStep),
``reference.py`` (attention over the cache), ``checks.py``, ``staging.py``.
"""

from .managers import KVCacheManager, NonPagedKVCacheManager
from .paged import PagedKVCacheManager
from .params import InferenceParams
from .record import KVCacheStep
from .reference import attention_over_cache, inference_attn_mask_type

__all__ = [
    "InferenceParams",
    "KVCacheManager",
    "NonPagedKVCacheManager",
    "PagedKVCacheManager",
    "KVCacheStep",
    "attention_over_cache",
    "inference_attn_mask_type",
]
