"""cuDNN 9 SDPA through nvidia-cudnn-frontend, one module per job:

- :mod:`.declaration`: :class:`FusedAttention`, the support declaration and its rules (cuDNN's
  limits, version floors, the configurations probed wrong on the H200);
- :mod:`.kernel`: :class:`_CudnnKernel`, the kernel interface (``..kernel_problem``) on the
  cuDNN ops, the one place their arguments are built;
- :mod:`.ops`: the registered ops ``cudnn_fwd``, ``cudnn_fwd_max``, ``cudnn_bwd`` and their fakes;
- :mod:`.graphs`: the cudnn-frontend graphs, their cache and their execution.

Arrows run down that list: the declaration runs the kernel, the kernel calls the ops, the ops
build and run the graphs.
"""

from .declaration import FusedAttention
from .kernel import _CudnnKernel

__all__ = ["FusedAttention", "_CudnnKernel"]
