"""Backend selection: a short loop over the backends' declarations in preference order.

``get_attention_backend(params)`` returns the first backend that supports the configuration,
with every other backend's reasons, as a :class:`BackendSelection` that also unpacks as TE's
six-element tuple. Environment switches (``NVTE_FLASH_ATTN``,
``NVTE_FUSED_ATTN``, ``NVTE_UNFUSED_ATTN``, ``NVTE_FLASH_ATTN_V2/_V3/_V4``) are read at each
call and are part of the cache key, so flipping one takes effect at once. So is the
:func:`backend_scope` in effect, the scoped way to restrict or force backends.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass, replace
from typing import Any, ContextManager, Dict, Iterable, Iterator, Optional, Tuple, Union

import torch

from ..backends import BACKENDS, backend_label
from ..environment import DEBUG_SLICE, BackendScope, env_snapshot, scoped
from .libraries import LIBRARY_INSTALLS, InstalledLibraries, installed_libraries
from .params import AttentionParams, params_from_key
from .support import Reason
from .te_compat import NVTE_Fused_Attn_Backend, fused_sub_backend, library_version

logger = logging.getLogger("transformer_engine.attention")


@dataclass(frozen=True)
class BackendSelection:
    """The chosen backend class (None if nothing fits), why each other one was not chosen, and
    how the choice was made among those that fit (``how``: the fixed preference order, a
    ``backend_scope(force=...)``, or measured by :mod:`.autotune`).

    It also unpacks as TE's tuple (:meth:`te_tuple`)::

        (use_flash_attention, flash_attention_backend, use_fused_attention,
         fused_attention_backend, use_unfused_attention, available_backends) = get_attention_backend(params)

    ``flash_version``: the version of the FlashAttention library that runs, or else of the
    first one (in preference order) that could, as ``packaging.version.Version`` (TE's
    ``PkgVersion``); None when none could. ``fused_backend``: TE's fused sub-backend enum
    (``FusedAttnBackend["F16_arbitrary_seqlen"]``, or ``["FP8"]`` for FP8 attention) when
    FusedAttention runs or could; None otherwise. Both as TE's two "backend" elements are.
    """

    backend: Optional[type]
    reasons: Tuple[Tuple[str, Tuple[Reason, ...]], ...]
    flash_version: Any = None
    fused_backend: Optional[NVTE_Fused_Attn_Backend] = None
    how: str = "fixed preference order"
    forced: bool = False  # backend_scope(force=...): not a choice autotune may change
    # Made without the measurement autotune would make (a bucket's first call under CUDA-graph
    # capture): a later eager call should choose again, so the fast path does not keep it.
    provisional: bool = False

    @property
    def name(self) -> Optional[str]:
        return None if self.backend is None else self.backend.NAME

    @property
    def label(self) -> Optional[str]:
        return None if self.backend is None else backend_label(self.backend)

    def reasons_for(self, label: str) -> Tuple[Reason, ...]:
        return dict(self.reasons).get(label, ())

    def can_run(self, label: str) -> bool:
        """Whether ``label`` could run the configuration (no reason against it), or is forced."""
        return label == self.label or (label in dict(self.reasons) and not self.reasons_for(label))

    def te_tuple(self) -> tuple:
        """TE's six elements. ``use_*``: which of TE's three backend kinds runs (FlashAttention is
        any of v2/v3/v4); ``available_backends``: [FlashAttention, FusedAttention, Unfused] each
        True where some backend of that kind could run."""
        kinds = ("FlashAttention", "FusedAttention", "UnfusedDotProductAttention")
        available = [any(self.can_run(backend_label(b)) for b in BACKENDS if b.NAME == kind) for kind in kinds]
        use_flash, use_fused, use_unfused = (self.name == kind for kind in kinds)
        return use_flash, self.flash_version, use_fused, self.fused_backend, use_unfused, available

    def __iter__(self) -> Iterator:
        return iter(self.te_tuple())

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index):
        return self.te_tuple()[index]

    def report(self) -> str:
        lines = [f"selected: {self.label} ({self.how})" if self.backend is not None else "selected: none"]
        for label, reasons in self.reasons:
            if label == self.label:
                continue
            why = "; ".join(map(str, reasons)) if reasons else "supported, but lower in the preference order"
            lines.append(f"  {label}: {why}")
        return "\n".join(lines)


def get_attention_backend(params: AttentionParams, libraries: Optional[InstalledLibraries] = None) -> BackendSelection:
    """Choose a backend for ``params``. ``libraries`` defaults to what is installed; tests pass a
    fake to see what a GPU machine would choose. TE's spelling works as TE's does::

        use_flash_attention, flash_attention_backend, use_fused_attention, \\
            fused_attention_backend, use_unfused_attention, available_backends = get_attention_backend(params)
    """
    env = env_snapshot()
    selection = _select(params, libraries or installed_libraries(), env)
    debug, level = (os.fsdecode(x) if x is not None else "0" for x in env[DEBUG_SLICE])  # read by the snapshot already
    if debug == "1" and int(level) >= 2:
        logger.warning("attention backend for %s\n%s", params, selection.report())
    return selection


@functools.lru_cache(maxsize=1024)
def _select(params: AttentionParams, libs: InstalledLibraries, env) -> BackendSelection:
    # ``env`` is in the key so a changed switch misses the cache; its last entry is the scope.
    scope = env[-1]
    chosen, reasons = None, []
    for backend in BACKENDS:
        label = backend_label(backend)
        why = tuple(backend.not_supported_reasons(params, libs)) + _scope_reasons(scope, label)
        reasons.append((label, why))
        if chosen is None and not why:
            chosen = backend
    if scope is not None and scope.force is not None:
        chosen = BACKENDS_BY_LABEL[scope.force]  # its declaration is not consulted (see backend_scope)
        selection = BackendSelection(chosen, tuple(reasons), how=f"forced by backend_scope(force={scope.force!r})",
                                     forced=True)
        return with_te_backends(selection, params, libs)
    return with_te_backends(BackendSelection(chosen, tuple(reasons)), params, libs)


def with_te_backends(selection: BackendSelection, params: AttentionParams, libs: InstalledLibraries) -> BackendSelection:
    """Fill in TE's two backend elements: the FlashAttention version and the fused sub-backend."""
    flash = [b for b in BACKENDS if b.NAME == "FlashAttention" and selection.can_run(backend_label(b))]
    if selection.name == "FlashAttention":
        flash = [selection.backend]
    version = library_version(getattr(libs, flash[0].LIBRARY), flash[0].VERSION) if flash else None
    fused = fused_sub_backend(params.fp8) if selection.can_run("FusedAttention") else None
    return replace(selection, flash_version=version, fused_backend=fused)


