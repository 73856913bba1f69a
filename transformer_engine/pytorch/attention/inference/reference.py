"""Attention of a step's queries over one layer's KV cache in plain PyTorch: the reference the
GPU backends are checked against, and the unfused backend's KV-cache path.

Equivalent to, for each sequence ``b`` of the step (``n = seqlens_q[b]`` new tokens,
``m = seqlens_kv[b]`` cached tokens including them, query ``i`` at position ``m - n + i``)::

    k, v = the first m tokens of sequence b in the cache (through the page table when paged)
    s = q_b @ k.T * softmax_scale                     # [n, m] per head (GQA: head h reads KV head h // (H // Hkv))
    s[i, j] = -inf where key j is masked for query i   # causal: j > m - n + i (bottom-right aligned)
    out_b = softmax(s) @ v

Query rows no sequence owns (padding) come out 0; cache slots past a sequence's length are never
read, whatever they hold. Computed in float32, or float64 for float64 inputs; no host sync.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .append import thd_token_rows
from .paged import gather_pages
from .record import KVCacheStep

INFERENCE_MASK_TYPES = {
    "padding": "padding",
    "padding_causal": "padding_causal_bottom_right",
    "padding_causal_bottom_right": "padding_causal_bottom_right",
}


def inference_attn_mask_type(attn_mask_type: str) -> str:
    """The mask attention over a KV cache applies for a module's ``attn_mask_type``: a padding
    kind is required (cached sequences have different lengths), and causal masks align to the
    last key (a step's queries come after the cached tokens), so ``padding_causal`` becomes
    ``padding_causal_bottom_right``, as in TE."""
    if attn_mask_type not in INFERENCE_MASK_TYPES:
        raise ValueError(
            f"attn_mask_type must be a padding kind with inference_params ({', '.join(INFERENCE_MASK_TYPES)}); "
            f"got {attn_mask_type!r}"
        )
    return INFERENCE_MASK_TYPES[attn_mask_type]


def attention_over_cache(query: torch.Tensor, step: KVCacheStep, *, attn_mask_type: str = "padding_causal",
                         window_size: Optional[Tuple[int, int]] = None,
                         softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Attention of the step's queries over the cache ``step`` returned, as in the module doc.

    ``query``: [B, Sq, H, D] (bshd), [Sq, B, H, D] (sbhd) or [T, H, D] (thd), the step's format.
    Returns [B, Sq, H, Dv], [Sq, B, H, Dv] or [T, H, Dv] in ``query``'s dtype.
    ``window_size`` (left, right), -1 unbounded, is aligned like the causal diagonal."""
    mask = inference_attn_mask_type(attn_mask_type)
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = _dense_queries(query, step).to(work)  # [B, Sq, H, D]
    k, v = (c.to(work) for c in cached_kv(step))  # [B, S, Hkv, D]
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query has {heads} heads; they must be a multiple of the cache's {kv_heads} KV heads")
    allowed, kv_valid = _allowed(step, q.shape[1], k.shape[1], mask, window_size)
    v = torch.where(kv_valid[:, :, None, None], v, 0.0)  # slots past a sequence may hold anything
    k, v = (_share_kv_heads(t, heads // kv_heads) for t in (k, v))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    scores = scores.masked_fill(~allowed[:, None], -math.inf)
    probs = torch.where(allowed.any(-1)[:, None, :, None], torch.softmax(scores, dim=-1), 0.0)
    out = torch.einsum("bhij,bjhd->bihd", probs, v).to(query.dtype)
    return _to_step_format(out, step, query.shape[0])


def _share_kv_heads(t: torch.Tensor, group: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, Hkv * group, D]: query head h reads KV head h // group."""
    b, s, hkv, d = t.shape
    return t[:, :, :, None, :].expand(b, s, hkv, group, d).reshape(b, s, hkv * group, d)


def cached_kv(step: KVCacheStep) -> Tuple[torch.Tensor, torch.Tensor]:
    """The step's cached K/V as dense [B, S, Hkv, D] tensors (gathered through the page table
    when paged); slots past each sequence's ``seqlens_kv`` are unspecified."""
    if not step.is_paged:
        return step.k_cache, step.v_cache
    return gather_pages(step.k_cache, step.v_cache, step.page_table)


def _dense_queries(query: torch.Tensor, step: KVCacheStep) -> torch.Tensor:
    if step.qkv_format == "bshd":
        return query
    if step.qkv_format == "sbhd":
        return query.transpose(0, 1)
    if query.shape[0] == 0:
        return query.new_zeros(step.batch_size, step.max_seqlen_q, *query.shape[1:])
    # thd: row (b, i) reads token cu_seqlens_q[b] + i; past a sequence's end it reads some row,
    # which the mask removes.
    index = step.cu_seqlens_q[:-1, None].long() + torch.arange(step.max_seqlen_q, device=query.device)
    return query[index.clamp(max=query.shape[0] - 1)]


def _allowed(step: KVCacheStep, sq: int, skv: int, mask: str, window) -> Tuple[torch.Tensor, torch.Tensor]:
    """([B, Sq, S] which key each query row sees, [B, S] which cache slots hold tokens)."""
    device = step.seqlens_q.device
    n = step.seqlens_q.long()[:, None, None]
    m = step.seqlens_kv.long()[:, None, None]
    i = torch.arange(sq, device=device)[None, :, None]
    j = torch.arange(skv, device=device)[None, None, :]
    position = m - n + i  # of query row i in its sequence
    left, right = window if window is not None else (-1, -1)
    if mask == "padding_causal_bottom_right":
        right = 0
    allowed = (i < n) & (j < m)
    if right >= 0:
        allowed = allowed & (j <= position + right)
    if left >= 0:
        allowed = allowed & (j >= position - left)
    return allowed, (j < m)[:, 0]


def _to_step_format(out: torch.Tensor, step: KVCacheStep, num_rows: int) -> torch.Tensor:
    if step.qkv_format == "bshd":
        return out
    if step.qkv_format == "sbhd":
        return out.transpose(0, 1).contiguous()
    rows, index, valid = thd_token_rows(step.cu_seqlens_q, num_rows)
    flat = out.flatten(0, 1)[rows * out.shape[1] + index.clamp(max=out.shape[1] - 1)]
    return torch.where(valid[:, None, None], flat, 0.0)
