"""Which span kernel (:mod:`.spans`) context parallelism runs for a selected backend. Each
backend's file holds its own implementation beside its module adapter and ops."""

from __future__ import annotations

from .backends.cudnn import CudnnSpanKernel
from .backends.fa4 import FA4SpanKernel
from .backends.unfused import UnfusedSpanKernel

KERNELS = {
    "UnfusedDotProductAttention": UnfusedSpanKernel,
    "FlashAttention v4": FA4SpanKernel,
    "FusedAttention": CudnnSpanKernel,
}