def _scope_reasons(scope: Optional[BackendScope], label: str) -> Tuple[Reason, ...]:
    if scope is None:
        return ()
    if scope.force is not None and scope.force != label:
        return (Reason("backend_scope", f"force={scope.force!r}", f"force={label!r} to run this one"),)
    if scope.allow is not None and label not in scope.allow:
        return (Reason("backend_scope", f"allow={sorted(scope.allow)}", f"an allow list containing {label!r}"),)
    return ()


BackendName = Union[str, type]


def backend_scope(allow: Optional[Iterable[BackendName]] = None, force: Optional[BackendName] = None) -> ContextManager:
    """Restrict or force the attention backends inside a ``with`` block; the previous scope
    comes back on exit. Scoped per thread and asyncio task (a context variable), and part of
    the selection and fast-path cache keys, so entering one takes effect at the next call.

    ``allow``: the backends selection may choose from, in the usual preference order; nothing
    allowed fits -> ``NoBackendError`` listing every reason. ``force``: the one backend that
    runs, without consulting its support declaration (for tests and for experts who know a
    declaration is too strict; an unsupported configuration then fails in the library). A
    forced backend whose library is not installed raises :class:`BackendLibraryMissing`
    (naming the backend, the package and how to install it) when it runs and the error leaves
    the block; the check is not made earlier because tests force backends over stand-in
    libraries, which package metadata does not list.
    A backend is named by its class, its label ("FlashAttention v4", "FusedAttention",
    "UnfusedDotProductAttention") or a short name ("fa4", "fa3", "fa2", "cudnn", "unfused").
    A scope replaces the enclosing one; under torch.compile the scope at tracing time counts.

    >>> with backend_scope(allow=["cudnn", "unfused"]):
    ...     out = dpa(q, k, v)  # FA4 is not considered
    """
    allowed = None if allow is None else frozenset(_label_of("allow", name) for name in allow)
    forced = None if force is None else _label_of("force", force)
    return _scope_block(BackendScope(allowed, forced))


