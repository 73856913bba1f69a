"""The Triton kernel behind :func:`gap_rows.zero_gap_rows` (see that module for what it writes).

Imported on first use, so Triton reads ``TRITON_INTERPRET`` (the CPU interpreter the tests use)
only then. ``zero_rows_qkv`` zeroes up to three tensors in one launch (grid axis 2), because one
Triton launch costs 20-40 us of host time on the H200's host: tensor 0 follows the query side
(``cu_a``/``off_a``, ``rows_a`` rows), tensors 1 and 2 the key/value side. One program row per
segment (grid axis 0: sequences + 1), ``n_parts`` programs per segment striding over its rows.
"""

import triton
import triton.language as tl


@triton.jit
def zero_segment(x_ptr, cu_ptr, off_ptr, n_seqs, n_rows, max_rows, stride_t, stride_h, stride_d, seg, part, n_parts,
                 D: tl.constexpr, HD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
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


@triton.jit
def zero_rows(x, cu, off, n_rows, max_rows, st, sh, sd, D: tl.constexpr, HD: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_C: tl.constexpr):
    """One tensor. Few arguments on purpose: Triton's launch cost grows with their number."""
    zero_segment(x, cu, off, tl.num_programs(0) - 1, n_rows, max_rows, st, sh, sd, tl.program_id(0), tl.program_id(1),
                 tl.num_programs(1), D, HD, BLOCK_R, BLOCK_C)


@triton.jit
def zero_rows_qkv(x0, x1, x2, cu_a, off_a, cu_b, off_b, rows_a, rows_b, max_rows, s0t, s0h, s0d, s1t, s1h, s1d, s2t, s2h, s2d,
                  D0: tl.constexpr, HD0: tl.constexpr, D1: tl.constexpr, HD1: tl.constexpr, D2: tl.constexpr,
                  HD2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Two or three tensors (grid axis 2): x0 on the query side, x1 and x2 on the key/value side."""
    seg = tl.program_id(0)
    part = tl.program_id(1)
    which = tl.program_id(2)
    n_seqs = tl.num_programs(0) - 1
    n_parts = tl.num_programs(1)
    if which == 0:
        zero_segment(x0, cu_a, off_a, n_seqs, rows_a, max_rows, s0t, s0h, s0d, seg, part, n_parts, D0, HD0, BLOCK_R, BLOCK_C)
    elif which == 1:
        zero_segment(x1, cu_b, off_b, n_seqs, rows_b, max_rows, s1t, s1h, s1d, seg, part, n_parts, D1, HD1, BLOCK_R, BLOCK_C)
    else:
        zero_segment(x2, cu_b, off_b, n_seqs, rows_b, max_rows, s2t, s2h, s2d, seg, part, n_parts, D2, HD2, BLOCK_R, BLOCK_C)
