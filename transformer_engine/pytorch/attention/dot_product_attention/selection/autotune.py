"""The fastest accepting library per shape, measured (opt-in: ``NVTE_ATTN_AUTOTUNE``).

Selection's fixed order (FA4 before cuDNN on Hopper) is not the fastest everywhere: on the H200
cuDNN ran short d64 batches faster, FA4 the long ones. With ``NVTE_ATTN_AUTOTUNE=1`` the first
call of a shape bucket runs every backend whose declaration accepts the call, times them, and
that bucket's later calls run the fastest. Off by default: FA4 and cuDNN round differently in
bf16, so switching libraries changes numerics within that noise, which a user should ask for.

- **Candidates**: the backends with no reason against this call (the selection's own reasons,
  ``backend_scope(allow=...)`` and the NVTE_* switches included), the unfused reference
  excepted. A recorded choice is filtered by the same rule at every call, so a backend whose
  declaration refuses a call never runs it.
- **Bucket**: every fact selection reads (:class:`.params.AttentionParams`: dtype, head dims,
  heads, groups, mask kinds and windows, format and layout, gaps, softmax and bias kinds,
  training and whether a backward follows, compute capability), with the token count (rows of
  q), the sequence count and the dense lengths rounded up to powers of two, and the GPU's name.
- **Timing** (:func:`measure`): each candidate once to warm up (FA4 compiles, cuDNN builds its
  graph), then :data:`REPEATS` runs, forward alone or forward and backward when gradients are
  wanted, on the current stream, from detached views of the call's tensors (nothing reaches the
  caller's autograd graph; the RNG state is restored, so dropout masks are those of an untuned
  run). ``NVTE_ATTN_AUTOTUNE=1`` (or ``eager``) times calls as eager ones: each from an idle GPU,
  host time included (what an eager step pays); ``gpu`` times GPU work alone, queued behind a
  GPU sleep (what a CUDA-graph replay pays). Synchronizes only there, on a bucket's first call.
- **Never consulted** (:func:`applies`) in deterministic mode (``torch.are_deterministic_algorithms_enabled()``
  or ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``), while torch.compile traces, under context
  parallelism, for FP8 calls (timing would step their amax state) and KV-cache steps, or with
  ``backend_scope(force=...)``; under CUDA-graph capture nothing is timed
  (timing inside a capture is impossible): the recorded choice, or the fixed order.
- **Cache**: per process; with ``NVTE_ATTN_AUTOTUNE_CACHE=path.json`` also read from and
  written to that file (each process's new choices are added; a process reads the file once, on
  its first tuned call, so ranks agree where an earlier run filled it; ranks that meet a new
  bucket at the same time each time it and may choose differently).

``last_selection.report()`` says how the backend was chosen: "chosen by autotune: X 0.41 ms vs
Y 0.47 ms" or "fixed preference order".
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..environment import ALLOW_NONDETERMINISTIC, AUTOTUNE, AUTOTUNE_CACHE, compiling
from .backend_selection import BACKENDS_BY_LABEL, BackendSelection, with_te_backends
from .libraries import installed_libraries
from .params import _KEY_FIELDS, AttentionParams, params_key

MODES = {"1": "eager", "eager": "eager", "gpu": "gpu"}
REPEATS = 5
_GPU_SLEEP_CYCLES = 20_000_000  # ~10 ms on an H200: longer than the host needs to queue REPEATS calls

_lock = threading.Lock()
_choices: Dict[str, "Choice"] = {}  # bucket (JSON text) -> choice; per process
_loaded_from: List[str] = []  # the cache files already read


@dataclasses.dataclass(frozen=True)
class Choice:
    """A bucket's measured candidates: label -> milliseconds per call, and how they were timed."""

    times_ms: Tuple[Tuple[str, float], ...]
    mode: str

    def fastest(self, labels) -> Optional[str]:
        """The fastest of ``labels`` measured here; None unless every one of them was."""
        times = dict(self.times_ms)
        if not all(label in times for label in labels):
            return None
        return min(labels, key=times.__getitem__)

    def describe(self, winner: str, labels) -> str:
        times = dict(self.times_ms)
        others = " vs ".join(f"{label} {times[label]:.3f} ms" for label in labels if label != winner)
        return f"chosen by autotune ({self.mode} timing): {winner} {times[winner]:.3f} ms vs {others}"


