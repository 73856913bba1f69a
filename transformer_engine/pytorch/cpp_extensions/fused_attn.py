"""TE's fused-attention enums that callers compare ``get_attention_backend``'s result with
(``fused_attention_backend == FusedAttnBackend["F16_arbitrary_seqlen"]``). Their home is
:mod:`transformer_engine.pytorch.attention.dot_product_attention.selection.te_compat`."""

from ..attention.dot_product_attention.selection.te_compat import FusedAttnBackend, NVTE_Fused_Attn_Backend

__all__ = ["FusedAttnBackend", "NVTE_Fused_Attn_Backend"]
