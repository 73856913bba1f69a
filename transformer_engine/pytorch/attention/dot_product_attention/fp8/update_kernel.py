"""The Triton kernel behind :func:`.state.delayed_update` on CUDA: the whole update of one
direction's history and scales in one launch (the PyTorch formulation takes about twenty small
kernels, which in a short FP8 step cost more GPU time than the update's arithmetic).

Imported on first use, as the other kernels here (Triton reads ``TRITON_INTERPRET`` then). One
program (the update shifts the history in place: several programs would race on its rows),
which reads the history in tiles and synchronizes its threads between reading a tile and
overwriting it.
Bit-identical to the PyTorch formulation: maxima are exact, NaN entries of the window are read
as 0 as ``torch.where(isnan)`` makes them, and the scale is a correctly rounded division.
"""

import triton
import triton.language as tl


@triton.jit
def delayed_update(history_ptr, reduced_ptr, scale_ptr, n_slots, history_len, scaled_max, fp32_max,
                   WINDOW_MAX: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr):
    """``history`` [L, N] row-major, ``reduced`` and ``scale`` [N] (float32). WINDOW_MAX: the
    recipe's "max" (over the window the new amax completes); else "most_recent". The history
    is read and shifted up one row in tiles of BLOCK_L rows (TE's default L is 1024)."""
    n = tl.arange(0, BLOCK_N)
    ok = n < n_slots
    reduced = tl.load(reduced_ptr + n, mask=ok, other=0.0)
    row0 = tl.load(history_ptr + n, mask=ok, other=0.0)
    last = tl.where(reduced != 0.0, reduced, row0)
    ran = last != 0.0  # NaN != 0: a NaN amax counts as a step that ran, as in PyTorch
    window = tl.where(last != last, 0.0, last)
    rows = tl.arange(0, BLOCK_L)
    for start in range(1, history_len, BLOCK_L):
        r = start + rows
        tile = (r < history_len)[:, None] & ok[None, :]
        h = tl.load(history_ptr + r[:, None] * n_slots + n[None, :], mask=tile, other=0.0)
        window = tl.maximum(window, tl.max(tl.where(h != h, 0.0, h), axis=0))
        tl.debug_barrier()  # the tile's rows are read by every thread before any is overwritten
        tl.store(history_ptr + (r[:, None] - 1) * n_slots + n[None, :], h, mask=tile & ran[None, :])
    tl.debug_barrier()  # row 0 was written by the first tile's threads: clear it after them
    tl.store(history_ptr + (history_len - 1) * n_slots + n, last, mask=ok & ran)
    tl.debug_barrier()  # (L = 1: row L-1 is row 0)
    tl.store(history_ptr + n, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=ok & ran)
    amax = window if WINDOW_MAX else last
    amax = tl.where(ran, amax, 0.0)
    old = tl.load(scale_ptr + n, mask=ok, other=1.0)
    good = (amax > 0.0) & (amax < float("inf"))  # finite and positive (NaN fails both)
    new = tl.where(good, tl.math.div_rn(tl.zeros((BLOCK_N,), dtype=tl.float32) + scaled_max, tl.where(good, amax, 1.0)), old)
    new = tl.where((new == float("inf")) | (new == -float("inf")), fp32_max, new)
    tl.store(scale_ptr + n, new, mask=ok)