def mode() -> Optional[str]:
    """The timing mode NVTE_ATTN_AUTOTUNE asks for, None when it is off."""
    value = AUTOTUNE.get("0")
    if value in ("0", ""):
        return None
    if value not in MODES:
        raise ValueError(f"NVTE_ATTN_AUTOTUNE must be 0, 1, eager or gpu; got {value!r}")
    return MODES[value]


def deterministic() -> bool:
    return torch.are_deterministic_algorithms_enabled() or ALLOW_NONDETERMINISTIC.get("1") == "0"


def key_part(cu_seqlens_q: Optional[torch.Tensor]) -> Optional[tuple]:
    """What the fast path's key must add while autotune is on (None when it is off): the timing
    mode (each keeps its own choices), the sequence-count bucket of a THD call (its recipe holds a
    bucket's choice; dense counts are shapes, in the key already) and whether deterministic
    mode, which disables it, is on."""
    how = mode()
    if how is None:
        return None
    seqs = None if cu_seqlens_q is None else _pow2(cu_seqlens_q.numel() - 1)
    return how, seqs, deterministic()


def bucket(params: AttentionParams, rows: int, device: torch.device) -> str:
    """The bucket of a call (see the module docstring) as JSON text, the cache's key."""
    values = {name: value if isinstance(value, (str, int, float, bool, tuple, type(None))) else _name(value)
              for name, value in zip((f.name for f in _KEY_FIELDS), params_key(params))}
    values["batch_size"] = _pow2(params.batch_size)
    thd = params.qkv_format == "thd"
    # THD max_seqlen is neither a token nor a sequence count: left out (dense lengths are shapes).
    values["max_seqlen_q"] = None if thd else _pow2(params.max_seqlen_q)
    values["max_seqlen_kv"] = None if thd else _pow2(params.max_seqlen_kv)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return json.dumps(dict(device=name, rows=_pow2(rows), **values), sort_keys=True)


def _name(value) -> str:
    """A non-JSON fact (a dtype, TE's qkv_type class) by name."""
    return getattr(value, "__name__", None) or str(value).replace("torch.", "")


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def candidates(selection: BackendSelection) -> List[str]:
    """Labels of the backends whose declarations accept the call, in preference order (the
    unfused reference, LIBRARY None, is never a candidate)."""
    return [label for label, reasons in selection.reasons
            if not reasons and getattr(BACKENDS_BY_LABEL[label], "LIBRARY", None) is not None]


def applies(selection: BackendSelection, params: AttentionParams) -> bool:
    """Whether autotune chooses among ``selection``'s candidates for a call of ``params`` (the
    rules of "Never consulted" above, in one place for the module and ``explain``)."""
    return (mode() is not None and selection.backend is not None and not selection.forced and not deterministic()
            # FP8: timing would step the amax state (and one backend, cuDNN, runs FP8 anyway)
            and not params.fp8 and not params.kv_cache and not params.context_parallel
            and len(candidates(selection)) > 1)


def tuned(selection: BackendSelection, params: AttentionParams, inp, training: bool) -> BackendSelection:
    """``selection`` with the measured fastest candidate for ``inp``'s bucket, where autotune is
    on and consulted; else ``selection`` itself (its report says "fixed preference order")."""
    if compiling() or not applies(selection, params):
        return selection
    how, labels = mode(), candidates(selection)
    rows = inp.q.shape[0] if params.qkv_format == "thd" else inp.q.shape[0] * inp.q.shape[1]
    key = f"{how}:{bucket(params, rows, inp.q.device)}"  # each timing mode keeps its own choices
    choice = _recorded(key)
    winner = None if choice is None else choice.fastest(labels)
    if winner is None:
        if inp.q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return dataclasses.replace(selection, how="fixed preference order (a bucket's first call under CUDA-graph "
                                                      "capture is not timed)", provisional=True)
        times = dict(choice.times_ms) if choice is not None else {}
        for label in labels:
            if label not in times:
                times[label] = measure(BACKENDS_BY_LABEL[label], inp, training, how)
        choice = Choice(tuple(times.items()), how)
        _record(key, choice)
        winner = choice.fastest(labels)
    chosen = dataclasses.replace(selection, backend=BACKENDS_BY_LABEL[winner], how=choice.describe(winner, labels))
    return with_te_backends(chosen, params, installed_libraries())  # TE's tuple names the library that runs


