"""Input checks for DotProductAttention.forward: host-side facts only (shapes, dtypes, types).

Each error names the argument, what it got and what it accepts.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from ..masks import AttnMaskType
from .inputs import BIAS_TYPES, QKV_FORMATS
from .packed_seqs import check_cu_seqlens, value_checks_on

BIAS_SHAPES = ("1hss", "b1ss", "bhss", "11ss", "111s")


def check_format(qkv_format) -> str:
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format must be one of {', '.join(QKV_FORMATS)}; got {qkv_format!r}")
    return qkv_format


def check_qkv(q, k, v, qkv_format: str, num_heads: int, num_gqa_groups: int, head_dims: Tuple[int, int]) -> None:
    rank = len(qkv_format)
    for name, t in (("query_layer", q), ("key_layer", k), ("value_layer", v)):
        if t.dim() != rank:
            raise ValueError(f"{name} must have rank {rank} for qkv_format={qkv_format!r}; got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise TypeError(f"query/key/value_layer must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"query/key/value_layer must be on one device; got {q.device}, {k.device}, {v.device}")
    if q.shape[-2] != num_heads:
        raise ValueError(f"query_layer has {q.shape[-2]} heads; num_attention_heads is {num_heads}")
    for name, t in (("key_layer", k), ("value_layer", v)):
        if t.shape[-2] != num_gqa_groups:
            raise ValueError(f"{name} has {t.shape[-2]} heads; num_gqa_groups is {num_gqa_groups}")
    if q.shape[-1] != head_dims[0] or k.shape[-1] != head_dims[0]:
        raise ValueError(f"query/key_layer head dims are {q.shape[-1]}/{k.shape[-1]}; kv_channels says {head_dims[0]}")
    if v.shape[-1] != head_dims[1]:
        raise ValueError(f"value_layer head dim is {v.shape[-1]}; kv_channels says {head_dims[1]}")
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"key_layer and value_layer must agree outside the last two dims; got {tuple(k.shape)} and {tuple(v.shape)}")
    if qkv_format != "thd":
        b_axis = 0 if qkv_format == "bshd" else 1
        if q.shape[b_axis] != k.shape[b_axis]:
            raise ValueError(f"query_layer and key_layer batch sizes differ: {q.shape[b_axis]} vs {k.shape[b_axis]}")


def check_mask_and_format(mask: AttnMaskType, qkv_format: str, attention_mask, has_cu_seqlens: bool) -> AttnMaskType:
    """THD carries lengths, so its masks are the padding kinds; dense padding needs lengths.

    As in TE, a THD call takes its lengths from cu_seqlens and does not read ``attention_mask``
    (callers that build one for every format may pass it along)."""
    if qkv_format == "thd":
        if mask is AttnMaskType.ARBITRARY:
            raise ValueError("attn_mask_type='arbitrary' needs a dense attention_mask; qkv_format='thd' accepts the padding mask types")
        return mask.with_padding()
    if mask.is_padding and attention_mask is None and not has_cu_seqlens:
        raise ValueError(
            f"attn_mask_type={mask.value!r} with qkv_format={qkv_format!r} needs attention_mask (True = padded) "
            f"or cu_seqlens_q/cu_seqlens_kv; got neither"
        )
    if attention_mask is not None and not (mask.is_padding or mask is AttnMaskType.ARBITRARY):
        raise ValueError(
            f"attention_mask was given but attn_mask_type={mask.value!r} ignores it; use a padding type or 'arbitrary'"
        )
    if mask is AttnMaskType.ARBITRARY and attention_mask is None:
        raise ValueError("attn_mask_type='arbitrary' needs attention_mask (a bool tensor, True = masked out); got None")
    return mask


def dense_padding(
    attention_mask, mask: AttnMaskType, b: int, sq: int, skv: int, cu_seqlens_q, cu_seqlens_kv, device
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(q_valid [B,SQ], kv_valid [B,SKV], arbitrary [B|1,H|1,SQ,SKV]) for a bshd/sbhd batch."""
    if mask is AttnMaskType.ARBITRARY:
        _check_bool("attention_mask", attention_mask, 4)
        if attention_mask.shape[-2:] != (sq, skv):
            raise ValueError(f"attention_mask must end in [sq, skv] = [{sq}, {skv}]; got shape {tuple(attention_mask.shape)}")
        return None, None, attention_mask
    if not mask.is_padding:
        return None, None, None
    if attention_mask is None:
        for name, cu, s in (("cu_seqlens_q", cu_seqlens_q, sq), ("cu_seqlens_kv", cu_seqlens_kv, skv)):
            check_cu_seqlens(name, cu, b, device)
            if value_checks_on(device):
                _check_dense_lengths(name, cu, s)
        return _valid_from_cu(cu_seqlens_q, sq), _valid_from_cu(cu_seqlens_kv, skv), None
    if isinstance(attention_mask, (tuple, list)):
        if len(attention_mask) != 2:
            raise ValueError(f"attention_mask as a tuple must be (q_mask, kv_mask); got {len(attention_mask)} items")
        q_mask, kv_mask = attention_mask
    else:
        q_mask = kv_mask = attention_mask
    for name, m, s in (("attention_mask (queries)", q_mask, sq), ("attention_mask (keys)", kv_mask, skv)):
        _check_bool(name, m, 4)
        if tuple(m.shape) != (b, 1, 1, s):
            raise ValueError(f"{name} must have shape [b, 1, 1, s] = [{b}, 1, 1, {s}]; got {tuple(m.shape)}")
    return ~q_mask.view(b, sq), ~kv_mask.view(b, skv), None


