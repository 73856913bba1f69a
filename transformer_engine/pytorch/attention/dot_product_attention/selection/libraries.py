"""Which optional GPU libraries are installed, found (all but one fact) without importing them.

``import transformer_engine.pytorch`` must work with none of them present, so this module asks
the package metadata (and, where cudnn-frontend is installed, its cuDNN version, once); a
backend imports its library where it first runs.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Optional, Tuple

import torch


@dataclass(frozen=True)
class InstalledLibraries:
    """Versions of the attention libraries (None = not installed). Tests build fakes of this."""

    flash_attn_2: Optional[str] = None
    flash_attn_3: Optional[str] = None
    flash_attn_4: Optional[str] = None
    cudnn_frontend: Optional[str] = None
    # The cuDNN library itself (torch's, which the frontend's graphs run on), as cuDNN numbers
    # it: 91900 for 9.19.0. Some features need a minimum (attention sinks: 9.13).
    cudnn: Optional[int] = None


@dataclass(frozen=True)
class LibraryInstall:
    """What one optional library is called and how to get it: ``modules`` are the import names
    whose absence means it is not installed; ``pip`` the command(s) that install it."""

    package: str
    modules: Tuple[str, ...]
    pip: str


# Keyed by the InstalledLibraries field (a backend's LIBRARY). The extras are setup.py's.
LIBRARY_INSTALLS = {
    "flash_attn_2": LibraryInstall("flash-attn (2.x)", ("flash_attn",),
                                   'pip install -e ".[fa2]" in this repository, or pip install "flash-attn>=2.4.1,<3"'),
    "flash_attn_3": LibraryInstall("flash_attn_interface (FA3, the hopper build of flash-attention)", ("flash_attn_interface",),
                                   "no wheel exists: build and install flash-attention's hopper/ directory"),
    "flash_attn_4": LibraryInstall("flash-attn-4", ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface"),
                                   'pip install -e ".[fa4]" in this repository, or pip install flash-attn-4==4.0.0b36'),
    "cudnn_frontend": LibraryInstall("nvidia-cudnn-frontend", ("cudnn",),
                                     'pip install -e ".[cudnn]" in this repository, or pip install "nvidia-cudnn-frontend>=1.13,<1.33"'),
}


def _dist_version(*names: str) -> Optional[str]:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def installed_libraries() -> InstalledLibraries:
    """Probe once per process. flash-attn-4 also installs a ``flash_attn`` package (for
    ``flash_attn.cute``), so FA2 is recognized by its own distribution name, not the module."""
    fa2 = _dist_version("flash-attn", "flash_attn")
    fa3 = _dist_version("flash-attn-3", "flash_attn_3") or ("unknown" if _has_module("flash_attn_interface") else None)
    fa4 = _dist_version("flash-attn-4", "flash_attn_4")
    cudnn = _dist_version("nvidia-cudnn-frontend") if _has_module("cudnn") else None
    return InstalledLibraries(flash_attn_2=fa2, flash_attn_3=fa3, flash_attn_4=fa4, cudnn_frontend=cudnn,
                              cudnn=_cudnn_runtime(cudnn is not None))


def _cudnn_runtime(have_frontend: bool) -> Optional[int]:
    """The cuDNN the frontend's graphs run on: the frontend loads libcudnn itself, so its own
    ``backend_version()`` is the fact (the one place this module imports a library: only
    where the frontend is installed, once per process); torch's cuDNN otherwise."""
    if have_frontend:
        try:
            import cudnn

            return int(cudnn.backend_version())
        except Exception:  # noqa: BLE001 - an import or loader failure: fall back to torch's
            pass
    try:
        return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except (RuntimeError, OSError):  # a broken or missing libcudnn: no version to offer
        return None


@functools.lru_cache(maxsize=None)
def _compute_capability(device_index: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(device_index))


# torch.compile cannot trace the lru_cache; it calls this once, while tracing.
@torch.compiler.assume_constant_result
def compute_capability(device_index: int) -> tuple:
    return _compute_capability(device_index)
