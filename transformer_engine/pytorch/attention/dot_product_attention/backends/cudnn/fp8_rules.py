"""What FusedAttention runs in FP8 (``AttentionParams.fp8``), each rule with its reason: cuDNN's
limits (cudnn-frontend 1.32's FP8 SDPA nodes, cuDNN 9.19), what was probed on the H200
(``benchmarks/attention/probe_fp8_paged_fp8.py``), and what TE itself refuses in FP8.

Forward: bshd, sbhd and thd (ragged offsets and a padding mask), causal or not, padding masks,
GQA, head dims that are multiples of 16 up to 128 (64 and 128 probed); on sm90 no bottom-right
causal mask with sq != skv. The FP8 backward
(``NVTE_FP8_DPA_BWD`` unset or 1) is narrower on Hopper: head dim 128 only, no THD, no
bottom-right causal with sq != skv; ``NVTE_FP8_DPA_BWD=0`` keeps the FP8 forward and runs the
ordinary backward, so those rules do not apply then.
"""

from __future__ import annotations

from typing import List

from ...environment import FP8_DPA_BWD
from ...selection.support import Reason
from .versions import cudnn_name, release

FP8_MAJORS = (9, 10)
FP8_MAX_HEAD_DIM = 128
FP8_HEAD_DIM_MULTIPLE = 16
FP8_MIN_CUDNN = 90100  # sdpa_fp8 and sdpa_fp8_backward
FP8_BROKEN_BACKWARD_CUDNN = 91000  # cudnn-frontend refuses the FP8 backward on 9.10.0 (known bugs)
FP8_MIN_FRONTEND = (1, 32)  # the release the FP8 graphs were probed with
_BWD_OFF = "or NVTE_FP8_DPA_BWD=0 (FP8 forward, high-precision backward)"


def fp8_reasons(params, libs) -> List[Reason]:
    """Every FP8 rule ``params`` breaks (none when it is not an FP8 call)."""
    if not params.fp8:
        return []
    out = _recipe_and_versions(params, libs) + _head_dims(params) + _features(params)
    if params.requires_grad and FP8_DPA_BWD.get("1") != "0":
        out += _backward(params, libs)
    return out


def _recipe_and_versions(params, libs) -> List[Reason]:
    out = []
    cc = params.compute_capability
    if cc is not None and cc[0] not in FP8_MAJORS:
        out.append(Reason("compute_capability", f"sm{cc[0]}{cc[1]} with FP8",
                          "sm9x or sm10x (cuDNN's FP8 SDPA needs Hopper or newer; TE refuses FP8 attention on sm120)"))
    if params.fp8_recipe != "DelayedScaling":
        out.append(Reason("fp8_recipe", str(params.fp8_recipe),
                          "DelayedScaling (cuDNN's FP8 SDPA writes O and dQ/dK/dV in FP8 on Hopper, so their scales must "
                          "exist before it runs, while current scaling derives them from those tensors; TE runs "
                          "Float8CurrentScaling attention on sm100+ only)"))
    if libs.cudnn is not None and libs.cudnn < FP8_MIN_CUDNN:
        out.append(Reason("cudnn", f"{cudnn_name(libs.cudnn)} with FP8", "9.1 or newer (sdpa_fp8)"))
    if libs.cudnn_frontend is not None and release(libs.cudnn_frontend) < FP8_MIN_FRONTEND:
        out.append(Reason("cudnn_frontend", f"{libs.cudnn_frontend} with FP8",
                          "1.32 or newer (the release cuDNN's FP8 graphs were probed with here)"))
    return out


