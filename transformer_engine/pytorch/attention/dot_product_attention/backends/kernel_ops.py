"""The registered custom ops and the one dispatcher every caller goes through.

Each GPU kernel is a plain function registered as ``te_attn::<name>`` with a shape-only fake,
so ``torch.compile`` traces it and CUDA graphs capture it; the libraries are imported inside
the op bodies. The backend files register their ops here (:func:`register`); callers write
``kernel_ops.ops.<name>(...)``, looked up at call time, so tests can substitute ``ops``. One
exception: FA4's eager calls of a problem the module made pass the library keyword dicts built
once per problem (``fa4._statics``) by the same builders the op bodies use.

Conventions shared by every op: q/k/v/out are [T, H, D] (varlen, with ``cu_seqlens`` giving
physical offsets and optional ``seqused`` the valid lengths) or [B, S, H, D] (dense,
``cu_seqlens`` None); windows are (left, right) with -1 unbounded; ``bottom_right`` aligns the
diagonal to the last key.
"""

from __future__ import annotations

from typing import Callable, Dict, Sequence

import torch

from . import gap_rows
from ..environment import compiling

LIB = "te_attn"
_OPS: Dict[str, object] = {}  # name -> registered op (what torch.compile traces)
_EAGER: Dict[str, Callable] = {  # name -> the plain function (what eager mode calls)
    "zero_gap_rows": gap_rows.zero_gap_rows,
    "zero_gap_rows_qkv": gap_rows.zero_gap_rows_qkv,
}


def register(name: str, fn: Callable, mutates_args: Sequence[str], fake: Callable) -> object:
    """Register ``fn`` as ``te_attn::<name>`` with its shape-only ``fake``; returns the op."""
    op = torch.library.custom_op(f"{LIB}::{name}", fn, mutates_args=tuple(mutates_args))
    op.register_fake(fake)
    _OPS[name] = op
    _EAGER[name] = fn
    return op


class KernelOps:
    """``ops.<name>(...)``: the registered op while torch.compile traces, the plain function in
    eager mode. Both run the same body; the dispatcher's Python layers around a custom op cost
    about 25 us per call (measured on a CPU core), and a training step makes several calls."""

    def __getattr__(self, name: str):
        if compiling():
            return getattr(torch.ops.te_attn, name)
        return _EAGER[name]


ops = KernelOps()