def _check_dense_lengths(name: str, cu: torch.Tensor, s: int) -> None:
    """Value check (see :func:`value_checks_on`): each length of a padded bshd/sbhd batch lies
    in [0, s]. Unchecked on CUDA, a bad length only marks too many or too few rows valid."""
    values = cu.tolist()
    lengths = [b - a for a, b in zip(values, values[1:])]
    bad = [n for n in lengths if not 0 <= n <= s]
    if bad:
        raise ValueError(f"{name} must give each sequence a length in [0, {s}] (the padded length); got lengths {lengths}")


def _valid_from_cu(cu: torch.Tensor, s: int) -> torch.Tensor:
    lengths = (cu[1:] - cu[:-1]).view(-1, 1)
    return torch.arange(s, device=cu.device).view(1, s) < lengths


def _check_bool(name: str, m, rank: int) -> None:
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or m.dim() != rank:
        got = f"shape {tuple(m.shape)}, dtype {m.dtype}" if isinstance(m, torch.Tensor) else type(m).__name__
        raise ValueError(f"{name} must be a {rank}-D bool tensor (True = masked out); got {got}")


def check_bias(
    bias_type: str, bias: Optional[torch.Tensor], alibi_slopes, qkv_format: str, b: int, h: int, sq: int, skv: int
) -> Optional[str]:
    """Validate the bias arguments; returns the bias shape string ('1hss', ...) or None."""
    if bias_type not in BIAS_TYPES:
        raise ValueError(f"core_attention_bias_type must be one of {', '.join(BIAS_TYPES)}; got {bias_type!r}")
    if bias_type in ("no_bias", "alibi"):
        if bias is not None:
            raise ValueError(f"core_attention_bias must be None with core_attention_bias_type={bias_type!r}")
        if alibi_slopes is not None:
            if bias_type != "alibi":
                raise ValueError("alibi_slopes needs core_attention_bias_type='alibi'")
            if alibi_slopes.dtype != torch.float32 or tuple(alibi_slopes.shape) not in ((h,), (b, h)):
                raise ValueError(f"alibi_slopes must be float32 of shape [{h}] or [{b}, {h}]; got {tuple(alibi_slopes.shape)}, {alibi_slopes.dtype}")
        return None
    if not isinstance(bias, torch.Tensor) or bias.dim() != 4:
        raise ValueError(f"core_attention_bias must be a 4-D tensor with core_attention_bias_type={bias_type!r}; got {bias if bias is None else tuple(bias.shape)}")
    bb, bh, bq = bias.shape[:3]
    one_row = tuple(bias.shape) == (1, 1, 1, skv)  # TE's "111s": one bias row for every query
    if not one_row and (bb not in (1, b) or bh not in (1, h) or tuple(bias.shape[2:]) != (sq, skv)):
        raise ValueError(
            f"core_attention_bias must have shape [1|{b}, 1|{h}, {sq}, {skv}] or [1, 1, 1, {skv}]; got {tuple(bias.shape)}"
        )
    if one_row and sq != 1:
        return "111s"
    return ("b" if bb == b and b > 1 else "1") + ("h" if bh == h and h > 1 else "1") + "ss"


