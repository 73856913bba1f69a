"""Which span kernel (:mod:`.spans`) context parallelism runs for a selected backend: the
unfused reference's own, or :class:`.spans.SpanAdapter` over a backend's kernel interface
(each defined in its backend's file)."""

from __future__ import annotations

from .backends.cudnn import CudnnSpanKernel
from .backends.fa4 import FA4SpanKernel
from .backends.unfused import UnfusedSpanKernel

KERNELS = {
    "UnfusedDotProductAttention": UnfusedSpanKernel,
    "FlashAttention v4": FA4SpanKernel,
    "FusedAttention": CudnnSpanKernel,
}
