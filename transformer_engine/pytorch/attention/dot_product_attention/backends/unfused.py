"""The unfused backend's declaration: pure PyTorch, every feature, every device. The
computation itself is :mod:`.unfused_math` (the reference the other backends are checked against)."""

from __future__ import annotations

from typing import Tuple, Union

import torch

from ..masks import AttnMaskType
from ..prepare.inputs import AttentionInputs
from ..fp8.emulation import run_emulated
from ..selection.support import ALL_FLOAT, HALF, SOFTMAX_TYPES, BackendSupport, Reason, bias_thd_reasons
from .unfused_kernel import UnfusedKernel
from .unfused_math import unfused_attention
from ...inference import attention_over_cache


class UnfusedDotProductAttention(BackendSupport):
    """Pure PyTorch: every feature, every device; the reference the others are checked against."""

    NAME = "UnfusedDotProductAttention"
    ENV_VARS = ("NVTE_UNFUSED_ATTN",)
    SUPPORTED_DEVICES = frozenset({"cpu", "cuda"})
    SUPPORTED_DTYPES = ALL_FLOAT
    SUPPORTED_MASK_TYPES = frozenset(AttnMaskType)
    SUPPORTED_BIAS_TYPES = frozenset({"no_bias", "pre_scale_bias", "post_scale_bias", "alibi"})
    MAX_HEAD_DIM = 1 << 16
    HEAD_DIM_MULTIPLE = 1
    SUPPORTS_DROPOUT = True
    SUPPORTS_PAD_BETWEEN_SEQS = True
    SUPPORTS_PER_SEQ_POLICY = True
    SUPPORTED_SOFTMAX_TYPES = frozenset(SOFTMAX_TYPES)
    SUPPORTS_RETURN_MAX_LOGIT = True
    SUPPORTS_KV_CACHE = True  # through attention_over_cache, the float64-capable reference
    SUPPORTS_PAGED_KV_CACHE = True  # the pages gathered through the page table
    KERNEL = UnfusedKernel
    CP_COMM_TYPES = frozenset({"p2p", "all_gather", "a2a", "a2a+p2p"})
    FP8_SUPPORT = "emulated"

    @classmethod
    def _check_special(cls, params, libs):
        out = bias_thd_reasons(params)
        if params.fp8 and params.qkv_dtype not in HALF:
            out.append(Reason("qkv_dtype", f"{params.qkv_dtype} with FP8 attention", "bfloat16, float16 (FP8 attention takes half-precision inputs, as TE's)"))
        return out

    @staticmethod
    def run(inp: AttentionInputs, training: bool) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """The output, or (output, max logit [H]) with ``inp.return_max_logit`` (the one backend
        that declares SUPPORTS_RETURN_MAX_LOGIT); FP8 calls run the emulation of the FP8 kernels."""
        if inp.fp8 is not None:
            return run_emulated(inp, training, unfused_attention)
        return unfused_attention(inp, training)

    @staticmethod
    def run_kv_cache(inp: AttentionInputs) -> torch.Tensor:
        """The KV call's query rows over the cache (``inference.attention_over_cache``)."""
        step = inp.kv_cache
        query = inp.q
        if step.qkv_format != "thd":  # the rows of a bshd/sbhd step are a [B, Sq] bshd batch
            query, step = inp.q.reshape(step.batch_size, step.max_seqlen_q, *inp.q.shape[1:]), step._replace(qkv_format="bshd")
        with torch.autocast(query.device.type, enabled=False):  # float32/float64 inside autocast too, as unfused_math
            out = attention_over_cache(query, step, attn_mask_type=inp.mask.mask_type.value, window_size=inp.mask.window,
                                       softmax_scale=inp.softmax_scale)
        return out if step.qkv_format == "thd" else out.flatten(0, 1)
