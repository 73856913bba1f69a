"""The FP8 casts around cuDNN's FP8 SDPA: Q/K/V and dO into FP8 before the kernels, O and
dQ/dK/dV back to the inputs' dtype after them.

For one tensor ``x`` and its delayed-scaling quantizer ``q`` (:class:`...fp8.quantize.Quantizer`,
whose scale is known before the cast), :func:`cast_fp8` is, with no host sync::

    q.amax_buffer[q.slot] = max(q.amax_buffer[q.slot], max |x|)      # over valid rows (THD)
    x8 = cast(clamp(float32(x) * q.scale, -fp8_max, fp8_max), q.dtype)

the same numbers :func:`...fp8.quantize.fake_quantize` rounds to before it dequantizes, so
cuDNN reads the bytes the CPU emulation computes with. On CUDA one Triton kernel does both
(:mod:`.fp8_cast_kernel`) for a dense tensor; elsewhere (the CPU, strided views with holes)
plain PyTorch does. The FP8 tensor keeps ``x``'s strides, so a declared packed buffer
(``qkv_layer``) is cast ONCE and q/k/v are views of its FP8 copy (:func:`view_like`).
:func:`dequantize` is ``float32(x8) * descale`` in the target dtype, as the emulation's (one
Triton kernel on CUDA in place of PyTorch's three passes over a float32 copy: with it and the
one-launch scale update an 8k-token GQA 64:8 FP8 forward replays in 1.37 ms on the H200,
benchmarks/results/bench_fp8_af46c41.md; 1.77 ms before, bench_fp8_gqa64x8_f1c4030.md in git
history at 3671ecf).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...fp8.quantize import scaled_cast
from ...fp8.state import triton_available

BLOCK = 2048
MAX_PROGRAMS = 1024  # programs stride over the rest: at most this many atomics on one amax
DEQUANT_BLOCK = 4096


def fp8_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``dtype`` tensor (FP8, or the dequantized copy's) with ``t``'s shape AND strides (a
    dense permuted layout stays dense)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=t.device)


def view_like(buf: torch.Tensor, base: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The view of ``buf`` (made by :func:`fp8_like` from ``base``) that ``t`` is of ``base``:
    same shape, strides and element offset. Zero-copy: a view of a packed FP8 buffer."""
    return buf.as_strided(t.shape, t.stride(), buf.storage_offset() + t.storage_offset() - base.storage_offset())


def dequantize(x8: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``float32(x8) * descale`` cast to ``dtype`` (``descale`` a 0-d float32 tensor), with
    ``x8``'s strides; one Triton launch for a dense CUDA tensor (the same bits)."""
    if not (x8.is_cuda and x8.numel() and _flat_dense(x8) and triton_available()):
        return (x8.float() * descale).to(dtype)
    from .fp8_cast_kernel import dequantize as kernel

    out = fp8_like(x8, dtype)
    n = x8.numel()
    kernel[(-(-n // DEQUANT_BLOCK),)](_flat(x8), _flat(out), descale, n, BLOCK=DEQUANT_BLOCK)
    return out


def cast_fp8(x: torch.Tensor, q, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` in ``q.dtype`` (see the module docstring), a new tensor with ``x``'s strides.
    ``valid`` ([x.shape[0]] bool): the rows that count (a THD tensor's owned rows); the others
    set no amax and are written as 0."""
    out = fp8_like(x, q.dtype)
    if x.numel() == 0:
        return out
    if _triton_fits(x, out, valid):
        _launch(x, out, q, valid)
    else:
        _cast_torch(x, out, q, valid)
    return out


def _cast_torch(x: torch.Tensor, out: torch.Tensor, q, valid: Optional[torch.Tensor]) -> None:
    xf = x.detach().float()
    if valid is not None:  # rows no sequence owns: no amax, written as 0
        xf = torch.where(valid.view(-1, *([1] * (x.dim() - 1))), xf, torch.zeros((), device=x.device))
    q.amax_buffer[q.slot] = torch.maximum(q.amax_buffer[q.slot], xf.abs().amax())  # (cast_fp8: numel > 0)
    out.copy_(scaled_cast(xf, q.scale, q.dtype, q.fp8_max))


def _flat_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive storage slots (any dim order)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _triton_fits(x: torch.Tensor, out: torch.Tensor, valid: Optional[torch.Tensor]) -> bool:
    if x.device.type != "cuda" or out.stride() != x.stride() or not _flat_dense(x) or not triton_available():
        return False
    # Valid rows are read as flat index // row_elems: dim 0 must be the outermost in memory.
    return valid is None or x.stride(0) * x.shape[0] == x.numel()


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _launch(x: torch.Tensor, out: torch.Tensor, q, valid: Optional[torch.Tensor]) -> None:
    import triton

    from .fp8_cast_kernel import cast_fp8 as kernel

    n = x.numel()
    flat_x = _flat(x)
    rows = flat_x if valid is None else valid.view(torch.uint8)  # a pointer the kernel never reads without HAS_VALID
    grid = (min(triton.cdiv(n, BLOCK), MAX_PROGRAMS),)
    kernel[grid](flat_x, _flat(out), q.scale.reshape(1), q.amax_buffer[q.slot:q.slot + 1], rows, n,
                 x.stride(0) if valid is not None else 1, FP8_MAX=q.fp8_max, HAS_VALID=valid is not None, BLOCK=BLOCK)
