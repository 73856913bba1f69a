"""One stand-in per attention library, shared by every CPU test that fakes a library.

Each is bound to the library's real interface (the call signatures, keyword names and tensor
layouts of the versions the package targets: flash-attn-4 4.0.0b36's ``_flash_attn_fwd`` /
``_flash_attn_bwd``, FA3's and flash-attn 2's public functions, the cuDNN graphs that
``backends/cudnn/graphs.py`` builds and runs) and computes in float64 with that library's
documented semantics, so the package's real backend code runs around it:

- :mod:`.fa4` installs ``flash_attn.cute.interface``: keyword-only calls, output and gradient
  buffers written only in the rows it runs, whole tiles of K/V read past each sequence end
  (0 * NaN = NaN, so a gap's NaN leaks unless the package's guard zeroes it), an LSE by row, a
  backward from the LSE it is handed, ``learnable_sink`` and its gradient.
- :mod:`.fa3` / :mod:`.fa2` install ``flash_attn_interface`` / ``flash_attn``: their own
  autograd, rows a varlen call skips left as NaN, FA3's ``seqused_q/k`` and whole-tile reads.
- :mod:`.cudnn` replaces the graph building and execution of ``graphs.py`` (the real ops code
  and the real mask-band translation run): ragged element offsets, per-sequence lengths,
  stats or the row max and sum of exponents, bias, ALiBi, sinks; it leaves a query row that
  sees no key unwritten, as cuDNN does.
  Its FP8 nodes (``sdpa_fp8`` / ``sdpa_fp8_backward``, executed by :mod:`.cudnn_fp8_nodes`) run
  the package's FP8 ops and graphs (``fp8_ops.py``, ``fp8_graphs.py``): scalars read by uid,
  amaxes written by uid, the quantizations where the H200 puts them, and the rows past a dense
  sequence's length written, as the H200's FP8 forward does.

Every stand-in records its calls. The fixtures in ``conftest.py`` (``fa4_lib``, ``fa3_lib``,
``fa2_lib``, ``cudnn_lib``) install one for a test; FA4's and cuDNN's also turn on torch's
deterministic mode, in which every uninitialized buffer is NaN-filled, so a row the package
hands a kernel unwritten and never zeroes shows as NaN.
"""

from __future__ import annotations

import sys
import types


def stand_in_module(monkeypatch, name: str) -> types.ModuleType:
    """sys.modules[name] as a stand-in module (the one made earlier in this test, if any)."""
    module = sys.modules.get(name)
    if not getattr(module, "__stand_in__", False):
        module = types.ModuleType(name)
        module.__stand_in__ = True
        monkeypatch.setitem(sys.modules, name, module)
    return module
