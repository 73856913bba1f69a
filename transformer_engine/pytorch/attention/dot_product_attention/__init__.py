"""DotProductAttention, its backends and backend selection."""

from .dot_product_attention import DotProductAttention
from .masks import AttnMaskType
from .selection.params import AttentionParams
from .prepare.layouts import get_qkv_layout
from .selection.backend_selection import (BackendSelection, backend_scope, explain_backends, get_attention_backend, support_matrix_markdown)
from .selection.te_compat import _attention_backends  # noqa: F401 - TE's test helpers import it from here

__all__ = [
    "AttentionParams",
    "AttnMaskType",
    "BackendSelection",
    "backend_scope",
    "DotProductAttention",
    "explain_backends",
    "get_attention_backend",
    "get_qkv_layout",
    "support_matrix_markdown",
]
