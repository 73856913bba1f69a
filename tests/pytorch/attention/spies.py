"""Spies: a backend's ``run`` (the prepared :class:`AttentionInputs` each call hands it), the
gap-row zeroing launches, an RNG tracker that counts its forks, and dispatch modes that watch
what aten ops return (the largest tensor, the peak of live storages)."""

from __future__ import annotations

import contextlib
import weakref
from typing import List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def spy_inputs(monkeypatch, backend) -> List:
    """Make ``backend.run`` record each call's inputs (the call still runs); returns the list."""
    seen = []
    real = backend.run

    def spy(inp, training):
        seen.append(inp)
        return real(inp, training)

    monkeypatch.setattr(backend, "run", staticmethod(spy))
    return seen


class ForkingTracker:
    """Megatron-style RNG tracker: fork() swaps in its own CPU generator state (``forks`` counts them)."""

    def __init__(self, seed: int):
        self.state = torch.Generator().manual_seed(seed).get_state()
        self.forks = 0

    @contextlib.contextmanager
    def fork(self):
        self.forks += 1
        saved = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(saved)


def _spy_ops(monkeypatch, names, record) -> None:
    """Call ``record(name, args)`` before each eager call of the named ``kernel_ops`` ops."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends import kernel_ops

    for name in names:
        real = kernel_ops._EAGER[name]
        monkeypatch.setitem(kernel_ops._EAGER, name, lambda *args, _n=name, _r=real: (record(_n, args), _r(*args)))


def spy_zeroing(monkeypatch) -> List:
    """Record the shape of every tensor the ``zero_gap_rows`` op zeroes (the op still runs)."""
    zeroed = []
    _spy_ops(monkeypatch, ("zero_gap_rows",), lambda name, args: zeroed.append(args[0].shape))
    return zeroed


def spy_zeroing_ops(monkeypatch) -> List:
    """Record the name of each zeroing op called (``zero_gap_rows``, ``zero_gap_rows_qkv``;
    the ops still run)."""
    made = []
    _spy_ops(monkeypatch, ("zero_gap_rows", "zero_gap_rows_qkv"), lambda name, args: made.append(name))
    return made


class LargestTensor(TorchDispatchMode):
    """Records the largest floating-point tensor any aten op returns while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.numel = max(self.numel, t.numel())
        return out


class PeakMemory(TorchDispatchMode):
    """Peak bytes of live storages that ops create while active (forward and backward), freed
    when the storage dies. Deterministic: it counts what ops return, not what an allocator
    caches, so it does not depend on the machine (workspace inside one kernel is not seen).
    ``existing`` tensors (the inputs) are not counted, nor are views of them."""

    def __init__(self, existing=()):
        super().__init__()
        self.live = self.peak = 0
        self.seen = weakref.WeakSet(t.untyped_storage() for t in existing)

    def _free(self, nbytes):
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage() not in self.seen:
                storage = t.untyped_storage()
                self.seen.add(storage)
                self.live += storage.nbytes()
                weakref.finalize(storage, self._free, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out
