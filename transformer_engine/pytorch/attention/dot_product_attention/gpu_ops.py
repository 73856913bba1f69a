"""Moved: the FA4 ops live in ``backends/fa4.py``, the cuDNN graphs and ops in
``backends/cudnn.py``, the op registry and dispatcher ``ops`` in ``backends/kernel_ops.py``."""

from ._reexport import forward_assignments
from .backends import cudnn as _cudnn
from .backends import kernel_ops as _kernel_ops
from .backends.cudnn import (  # noqa: F401
    MAX_GRAPHS,
    _UID,
    _band_key,
    _band_kwargs,
    _build_bwd,
    _build_fwd,
    _cached,
    _desc,
    _dtype,
    _feature_key,
    _feature_kwargs,
    _feature_pack,
    _finish,
    _graph_lock,
    _graph_tensors,
    _graphs,
    _handle,
    _handles,
    _metadata_pack,
    _new_graph,
    _ragged,
    _ragged_rows,
    _round64,
    _run_graph,
    cudnn_bwd,
    cudnn_fwd,
    stats_shape,
)
from .backends.fa4 import _opt, fa4_bwd, fa4_fwd  # noqa: F401
from .backends.kernel_ops import _EAGER, _OPS, LIB, KernelOps, ops  # noqa: F401

# Patching an old name (``gpu_ops.MAX_GRAPHS = 2``) reaches the code that reads it.
forward_assignments(__name__, {"MAX_GRAPHS": _cudnn, "_round64": _cudnn, "ops": _kernel_ops})
