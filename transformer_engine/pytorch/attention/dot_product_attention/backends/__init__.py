"""The backends, one file per library, and their preference order (:data:`BACKENDS`).

Shape legend: T = packed tokens, B = batch, S = length, H = query heads, HG = key/value heads,
D = head dim. A backend's ``run`` takes the prepared, immutable :class:`AttentionInputs` and
returns [B, S, H, Dv] or [T, H, Dv] (with ``return_max_logit``, the backends that declare it
return (output, max logit [H])).

- :mod:`.fa4`, :mod:`.fa3`, :mod:`.fa2`, :mod:`.cudnn`, :mod:`.unfused`: each library's support
  declaration, the translation of a call into its arguments, and its registered ops;
- :mod:`.varlen`: THD routing (plans, row owners, combining rows, the NaN gap guard);
- :mod:`.kernel_autograd`: the autograd around the kernels that write into caller buffers;
- :mod:`.kernel_ops`: the custom-op registry and the eager/compile dispatcher ``ops``;
- :mod:`.flash_common`: what the FlashAttention versions share.
"""

from __future__ import annotations

from typing import Tuple

from .cudnn import FusedAttention
from .fa2 import FlashAttentionV2
from .fa3 import FlashAttentionV3
from .fa4 import FlashAttentionV4
from .flash_common import FlashAttention
from .unfused import UnfusedDotProductAttention

# Preference order, fastest first on the measured H200 (benchmarks/results): FA4/FA3, then
# cuDNN, then flash-attn 2, then the unfused reference.
BACKENDS: Tuple[type, ...] = (FlashAttentionV4, FlashAttentionV3, FusedAttention, FlashAttentionV2, UnfusedDotProductAttention)


def backend_label(cls: type) -> str:
    return cls.label() if issubclass(cls, FlashAttention) else cls.NAME

