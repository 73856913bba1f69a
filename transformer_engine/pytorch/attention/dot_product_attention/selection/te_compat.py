"""TransformerEngine's spelling of backend selection, at the selection boundary.

TE's callers (its own tests, frameworks that mirror them) build ``AttentionParams`` with a layout
string and string mask types, unpack ``get_attention_backend``'s six-element tuple and compare its
fused element with ``FusedAttnBackend[...]``. This module holds those facts: the layouts and the
format each implies, the fused sub-backend enum, the tuple made from a selection, and the two
module-level names TE's test helpers import (``_attention_backends``, ``AttentionLogging``).
"""

from __future__ import annotations

import enum
import functools
import logging
import os
from typing import Any, Dict, Optional, Tuple

# TE's layout names: q, k, v separate ("bshd_bshd_bshd"), k/v packed ("bshd_bs2hd", "bshd_bsh2d"),
# all packed ("bs3hd", "bsh3d"), q in another format than k/v ("thd_bshd_bshd", for KV caches),
# and the paged-KV variants of those.
_BASE_LAYOUTS = (
    "sb3hd", "sbh3d", "sbhd_sb2hd", "sbhd_sbh2d", "sbhd_sbhd_sbhd",
    "bs3hd", "bsh3d", "bshd_bs2hd", "bshd_bsh2d", "bshd_bshd_bshd",
    "t3hd", "th3d", "thd_t2hd", "thd_th2d", "thd_thd_thd",
    "sbhd_bshd_bshd", "bshd_sbhd_sbhd", "thd_bshd_bshd", "thd_sbhd_sbhd",
)
PAGED_PREFIX = "paged_kv_"
QKV_LAYOUTS: Tuple[str, ...] = _BASE_LAYOUTS + tuple(
    PAGED_PREFIX + name for name in ("bshd_bshd_bshd", "bshd_sbhd_sbhd", "sbhd_bshd_bshd", "sbhd_sbhd_sbhd",
                                     "thd_bshd_bshd", "thd_sbhd_sbhd"))
# The formats those layouts imply: one format, or q's format and then k/v's ("thd_2bshd").
QKV_FORMATS: Tuple[str, ...] = ("sbhd", "bshd", "thd", "sbhd_2bshd", "bshd_2sbhd", "thd_2bshd", "thd_2sbhd")
DEFAULT_LAYOUT = "sbh3d"  # TE's AttentionParams default


@functools.lru_cache(maxsize=None)
def format_of_layout(qkv_layout: str) -> str:
    """The qkv format a layout implies: ``sb3hd`` -> ``sbhd``, ``thd_t2hd`` -> ``thd``,
    ``thd_bshd_bshd`` -> ``thd_2bshd`` (q in thd, k/v in bshd)."""
    if qkv_layout not in QKV_LAYOUTS:
        raise ValueError(f"qkv_layout must be one of {', '.join(QKV_LAYOUTS)}; got {qkv_layout!r}")
    parts = qkv_layout[len(PAGED_PREFIX):].split("_") if qkv_layout.startswith(PAGED_PREFIX) else qkv_layout.split("_")
    q_format, kv_format = (p.replace("2", "").replace("3", "") for p in (parts[0], parts[-1]))
    return q_format if q_format == kv_format else f"{q_format}_2{kv_format}"


def resolve_format_and_layout(qkv_format: Optional[str], qkv_layout: Optional[str]) -> Tuple[str, str]:
    """(format, layout) from what a caller gave: TE passes only the layout, this package's callers
    often only the format (separate q, k, v); both given must agree."""
    if qkv_format is not None and qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format must be None or one of {', '.join(QKV_FORMATS)}; got {qkv_format!r}")
    if qkv_layout is None:
        if qkv_format is None:
            return format_of_layout(DEFAULT_LAYOUT), DEFAULT_LAYOUT
        if "_2" in qkv_format:
            q_format, kv_format = qkv_format.split("_2")
            return qkv_format, f"{q_format}_{kv_format}_{kv_format}"
        return qkv_format, "_".join([qkv_format] * 3)
    implied = format_of_layout(qkv_layout)
    if qkv_format is not None and qkv_format != implied:
        raise ValueError(f"qkv_format={qkv_format!r} does not match qkv_layout={qkv_layout!r}, whose format is "
                         f"{implied!r}; give the layout alone (the format is read from it) or both agreeing")
    return implied, qkv_layout