# ---------------------------------------------------------------------------------- timing


def measure(backend: type, inp, training: bool, how: str) -> float:
    """Milliseconds per call of ``backend`` on ``inp`` (see the module docstring); tests replace
    this function with stand-in timings."""
    step = _step(backend, inp, training)
    device = inp.q.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        step()  # warm up: JIT compiles, graph builds, allocator
        if device.type != "cuda":
            return _median_ms(step, time.perf_counter)
        stream = torch.cuda.current_stream(device)
        if how == "gpu":
            return _gpu_ms(step, stream)
        return _median_ms(step, time.perf_counter, stream.synchronize)


def _step(backend: type, inp, training: bool) -> Callable[[], None]:
    """One call of ``backend`` on detached views of ``inp``'s tensors (and its backward, when
    the call wants gradients: q, k, v or the learnable sink, as selection reads it): the
    caller's autograd graph is never touched."""
    given = dict(q=inp.q, k=inp.k, v=inp.v, softmax_offset=inp.softmax_offset)
    leaves = {name: t.detach().requires_grad_(t.requires_grad) for name, t in given.items() if t is not None}
    timed = dataclasses.replace(inp, **leaves)
    wanted = [t for t in leaves.values() if t.requires_grad] if torch.is_grad_enabled() else []

    def step() -> None:
        out = backend.run(timed, training)
        out = out[0] if isinstance(out, tuple) else out
        if wanted:
            torch.autograd.grad(out, wanted, torch.ones_like(out), allow_unused=True)

    return step


def _median_ms(step, clock, sync: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(REPEATS):
        sync()
        start = clock()
        step()
        sync()
        times.append((clock() - start) * 1e3)
    return statistics.median(times)


def _gpu_ms(step, stream) -> float:
    """GPU time per call: the calls queue behind a GPU sleep, so no host gap enters the span."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(_GPU_SLEEP_CYCLES)
        start.record(stream)
        for _ in range(REPEATS):
            step()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / REPEATS


# ---------------------------------------------------------------------------------- the cache


def _recorded(key: str) -> Optional[Choice]:
    path = AUTOTUNE_CACHE.get("")
    with _lock:
        if path and path not in _loaded_from:
            _loaded_from.append(path)
            _choices.update({k: v for k, v in _read(path).items() if k not in _choices})
        return _choices.get(key)


def _record(key: str, choice: Choice) -> None:
    path = AUTOTUNE_CACHE.get("")
    with _lock:
        _choices[key] = choice
        if path:
            merged = _read(path)
            merged[key] = choice
            _write(path, merged)


def _read(path: str) -> Dict[str, Choice]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"NVTE_ATTN_AUTOTUNE_CACHE={path!r} is not a readable autotune cache: {e}") from None
    return {entry["bucket"]: Choice(tuple((k, float(v)) for k, v in entry["ms"].items()), entry["mode"])
            for entry in data.get("choices", [])}


def _write(path: str, choices: Dict[str, Choice]) -> None:
    data = {"format": 1, "choices": [dict(bucket=k, mode=c.mode, ms=dict(c.times_ms)) for k, c in choices.items()]}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)  # whole files only: another rank may read it meanwhile


def forget() -> None:
    """Drop every recorded choice of this process (tests; a cache file is read again)."""
    with _lock:
        _choices.clear()
        _loaded_from.clear()
