"""The Triton kernel behind :func:`.state.delayed_update` on CUDA: the whole update of one
direction's history and scales in one launch (the PyTorch formulation takes about twenty small
kernels, which in a short FP8 step cost more GPU time than the update's arithmetic).

Imported on first use, as the other kernels here (Triton reads ``TRITON_INTERPRET`` then). One
program; lane n owns slot n: it reads its column of the history and its reduced amax, then
writes the rolled column and the new scale, so reading and writing one column never race.
Bit-identical to the PyTorch formulation: maxima are exact, NaN entries of the window are read
as 0 as ``torch.where(isnan)`` makes them, and the scale is a correctly rounded division.
"""

import triton
import triton.language as tl


@triton.jit
def delayed_update(history_ptr, reduced_ptr, scale_ptr, n_slots, history_len, scaled_max, fp32_max,
                   WINDOW_MAX: tl.constexpr, BLOCK: tl.constexpr):
    """``history`` [L, N] row-major, ``reduced`` and ``scale`` [N] (float32). WINDOW_MAX: the
    recipe's "max" (over the window the new amax completes); else "most_recent"."""
    n = tl.arange(0, BLOCK)
    ok = n < n_slots
    reduced = tl.load(reduced_ptr + n, mask=ok, other=0.0)
    row0 = tl.load(history_ptr + n, mask=ok, other=0.0)
    last = tl.where(reduced != 0.0, reduced, row0)
    ran = last != 0.0  # NaN != 0: a NaN amax counts as a step that ran, as in PyTorch
    window = tl.where(last != last, 0.0, last)
    for i in range(1, history_len):
        h = tl.load(history_ptr + i * n_slots + n, mask=ok, other=0.0)
        window = tl.maximum(window, tl.where(h != h, 0.0, h))
        tl.store(history_ptr + (i - 1) * n_slots + n, h, mask=ok & ran)
    tl.store(history_ptr + (history_len - 1) * n_slots + n, last, mask=ok & ran)
    tl.store(history_ptr + n, tl.zeros((BLOCK,), dtype=tl.float32), mask=ok & ran)  # row 0 cleared last
    amax = window if WINDOW_MAX else last
    amax = tl.where(ran, amax, 0.0)
    old = tl.load(scale_ptr + n, mask=ok, other=1.0)
    good = (amax > 0.0) & (amax < float("inf"))  # finite and positive (NaN fails both)
    new = tl.where(good, tl.math.div_rn(tl.zeros((BLOCK,), dtype=tl.float32) + scaled_max, tl.where(good, amax, 1.0)), old)
    new = tl.where((new == float("inf")) | (new == -float("inf")), fp32_max, new)
    tl.store(scale_ptr + n, new, mask=ok)
