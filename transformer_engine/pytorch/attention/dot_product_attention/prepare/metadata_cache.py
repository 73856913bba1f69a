"""THD metadata derived once per cu_seqlens tensor, not once per layer (issue #26).

Every layer of a training step passes the same cu_seqlens tensors, and every call derives the
same small tensors from them: the bounded offsets (``made_safe``: a clamp and a cummax), the
valid lengths, cuDNN's int64 and element offsets. Each derivation is a kernel launch, and on a
short batch each launch before the attention kernel adds its host time to the call's (FA4's two
took 70-87 us of the H200's host time; cuDNN's forward made seven). :func:`remembered`
keeps them, keyed by the source tensors themselves, so layers 2..N of a step launch none.

When a remembered value is reused (all of these hold, else it is derived again):

- the source is the same tensor object (the cache holds it, so its id cannot be reused) with
  the same ``_version`` and data pointer: any in-place write through PyTorch (``copy_``,
  ``fill_``, an out= op, a write under ``no_grad``) bumps the version and re-derives;
- the call runs on the same CUDA stream (a value made on another stream may not be ready);
- no CUDA graph is being captured (a capture records its own derivations, which replays redo),
  torch.compile is not tracing, no dispatch mode is active (make_fx, export, FakeTensorMode: a
  remembered tensor must not become a traced graph's constant), and neither the sources nor the
  call are in inference mode (inference tensors have no version counter, and values made there
  must not reach training calls);
- NVTE_ATTN_METADATA_CACHE is not "0".

The contract this relies on is PyTorch's own for autograd's saved tensors: writes that bypass
the version counter (a raw Triton or CUDA kernel writing into the tensor, ``t.data.copy_``, a
CUDA graph replay that refills it) are not seen. A caller that refills cu_seqlens that way
between calls passes a fresh tensor or sets NVTE_ATTN_METADATA_CACHE=0.

Only the first derivation (the bounded offsets) reads the caller's tensors (:func:`remembered`);
the later ones read its outputs and are kept with them (:func:`derived_from`): nothing writes
those, so a chain stays consistent and its later lookups cost two dict reads.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from ..environment import Switch, compiling

METADATA_CACHE = Switch("NVTE_ATTN_METADATA_CACHE")  # "0": derive on every call
# A step adds a handful of entries (bounded offsets per distinct cu_seqlens and bound); a full
# cache is emptied, which costs the next call one derivation each.
MAX_ENTRIES = 32
MAX_DERIVED = 16  # values kept with one tensor

_ENTRIES: Dict[tuple, Tuple[tuple, tuple, Any]] = {}  # key -> (sources, data pointers, value)
# id -> (tensor, {key: value derived from it}) for every tensor a remembered value holds.
_OUTPUTS: Dict[int, Tuple[torch.Tensor, Dict[Any, Any]]] = {}


def _stream_of(t: torch.Tensor):
    """The call's stream on ``t``'s device (CUDA), or None (CPU); False where nothing may be
    remembered now (a graph capture on the current stream)."""
    if not t.is_cuda:
        return None
    if torch._C._cuda_isCurrentStreamCapturing():
        return False
    return torch._C._cuda_getCurrentStream(t.get_device())


def remembered(tag: str, sources: Tuple[torch.Tensor, ...], extra: Any, derive: Callable[[], Any]) -> Any:
    """``derive()`` (a tensor or tuple of tensors computed from the caller's ``sources`` and
    the hashable ``extra``), or the value an earlier call derived from the same unchanged
    sources on the same stream."""
    if (METADATA_CACHE.get("1") == "0" or compiling() or torch._C._len_torch_dispatch_stack()
            or torch.is_inference_mode_enabled()):
        return derive()
    first = sources[0]
    stream = _stream_of(first)
    if stream is False:
        return derive()
    # One source (self-attention without gaps) is spelled out: generators cost ~0.8 us a call.
    if len(sources) == 1:
        if first.is_inference():
            return derive()
        key: tuple = (tag, extra, stream, id(first), first._version)
        pointers: Any = first.data_ptr()
    else:
        if any([t.is_inference() for t in sources]):
            return derive()
        key = (tag, extra, stream) + tuple([(id(t), t._version) for t in sources])
        pointers = tuple([t.data_ptr() for t in sources])
    entry = _ENTRIES.get(key)
    if entry is not None and entry[1] == pointers:
        return entry[2]
    if len(_ENTRIES) >= MAX_ENTRIES:
        clear()  # before deriving: a derivation may remember inner values (made_safe's bounds) to keep
    value = derive()
    _ENTRIES[key] = (sources, pointers, value)
    for t in value if isinstance(value, tuple) else (value,):
        _OUTPUTS[id(t)] = (t, {})
    return value


def owns(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor the cache holds (a value of :func:`remembered` or
    :func:`derived_from`). Never while torch.compile traces (``id`` of a traced tensor would
    break the graph; nothing is remembered there)."""
    if compiling():
        return False
    slot = _OUTPUTS.get(id(t))
    return slot is not None and slot[0] is t