def _head_dims(params) -> List[Reason]:
    out = []
    if params.head_dim_qk != params.head_dim_v:
        out.append(Reason("head_dim_v", f"{params.head_dim_v} with head_dim_qk={params.head_dim_qk} in FP8",
                          "equal head dims (cuDNN's FP8 SDPA is wired for one head dim)"))
    d = params.head_dim_qk
    if d > FP8_MAX_HEAD_DIM or d % FP8_HEAD_DIM_MULTIPLE:
        out.append(Reason("head_dim_qk", f"{d} in FP8", "multiples of 16 up to 128 (cuDNN's FP8 SDPA; 64 and 128 probed)"))
    return out


def _features(params) -> List[Reason]:
    """Features cuDNN's FP8 path is not wired for here (the emulation runs all of them)."""
    out = []
    if params.attention_dropout > 0 and params.is_training:
        out.append(Reason("attention_dropout", f"{params.attention_dropout} in FP8",
                          "0.0 (dropout in cuDNN's FP8 SDPA is not wired here: not probed on the H200)"))
    if params.core_attention_bias_type != "no_bias":
        out.append(Reason("core_attention_bias_type", f"{params.core_attention_bias_type} in FP8",
                          "no_bias (cuDNN's FP8 SDPA is wired without a bias or ALiBi)"))
    if params.softmax_type != "vanilla":
        out.append(Reason("softmax_type", f"{params.softmax_type!r} in FP8", "vanilla (TE has no FP8 attention sinks either)"))
    if params.return_max_logit:
        out.append(Reason("return_max_logit", "True in FP8", "False (TE returns no max logit in FP8 either)"))
    if params.per_seq_policies is not None:
        out.append(Reason("attn_mask_type_per_seq", "given in FP8", "None (one mask policy per FP8 call on cuDNN)"))
    cc = params.compute_capability
    bottom_right = _bottom_right_causal(params)
    if bottom_right and not params.same_lengths and cc is not None and cc[0] == 9:
        out.append(Reason("attn_mask_type", f"{bottom_right[0].mask_type.value} with sq != skv possible in FP8 on sm90",
                          "top-left causal masks or sq == skv (cuDNN 9.19 builds no FP8 forward with a bottom-right "
                          "diagonal on Hopper: 'only supported on Blackwell', measured on the H200)"))
    for spec in params.mask_specs:
        if spec.window not in ((-1, -1), (-1, 0)):
            out.append(Reason("window_size", f"{spec.window} in FP8",
                              "(-1, -1) or (-1, 0) (sliding windows are not wired in cuDNN's FP8 path)"))
    return out


def _bottom_right_causal(params) -> list:
    return [s for s in params.mask_specs if s.mask_type.is_causal and s.mask_type.bottom_right]


def _backward(params, libs) -> List[Reason]:
    """The FP8 backward's own limits (cudnn-frontend's sdpa_fp8_backward validation)."""
    out = []
    cc = params.compute_capability
    if cc is not None and cc[0] == 9 and params.head_dim_qk != 128:
        out.append(Reason("head_dim_qk", f"{params.head_dim_qk} with FP8 gradients on sm90",
                          f"128 (cuDNN's FP8 backward on Hopper takes head dim 128 only), {_BWD_OFF}"))
    if params.qkv_format == "thd":
        out.append(Reason("qkv_format", "thd with FP8 gradients",
                          f"bshd or sbhd (cuDNN's FP8 backward refuses ragged offsets on Hopper), {_BWD_OFF}"))
    bottom_right = _bottom_right_causal(params)
    if bottom_right and not params.same_lengths:
        out.append(Reason("attn_mask_type", f"{bottom_right[0].mask_type.value} with sq != skv possible and FP8 gradients",
                          f"top-left causal masks or sq == skv (cuDNN's FP8 backward has no bottom-right diagonal on "
                          f"Hopper, and this package has not run it on Blackwell), {_BWD_OFF}"))
    if libs.cudnn == FP8_BROKEN_BACKWARD_CUDNN:
        out.append(Reason("cudnn", "9.10.0 with FP8 gradients", f"any other version (cudnn-frontend refuses it: known bugs), {_BWD_OFF}"))
    return out
