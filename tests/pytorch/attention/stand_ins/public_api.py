"""What the stand-ins of flash-attention's public functions share (flash-attn 2's
``flash_attn``, FA3's ``flash_attn_interface``): binding each call to the library's signature
and recording it, and the float64 computation, differentiable (these libraries run their own
autograd). Bottom-right causal, (left, right) windows with -1 unbounded, ALiBi as
-slope * |i + skv - sq - j|; a varlen call leaves the rows of no sequence (and, with
``seqused``, those past each length) unwritten, NaN here, and reads V in whole tiles past each
sequence end (0 * NaN = NaN: a gap's NaN leaks into the sequence unless the package zeroes it)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, List

import torch

from ..reference import alibi_bias, allowed_matrix, attend_one
from . import stand_in_module
from .rows import tile_end


@dataclass
class Library:
    """One library function: each call is bound to ``signature``'s parameters (an unknown
    keyword, a missing argument or an extra positional one raises TypeError, as the library
    would) and recorded, with all arguments by name, which were passed by keyword and how many
    positionally; then computed."""

    signature: Callable
    compute: Callable
    calls: List[dict] = field(default_factory=list)

    def __call__(self, *args, **kwargs):
        bound = inspect.signature(self.signature).bind(*args, **kwargs)
        bound.apply_defaults()
        self.calls.append(dict(bound.arguments, _keywords=set(kwargs), _positional=len(args)))
        return self.compute(**bound.arguments)


def _one(q, k, v, causal, window, scale, slopes=None):
    n, m = q.shape[0], k.shape[0]
    mask = "padding_causal_bottom_right" if causal else "padding"
    window = None if tuple(window) == (-1, -1) else tuple(window)
    bias = None if slopes is None else alibi_bias(n, m, mask, slopes)
    return attend_one(q, k, v, allowed_matrix(n, m, mask, window), scale, bias)


def dense(q, k, v, softmax_scale, causal, window_size, alibi_slopes=None, **_):
    """[B, S, H, D] inputs: one sequence per batch entry."""
    return torch.stack([_one(q[b], k[b], v[b], causal, window_size, softmax_scale, alibi_slopes)
                        for b in range(q.shape[0])]).to(q.dtype)


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, seqused_q=None, seqused_k=None,
           alibi_slopes=None, **_):
    """[T, H, D] inputs: sequence b from row cu_seqlens[b], seqused[b] rows long (else up to the
    next offset)."""
    parts, cursor = [], 0
    nan = lambda rows: torch.full((rows, q.shape[1], v.shape[-1]), float("nan"), dtype=torch.float64)  # noqa: E731
    for b in range(cu_seqlens_q.numel() - 1):
        start, kv_start = int(cu_seqlens_q[b]), int(cu_seqlens_k[b])
        n = int(seqused_q[b]) if seqused_q is not None else int(cu_seqlens_q[b + 1]) - start
        m = int(seqused_k[b]) if seqused_k is not None else int(cu_seqlens_k[b + 1]) - kv_start
        parts.append(nan(start - cursor))  # unwritten
        cursor = start + n
        if n:
            o = _one(q[start:cursor], k[kv_start:kv_start + m], v[kv_start:kv_start + m], causal, window_size, softmax_scale,
                     alibi_slopes)
            spill = v[kv_start + m : tile_end(kv_start, m, v.shape[0])].double()
            parts.append(o + 0 * spill.sum())
    parts.append(nan(q.shape[0] - cursor))
    return torch.cat(parts).to(q.dtype)


def install(monkeypatch, module_name: str, dense_signature: Callable, varlen_signature: Callable) -> SimpleNamespace:
    """Put the two functions into a stand-in module ``module_name``; returns them as ``.dense``
    and ``.varlen`` (each with its ``.calls``)."""
    lib = SimpleNamespace(dense=Library(dense_signature, dense), varlen=Library(varlen_signature, varlen))
    module = stand_in_module(monkeypatch, module_name)
    monkeypatch.setattr(module, "flash_attn_func", lib.dense, raising=False)
    monkeypatch.setattr(module, "flash_attn_varlen_func", lib.varlen, raising=False)
    return lib