# ------------------------------------------------------------------ the fused sub-backend


class NVTE_Fused_Attn_Backend(enum.IntEnum):  # noqa: N801 - TE's (C enum) name
    """TE's fused-attention sub-backends, with TE's values. This package's FusedAttention is a
    cuDNN graph for any sequence length: F16_arbitrary_seqlen, or FP8 for FP8 attention."""

    NVTE_No_Backend = -1
    NVTE_F16_max512_seqlen = 0
    NVTE_F16_arbitrary_seqlen = 1
    NVTE_FP8 = 2


# TE's lookup by short name, as its tests write ``FusedAttnBackend["F16_arbitrary_seqlen"]``.
FusedAttnBackend: Dict[str, NVTE_Fused_Attn_Backend] = {
    "F16_max512_seqlen": NVTE_Fused_Attn_Backend.NVTE_F16_max512_seqlen,
    "F16_arbitrary_seqlen": NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen,
    "FP8": NVTE_Fused_Attn_Backend.NVTE_FP8,
    "No_Backend": NVTE_Fused_Attn_Backend.NVTE_No_Backend,
}


def fused_sub_backend(fp8: bool) -> NVTE_Fused_Attn_Backend:
    return FusedAttnBackend["FP8" if fp8 else "F16_arbitrary_seqlen"]


def library_version(text: Optional[str], major: int) -> Any:
    """A FlashAttention version as TE gives it (``packaging.version.Version``, TE's
    ``PkgVersion``), so ``flash_attention_backend >= PkgVersion("3")`` works; a build without
    package metadata (FA3 from source) reads as ``major``. Without ``packaging`` installed
    (torch does not need it), the version string."""
    if text is None:
        return None
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return text
    try:
        return Version(text)
    except InvalidVersion:
        return Version(str(major))


# ------------------------------------------------------------------ TE's test-helper names

# TE's module keeps its last selection here and its test helpers write it; this package caches
# selection by its parameters instead and never reads this dict (it exists so such helpers run).
_attention_backends: Dict[str, Any] = {
    "attention_params": None,
    "use_flash_attention": None,
    "flash_attention_backend": None,
    "use_fused_attention": None,
    "fused_attention_backend": None,
    "use_unfused_attention": None,
    "backend_selection_requires_update": False,
}


def _env_int(name: str) -> int:
    try:
        return int(os.getenv(name, "0"))
    except ValueError:  # a malformed switch leaves logging quiet rather than failing the import
        return 0


class AttentionLogging:
    """TE's logging switch for selection: ``NVTE_DEBUG=1`` with ``NVTE_DEBUG_LEVEL`` 0/1/2 sets
    the level of this package's selection logger (``transformer_engine.attention``), which
    ``NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2`` makes report every selection."""

    _log_level = _env_int("NVTE_DEBUG") * _env_int("NVTE_DEBUG_LEVEL")
    fa_logger = logging.getLogger("transformer_engine.attention")
    _is_logging_setup = False

    @staticmethod
    def setup_logging() -> None:
        levels = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}
        AttentionLogging._log_level = levels[min(max(AttentionLogging._log_level, 0), 2)]
        AttentionLogging.fa_logger.setLevel(AttentionLogging._log_level)
        if not AttentionLogging.fa_logger.hasHandlers():
            AttentionLogging.fa_logger.addHandler(logging.StreamHandler())
        AttentionLogging._is_logging_setup = True
