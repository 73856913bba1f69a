"""Host time by stage: wrappers that time named functions without changing what they do.

A stage is a set of functions (module attributes, static methods, class methods); each call of
one is timed and its EXCLUSIVE time (its own minus the wrapped calls inside it) goes to the
stage, so nested stages never count twice. Calls made inside a stage named in ``passthrough``
run unwrapped and count to that stage (a library allocating its own buffers is the library's
time, not the caller's buffers).

The wrappers cost time too, and that time lands in the caller's share: a stage that makes
many wrapped calls looks slower than it is. :func:`corrected` takes it back out: the cost per
wrapped call is fitted so that the stages sum to the same call measured without wrappers, and
each stage gives back that cost once per wrapped call it made.

Used by ``profile_stages.py``; kept apart so the patching can be read on its own.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Tuple

_perf = time.perf_counter
_MISSING = object()


class StageClock:
    """``clock.patch(owner, name, stage)`` wraps ``owner.name``; a call's times go to
    ``clock.table`` ({stage: exclusive seconds}) and ``clock.children`` ({stage: wrapped calls
    made from inside it}), which the caller swaps per call; ``clock.restore()`` undoes every patch."""

    def __init__(self) -> None:
        self.table: Dict[str, float] = defaultdict(float)
        self.children: Dict[str, int] = defaultdict(int)
        self._stack: List[list] = []  # [stage, child seconds, child calls]
        self._patches: List[Tuple[Any, str, Any]] = []

    def reset(self) -> None:
        self.table, self.children = defaultdict(float), defaultdict(int)

    def timed(self, stage: str, fn: Callable, passthrough: Tuple[str, ...] = ()) -> Callable:
        stack = self._stack

        def wrapper(*args, **kwargs):
            if passthrough and stack and stack[-1][0] in passthrough:
                return fn(*args, **kwargs)
            frame = [stage, 0.0, 0]
            stack.append(frame)
            start = _perf()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = _perf() - start
                stack.pop()
                self.table[stage] += elapsed - frame[1]
                self.children[stage] += frame[2]
                if stack:
                    stack[-1][1] += elapsed
                    stack[-1][2] += 1

        # The wrapped function's attributes come along (shared objects): FA4's entries read their
        # compile caches through their own module-level name (``_flash_attn_fwd.compile_cache``),
        # which is the wrapper while patched.
        return functools.update_wrapper(wrapper, fn)

    def run(self, stage: str, fn: Callable, *args):
        """Call ``fn`` as the outermost stage ``stage`` (what no inner stage claims lands here)."""
        return self.timed(stage, fn)(*args)

    # ------------------------------------------------------------------ patching

    def patch(self, owner: Any, name: str, stage: str, passthrough: Tuple[str, ...] = ()) -> None:
        """Wrap ``owner.name`` (a module or class attribute; static and class methods keep their kind)."""
        if not isinstance(owner, type):  # a module
            old = getattr(owner, name)
            setattr(owner, name, self.timed(stage, old, passthrough))
            self._patches.append((owner, name, old))
            return
        own = owner.__dict__.get(name, _MISSING)
        current = getattr(owner, name)
        if isinstance(own, staticmethod):
            new = staticmethod(self.timed(stage, own.__func__, passthrough))
        elif getattr(current, "__self__", None) is owner:
            # A class method, own or inherited (autograd.Function.apply): wrapped bound to owner.
            new = staticmethod(self.timed(stage, current, passthrough))
        else:  # a method (a function, or a C method descriptor such as Tensor.new_empty): bound on access
            new = self.timed(stage, current, passthrough)
        setattr(owner, name, new)
        self._patches.append((owner, name, own))

    def patch_item(self, mapping: dict, key: str, stage: str) -> None:
        """Wrap ``mapping[key]`` (the eager op table)."""
        self._patches.append((mapping, key, mapping[key]))
        mapping[key] = self.timed(stage, mapping[key])

    def restore(self) -> None:
        for owner, name, old in reversed(self._patches):
            if isinstance(owner, dict):
                owner[name] = old
            elif old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._patches.clear()


def corrected(raw: Dict[str, float], children: Dict[str, float], total: float) -> Tuple[Dict[str, float], float]:
    """(stages with the wrappers' cost taken out, that cost per wrapped call), in the units of
    ``raw``: the cost per wrapped call is what makes the stages sum to ``total``, the call
    measured without wrappers (never below 0: then the stages stay as measured)."""
    calls = sum(children.values())
    per_call = max((sum(raw.values()) - total) / calls, 0.0) if calls else 0.0
    return {stage: value - per_call * children.get(stage, 0) for stage, value in raw.items()}, per_call


def median(values: List[float]) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
