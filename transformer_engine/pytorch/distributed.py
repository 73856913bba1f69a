"""RNG-state tracking and the recompute context that TE-based training loops use.

``CudaRNGStatesTracker`` keeps named generator states (Megatron's "model-parallel-rng" stream
among them) and swaps one in for the body of ``fork(name)``: dropout inside the fork draws from
that stream and advances it, leaving the default stream where it was. It tracks the CUDA
generator of the current device when CUDA is available, else torch's CPU generator (where this
package's unfused backend draws its dropout on CPU).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional, Set

import torch

from .quantization import FP8GlobalStateManager

_MODEL_PARALLEL_RNG = "model-parallel-rng"

# Read by FP8 modules (here: DotProductAttention's FP8 state, fp8/context.py) to stash the forward
# scales for an activation-recompute rerun and to record no amaxes in that rerun, as TE does.
_FP8_ACTIVATION_RECOMPUTE_ENABLED = False
_FP8_ACTIVATION_RECOMPUTE_PHASE = False
_ALL_ACTIVE_RNG_STATES: Dict[str, torch.Tensor] = {}


class CudaRNGStatesTracker:
    """Named RNG states: ``add(name, seed)``, ``fork(name)``, ``get_states()``/``set_states()``, ``reset()``.

    ``device`` is ``"cuda"`` or ``"cpu"``; ``None`` means CUDA when available, else CPU.
    """

    def __init__(self, device: Optional[str] = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda', 'cpu' or None; got {device!r}")
        self.device = device
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_: Set[int] = set()

    def reset(self) -> None:
        """Forget every tracked state and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A new dict of the tracked states (the state tensors themselves are not copied)."""
        return dict(self.states_)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace the tracked states (e.g. with an earlier ``get_states()`` for recomputation)."""
        if not isinstance(states, dict):
            raise TypeError(f"states must be a dict of name -> RNG state tensor; got {type(states).__name__}")
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Track a new stream ``name`` seeded with ``seed``; the current stream is left untouched."""
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} is already tracked (under another name); each stream needs its own seed")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked; call reset() first to re-seed it")
        self.seeds_.add(seed)
        saved = self._get()
        try:
            self._seed(seed)
            self.states_[name] = self._get()
        finally:
            self._set(saved)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the body on stream ``name``; on exit store its advanced state and restore the caller's."""
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} is not tracked (tracked: {sorted(self.states_)}); add() it first")
        saved = self._get()
        self._set(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = self._get()
            self._set(saved)

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state() if self.device == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device == "cuda":
            torch.cuda.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    def _seed(self, seed: int) -> None:
        if self.device == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)


def get_all_rng_states() -> Dict[str, torch.Tensor]:
    """The states registered with :func:`set_all_rng_states` (TE keeps them for CUDA graphs)."""
    return _ALL_ACTIVE_RNG_STATES


def set_all_rng_states(states: Dict[str, torch.Tensor]) -> None:
    global _ALL_ACTIVE_RNG_STATES
    _ALL_ACTIVE_RNG_STATES = states


@contextlib.contextmanager
def activation_recompute_forward(activation_recompute: bool = False, recompute_phase: bool = False) -> Iterator[None]:
    """Marks a forward run under activation checkpointing (``recompute_phase``: the rerun in backward).

    FP8 modules read these flags to keep or reuse their FP8 scaling state ("recompute enabled"
    only inside an FP8 region). Both flags are restored on exit, so nested regions behave.
    """
    global _FP8_ACTIVATION_RECOMPUTE_ENABLED, _FP8_ACTIVATION_RECOMPUTE_PHASE
    saved = (_FP8_ACTIVATION_RECOMPUTE_ENABLED, _FP8_ACTIVATION_RECOMPUTE_PHASE)
    _FP8_ACTIVATION_RECOMPUTE_ENABLED = bool(activation_recompute) and FP8GlobalStateManager.is_fp8_enabled()
    _FP8_ACTIVATION_RECOMPUTE_PHASE = bool(recompute_phase)
    try:
        yield
    finally:
        _FP8_ACTIVATION_RECOMPUTE_ENABLED, _FP8_ACTIVATION_RECOMPUTE_PHASE = saved


def is_fp8_activation_recompute_enabled() -> bool:
    return _FP8_ACTIVATION_RECOMPUTE_ENABLED


def in_fp8_activation_recompute_phase() -> bool:
    return _FP8_ACTIVATION_RECOMPUTE_PHASE
