"""Every NVTE_* switch the package reads, and the one torch.compile predicate.

os.environ keeps its values in a bytes-keyed dict on POSIX; reading that dict directly skips
os.environ.get's per-key encoding (0.07 instead of 1.2 us a key, measured on one CPU core).
Switches are read at each call, never cached, so flipping one takes effect at once.

What changes while torch.compile traces (:func:`compiling`), each decided where it applies:
backend selection is made once, while tracing (``selection.chosen_backend_label``); the fast
path is off (``fast_path.call_key``); values are never read (``thd.value_checks_on``); the
kernels are called as registered ops (``backends.kernel_ops``; FA4's eager calls pass keyword
dicts built once per problem instead, ``backends.fa4``); the NaN guard works on copies
(``backends.varlen``); the unfused THD path runs gathered, not per sequence (``unfused``); the
autograd Function is entered through its public ``apply`` (``backends.kernel_autograd``);
autotune is not consulted (``selection.autotune``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass
from typing import FrozenSet, Iterator, Optional, Tuple

import torch

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


def compiling() -> bool:
    """Whether torch.compile is tracing this call (see the module docstring for what changes)."""
    return torch.compiler.is_compiling()


# ---------------------------------------------------------------------------------- the switches

# Per-backend off switches ("0" turns a backend off; see each backend's ENV_VARS).
def backend_switch_on(name: str) -> bool:
    return Switch(name).get("1") != "0"


VALIDATE = Switch("NVTE_ATTN_VALIDATE")  # "1": value checks (device syncs) on CUDA too
SANITIZE_GAPS = Switch("NVTE_FLASH_ATTN_SANITIZE_GAPS")  # the NaN guard: "1", "copy" or "0"
UNFUSED_MAX_SCORES = Switch("NVTE_UNFUSED_ATTN_MAX_SCORES")  # unfused: score elements per chunk
UNFUSED_THD_GATHER = Switch("NVTE_UNFUSED_THD_GATHER")  # "1": the gathered THD path on the CPU
CP_HOST_STAGING = Switch("NVTE_CP_HOST_STAGING")  # "1": CP transfers staged through the host
# "1": where the policy sizes are known, each policy's kernel call gets only its own sequences
# (varlen.py). Off by default: on the H200 it gained at most ~7% replayed from a CUDA graph and
# cost up to ~0.3 ms of eager host time (benchmarks/results/2026-12-03-h200/ at 2f8a113 in git history: mixed_2dc2a39.md).
THD_POLICY_COMPACT = Switch("NVTE_THD_POLICY_COMPACT")
# FP8 attention (TE's names). "1": the unfused backend emulates the FP8 kernels (any device).
FP8_EMULATE = Switch("NVTE_UnfusedDPA_Emulate_FP8")
# "0": FP8 forward, high-precision backward (default "1": the backward quantizes dO, dP, dQKV).
FP8_DPA_BWD = Switch("NVTE_FP8_DPA_BWD")
# Under Float8CurrentScaling, S and dP keep delayed scaling (a fused kernel needs their scales
# before it forms them): the history length, amax algorithm and reduction of that state.
DPA_FP8DS_AMAX_HISTLEN = Switch("NVTE_DPA_FP8DS_AMAX_HISTLEN")
DPA_FP8DS_AMAX_ALGO = Switch("NVTE_DPA_FP8DS_AMAX_ALGO")
DPA_FP8DS_REDUCE_AMAX = Switch("NVTE_DPA_FP8DS_REDUCE_AMAX")
# Opt-in choice of the fastest accepting library per shape (selection/autotune.py): "1" (or
# "eager") times each call as an eager call, "gpu" times GPU work alone; optionally kept in a
# JSON file. TE's NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (deterministic mode) turns it off.
AUTOTUNE = Switch("NVTE_ATTN_AUTOTUNE")
AUTOTUNE_CACHE = Switch("NVTE_ATTN_AUTOTUNE_CACHE")
ALLOW_NONDETERMINISTIC = Switch("NVTE_ALLOW_NONDETERMINISTIC_ALGO")

# The switches that decide backend selection (the debug switches last).
_SELECTION_KEYS = (
    "NVTE_FLASH_ATTN",
    "NVTE_FUSED_ATTN",
    "NVTE_UNFUSED_ATTN",
    "NVTE_FLASH_ATTN_V2",
    "NVTE_FLASH_ATTN_V3",
    "NVTE_FLASH_ATTN_V4",
    "NVTE_UnfusedDPA_Emulate_FP8",
    "NVTE_FP8_DPA_BWD",  # cuDNN's FP8 rules differ for an FP8 and an F16 backward
    "NVTE_DEBUG",
    "NVTE_DEBUG_LEVEL",
)
_SELECTION_BYTES = tuple(os.fsencode(k) for k in _SELECTION_KEYS)


DEBUG_SLICE = slice(len(_SELECTION_KEYS) - 2, len(_SELECTION_KEYS))  # NVTE_DEBUG, NVTE_DEBUG_LEVEL in the snapshot


def env_snapshot() -> tuple:
    """What decides backend selection besides the call, as one hashable tuple: the selection
    switches, the debug switches, and last the :class:`BackendScope` in effect (or None)."""
    return raw_values(_SELECTION_KEYS, _SELECTION_BYTES) + (_SCOPE.get(),)


# ---------------------------------------------------------------------------------- the scope


@dataclass(frozen=True)
class BackendScope:
    """Which backends a ``backend_scope`` block lets selection choose (backend labels):
    ``allow`` restricts the candidates (None = all); ``force`` names the one that runs."""

    allow: Optional[FrozenSet[str]] = None
    force: Optional[str] = None


# A context variable, not a global: each thread (and asyncio task) sees its own scope.
_SCOPE: contextvars.ContextVar[Optional[BackendScope]] = contextvars.ContextVar("te_attention_backend_scope", default=None)


def current_scope() -> Optional[BackendScope]:
    return _SCOPE.get()


@contextlib.contextmanager
def scoped(scope: Optional[BackendScope]) -> Iterator[Optional[BackendScope]]:
    """Make ``scope`` the current one inside the block; the previous one comes back on exit."""
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)
