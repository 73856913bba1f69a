"""Where each token of a step lands in its sequence, computed on the device from the step's
cumulative lengths: no host sync, fixed shapes, so a decode step can be captured in a CUDA graph.

The input's token slots are numbered in memory order: ``[b, s]`` for bshd, ``[s, b]`` for sbhd,
``[t]`` for thd. Slots that hold no token of the step (padding past a sequence's step length,
batch rows past the batch, thd rows past the last sequence) are marked invalid; the caches send
them to a scratch row that nothing reads.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence, Tuple

import torch

from .checks import batch_and_seq


class TokenPositions(NamedTuple):
    """Per token slot of the input, flattened in memory order ([N] each)."""

    rows: torch.Tensor  # int64: the batch row (sequence) the slot belongs to
    pos: torch.Tensor  # int64: the token's position in its sequence (0 where not valid)
    valid: torch.Tensor  # bool: the slot holds one of the step's tokens


def thd_token_rows(cu_seqlens: torch.Tensor, num_tokens: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each of ``num_tokens`` packed rows: (sequence index, index within the sequence, valid),
    from ``cu_seqlens`` [B+1] (rows from ``cu_seqlens[-1]`` on belong to no sequence)."""
    t = torch.arange(num_tokens, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    rows = torch.searchsorted(cu_seqlens, t, right=True) - 1  # the last sequence starting at or before t
    rows = rows.clamp(max=cu_seqlens.numel() - 2).long()
    valid = t < cu_seqlens[-1]
    return rows, t.long() - cu_seqlens.long()[rows], valid


def token_positions(cu_new: torch.Tensor, cu_cached: torch.Tensor, qkv_format: str, token_shape: Sequence[int]) -> TokenPositions:
    """Token slots of a step's K/V (``token_shape``: its shape without the last two dims) and
    where their tokens go. ``cu_new``/``cu_cached`` are the [max_batch+1] cumulative step lengths
    and cached lengths after the step; a token ``i`` of sequence ``b`` lands at position
    ``cached_len[b] - step_len[b] + i``."""
    lens_new = cu_new[1:] - cu_new[:-1]
    start = ((cu_cached[1:] - cu_cached[:-1]) - lens_new).long()
    if qkv_format == "thd":
        rows, index, valid = thd_token_rows(cu_new, token_shape[0])
    else:
        b, s = batch_and_seq(token_shape, qkv_format)
        device = cu_new.device
        rows = torch.arange(b, device=device)[:, None].expand(b, s)
        index = torch.arange(s, device=device)[None, :].expand(b, s)
        valid = index < lens_new[:b, None]
        if qkv_format == "sbhd":
            rows, index, valid = rows.t(), index.t(), valid.t()
        rows, index, valid = rows.reshape(-1), index.reshape(-1), valid.reshape(-1)
    return TokenPositions(rows, torch.where(valid, start[rows] + index, 0), valid)


def write_tokens(store: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, tokens: torch.Tensor) -> None:
    """``store`` [N+1, H, D]: N cache slots and a last scratch row. Each valid token is copied
    to its slot; the others all go to the scratch row (their order there does not matter)."""
    scratch = store.shape[0] - 1
    store.index_copy_(0, torch.where(valid, slots, scratch), tokens)
