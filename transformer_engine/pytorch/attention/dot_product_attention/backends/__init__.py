"""The backends, one file per library, and their preference order (:data:`BACKENDS`).

Shape legend: T = packed tokens, B = batch, S = length, H = query heads, HG = key/value heads,
D = head dim. A backend's ``run`` takes :class:`AttentionInputs` and returns [B, S, H, Dv] or
[T, H, Dv].

- :mod:`.fa4`, :mod:`.fa3`, :mod:`.fa2`, :mod:`.cudnn`, :mod:`.unfused`: each library's support
  declaration, the translation of a call into its arguments, and its registered ops;
- :mod:`.varlen`: THD routing (plans, row owners, combining rows, the NaN gap guard);
- :mod:`.kernel_autograd`: the autograd around the kernels that write into caller buffers;
- :mod:`.kernel_ops`: the custom-op registry and the eager/compile dispatcher ``ops``;
- :mod:`.flash_common`: what the FlashAttention versions share.

The names the single-file ``backends.py`` had are re-exported here.
"""

from __future__ import annotations

from typing import Tuple

from .._reexport import forward_assignments
from ..support import bias_thd_reasons
from . import kernel_ops
from .cudnn import FusedAttention, _CudnnKernel, _cudnn_feature_reasons, _dense_lengths
from .fa2 import FlashAttentionV2, _fa2_alibi
from .fa3 import FlashAttentionV3, _fa3_varlen_call
from .fa4 import FlashAttentionV4, _FA4Kernel
from .flash_common import FlashAttention, fa_mask_args, first_output
from .kernel_autograd import KernelCall, ScoreFeatures, _calls, _draw_rng, _kernel_bias, _KernelAttention, run_kernel
from .kernel_ops import KernelOps, ops
from .unfused import UnfusedDotProductAttention
from .varlen import (
    _SANITIZE_GAPS,
    VarlenCall,
    VarlenPlan,
    _gap_guard,
    _MaskRowGrad,
    _owners,
    _row_owner,
    _valid_lengths,
    _zero_spill_rows,
    _zero_spill_rows_in_place,
    combine_rows,
    guard_library_inputs,
    plan_varlen,
    run_library_varlen,
)

# Preference order, fastest first on the measured H200 (benchmarks/results): FA4/FA3, then
# cuDNN, then flash-attn 2, then the unfused reference.
BACKENDS: Tuple[type, ...] = (FlashAttentionV4, FlashAttentionV3, FusedAttention, FlashAttentionV2, UnfusedDotProductAttention)


def backend_label(cls: type) -> str:
    return cls.label() if issubclass(cls, FlashAttention) else cls.NAME


# The single-file module's private names, for code and tests written against it.
_run_kernel, _first, _run_library_varlen = run_kernel, first_output, run_library_varlen
_guard_library_inputs, _bias_thd_reasons = guard_library_inputs, bias_thd_reasons
# ``backends.ops = fake`` (tests substituting the kernels) reaches the adapters.
forward_assignments(__name__, {"ops": kernel_ops})
