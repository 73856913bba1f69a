"""Checks of InferenceParams' configuration and of a step's new K/V: host facts only (types,
shapes, the step lengths ``pre_step`` was given). Each error names the argument, what it got and
what it accepts."""

from __future__ import annotations

import operator
from typing import Optional, Sequence, Tuple

import torch

QKV_FORMATS = ("bshd", "sbhd", "thd")
_INT32_LIMIT = 2**31


def check_qkv_format(qkv_format) -> str:
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format must be one of {', '.join(QKV_FORMATS)}; got {qkv_format!r}")
    return qkv_format


def batch_and_seq(shape: Sequence[int], qkv_format: str) -> Tuple[int, int]:
    """(batch, sequence) sizes of a bshd or sbhd shape (its batch dim is 0 or 1)."""
    return (shape[0], shape[1]) if qkv_format == "bshd" else (shape[1], shape[0])


def positive_int(name: str, value, *, optional: bool = False) -> Optional[int]:
    if value is None and optional:
        return None
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a positive int; got {type(value).__name__}") from None
    if value < 1:
        raise ValueError(f"{name} must be a positive int; got {value}")
    return value


def check_required(num_heads_kv, head_dim_k, dtype) -> None:
    missing = [n for n, v in (("num_heads_kv", num_heads_kv), ("head_dim_k", head_dim_k), ("dtype", dtype)) if v is None]
    if missing:
        raise ValueError(f"InferenceParams needs num_heads_kv, head_dim_k and dtype (as TE since 2.2); missing: {', '.join(missing)}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (the KV cache's); got {dtype!r}")


def check_paging(is_paged: bool, total_num_pages, page_size, max_sequence_length: int) -> None:
    if not is_paged:
        return
    if page_size is None:
        raise ValueError("is_paged=True needs page_size (tokens per page); got None")
    if total_num_pages is None:
        raise ValueError("is_paged=True needs total_num_pages (pages in each layer's pool); got None")
    page_size = positive_int("page_size", page_size)
    positive_int("total_num_pages", total_num_pages)
    if max_sequence_length % page_size:
        raise ValueError(
            f"max_sequence_length={max_sequence_length} must be a multiple of page_size={page_size} "
            "(a sequence's page table row holds max_sequence_length // page_size pages)"
        )
    if total_num_pages * page_size >= _INT32_LIMIT:
        raise ValueError(f"total_num_pages * page_size = {total_num_pages * page_size} tokens; int32 offsets allow < 2**31")


def check_ctx_len(max_ctx_len, qkv_format: str, max_sequence_length: int) -> Optional[int]:
    if qkv_format == "thd" and max_ctx_len is None:
        raise ValueError("qkv_format='thd' needs max_ctx_len (the longest step of one sequence, the queries' bound); got None")
    max_ctx_len = positive_int("max_ctx_len", max_ctx_len, optional=True)
    if max_ctx_len is not None and max_ctx_len > max_sequence_length:
        raise ValueError(f"max_ctx_len={max_ctx_len} must be at most max_sequence_length={max_sequence_length}")
    return max_ctx_len


def check_new_kv(new_k, new_v, qkv_format: str, *, dtype: torch.dtype, num_heads: int, head_dims: Sequence[int],
                 device: torch.device) -> None:
    """The step's K/V against the cache: rank, dtype, device, KV heads and head dims."""
    for name, t, head_dim, dim_name in (("new_k", new_k, head_dims[0], "head_dim_k"), ("new_v", new_v, head_dims[1], "head_dim_v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor; got {type(t).__name__}")
        if t.dim() != len(qkv_format):
            raise ValueError(f"{name} must have rank {len(qkv_format)} for qkv_format={qkv_format!r}; got shape {tuple(t.shape)}")
        if t.dtype != dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; the KV cache holds {dtype}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}; the KV cache is on {device}")
        if t.shape[-2] != num_heads:
            raise ValueError(f"{name} has {t.shape[-2]} heads; the KV cache has num_heads_kv={num_heads}")
        if t.shape[-1] != head_dim:
            raise ValueError(f"{name} has head dim {t.shape[-1]}; the KV cache has {dim_name}={head_dim}")
    if new_k.shape[:-2] != new_v.shape[:-2]:
        raise ValueError(f"new_k and new_v must agree outside the last two dims; got {tuple(new_k.shape)} and {tuple(new_v.shape)}")


def check_token_dims(token_shape: Sequence[int], qkv_format: str, step_lens: Sequence[int], max_batch_size: int) -> None:
    """The step's K/V hold every token ``pre_step`` announced: thd rows for all of them, a dense
    batch dim covering the batch (at most max_batch_size) and a sequence dim covering each step."""
    if qkv_format == "thd":
        if token_shape[0] < sum(step_lens):
            raise ValueError(f"new_k has {token_shape[0]} tokens (qkv_format='thd'); the step has {sum(step_lens)} (pre_step)")
        return
    b, s = batch_and_seq(token_shape, qkv_format)
    if not len(step_lens) <= b <= max_batch_size:
        raise ValueError(
            f"new_k's batch dim is {b} ({qkv_format}); it must cover the step's {len(step_lens)} sequences "
            f"and be at most max_batch_size={max_batch_size}"
        )
    if s < max(step_lens, default=0):
        raise ValueError(f"new_k's sequence dim is {s} ({qkv_format}); the step's longest sequence has {max(step_lens)} new tokens")