def derived_from(t: Any, key: Any, derive: Callable[[], Any]) -> Any:
    """``derive()``, a value computed from ``t`` (and from other values the cache holds, named
    in the hashable ``key``), remembered with ``t`` where the cache holds ``t``: a tensor, or a
    record made only of such values (the varlen plan, its KernelCall, its rows fact), which can
    hold derivations of its own.

    No version, stream or capture check here: ``t`` came out of :func:`remembered` (or this
    function) for a call that passed those checks, on that call's stream, and nothing writes
    it; its derivations are made and read by the calls that use it (and their backwards). The
    modes that would make a derivation something else than a plain tensor (a traced or fake
    one, an inference tensor) are still checked: a backward may run under one."""
    if compiling() or torch._C._len_torch_dispatch_stack() or torch.is_inference_mode_enabled():
        return derive()
    slot = _OUTPUTS.get(id(t))
    if slot is None or slot[0] is not t:
        return derive()
    values = slot[1]
    value = values.get(key)
    if value is None:
        if len(values) >= MAX_DERIVED:  # e.g. one tensor met with ever new max_seqlen values
            for dropped in list(values.values()):  # (a backward thread may add one meanwhile)
                if dropped is not t:  # (offsets.long() of int64 offsets is the tensor itself)
                    _OUTPUTS.pop(id(dropped), None)
            values.clear()
        value = values[key] = derive()
        _OUTPUTS.setdefault(id(value), (value, {}))
    return value


def clear() -> None:
    """Forget every remembered value (tests; a full cache)."""
    _ENTRIES.clear()
    _OUTPUTS.clear()


class LateFact:
    """Whether a few device integers equal the host integers ``expected``, learnt without
    waiting: the values are copied to pinned host memory behind the stream's work
    (``non_blocking``) and read once an event recorded after the copy has completed
    (``Event.query`` never blocks). Until then :meth:`holds` says False, as it does when they
    differ, so a caller that skips work on it only ever skips work the values make needless.

    Made for remembered metadata (a value derived from cache outputs, which nothing writes): the
    later layers of a step and the backwards read it after the first layer made it. On the CPU
    the values are read at once (no device to wait for)."""

    __slots__ = ("expected", "_host", "_event", "_known")

    def __init__(self, values: torch.Tensor, expected: Sequence[int]):
        self.expected = list(expected)
        self._known: Optional[bool] = None
        self._host, self._event = copy_to_host(values)
        if self._event is None:
            self._known = self._host.tolist() == self.expected

    def holds(self) -> bool:
        known = self._known
        if known is None:
            # The event and host copy are kept (never cleared): another thread (autograd's, a
            # recompute) may be reading them at the same time.
            if not self._event.query():
                return False
            # A pinned host tensor: reading it is a memory read, not a device sync.
            known = self._known = self._host.tolist() == self.expected
        return known


def copy_to_host(values: torch.Tensor):
    """(host tensor, event to wait for or None): a CUDA tensor copied without waiting into
    pinned memory, the event recorded after the copy on the tensor's current stream; a CPU
    tensor as it is (tests replace this to stand in for a copy still in flight)."""
    if not values.is_cuda:
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(values.device))
    return host, event
