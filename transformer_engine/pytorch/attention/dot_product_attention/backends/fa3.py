"""FA3 (``flash_attn_interface``, the Hopper build of flash-attention; not on PyPI): its
support declaration and the translation into its public functions, which run their own
autograd (THD goes through :func:`.varlen.run_library_varlen`)."""

from __future__ import annotations

import torch

from .kernel_problem import KernelRun
from ..prepare.inputs import AttentionInputs
from .flash_common import FlashAttention, fa_mask_args, first_output
from .varlen import guard_library_inputs, plan_varlen, run_library_varlen


class FlashAttentionV3(FlashAttention):
    """FA3 (``flash_attn_interface``, the Hopper build of flash-attention); not on PyPI."""

    VERSION = 3
    ENV_VARS = ("NVTE_FLASH_ATTN", "NVTE_FLASH_ATTN_V3")
    LIBRARY = "flash_attn_3"
    COMPUTE_CAPABILITY_MAJORS = frozenset({9})
    SUPPORTS_PAD_BETWEEN_SEQS = True
    SUPPORTS_PER_SEQ_POLICY = True
    SANITIZE_GAPS = True  # whole-tile reads, like FA4
    NUM_SPLITS_MAJORS = frozenset({9})  # flash_attn_interface's num_splits (TE passes it to FA3 alone)
    NOTES = {**FlashAttention.NOTES,
             "fp8": "FA3's FP8 kernels are forward-only (inference: no backward), and not wired here"}

    @staticmethod
    def run(inp: AttentionInputs, training: bool) -> torch.Tensor:
        import flash_attn_interface as fa3

        if not inp.is_thd:
            causal, left, right = fa_mask_args(inp.mask)
            return first_output(fa3.flash_attn_func(inp.q, inp.k, inp.v, softmax_scale=inp.softmax_scale, causal=causal,
                                                    window_size=(left, right), deterministic=torch.are_deterministic_algorithms_enabled(),
                                                    **_split_kwargs(inp)))
        plan = plan_varlen(inp)
        return run_library_varlen(guard_library_inputs(inp, plan, FlashAttentionV3), plan, _fa3_varlen_call)


def _split_kwargs(inp: AttentionInputs) -> dict:
    """``num_splits`` for FA3 where the call gave one (FA3's default, 1, where it did not)."""
    return {} if inp.num_splits is None else {"num_splits": inp.num_splits}


def _fa3_varlen_call(q, k, v, inp: AttentionInputs, call: KernelRun):
    import flash_attn_interface as fa3

    causal, left, right = fa_mask_args(call.spec)
    return first_output(fa3.flash_attn_varlen_func(
        q, k, v, call.offsets_q, call.offsets_kv, inp.packed_q.max_seqlen, inp.packed_kv.max_seqlen,
        seqused_q=call.seqused_q, seqused_k=call.seqused_kv, softmax_scale=inp.softmax_scale,
        causal=causal, window_size=(left, right), deterministic=torch.are_deterministic_algorithms_enabled(),
        **_split_kwargs(inp),
    ))


