"""Mask types, sliding windows and the one rule that says which (query, key) pairs may attend.

Shape legend: B = batch (number of sequences), H = heads, SQ/SKV = query/key lengths.

The rule, for query position i and key position j of one sequence (0-based, within the
sequence), with lengths sq and skv and a window (left, right), -1 meaning unbounded::

    shift = skv - sq   if the diagonal is bottom-right aligned, else 0
    allowed(i, j) = i + shift - left <= j <= i + shift + right

A causal mask is a window whose right bound is 0. Top-left alignment applies only to
``causal`` and ``padding_causal``; every other mask (``*_bottom_right``, and windows on
``no_mask``/``padding``) aligns the diagonal to the last key, as FlashAttention does.
For sq=3, skv=5::

    causal (top-left)     causal_bottom_right
    1 0 0 0 0             1 1 1 0 0
    1 1 0 0 0             1 1 1 1 0
    1 1 1 0 0             1 1 1 1 1
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

# Stands for "unbounded" in integer comparisons: larger than any sequence length.
UNBOUNDED = 1 << 30


class AttnMaskType(str, enum.Enum):
    """TransformerEngine's mask types, parsed once at the boundary."""

    NO_MASK = "no_mask"
    PADDING = "padding"
    CAUSAL = "causal"
    PADDING_CAUSAL = "padding_causal"
    CAUSAL_BOTTOM_RIGHT = "causal_bottom_right"
    PADDING_CAUSAL_BOTTOM_RIGHT = "padding_causal_bottom_right"
    ARBITRARY = "arbitrary"

    @property
    def is_padding(self) -> bool:
        return self.value.startswith("padding")

    @property
    def is_causal(self) -> bool:
        return "causal" in self.value

    @property
    def bottom_right(self) -> bool:
        """Whether the diagonal (causal or window) is aligned to the last key."""
        return self not in (AttnMaskType.CAUSAL, AttnMaskType.PADDING_CAUSAL)

    def with_padding(self) -> "AttnMaskType":
        """The padding kind of this mask (THD always carries per-sequence lengths)."""
        if self.is_padding or self is AttnMaskType.ARBITRARY:
            return self
        return AttnMaskType("padding" if self is AttnMaskType.NO_MASK else "padding_" + self.value)

    @classmethod
    def parse(cls, value: Union[str, "AttnMaskType"], arg: str = "attn_mask_type") -> "AttnMaskType":
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ValueError(f"{arg} must be one of {allowed}; got {value!r}") from None


Window = Tuple[int, int]


def normalize_window(window: Optional[Tuple[int, int]], mask: AttnMaskType, arg: str = "window_size") -> Window:
    """Check a (left, right) window against the mask and return its canonical form, as TE's
    window check does: None and (-1, -1) mean no window; a causal mask fixes the right bound at
    0, so a window reaching right of the diagonal, (left >= 0, right != 0), becomes (left, 0)
    with a warning; on a non-causal mask (-1, 0) becomes (-1, -1) with a warning (the mask type,
    not the window, says whether attention is causal). Other negative bounds are errors.
    """
    if window is None:
        window = (-1, -1)
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window)
    ):
        raise TypeError(f"{arg} must be None or a (left, right) tuple of ints, -1 = unbounded; got {window!r}")
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"{arg} bounds must be >= -1 (-1 = unbounded); got {tuple(window)}")
    if mask.is_causal:
        if (left, right) == (-1, -1) or right == 0:
            return (left, 0)
        if left >= 0:
            warnings.warn(f"{arg}={tuple(window)} reaches right of the diagonal, which attn_mask_type={mask.value!r} "
                          f"forbids; using ({left}, 0)", stacklevel=3)
            return (left, 0)
        raise ValueError(
            f"{arg}={tuple(window)} does not fit attn_mask_type={mask.value!r}; use (-1, 0), (left >= 0, 0) or (-1, -1)"
        )
    if (left, right) == (-1, 0):
        warnings.warn(f"{arg}=(-1, 0) with attn_mask_type={mask.value!r} means no window (use a causal mask type for "
                      f"causal attention); using (-1, -1)", stacklevel=3)
        return (-1, -1)
    return (left, right)


@dataclass(frozen=True)
class MaskSpec:
    """One mask policy: the mask type and its normalized window."""

    mask_type: AttnMaskType
    window: Window

    @property
    def left(self) -> int:
        return UNBOUNDED if self.window[0] < 0 else self.window[0]

    @property
    def right(self) -> int:
        return UNBOUNDED if self.window[1] < 0 else self.window[1]

    @property
    def has_band(self) -> bool:
        """Whether any diagonal bound applies (causal or a window)."""
        return self.window != (-1, -1)


def band_allowed(
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    shift: Union[int, torch.Tensor],
    left: Union[int, torch.Tensor],
    right: Union[int, torch.Tensor],
) -> torch.Tensor:
    """``q_pos + shift - left <= kv_pos <= q_pos + shift + right``, broadcast elementwise.

    ``q_pos`` is shaped [..., SQ, 1] and ``kv_pos`` [..., 1, SKV]; ``shift``/``left``/``right``
    are ints or tensors broadcastable to the result (per-sequence values in a batch).
    """
    diag = q_pos + shift
    return (kv_pos >= diag - left) & (kv_pos <= diag + right)
