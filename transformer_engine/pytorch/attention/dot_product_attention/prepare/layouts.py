"""qkv layouts: TE's layout names (``bshd_bshd_bshd``, ``sb3hd``, ``thd_t2hd`` ...) and the
legacy detection of packed q/k/v from pointers and strides. Pure helpers; no backend needed."""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def layout_string(qkv_format: str, packing: Optional[str], interleave_dim: int = -3) -> str:
    """The layout name for a format and a declared packing.

    ``packing``: None (separate q, k, v), "kv" (k and v share a buffer) or "qkv"; with
    ``interleave_dim=-3`` the count sits before the heads (``bs3hd``), with -2 after (``bsh3d``).
    """
    prefix = qkv_format[:-2]  # "bs", "sb" or "t"
    if packing is None:
        return "_".join([qkv_format] * 3)
    n = "3" if packing == "qkv" else "2"
    packed = prefix + (n + "hd" if interleave_dim == -3 else "h" + n + "d")
    return packed if packing == "qkv" else f"{qkv_format}_{packed}"


def _may_share(tensors) -> bool:
    """False when strides alone rule out ``tensors`` being views of one packed buffer: such
    views step n * h * d per token, while a tensor of its own steps h * d. It rejects separate
    tensors (the common case) at the cost of one stride."""
    first = tensors[0]
    return first.dim() >= 3 and first.stride(-1) == 1 and first.stride(-3) == len(tensors) * first.shape[-2] * first.shape[-1]


def stride_rules_out_packing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`get_qkv_layout` decides "separate" from strides alone (no pointers read)."""
    return not _may_share([q, k, v]) and not _may_share([k, v])


def _shared_interleave(tensors) -> Optional[int]:
    """-3 or -2 when ``tensors`` are equal-shaped, evenly spaced views of one packed buffer."""
    if not _may_share(tensors):
        return None
    first = tensors[0]
    n = len(tensors)
    if any(t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype for t in tensors):
        return None
    h, d = first.shape[-2:]
    step = [(t.data_ptr() - first.data_ptr()) // first.element_size() for t in tensors]
    dim = None
    if first.stride(-2) == d and step == [i * h * d for i in range(n)]:
        dim = -3
    elif first.stride(-2) == n * d and step == [i * d for i in range(n)]:
        dim = -2
    # The storage check last: building storage objects is the slow part, and separate tensors
    # almost never pass the pointer arithmetic above.
    if dim is None or any(t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for t in tensors):
        return None
    return dim


def get_qkv_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str = "sbhd") -> Tuple[str, Optional[str]]:
    """Legacy detection from pointers and strides: (layout, packing) for separate tensors.

    Only the undeclared path calls this; ``qkv_layer``/``kv_layer`` build the layout instead.
    """
    dim = _shared_interleave([q, k, v])
    if dim is not None:
        return layout_string(qkv_format, "qkv", dim), "qkv"
    dim = _shared_interleave([k, v])
    if dim is not None:
        return layout_string(qkv_format, "kv", dim), "kv"
    return layout_string(qkv_format, None), None

