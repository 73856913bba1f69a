"""flash-attn-4 over a KV cache (TE's ``inference_params``): the translation of a KV call into
``_flash_attn_fwd``'s arguments and its registered op, ``te_attn::fa4_kv_fwd``.

The step's queries are packed rows (``cu_seqlens_q``: the step's padded offsets, ``seqused_q``:
its step lengths); the cache goes in as it is stored, without a copy: the non-paged cache as its
[B, S, Hkv, D] tensors, the paged one as its pools [P, page_size, Hkv, D] with ``page_table``
[B, S // page_size] int32; either way ``cu_seqlens_k`` is None and ``seqused_k`` holds the cached
lengths (tested on the H200 with flash-attn-4 4.0.0b36 against the float64 oracle:
test_gpu_kv_cache.py, decode steps and prefill chunks, pages of 16, 48 and 128 tokens,
bottom-right causal). Like cuDNN's paged graph, it reads a page's slots past a sequence's length
(at weight 0): a NaN left there by an earlier request that held the page makes this sequence's
output NaN (measured on the H200, benchmarks/results/gpu_suite_*.log, section 0a2d061). The
caches start zeroed and hold only appended K/V, so only a request whose K/V were NaN can do it.
FA4 leaves the rows it does not run unwritten; those (padding rows of a bshd/sbhd step, the tail
of a thd one) are zeroed afterwards. A causal bshd/sbhd decode step (one query row per batch
entry) needs no zeroing launch: FA4 runs every entry's row (``seqused_q`` None), and an entry
past the batch, whose cached length is 0, comes out as zeros (an entry with queries and no keys
is written 0 by flash-attn-4 4.0.0b36 on the H200: benchmarks/attention/probe_kv_zeroing.py).
That is the launch a captured decode step, where the batch changes between replays, would
otherwise pay every step. Forward only: selection keeps gradients away.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

import torch

from ..prepare.inputs import AttentionInputs
from . import kernel_ops
from .flash_common import mask_args
from .kv_rows import kv_output_rows, zero_unowned_rows

_INTERFACE = "flash_attn.cute.interface"


def fa4_kv_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    page_table: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    seqused_q: Optional[torch.Tensor],
    seqused_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
) -> None:
    """Writes ``out`` [T, H, Dv] in the valid query rows. ``k``/``v``: [B, S, Hkv, D] (no
    ``page_table``) or page pools [P, page_size, Hkv, D]. FA4's private forward, by keyword
    (its public varlen function runs its own autograd and takes no output buffer)."""
    kwargs = {
        "q": q, "k": k, "v": v, "out": out, "lse": None, "return_lse": False,
        "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": None, "seqused_q": seqused_q, "seqused_k": seqused_k,
        "max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k, "softmax_scale": softmax_scale, "causal": causal,
        "window_size_left": None if window_left < 0 else window_left,
        "window_size_right": None if window_right < 0 else window_right,
    }
    if page_table is not None:
        kwargs["page_table"] = page_table
    # Found in sys.modules after the first call: an import statement costs ~1 us on the host.
    (sys.modules.get(_INTERFACE) or importlib.import_module(_INTERFACE))._flash_attn_fwd(**kwargs)


def _fa4_kv_fwd_fake(q, k, v, out, *args) -> None:
    return None


kernel_ops.register("fa4_kv_fwd", fa4_kv_fwd, ("out",), _fa4_kv_fwd_fake)


def run_fa4_kv_cache(inp: AttentionInputs) -> torch.Tensor:
    """The KV call's output rows [rows, H, Dv] (rows no sequence owns 0)."""
    step, q = inp.kv_cache, inp.q
    out = kv_output_rows(inp)
    mask = mask_args(inp.mask)
    every_row = decode_writes_every_row(step, mask)
    kernel_ops.ops.fa4_kv_fwd(q, step.k_cache, step.v_cache, out, step.page_table, step.cu_seqlens_q_padded,
                              None if every_row else step.seqlens_q, step.seqlens_kv, step.max_seqlen_q, step.max_seqlen_kv,
                              inp.softmax_scale, *mask)
    if not every_row:
        zero_unowned_rows(out, inp)
    return out


def decode_writes_every_row(step, mask) -> bool:
    """Whether FA4, run on every batch entry's rows, writes each query row of the step: one row
    per entry (bshd/sbhd, Sq = 1: an entry in the batch has exactly one token, as ``pre_step``
    takes step lengths >= 1; an entry past it has no keys, and its row comes out 0) under the
    causal mask of a decode (the case probed)."""
    return step.qkv_format != "thd" and step.max_seqlen_q == 1 and mask == (True, -1, -1)
