"""FusedAttention: what cuDNN 9 SDPA (through nvidia-cudnn-frontend's graph API) runs here, as a
support declaration, and the rules that are not attributes: cuDNN's own limits, the version
floors of sinks and of the max logit, and the configurations probed wrong on the H200."""

from __future__ import annotations

from typing import List

import torch

from ...prepare.inputs import AttentionInputs
from ...selection.support import SOFTMAX_TYPES, BackendSupport, Reason, bias_thd_reasons
from ..kernel_autograd import bind_kernel, run_kernel
from ..varlen import plan_varlen
from .fp8 import run_fp8
from .fp8_rules import fp8_reasons
from .kernel import _CudnnKernel
from .kv_cache import run_cudnn_kv_cache
from .versions import cudnn_name as _cudnn_name, release as _release


class FusedAttention(BackendSupport):
    """cuDNN 9 SDPA through nvidia-cudnn-frontend's graph API (THD via ragged offsets)."""

    NAME = "FusedAttention"
    ENV_VARS = ("NVTE_FUSED_ATTN",)
    LIBRARY = "cudnn_frontend"
    MIN_COMPUTE_CAPABILITY = (8, 0)
    MAX_HEAD_DIM = 256
    SUPPORTS_PAD_BETWEEN_SEQS = True
    SUPPORTS_PER_SEQ_POLICY = True
    SUPPORTS_DROPOUT = True
    SUPPORTED_BIAS_TYPES = frozenset({"no_bias", "post_scale_bias", "alibi"})
    # Attention sinks through sdpa's sink_token / sdpa_backward's dSink_token (off-by-one is a
    # sink of 0); the cuDNN version rules are in _sink_reasons.
    SUPPORTED_SOFTMAX_TYPES = frozenset(SOFTMAX_TYPES)
    # sdpa's score_max output (its row max), reduced to [H] on the device; rules in
    # _max_logit_reasons.
    SUPPORTS_RETURN_MAX_LOGIT = True
    NOTES = {
        "core_attention_bias_type": "cuDNN adds a bias after scaling only",
    }
    # cudnn-frontend's sdpa_fp8 / sdpa_fp8_backward (backends/cudnn/fp8.py); rules in fp8_rules.py.
    FP8_SUPPORT = "yes"
    CP_COMM_TYPES = frozenset({"p2p", "all_gather", "a2a", "a2a+p2p"})
    KERNEL = _CudnnKernel  # the one kernel interface (context parallelism's ring and all-gather steps run on it)
    # KV caches (kv_cache.py): the ragged graph over the non-paged cache, cuDNN's paged SDPA over
    # pages; page sizes probed on the H200: 64, 128 and 256 (probe_fp8_paged_kv.py).
    SUPPORTS_KV_CACHE = True
    SUPPORTS_PAGED_KV_CACHE = True
    KV_PAGE_SIZE_MULTIPLE = 64
    run_kv_cache = staticmethod(run_cudnn_kv_cache)

    @classmethod
    def _check_special(cls, params, libs):
        cc = params.compute_capability
        out = []
        if cc is not None and cc[0] == 8 and max(params.head_dim_qk, params.head_dim_v) > 128:
            out.append(Reason("head_dim_qk", str(params.head_dim_qk), "<= 128 on sm8x"))
        if params.qkv_format == "thd" and params.head_dim_qk == 256 and params.head_dim_v != 256:
            # Probed on the H200 (benchmarks/results/2026-12-03-h200/ at 2f8a113 in git history: probe_cudnn.log): non-finite
            # results for THD at (256, 128); dense layouts and every other pair probed are fine.
            out.append(Reason("head_dim_v", f"{params.head_dim_v} with head_dim_qk=256 in thd", "256 with head_dim_qk=256 in thd"))
        return (out + _bottom_right_reasons(params) + _probed_backward_reasons(params) + bias_thd_reasons(params)
                + _cudnn_feature_reasons(params)
                + _sink_reasons(params, libs) + _max_logit_reasons(params, libs) + fp8_reasons(params, libs))

    @staticmethod
    def run(inp: AttentionInputs, training: bool) -> torch.Tensor:
        """The output, or (output, max logit [H] float32) with ``inp.return_max_logit``; FP8
        calls (``inp.fp8``) run cuDNN's FP8 SDPA."""
        if inp.fp8 is not None:
            return run_fp8(inp, training)
        return run_kernel(_CudnnKernel, inp, plan_varlen(inp, always_lengths=True) if inp.is_thd else None, training)

    @classmethod
    def bind(cls, inp: AttentionInputs, training: bool):
        if inp.fp8 is not None or not inp.is_thd:
            return None
        plan = plan_varlen(inp, always_lengths=True)
        return plan, bind_kernel(_CudnnKernel, inp, plan, training)


