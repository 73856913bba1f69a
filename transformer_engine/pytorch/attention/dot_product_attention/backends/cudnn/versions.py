"""Library versions as the cuDNN rules compare and name them."""

from __future__ import annotations

from typing import Optional, Tuple


def release(version: Optional[str]) -> Tuple[int, ...]:
    """(major, minor) of a version string such as "1.32.0"; (0,) where it cannot be read."""
    try:
        return tuple(int(part) for part in (version or "").split(".")[:2])
    except ValueError:
        return (0,)


def cudnn_name(version: Optional[int]) -> str:
    """cuDNN's number (91900) as people write it (9.19)."""
    if version is None:
        return "of unknown version"
    return f"{version // 10000}.{version // 100 % 100}"
