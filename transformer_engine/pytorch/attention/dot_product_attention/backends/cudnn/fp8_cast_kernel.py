"""The Triton kernel behind :func:`.fp8_cast.cast_fp8`: one pass over a dense tensor that records
its amax and writes its scaled, saturated FP8 cast (see that module for the semantics).

Imported on first use, as ``gap_rows_kernel``: Triton reads ``TRITON_INTERPRET`` only then. The
interpreter rounds some values to the wrong FP8 neighbour at binade edges (numpy emulates the
cast), so the CPU tests check this kernel's indexing and amax, and the GPU test its bits.
"""

import triton
import triton.language as tl


@triton.jit
def cast_fp8(x_ptr, out_ptr, scale_ptr, amax_ptr, valid_ptr, n, row_elems, FP8_MAX: tl.constexpr, HAS_VALID: tl.constexpr,
             BLOCK: tl.constexpr):
    """Programs stride over the flat elements; each keeps a running max of |x| and adds it to
    ``amax_ptr`` with one atomic max at the end (amaxes are >= 0, so a float max is exact).
    ``valid_ptr`` ([rows] uint8, with HAS_VALID): rows of ``row_elems`` elements that count;
    the others neither set the amax nor keep their values (they are written as 0)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    scale = tl.load(scale_ptr)
    running = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(pid * BLOCK, n, step):
        offs = tl.arange(0, BLOCK).to(tl.int64) + start
        in_range = offs < n
        x = tl.load(x_ptr + offs, mask=in_range, other=0.0).to(tl.float32)
        if HAS_VALID:
            keep = tl.load(valid_ptr + offs // row_elems, mask=in_range, other=0) != 0
            x = tl.where(keep, x, 0.0)
        running = tl.maximum(running, tl.abs(x))
        y = tl.minimum(tl.maximum(x * scale, -FP8_MAX), FP8_MAX)
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=in_range)
    tl.atomic_max(amax_ptr, tl.max(running, axis=0))


@triton.jit
def dequantize(x_ptr, out_ptr, descale_ptr, n, BLOCK: tl.constexpr):
    """``out = float32(x) * descale`` in ``out``'s dtype, over ``n`` flat elements: one read of
    the FP8 tensor and one write of the result (PyTorch's three kernels write and re-read a
    float32 copy, about six times the bytes)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n
    x = tl.load(x_ptr + offs, mask=in_range, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x * tl.load(descale_ptr)).to(out_ptr.dtype.element_ty), mask=in_range)