SINK_MIN_CUDNN = 91300  # sink_token in sdpa and sdpa_backward
SINK_THD_BACKWARD_MIN_CUDNN = 92600  # sink_token with ragged offsets in sdpa_backward
SINK_MIN_FRONTEND = (1, 32)  # the frontend release sink_token / dSink_token were run with
MAX_LOGIT_MIN_FRONTEND = (1, 32)  # the frontend release sdpa's score_max / score_sum_exp were run with


def _sink_reasons(params, libs) -> List[Reason]:
    """cudnn-frontend's rules for sink_token: cuDNN 9.13 or newer, 9.26 for the ragged (THD)
    backward (older ones read out of bounds there), and not for a single query row (its
    decode-only mode); an unknown cuDNN version runs none."""
    if params.softmax_type == "vanilla":
        return []
    if params.max_seqlen_q == 1:
        return [Reason("softmax_type", f"{params.softmax_type!r} with max_seqlen_q=1",
                       "vanilla, or max_seqlen_q > 1 (cuDNN's decode-only mode takes no sink)")]
    if _release(libs.cudnn_frontend) < SINK_MIN_FRONTEND:
        return [Reason("softmax_type", f"{params.softmax_type!r} with cudnn-frontend {libs.cudnn_frontend}",
                       "vanilla, or cudnn-frontend >= 1.32 (the first release sink_token was tested with here)")]
    have = libs.cudnn
    need, why = SINK_MIN_CUDNN, "sinks"
    if params.qkv_format == "thd" and params.requires_grad:
        need, why = SINK_THD_BACKWARD_MIN_CUDNN, "sinks in the thd backward"
    if have is not None and have >= need:
        return []
    return [Reason("softmax_type", f"{params.softmax_type!r} with cuDNN {_cudnn_name(have)}",
                   f"vanilla, or cuDNN >= {_cudnn_name(need)} ({why})")]


def _max_logit_reasons(params, libs) -> List[Reason]:
    """The max logit comes from sdpa's score_max (with score_sum_exp, from which the backward's
    stats are derived: cuDNN before 9.21 outputs those two or the stats, not all three). Its
    max takes the sink logit in (cudnn-frontend's softmax: max(row max, sink)), which TE's max
    logit leaves out and nothing can take back out, so sinks are refused with it."""
    if not params.return_max_logit:
        return []
    out = []
    if params.softmax_type != "vanilla":
        out.append(Reason("return_max_logit", f"True with softmax_type={params.softmax_type!r}",
                          "False, or softmax_type='vanilla' (cuDNN's score max includes the sink logit)"))
    if _release(libs.cudnn_frontend) < MAX_LOGIT_MIN_FRONTEND:
        out.append(Reason("return_max_logit", f"True with cudnn-frontend {libs.cudnn_frontend}",
                          "False, or cudnn-frontend >= 1.32 (the first release score_max was tested with here)"))
    return out


