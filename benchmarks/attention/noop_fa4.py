"""A stand-in for flash-attn-4's interface module (``flash_attn.cute.interface``) that runs no
kernel, for the host-time profiles on a CPU (``profile_stages.py --cpu-noop``,
``profile_mixed_host.py``): ``_flash_attn_fwd`` / ``_flash_attn_bwd`` allocate what FA4 4.0.0b36
allocates where the caller hands no buffer (the output; the LSE where ``return_lse`` or an input
requires grad; dQ/dK/dV) and return what FA4 returns, so a profile charges those allocations to
the library, as on the GPU."""

from __future__ import annotations

import types
from typing import Callable, Optional

import torch


def _fwd(**kw):
    q, v = kw["q"], kw["v"]
    out, lse = kw.get("out"), kw.get("lse")
    if out is None:
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    grads = any(t is not None and t.requires_grad for t in (q, kw["k"], v, kw.get("learnable_sink")))
    if lse is None and (kw.get("return_lse") or grads):
        shape = (q.shape[-2], q.shape[0]) if kw.get("cu_seqlens_q") is not None else (q.shape[0], q.shape[2], q.shape[1])
        lse = torch.empty(shape, dtype=torch.float32, device=q.device)
    return out, lse, None, None, None


def _bwd(**kw):
    grads = tuple(kw[g] if kw.get(g) is not None else torch.empty_like(kw[t]) for g, t in (("dq", "q"), ("dk", "k"), ("dv", "v")))
    sink = kw.get("learnable_sink")
    return grads if sink is None else grads + (torch.zeros_like(sink, dtype=torch.float32),)  # dsink fourth, as FA4


def interface(on_call: Optional[Callable[[str], None]] = None) -> types.ModuleType:
    """The stand-in module; ``on_call("fa4_fwd" | "fa4_bwd")`` is told of each call."""
    module = types.ModuleType("flash_attn.cute.interface")
    for name, fn, tag in (("_flash_attn_fwd", _fwd, "fa4_fwd"), ("_flash_attn_bwd", _bwd, "fa4_bwd")):
        setattr(module, name, fn if on_call is None else _told(on_call, tag, fn))
    return module


def _told(on_call: Callable[[str], None], tag: str, fn: Callable) -> Callable:
    def call(**kw):
        on_call(tag)
        return fn(**kw)
    return call
