"""Declarative packed inputs: ``qkv_layer`` / ``kv_layer`` with ``qkv_interleave_dim``.

The caller says how its fused projection is packed; q, k and v come out as zero-copy
``select()`` views and the layout string is built from the declaration. Nothing is inferred
from pointers, so this path traces under ``torch.compile(fullgraph=True)``.

Accepted shapes (interleave dim -3 / -2)::

    qkv_layer: [B, S, 3, H, D] / [B, S, H, 3, D]   (bshd)     kv_layer: [B, S, 2, HG, D] / [B, S, HG, 2, D]
               [S, B, 3, H, D] / [S, B, H, 3, D]   (sbhd)               [S, B, 2, HG, D] / [S, B, HG, 2, D]
               [T, 3, H, D]    / [T, H, 3, D]      (thd)                [T, 2, HG, D]    / [T, HG, 2, D]
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .layouts import get_qkv_layout, layout_string


@dataclass(frozen=True)
class ResolvedQKV:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: str
    packing: Optional[str]
    declared: bool = False  # packing stated through qkv_layer / kv_layer (not read from pointers)
    buffer: Optional[torch.Tensor] = None  # the declared qkv_layer / kv_layer itself


def split_packed(packed: torch.Tensor, interleave_dim: int) -> Tuple[torch.Tensor, ...]:
    """The q/k/v (or k/v) views of a packed buffer. ``select`` rather than ``unbind``: unbind's
    views are multi-output views, which autograd forbids modifying in place."""
    return tuple(packed.select(interleave_dim, i) for i in range(packed.shape[interleave_dim]))


def _views(packed: torch.Tensor, name: str, n: int, interleave_dim: int, qkv_format: str) -> Tuple[torch.Tensor, ...]:
    rank = len(qkv_format) + 1
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a tensor; got {type(packed).__name__}")
    if packed.dim() != rank:
        raise ValueError(f"{name} must have rank {rank} for qkv_format={qkv_format!r}; got shape {tuple(packed.shape)}")
    if packed.shape[interleave_dim] != n:
        raise ValueError(
            f"{name} must have size {n} at qkv_interleave_dim={interleave_dim}; got shape {tuple(packed.shape)}"
        )
    if packed.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last (head) dim: stride(-1) must be 1, got {packed.stride(-1)}")
    return split_packed(packed, interleave_dim)


def resolve_qkv(
    query_layer: Optional[torch.Tensor],
    key_layer: Optional[torch.Tensor],
    value_layer: Optional[torch.Tensor],
    qkv_layer: Optional[torch.Tensor],
    kv_layer: Optional[torch.Tensor],
    qkv_interleave_dim: int,
    qkv_format: str,
) -> ResolvedQKV:
    """Turn the declared or separate inputs into q/k/v views and a layout string."""
    if qkv_interleave_dim not in (-3, -2):
        raise ValueError(f"qkv_interleave_dim must be -3 or -2; got {qkv_interleave_dim!r}")
    separate = {"query_layer": query_layer, "key_layer": key_layer, "value_layer": value_layer}
    if qkv_layer is not None:
        clash = [n for n, t in separate.items() if t is not None] + (["kv_layer"] if kv_layer is not None else [])
        if clash:
            raise ValueError(f"qkv_layer already holds q, k and v; do not also pass {', '.join(clash)}")
        q, k, v = _views(qkv_layer, "qkv_layer", 3, qkv_interleave_dim, qkv_format)
        return ResolvedQKV(q, k, v, layout_string(qkv_format, "qkv", qkv_interleave_dim), "qkv", True, qkv_layer)
    if kv_layer is not None:
        if query_layer is None:
            raise ValueError("kv_layer needs query_layer (the queries are not in the packed buffer); got None")
        if key_layer is not None or value_layer is not None:
            raise ValueError("kv_layer already holds k and v; do not also pass key_layer/value_layer")
        k, v = _views(kv_layer, "kv_layer", 2, qkv_interleave_dim, qkv_format)
        return ResolvedQKV(query_layer, k, v, layout_string(qkv_format, "kv", qkv_interleave_dim), "kv", True, kv_layer)
    missing = [n for n, t in separate.items() if t is None]
    if missing:
        raise ValueError(f"pass query_layer, key_layer and value_layer, or qkv_layer, or query_layer with kv_layer; missing {', '.join(missing)}")
    for name, t in separate.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor; got {type(t).__name__}")
    layout, packing = get_qkv_layout(query_layer, key_layer, value_layer, qkv_format)
    if packing is not None:
        warnings.warn(
            f"query/key/value_layer are views of one packed buffer (layout {layout!r}), found by pointer "
            f"inspection; pass it as qkv_layer= (or kv_layer=) with qkv_interleave_dim instead",
            DeprecationWarning,
            stacklevel=4,
        )
    return ResolvedQKV(query_layer, key_layer, value_layer, layout, packing)
