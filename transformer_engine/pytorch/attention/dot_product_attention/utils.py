"""TE's ``dot_product_attention.utils`` names, for code that imports them from here.

Their homes: :mod:`.params` (``AttentionParams``), :mod:`.selection` (``get_attention_backend``),
:mod:`.layouts` (``get_qkv_layout``).
"""

from .prepare.layouts import get_qkv_layout
from .selection.params import AttentionParams
from .selection.backend_selection import get_attention_backend

__all__ = ["AttentionParams", "get_attention_backend", "get_qkv_layout"]