def _bottom_right_reasons(params) -> List[Reason]:
    """cudnn-frontend refuses a bottom-right causal band with s_q > s_kv unless a padding mask
    (per-sequence lengths) comes with it (seen on the H200 with 1.32: "Bottom right causal mask
    does not support max_s_q > max_s_kv"). THD always passes lengths; a dense call passes them
    only with a padding mask."""
    if params.qkv_format == "thd" or params.has_padding_mask or params.max_seqlen_q <= params.max_seqlen_kv:
        return []
    causal_br = [s for s in params.mask_specs if s.mask_type.is_causal and s.mask_type.bottom_right]
    if not causal_br:
        return []
    return [Reason("attn_mask_type", f"{causal_br[0].mask_type.value} with max_seqlen_q={params.max_seqlen_q} > "
                   f"max_seqlen_kv={params.max_seqlen_kv} and no padding mask",
                   "max_seqlen_q <= max_seqlen_kv, a padding mask, or top-left causal (cudnn-frontend's rule)")]


def _probed_backward_reasons(params) -> List[Reason]:
    """Backward configurations cuDNN (9.19, frontend 1.32) runs without an error but gets wrong,
    found by TE's configuration matrix on the H200 (benchmarks/results/2026-12-03-h200/ at 2f8a113 in git history:
    te_matrix.log); the forward of each is right, so they are refused only with gradients."""
    if not params.requires_grad:
        return []
    out = []
    if params.qkv_layout in ("t3hd", "th3d"):
        # The ragged backward reads a packed q (token stride 3*H*D) wrongly: dQ off by ~80%.
        out.append(Reason("qkv_layout", f"{params.qkv_layout} with gradients",
                          "thd_thd_thd, thd_t2hd or thd_th2d (cuDNN's ragged backward gets dQ wrong for a packed q)"))
    top_left = any(s.mask_type.is_causal and not s.mask_type.bottom_right for s in params.mask_specs)
    if top_left and params.max_seqlen_q == 1 < params.max_seqlen_kv:
        # Decode-shaped top-left causal (one query row sees key 0 only): dQ/dK came back ~1e24.
        out.append(Reason("attn_mask_type", "top-left causal with max_seqlen_q=1 < max_seqlen_kv and gradients",
                          "bottom-right causal, or max_seqlen_q > 1 (cuDNN's backward returns garbage there)"))
    return out


def _cudnn_feature_reasons(params) -> List[Reason]:
    """cuDNN's rules for bias, ALiBi and dropout (cudnn-frontend's SDPA validation)."""
    alibi = params.core_attention_bias_type == "alibi"
    features = [name for name, on in (("a bias", params.core_attention_bias_type == "post_scale_bias"), ("ALiBi", alibi),
                                      ("dropout", params.attention_dropout > 0 and params.is_training)) if on]
    if not features:
        return []
    out = []
    for spec in params.mask_specs:
        # Bottom-right bands cannot carry them; where sq == skv the band runs top-left instead.
        if spec.mask_type.bottom_right and spec.has_band and not params.same_lengths:
            out.append(Reason("attn_mask_type", f"{spec.mask_type.value} with {' and '.join(features)}",
                              "top-left masks, or sq == skv known for every sequence"))
        if alibi and spec.right != 0:
            out.append(Reason("attn_mask_type", f"{spec.mask_type.value}, window {spec.window} with alibi",
                              "causal masks (cuDNN's ALiBi needs a right bound of 0)"))
    if alibi and params.alibi_slopes_shape is not None:
        out.append(Reason("alibi_slopes", f"shape {params.alibi_slopes_shape}", "None (cuDNN computes the standard slopes)"))
    if alibi and not params.same_lengths:
        # cuDNN's ALiBi is slope * (j - i) under its causal mask; the reference's
        # -slope * |j - i - (skv - sq)| agrees with it (up to a per-row constant, which softmax
        # drops) where sq == skv.
        out.append(Reason("sequence lengths", "sq != skv possible with alibi",
                          "sq == skv for every sequence (self-attention sharing cu_seqlens, or dense without padding)"))
    return out
