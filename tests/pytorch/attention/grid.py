"""Parametrization helpers."""

from __future__ import annotations

import itertools


def cycled(axes, cycle):
    """The product of ``axes``, each item extended by the next value of ``cycle`` in turn: every
    value of ``cycle`` meets every value of the first axis, not every combination. For values
    that are independent of the others (head counts, formats next to the mask arithmetic), so
    each distinct behaviour runs once instead of once per combination."""
    return [combo + tuple(value) for combo, value in zip(itertools.product(*axes), itertools.cycle(cycle))]
