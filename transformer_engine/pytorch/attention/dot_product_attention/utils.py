"""TE's ``dot_product_attention.utils`` names, for code that imports them from here.

Their homes: :mod:`.selection.params` (``AttentionParams``), :mod:`.selection.backend_selection`
(``get_attention_backend``), :mod:`.selection.te_compat` (``AttentionLogging``),
:mod:`.prepare.layouts` (``get_qkv_layout``).
"""

from .prepare.layouts import get_qkv_layout
from .selection.params import AttentionParams
from .selection.backend_selection import get_attention_backend
from .selection.te_compat import AttentionLogging

__all__ = ["AttentionLogging", "AttentionParams", "get_attention_backend", "get_qkv_layout"]
