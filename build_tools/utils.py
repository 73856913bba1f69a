"""What setup.py needs: the version (read as text, no import of the package) and extras."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def read_version() -> str:
    """The distribution's own version (``te-attention``), not the TE API level in ``__version__``."""
    text = (ROOT / "transformer_engine" / "version.py").read_text()
    match = re.search(r'DISTRIBUTION_VERSION\s*=\s*"([^"]+)"', text)
    if match is None:
        raise RuntimeError("transformer_engine/version.py has no DISTRIBUTION_VERSION string")
    return match.group(1)


# The GPU libraries are optional: the package imports them lazily, where a backend is
# checked or used, so a CPU-only install needs none of them.
OPTIONAL_DEPENDENCIES = {
    # The versions the code is written and tested against. cudnn-frontend: 1.13 added
    # sdpa(generate_stats=...); the GPU suite ran on 1.32. flash-attn-4: the private
    # _flash_attn_fwd/_flash_attn_bwd keywords are those of 4.0.0b36 (a beta: no range is safe).
    # flash-attn 2: 2.4.1 added `deterministic` (window_size 2.3, alibi_slopes 2.4).
    "cudnn": ["nvidia-cudnn-frontend>=1.13,<1.33"],
    "fa4": ["flash-attn-4==4.0.0b36"],
    "fa2": ["flash-attn>=2.4.1,<3"],
    # triton (+ numpy, which its CPU interpreter needs): the gap-row kernel is tested without a GPU
    # megatron-core: the drop-in tests run its TEDotProductAttention and a small GPT on CPU; its
    # own requirements are torch, numpy and packaging only (no second torch is pulled).
    "test": ["pytest>=7", "hypothesis>=6", "triton>=3.2", "numpy", "packaging", "megatron-core>=0.16,<0.17"],
    "bench": ["matplotlib>=3.7"],
}
