"""What the FlashAttention libraries (v2, v3, v4) share: the declaration base class, the mask
translation into their bottom-right (causal, window_left, window_right), and result unpacking."""

from __future__ import annotations

import functools
from typing import ClassVar, Tuple

from ..environment import compiling
from ..masks import MaskSpec
from ..selection.support import BackendSupport


def fa_mask_args(spec: MaskSpec) -> Tuple[bool, int, int]:
    """(causal, window_left, window_right) in FlashAttention's bottom-right convention."""
    left, right = spec.window
    if spec.mask_type.is_causal and left < 0:
        return True, -1, -1
    return False, left, right


_cached_mask_args = functools.lru_cache(maxsize=256)(fa_mask_args)


def mask_args(spec: MaskSpec) -> Tuple[bool, int, int]:
    """:func:`fa_mask_args`, cached per spec in eager calls: the few specs a process meets come
    back on every call (0.3 us for the lookup, 1 us to derive). torch.compile traces the plain
    function (it warns about, and skips, an lru_cache wrapper)."""
    return fa_mask_args(spec) if compiling() else _cached_mask_args(spec)


class FlashAttention(BackendSupport):
    """FlashAttention; one subclass per library version. Its diagonal is always bottom-right."""

    NAME = "FlashAttention"
    VERSION: ClassVar[int] = 0
    SUPPORTS_TOP_LEFT_CROSS = False
    SUPPORTS_DENSE_PADDING = False
    NOTES = {
        "attention_mask": "FlashAttention takes padding only as cu_seqlens (qkv_format='thd')",
        "attn_mask_type": "FlashAttention aligns causal masks bottom-right only",
        "softmax_type": "this FlashAttention library takes no attention-sink logits",
        "return_max_logit": "FlashAttention returns only the log-sum-exp, which bounds the max logit "
                            "(max <= lse <= max + log(skv)) but does not give it",
        "inference_params": "this FlashAttention library's KV-cache entry is not wired here (FA4 runs paged and non-paged caches)",
    }

    @classmethod
    def label(cls) -> str:
        return f"FlashAttention v{cls.VERSION}"


def first_output(result):
    """The output of a library call that returns either it or a tuple starting with it."""
    return result[0] if isinstance(result, tuple) else result
