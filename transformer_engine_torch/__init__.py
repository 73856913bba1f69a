"""Stand-in for TransformerEngine's compiled extension module, for callers that import it by
name. It holds only what this package implements: ``thd_get_partitioned_indices``, which
megatron-core's THD context-parallel batch split looks up here."""

from transformer_engine.pytorch.attention.dot_product_attention.cp.partition import thd_get_partitioned_indices

__all__ = ["thd_get_partitioned_indices"]
