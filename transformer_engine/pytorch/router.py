"""``transformer_engine.pytorch.router``: MoE router kernels, as stand-ins (attention only here).

megatron-core imports these names when TE >= 2.7; calling one raises ``NotImplementedError``
(megatron uses them only with ``moe_router_fusion``).
"""

from ._placeholder import placeholder_function

fused_topk_with_score_function = placeholder_function("transformer_engine.pytorch.router.fused_topk_with_score_function")
fused_compute_score_for_moe_aux_loss = placeholder_function(
    "transformer_engine.pytorch.router.fused_compute_score_for_moe_aux_loss")
fused_moe_aux_loss = placeholder_function("transformer_engine.pytorch.router.fused_moe_aux_loss")
