"""Pure helpers, testable without a GPU: backend selection, qkv layouts, the support matrix.

``get_attention_backend(params)`` walks the backends in preference order and returns the first
that supports the configuration, with every other backend's reasons. Environment switches
(``NVTE_FLASH_ATTN``, ``NVTE_FUSED_ATTN``, ``NVTE_UNFUSED_ATTN``, ``NVTE_FLASH_ATTN_V2/_V3/_V4``)
are read at each call and are part of the cache key, so flipping one takes effect at once.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .backends import BACKENDS, backend_label
from .environment import raw_values
from .libraries import InstalledLibraries, installed_libraries
from .params import AttentionParams, params_from_key
from .support import Reason

logger = logging.getLogger("transformer_engine.attention")

_ENV_KEYS = (
    "NVTE_FLASH_ATTN",
    "NVTE_FUSED_ATTN",
    "NVTE_UNFUSED_ATTN",
    "NVTE_FLASH_ATTN_V2",
    "NVTE_FLASH_ATTN_V3",
    "NVTE_FLASH_ATTN_V4",
)


@dataclass(frozen=True)
class BackendSelection:
    """The chosen backend class (None if nothing fits) and why each other one was not chosen."""

    backend: Optional[type]
    reasons: Tuple[Tuple[str, Tuple[Reason, ...]], ...]

    @property
    def name(self) -> Optional[str]:
        return None if self.backend is None else self.backend.NAME

    @property
    def label(self) -> Optional[str]:
        return None if self.backend is None else backend_label(self.backend)

    def reasons_for(self, label: str) -> Tuple[Reason, ...]:
        return dict(self.reasons).get(label, ())

    def report(self) -> str:
        lines = [f"selected: {self.label or 'none'}"]
        for label, reasons in self.reasons:
            if label == self.label:
                continue
            why = "; ".join(map(str, reasons)) if reasons else "supported, but lower in the preference order"
            lines.append(f"  {label}: {why}")
        return "\n".join(lines)


def get_attention_backend(params: AttentionParams, libraries: Optional[InstalledLibraries] = None) -> BackendSelection:
    """Choose a backend for ``params``. ``libraries`` defaults to what is installed; tests pass a
    fake to see what a GPU machine would choose."""
    env = env_snapshot()
    selection = _select(params, libraries or installed_libraries(), env)
    debug, level = (os.fsdecode(x) if x is not None else "0" for x in env[-2:])  # read by the snapshot already
    if debug == "1" and int(level) >= 2:
        logger.warning("attention backend for %s\n%s", params, selection.report())
    return selection


_SNAPSHOT_KEYS = _ENV_KEYS + ("NVTE_DEBUG", "NVTE_DEBUG_LEVEL")
_SNAPSHOT_BYTES = tuple(os.fsencode(k) for k in _SNAPSHOT_KEYS)


def env_snapshot() -> tuple:
    """The selection switches (and the debug switches, last) as one hashable tuple."""
    return raw_values(_SNAPSHOT_KEYS, _SNAPSHOT_BYTES)


@functools.lru_cache(maxsize=1024)
def _select(params: AttentionParams, libs: InstalledLibraries, env) -> BackendSelection:
    # ``env`` is unused in the body: it is in the key so a changed switch misses the cache.
    chosen, reasons = None, []
    for backend in BACKENDS:
        why = tuple(backend.not_supported_reasons(params, libs))
        reasons.append((backend_label(backend), why))
        if chosen is None and not why:
            chosen = backend
    return BackendSelection(chosen, tuple(reasons))


class NoBackendError(NotImplementedError):
    """No backend supports the configuration; the message lists every backend's reasons."""


def require_backend(params: AttentionParams) -> BackendSelection:
    selection = get_attention_backend(params)
    if selection.backend is None:
        raise NoBackendError("no attention backend supports this configuration:\n" + selection.report())
    return selection


BACKENDS_BY_LABEL = {backend_label(b): b for b in BACKENDS}


@torch.compiler.assume_constant_result
def chosen_backend_label(key: tuple) -> str:
    """Selection as a constant for torch.compile: the label for ``params_key(params)``.

    Under compilation the choice is made once, while tracing; raises like require_backend."""
    return require_backend(params_from_key(key)).label


# ---------------------------------------------------------------------------------- qkv layouts


def layout_string(qkv_format: str, packing: Optional[str], interleave_dim: int = -3) -> str:
    """The layout name for a format and a declared packing.

    ``packing``: None (separate q, k, v), "kv" (k and v share a buffer) or "qkv"; with
    ``interleave_dim=-3`` the count sits before the heads (``bs3hd``), with -2 after (``bsh3d``).
    """
    prefix = qkv_format[:-2]  # "bs", "sb" or "t"
    if packing is None:
        return "_".join([qkv_format] * 3)
    n = "3" if packing == "qkv" else "2"
    packed = prefix + (n + "hd" if interleave_dim == -3 else "h" + n + "d")
    return packed if packing == "qkv" else f"{qkv_format}_{packed}"


def _may_share(tensors) -> bool:
    """False when strides alone rule out ``tensors`` being views of one packed buffer: such
    views step n * h * d per token, while a tensor of its own steps h * d. It rejects separate
    tensors (the common case) at the cost of one stride."""
    first = tensors[0]
    return first.dim() >= 3 and first.stride(-1) == 1 and first.stride(-3) == len(tensors) * first.shape[-2] * first.shape[-1]


def stride_rules_out_packing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`get_qkv_layout` decides "separate" from strides alone (no pointers read)."""
    return not _may_share([q, k, v]) and not _may_share([k, v])


def _shared_interleave(tensors) -> Optional[int]:
    """-3 or -2 when ``tensors`` are equal-shaped, evenly spaced views of one packed buffer."""
    if not _may_share(tensors):
        return None
    first = tensors[0]
    n = len(tensors)
    if any(t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype for t in tensors):
        return None
    h, d = first.shape[-2:]
    step = [(t.data_ptr() - first.data_ptr()) // first.element_size() for t in tensors]
    dim = None
    if first.stride(-2) == d and step == [i * h * d for i in range(n)]:
        dim = -3
    elif first.stride(-2) == n * d and step == [i * d for i in range(n)]:
        dim = -2
    # The storage check last: building storage objects is the slow part, and separate tensors
    # almost never pass the pointer arithmetic above.
    if dim is None or any(t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for t in tensors):
        return None
    return dim


def get_qkv_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str = "sbhd") -> Tuple[str, Optional[str]]:
    """Legacy detection from pointers and strides: (layout, packing) for separate tensors.

    Only the undeclared path calls this; ``qkv_layer``/``kv_layer`` build the layout instead.
    """
    dim = _shared_interleave([q, k, v])
    if dim is not None:
        return layout_string(qkv_format, "qkv", dim), "qkv"
    dim = _shared_interleave([k, v])
    if dim is not None:
        return layout_string(qkv_format, "kv", dim), "kv"
    return layout_string(qkv_format, None), None


# ---------------------------------------------------------------------------------- support matrix


def support_matrix_markdown() -> str:
    """The README's support matrix, rendered from the backends' declarations."""
    rows = [b.matrix_row() for b in BACKENDS]
    for b, row in zip(BACKENDS, rows):
        row["backend"] = backend_label(b)
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def explain_backends(params: AttentionParams, libraries: Optional[InstalledLibraries] = None) -> Dict[str, Tuple[str, ...]]:
    """{backend label: reasons it cannot run ``params``} ("which backend, and why not the others")."""
    selection = get_attention_backend(params, libraries)
    return {label: tuple(map(str, why)) for label, why in selection.reasons}
