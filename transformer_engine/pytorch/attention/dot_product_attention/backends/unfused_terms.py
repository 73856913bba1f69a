"""Score terms of the unfused math (:mod:`.unfused_math`): ALiBi's factored bias and slopes, the
mask band of a chunk's rows, the bias added to grouped scores and the max logit."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import torch

from ..masks import band_allowed

IntOrTensor = Union[int, torch.Tensor]


class AlibiTerm(NamedTuple):
    """ALiBi's bias ``-slopes * distance`` for one chunk, kept factored so that no per-head
    [B, H, R, SKV] bias tensor is built: slopes [B'|1, H, 1, 1], distance [B'|1, 1, R, SKV]."""

    slopes: torch.Tensor
    distance: torch.Tensor


def default_alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """The standard geometric ALiBi slopes (float32, [H]), extended for non-power-of-2 H.
    Computed on ``device`` from host constants: a tensor made from a Python list and moved to
    CUDA would be a blocking copy (a sync, and a break in CUDA-graph capture)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    i = torch.arange(num_heads, dtype=torch.float64, device=device)
    base = torch.exp2(-8.0 * (i + 1) / closest)
    extra = torch.exp2(-4.0 * (2 * (i - closest) + 1) / closest)  # heads past the power of two
    return torch.where(i < closest, base, extra).float()


def add_bias(scores: torch.Tensor, bias, hg: int, dtype: torch.dtype) -> torch.Tensor:
    """scores [B, HG, G, R, SKV] += bias, in place; bias is a tensor [B'|1, H'|1, R, SKV] or an
    :class:`AlibiTerm`."""
    if bias is None:
        return scores
    if isinstance(bias, AlibiTerm):
        return scores.addcmul_(group_heads(bias.slopes, hg), group_heads(bias.distance, hg), value=-1.0)
    return scores.add_(group_heads(bias.to(dtype), hg))


def max_logit(scores: torch.Tensor, h: int) -> torch.Tensor:
    """[B, HG, G, R, SKV] -> [H]; the dtype's lowest value where nothing was scored (no keys),
    as for a fully masked head."""
    if scores.numel() == 0:
        return torch.full((h,), torch.finfo(scores.dtype).min, dtype=scores.dtype, device=scores.device)
    return scores.amax(dim=(0, 3, 4)).reshape(h)


def group_heads(t: torch.Tensor, hg: int) -> torch.Tensor:
    """[B', H'|1, SQ, SKV] -> [B', HG, G|1, SQ, SKV] to line up with grouped query heads."""
    if t.shape[1] == 1:
        return t.unsqueeze(1)
    return t.reshape(t.shape[0], hg, t.shape[1] // hg, *t.shape[2:])


def band(
    spec_left: IntOrTensor, spec_right: IntOrTensor, shift: IntOrTensor, r0: int, r1: int, skv: int, device
) -> torch.Tensor:
    """[.., R, SKV] bool for query rows [r0, r1) from per-batch (or scalar) band bounds shaped
    [B, 1, 1, 1]."""
    qi = torch.arange(r0, r1, device=device).view(r1 - r0, 1)
    kj = torch.arange(skv, device=device).view(1, skv)
    return band_allowed(qi, kj, shift, spec_left, spec_right)


def alibi_bias(slopes: Optional[torch.Tensor], h: int, r0: int, r1: int, skv: int, shift: IntOrTensor,
                dtype: torch.dtype, device) -> AlibiTerm:
    """-slope * |j - i - shift| for query rows [r0, r1). As in TE, ALiBi follows the mask's
    diagonal: ``shift`` is skv - sq (per sequence, [B, 1, 1, 1]) for bottom-right masks and 0
    for the top-left ones (causal, padding_causal). Positions are exact in float32 up to 2**24."""
    if slopes is None:
        slopes = default_alibi_slopes(h, device)
    slopes = slopes.to(device=device, dtype=dtype)
    slopes = slopes.view(-1, h, 1, 1) if slopes.dim() == 2 else slopes.view(1, h, 1, 1)
    qi = torch.arange(r0, r1, device=device, dtype=dtype).view(r1 - r0, 1)
    kj = torch.arange(skv, device=device, dtype=dtype).view(1, skv)
    diag = qi + (shift.to(dtype) if isinstance(shift, torch.Tensor) else shift)
    distance = (kj - diag).abs_()
    return AlibiTerm(slopes, distance.view(1, 1, r1 - r0, skv) if distance.dim() == 2 else distance)


def rows_of(t: Optional[torch.Tensor], r0: int, r1: int) -> Optional[torch.Tensor]:
    """Rows [r0, r1) of a [.., SQ|1, SKV] tensor (a broadcast row dim stays as it is)."""
    if t is None or t.shape[-2] == 1:
        return t
    return t[..., r0:r1, :]
