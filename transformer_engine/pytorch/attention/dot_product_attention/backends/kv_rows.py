"""What the KV-cache kernels (``fa4_kv.py``, ``cudnn/kv_cache.py``) share: the output buffer of
a KV call and the zeroing of its rows no sequence owns (padding rows of a bshd/sbhd step, batch
rows past the batch, the tail of a thd step), which both libraries leave unwritten."""

from __future__ import annotations

import torch

from ..prepare.inputs import AttentionInputs
from . import kernel_ops


def kv_output_rows(inp: AttentionInputs) -> torch.Tensor:
    """An uninitialized [rows, H, Dv] output for the KV call's query rows."""
    return inp.q.new_empty(*inp.q.shape[:-1], inp.v.shape[-1])


def zero_unowned_rows(out: torch.Tensor, inp: AttentionInputs) -> None:
    """Zero ``out``'s rows no sequence owns. Skipped where the step's host facts say every row
    holds a token (a full decode batch, eager: one launch less), never while a CUDA graph is
    captured (it replays as sequences finish and the batch's rows empty)."""
    step = inp.kv_cache
    if step.rows_all_valid and not (out.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    kernel_ops.ops.zero_gap_rows(out, step.cu_seqlens_q, step.cu_seqlens_q_padded, -1)
