"""What setup.py needs: the version (read as text, no import of the package) and extras."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def read_version() -> str:
    text = (ROOT / "transformer_engine" / "version.py").read_text()
    match = re.search(r'__version__\s*=\s*"([^"]+)"', text)
    if match is None:
        raise RuntimeError("transformer_engine/version.py has no __version__ string")
    return match.group(1)


# The GPU libraries are optional: the package imports them lazily, where a backend is
# checked or used, so a CPU-only install needs none of them.
OPTIONAL_DEPENDENCIES = {
    "cudnn": ["nvidia-cudnn-frontend>=1.10"],
    "fa4": ["flash-attn-4"],
    "fa2": ["flash-attn>=2.1"],
    # triton (+ numpy, which its CPU interpreter needs): the gap-row kernel is tested without a GPU
    "test": ["pytest>=7", "hypothesis>=6", "triton>=3.2", "numpy"],
    "bench": ["matplotlib>=3.7"],
}
