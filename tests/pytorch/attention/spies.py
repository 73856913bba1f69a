"""A spy on a backend's ``run``: the prepared :class:`AttentionInputs` each call hands it."""

from __future__ import annotations

from typing import List


def spy_inputs(monkeypatch, backend) -> List:
    """Make ``backend.run`` record each call's inputs (the call still runs); returns the list."""
    seen = []
    real = backend.run

    def spy(inp, training):
        seen.append(inp)
        return real(inp, training)

    monkeypatch.setattr(backend, "run", staticmethod(spy))
    return seen
