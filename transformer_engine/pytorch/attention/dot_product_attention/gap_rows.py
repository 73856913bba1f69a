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

import torch

# The largest tile FA4 loads along the sequence (its m/n blocks are at most 256 rows on sm90
# and sm100, 2-CTA tiles included), so no kernel reads further past a sequence end.
FA4_MAX_TILE_ROWS = 256
_BLOCK_ROWS = 16
_MAX_PROGRAMS = 4096


def unowned_rows(cu_seqlens: torch.Tensor, offsets: torch.Tensor, total: int, max_rows: int = -1) -> torch.Tensor:
    """[T] bool: the rows ``zero_gap_rows`` writes (sync-free; used on the CPU and in tests)."""
    rows = torch.arange(total, device=offsets.device, dtype=torch.int64)
    off = offsets.long()
    ends = off[:-1] + (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    # Segment s >= 1 starts at sequence s-1's end; segment 0 is the rows before the first slot.
    seg_start = torch.cat([ends.new_zeros(1), ends])
    seg_stop = torch.cat([off[:1], off[1:-1], off.new_full((1,), total)]) if off.numel() > 1 else off.new_full((1,), total)
    if max_rows >= 0:
        seg_stop = torch.minimum(seg_stop, seg_start + max_rows)
    # A row belongs to the last segment that starts at or before it.
    seg = torch.searchsorted(seg_start, rows, right=True) - 1
    return (seg >= 0) & (rows < seg_stop[seg.clamp_min(0)])


@functools.lru_cache(maxsize=None)
def _kernel():
    """The Triton kernel, built on first use (Triton reads ``TRITON_INTERPRET`` when it is built)."""
    import triton
    import triton.language as tl

    @triton.jit
    def zero_rows(x_ptr, cu_ptr, off_ptr, n_seqs, n_rows, max_rows, stride_t, stride_h, stride_d,
                  D: tl.constexpr, HD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        seg = tl.program_id(0)
        part = tl.program_id(1)
        n_parts = tl.num_programs(1)
        b = seg - 1
        has_seq = seg > 0
        # Segment 0: [0, offsets[0]). Segment b+1: [offsets[b] + len_b, offsets[b+1]), or up to
        # n_rows for the last sequence (its gap and the tail are one run of rows).
        seq_off = tl.load(off_ptr + b, mask=has_seq, other=0)
        seq_len = tl.load(cu_ptr + b + 1, mask=has_seq, other=0) - tl.load(cu_ptr + b, mask=has_seq, other=0)
        start = seq_off + seq_len
        next_off = tl.load(off_ptr + seg)
        stop = tl.where(seg == n_seqs, n_rows, next_off)
        stop = tl.where(max_rows >= 0, tl.minimum(stop, start + max_rows), stop)
        stop = tl.minimum(stop, n_rows)
        cols = tl.arange(0, BLOCK_C)
        for r0 in range(start + part * BLOCK_R, stop, n_parts * BLOCK_R):
            rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
            row_ok = rows < stop
            for c0 in range(0, HD, BLOCK_C):
                c = c0 + cols
                col_off = (c // D) * stride_h + (c % D) * stride_d
                ptrs = x_ptr + rows[:, None] * stride_t + col_off[None, :]
                tl.store(ptrs, tl.zeros((BLOCK_R, BLOCK_C), dtype=x_ptr.dtype.element_ty),
                         mask=row_ok[:, None] & (c < HD)[None, :])

    return zero_rows


def launch_triton(x: torch.Tensor, cu_seqlens: torch.Tensor, offsets: torch.Tensor, max_rows: int) -> None:
    """Run the Triton kernel on ``x`` ([T, H, D], any strides); CUDA, or the CPU under
    ``TRITON_INTERPRET=1`` (how the tests check it without a GPU)."""
    import triton

    t, h, d = x.shape
    n_seqs = offsets.numel() - 1
    if t == 0:
        return
    segments = n_seqs + 1
    rows_per_segment = t if max_rows < 0 else min(t, max_rows)
    n_parts = max(1, min(triton.cdiv(rows_per_segment, _BLOCK_ROWS), _MAX_PROGRAMS // segments))
    _kernel()[(segments, n_parts)](
        x, cu_seqlens, offsets, n_seqs, t, max_rows, *x.stride(),
        D=d, HD=h * d, BLOCK_R=_BLOCK_ROWS, BLOCK_C=min(triton.next_power_of_2(h * d), 1024),
    )


def zero_gap_rows(x: torch.Tensor, cu_seqlens: torch.Tensor, offsets: torch.Tensor, max_rows: int) -> None:
    """Set the unowned rows of ``x`` to 0 (see the module docstring)."""
    if x.device.type == "cuda":
        launch_triton(x, cu_seqlens, offsets, max_rows)
    else:
        x.masked_fill_(unowned_rows(cu_seqlens, offsets, x.shape[0], max_rows).view(-1, 1, 1), 0)


zero_gap_rows_op = torch.library.custom_op("te_attn::zero_gap_rows", zero_gap_rows, mutates_args=("x",))


@zero_gap_rows_op.register_fake
def _(x, cu_seqlens, offsets, max_rows) -> None:
    return None
