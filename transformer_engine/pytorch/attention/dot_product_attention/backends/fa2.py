"""flash-attn 2 (``flash_attn``): its support declaration and the translation into its public
functions, which run their own autograd. It has no ``seqused``, so gaps between sequences and
per-sequence policies are declared unsupported."""

from __future__ import annotations

import torch

from ..prepare.inputs import AttentionInputs
from .flash_common import FlashAttention, fa_mask_args
from .varlen import plan_varlen, run_library_varlen


class FlashAttentionV2(FlashAttention):
    """flash-attn 2 (``flash_attn``): Ampere and newer; dropout and ALiBi, no ``seqused``."""

    VERSION = 2
    ENV_VARS = ("NVTE_FLASH_ATTN", "NVTE_FLASH_ATTN_V2")
    LIBRARY = "flash_attn_2"
    MIN_COMPUTE_CAPABILITY = (8, 0)
    SUPPORTS_DROPOUT = True
    SUPPORTED_BIAS_TYPES = frozenset({"no_bias", "alibi"})
    NOTES = {
        **FlashAttention.NOTES,
        "pad_between_seqs": "flash-attn 2 has no seqused_q/k, so it cannot skip gaps between sequences",
        "attn_mask_type_per_seq": "per-sequence policies need seqused_q/k, which flash-attn 2 lacks",
        "fp8": "flash-attn 2 has no FP8 kernels",
    }

    @staticmethod
    def run(inp: AttentionInputs, training: bool) -> torch.Tensor:
        import flash_attn

        causal, left, right = fa_mask_args(inp.mask)
        kwargs = dict(dropout_p=inp.dropout_p if training else 0.0, softmax_scale=inp.softmax_scale, causal=causal,
                      window_size=(left, right), alibi_slopes=_fa2_alibi(inp),
                      deterministic=torch.are_deterministic_algorithms_enabled())
        if not inp.is_thd:
            return flash_attn.flash_attn_func(inp.q, inp.k, inp.v, **kwargs)

        def call_fn(q, k, v, inp, call):
            return flash_attn.flash_attn_varlen_func(q, k, v, call.offsets_q, call.offsets_kv, inp.packed_q.max_seqlen,
                                                     inp.packed_kv.max_seqlen, **kwargs)

        # No gaps here (declared unsupported), but rows past cu_seqlens[-1] are left unwritten.
        return run_library_varlen(inp, plan_varlen(inp), call_fn)


def _fa2_alibi(inp: AttentionInputs):
    if inp.bias_type != "alibi":
        return None
    from .unfused_terms import default_alibi_slopes

    slopes = inp.alibi_slopes if inp.alibi_slopes is not None else default_alibi_slopes(inp.q.shape[-2])
    return slopes.to(device=inp.q.device, dtype=torch.float32)

