"""Zeroing the rows of a packed tensor that belong to no sequence, touching only those rows.

Shape legend: T = rows of the packed tensor, B = sequences, H = heads, D = head dim.

A packed [T, H, D] tensor holds sequence b at rows ``[offsets[b], offsets[b] + len_b)``, with
``len_b = cu_seqlens[b+1] - cu_seqlens[b]``. Rows before ``offsets[0]``, between a sequence's
end and the next slot, and from the last sequence's end to T are *unowned*. For
``a a a _ b b _ _ c c c c _`` (offsets [0, 4, 8, 12], lengths 3, 2, 4, T = 13) the unowned
rows are 3, 6, 7 and 12.

``te_attn::zero_gap_rows(x, cu_seqlens, offsets, max_rows)`` sets to 0 the first ``max_rows``
unowned rows after each sequence end (and before the first slot); ``max_rows < 0`` means all
of them. Two uses:

* outputs and gradients: the kernels leave unowned rows unwritten, so the buffers are allocated
  empty and only their unowned rows are zeroed (a memset of the whole buffer cost 7% of a
  causal FA4 forward on the H200);
* the FA4 NaN guard: FA4 loads whole tiles, so the rows just past a sequence end enter its
  products with weight 0, and 0 * NaN = NaN. Zeroing the first :data:`FA4_MAX_TILE_ROWS` rows
  after each end is enough; rows further away are never loaded.

On CUDA a Triton kernel writes the unowned rows and nothing else: one program row per segment
(the lengths stay on the device, so nothing syncs and CUDA graphs capture it), ``n_parts``
programs per segment striding over its rows. On the CPU the op uses :func:`unowned_rows`, which
is also the reference the kernel is tested against.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

# The largest tile FA4 loads along the sequence (its m/n blocks are at most 256 rows on sm90
# and sm100, 2-CTA tiles included), so no kernel reads further past a sequence end.
FA4_MAX_TILE_ROWS = 256
_BLOCK_ROWS = 16
_MAX_PROGRAMS = 4096


def unowned_rows(cu_seqlens: torch.Tensor, offsets: torch.Tensor, total: int, max_rows: int = -1) -> torch.Tensor:
    """[T] bool: the rows ``zero_gap_rows`` writes, segment by segment as its kernel walks them
    (sync-free; used on the CPU and in tests). Segment 0 is [0, offsets[0]), segment b+1 runs
    from sequence b's end (its offset plus its cu_seqlens length) to the next slot, the last one
    to T; each capped at ``max_rows`` rows and at T. A length that overruns its slot leaves its
    segment empty. Non-decreasing offsets keep the segments disjoint."""
    off = offsets.long()
    ends = off[:-1] + (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = torch.cat([off.new_zeros(1), ends]).clamp(0, total)
    stops = torch.cat([off[:-1], off.new_full((1,), total)]) if off.numel() > 1 else off.new_full((1,), total)
    if max_rows >= 0:
        stops = torch.minimum(stops, starts + max_rows)
    stops = stops.clamp(0, total)
    live = (starts < stops).long()
    # +1 where a segment starts, -1 where it stops (dead segments add 0 at row T): rows with a
    # positive running sum lie in a segment.
    delta = torch.zeros(total + 1, dtype=torch.int64, device=off.device)
    delta.index_add_(0, starts, live).index_add_(0, stops, -live)
    return delta.cumsum(0)[:total] > 0


@functools.lru_cache(maxsize=None)
def _kernels():
    """The Triton kernels, imported on first use (Triton reads ``TRITON_INTERPRET`` then)."""
    from .gap_rows_kernel import zero_rows, zero_rows_qkv

    return zero_rows, zero_rows_qkv


def launch_triton(x: torch.Tensor, cu_seqlens: torch.Tensor, offsets: torch.Tensor, max_rows: int,
                  kv: Tuple[torch.Tensor, ...] = (), cu_seqlens_kv: Optional[torch.Tensor] = None,
                  offsets_kv: Optional[torch.Tensor] = None) -> None:
    """Run the Triton kernel on ``x`` ([T, H, D], any strides) and, in the same launch, on up to
    two tensors ``kv`` laid out by ``cu_seqlens_kv``/``offsets_kv``; CUDA, or the CPU under
    ``TRITON_INTERPRET=1`` (how the tests check it without a GPU)."""
    import triton

    rows = max(x.shape[0], kv[0].shape[0] if kv else 0)
    if rows == 0:
        return
    segments = offsets.numel()  # sequences + 1
    n_parts = max(1, min(triton.cdiv(rows if max_rows < 0 else min(rows, max_rows), _BLOCK_ROWS), _MAX_PROGRAMS // segments))
    one, many = _kernels()
    if not kv:
        hd = x.shape[-2] * x.shape[-1]
        one[(segments, n_parts)](x, cu_seqlens, offsets, x.shape[0], max_rows, *x.stride(), D=x.shape[-1], HD=hd,
                                 BLOCK_R=_BLOCK_ROWS, BLOCK_C=min(triton.next_power_of_2(hd), 1024))
        return
    slots = (x, *kv, kv[0])[:3]  # with one kv tensor the third slot is never visited (grid axis 2 = 2)
    dims = [(t.shape[-1], t.shape[-2] * t.shape[-1]) for t in slots]
    many[(segments, n_parts, 1 + len(kv))](
        *slots, cu_seqlens, offsets, cu_seqlens_kv, offsets_kv, x.shape[0], kv[0].shape[0], max_rows,
        *slots[0].stride(), *slots[1].stride(), *slots[2].stride(),
        D0=dims[0][0], HD0=dims[0][1], D1=dims[1][0], HD1=dims[1][1], D2=dims[2][0], HD2=dims[2][1],
        BLOCK_R=_BLOCK_ROWS, BLOCK_C=min(triton.next_power_of_2(max(hd for _, hd in dims)), 1024),
    )


def zero_gap_rows(x: torch.Tensor, cu_seqlens: torch.Tensor, offsets: torch.Tensor, max_rows: int) -> None:
    """Set the unowned rows of ``x`` to 0 (see the module docstring)."""
    if x.device.type == "cuda":
        launch_triton(x, cu_seqlens, offsets, max_rows)
    else:
        x.masked_fill_(unowned_rows(cu_seqlens, offsets, x.shape[0], max_rows).view(-1, 1, 1), 0)


def zero_gap_rows_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      offsets_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, offsets_kv: torch.Tensor, max_rows: int) -> None:
    """``zero_gap_rows`` on q (query side) and on k and v (key/value side), in one launch on CUDA.
    Called as this plain function (eager mode), ``k`` may be ``v``; the registered op, which
    torch.compile traces, must get three distinct tensors."""
    if q.device.type == "cuda":
        launch_triton(q, cu_seqlens_q, offsets_q, max_rows, (k,) if k is v else (k, v), cu_seqlens_kv, offsets_kv)
        return
    zero_gap_rows(q, cu_seqlens_q, offsets_q, max_rows)
    for t in (k,) if k is v else (k, v):
        zero_gap_rows(t, cu_seqlens_kv, offsets_kv, max_rows)


zero_gap_rows_op = torch.library.custom_op("te_attn::zero_gap_rows", zero_gap_rows, mutates_args=("x",))


@zero_gap_rows_op.register_fake
def _(x, cu_seqlens, offsets, max_rows) -> None:
    return None


zero_gap_rows_qkv_op = torch.library.custom_op("te_attn::zero_gap_rows_qkv", zero_gap_rows_qkv, mutates_args=("q", "k", "v"))


@zero_gap_rows_qkv_op.register_fake
def _(q, k, v, cu_seqlens_q, offsets_q, cu_seqlens_kv, offsets_kv, max_rows) -> None:
    return None
