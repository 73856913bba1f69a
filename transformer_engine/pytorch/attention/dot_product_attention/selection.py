"""Backend selection: a short loop over the backends' declarations in preference order.

``get_attention_backend(params)`` returns the first backend that supports the configuration,
with every other backend's reasons. Environment switches (``NVTE_FLASH_ATTN``,
``NVTE_FUSED_ATTN``, ``NVTE_UNFUSED_ATTN``, ``NVTE_FLASH_ATTN_V2/_V3/_V4``) are read at each
call and are part of the cache key, so flipping one takes effect at once.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .backends import BACKENDS, backend_label
from .environment import env_snapshot
from .libraries import InstalledLibraries, installed_libraries
from .params import AttentionParams, params_from_key
from .support import Reason

logger = logging.getLogger("transformer_engine.attention")


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
