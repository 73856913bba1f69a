"""NVTE_* switches read on every call, cheaply.

os.environ keeps its values in a bytes-keyed dict on POSIX; reading that dict directly skips
os.environ.get's per-key encoding (0.07 instead of 1.2 us a key, measured on one CPU core).
Switches are read at each call, never cached, so flipping one takes effect at once.
"""

from __future__ import annotations

import os
from typing import Tuple

_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None


def raw_values(names: Tuple[str, ...], encoded: Tuple[bytes, ...]) -> tuple:
    """The raw values of ``names`` (``encoded`` = their fsencoded forms), None where unset;
    bytes on POSIX, str elsewhere: for comparing snapshots, not for reading values."""
    if isinstance(_DATA, dict):
        return tuple(map(_DATA.get, encoded))
    return tuple(map(os.environ.get, names))


class Switch:
    """One variable, read at each call: ``Switch("NVTE_X").get("0")``."""

    __slots__ = ("name", "_encoded")

    def __init__(self, name: str) -> None:
        self.name = name
        self._encoded = os.fsencode(name)

    def get(self, default: str) -> str:
        if isinstance(_DATA, dict):
            raw = _DATA.get(self._encoded)
            return default if raw is None else os.fsdecode(raw)
        return os.environ.get(self.name, default)


# The switches that decide backend selection (the debug switches last).
_SELECTION_KEYS = (
    "NVTE_FLASH_ATTN",
    "NVTE_FUSED_ATTN",
    "NVTE_UNFUSED_ATTN",
    "NVTE_FLASH_ATTN_V2",
    "NVTE_FLASH_ATTN_V3",
    "NVTE_FLASH_ATTN_V4",
    "NVTE_DEBUG",
    "NVTE_DEBUG_LEVEL",
)
_SELECTION_BYTES = tuple(os.fsencode(k) for k in _SELECTION_KEYS)


def env_snapshot() -> tuple:
    """The selection switches (and the debug switches, last) as one hashable tuple."""
    return raw_values(_SELECTION_KEYS, _SELECTION_BYTES)