def check_softmax_scale(scale) -> float:
    """A finite real number (TE's default 1/sqrt(head_dim_qk) is applied by the caller)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be a finite float (or None for 1/sqrt(head_dim)); got {scale!r}")
    return float(scale)


def check_num_splits(num_splits) -> None:
    """TE forwards num_splits to FlashAttention 3 as a split-KV performance hint; results do not
    depend on it. Here FA3 and FA4 take it where their declarations' NUM_SPLITS_MAJORS say so,
    and every other backend ignores it."""
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0):
        raise ValueError(f"num_splits must be None or a non-negative int (0 = the library's heuristic, 1 = no split); "
                         f"got {num_splits!r}")


def check_bottom_right_diagonal(value, mask: AttnMaskType, window, alibi: bool = False, source: Optional[str] = None) -> AttnMaskType:
    """TE's ``bottom_right_diagonal``. As in TE the mask type wins for causal masks (``causal`` /
    ``padding_causal`` are top-left, ``*_bottom_right`` bottom-right, whatever the flag says);
    for the other masks it aligns sliding windows and ALiBi, True (bottom-right) by default.
    Top-left windows and ALiBi on non-causal masks are not implemented: False is refused by name
    where it would change something. ``source`` names where ``mask`` and ``window`` come from
    when they are not the call's own (a per-sequence policy)."""
    if value is None:
        return mask
    if not isinstance(value, bool):
        raise TypeError(f"bottom_right_diagonal must be None, True or False; got {value!r}")
    banded = window is not None and tuple(window) not in ((-1, -1), (-1, 0))
    if not mask.is_causal and not value and (banded or alibi):
        raise NotImplementedError(
            f"bottom_right_diagonal=False with {source or f'attn_mask_type={mask.value!r}'}: windows and ALiBi on "
            f"non-causal masks are aligned bottom-right here; use None or True (a top-left band that ends at the "
            f"diagonal is a causal mask: 'padding_causal' with window (left, 0))"
        )
    return mask


def check_policy_diagonals(value, specs, arg: str) -> None:
    """``bottom_right_diagonal`` against each per-sequence policy (``specs``: its MaskSpecs, from
    ``arg``), as against the call's own mask: a policy's window is aligned like the call's."""
    for spec in specs:
        check_bottom_right_diagonal(value, spec.mask_type, spec.window, source=f"the {spec.mask_type.value!r} policy of {arg} "
                                                                                f"(window {spec.window})")


def check_kv_channels(kv_channels: Union[int, Tuple[int, int]]) -> Tuple[int, int]:
    if isinstance(kv_channels, int) and not isinstance(kv_channels, bool) and kv_channels > 0:
        return kv_channels, kv_channels
    if isinstance(kv_channels, (tuple, list)) and len(kv_channels) == 2 and all(isinstance(x, int) and x > 0 for x in kv_channels):
        return int(kv_channels[0]), int(kv_channels[1])
    raise ValueError(f"kv_channels must be a positive int or a (qk, v) pair of them; got {kv_channels!r}")