class BackendLibraryMissing(ModuleNotFoundError):
    """A backend forced by ``backend_scope(force=...)`` ran, and its library is not installed."""


@contextlib.contextmanager
def _scope_block(scope: BackendScope) -> Iterator[BackendScope]:
    with scoped(scope):
        try:
            yield scope
        except ModuleNotFoundError as error:
            missing = _forced_library_missing(scope.force, error)
            if missing is None:
                raise
            raise missing from error


def _forced_library_missing(forced: Optional[str], error: ModuleNotFoundError) -> Optional[BackendLibraryMissing]:
    """The named error for ``error`` when it says the forced backend's own library is absent
    (not a dependency of it, not another module)."""
    library = None if forced is None else BACKENDS_BY_LABEL[forced].LIBRARY
    install = LIBRARY_INSTALLS.get(library)
    if install is None or error.name not in install.modules:
        return None
    return BackendLibraryMissing(
        f"backend_scope(force={forced!r}) ran {forced}, which needs {install.package}; it is not installed "
        f"(import of {error.name!r} failed). Install it ({install.pip}), or force another backend / leave "
        f"the choice to selection (te-attention-backend says which backends this machine can run)",
        name=error.name)


_SHORT_NAMES = {"fa4": "FlashAttention v4", "fa3": "FlashAttention v3", "fa2": "FlashAttention v2",
                "cudnn": "FusedAttention", "unfused": "UnfusedDotProductAttention"}


def _label_of(argument: str, name: BackendName) -> str:
    if isinstance(name, type) and name in BACKENDS:
        return backend_label(name)
    label = _SHORT_NAMES.get(name, name) if isinstance(name, str) else None
    if label not in BACKENDS_BY_LABEL:
        raise ValueError(f"{argument} names an unknown backend: got {name!r}; accepted: a backend class, "
                         f"{sorted(BACKENDS_BY_LABEL)} or {sorted(_SHORT_NAMES)}")
    return label


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


def kv_cache_support_markdown() -> str:
    """The README's KV-cache table (TE's ``inference_params``), rendered from the backends'
    declarations. Every backend that runs a cache runs it forward only, with the vanilla
    softmax and without dropout (``BackendSupport._check_kv_cache``)."""
    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    lines = ["| backend | non-paged cache | paged cache | page size |", "|---|---|---|---|"]
    for b in BACKENDS:
        paged = b.SUPPORTS_KV_CACHE and b.SUPPORTS_PAGED_KV_CACHE
        size = ("any" if b.KV_PAGE_SIZE_MULTIPLE == 1 else f"multiple of {b.KV_PAGE_SIZE_MULTIPLE}") if paged else "-"
        lines.append(f"| {backend_label(b)} | {yes(b.SUPPORTS_KV_CACHE)} | {yes(paged)} | {size} |")
    return "\n".join(lines)


def explain_backends(params: AttentionParams, libraries: Optional[InstalledLibraries] = None) -> Dict[str, Tuple[str, ...]]:
    """{backend label: reasons it cannot run ``params``} ("which backend, and why not the others")."""
    selection = get_attention_backend(params, libraries)
    return {label: tuple(map(str, why)) for label, why in selection.reasons}
