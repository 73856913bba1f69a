"""Host bookkeeping of one inference step: which sequences join, advance and leave.

Pure Python over host integers (TE's ``pre_step`` is a host API); the device side of a step is
filled from the :class:`StepPlan` made here, into tensors of fixed shapes.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Hashable, Optional, Tuple

import torch

from .checks import positive_int


@dataclass(frozen=True)
class StepPlan:
    """One ``pre_step``: the batch in order (batch row ``i`` is ``seq_ids[i]``, the order of the
    step dict), with each sequence's step length and its cached length after the step.

    ``old_rows[i]`` is the row the sequence held in the previous step, None when it joins now;
    ``finished`` are the cached sequences the step dict left out (freed now)."""

    seq_ids: Tuple[Hashable, ...]
    step_lens: Tuple[int, ...]
    cached_lens: Tuple[int, ...]
    old_rows: Tuple[Optional[int], ...]
    finished: Tuple[Hashable, ...]

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

    @functools.cached_property
    def moves(self) -> Tuple[Tuple[int, int], ...]:
        """(old row, new row) of the continuing sequences whose batch row changes."""
        return tuple((old, new) for new, old in enumerate(self.old_rows) if old is not None and old != new)

    @property
    def sequences(self) -> "OrderedDict[Hashable, int]":
        """TE's ``sequences``: sequence id -> cached length after the step, in batch order."""
        return OrderedDict(zip(self.seq_ids, self.cached_lens))


class CheckedStepDict(OrderedDict):
    """A step dict :func:`check_step_dict` has checked (its lengths Python ints): the manager
    that ``InferenceParams.pre_step`` hands it to does not check it again."""


def check_step_dict(step_dict, max_batch_size: int, max_ctx_len: Optional[int] = None) -> CheckedStepDict:
    """``step_dict`` (sequence id -> number of new tokens this step) checked and with its lengths
    as Python ints, in the caller's order."""
    if isinstance(step_dict, CheckedStepDict):
        return step_dict
    if not isinstance(step_dict, Mapping):
        raise TypeError(f"step_dict must be an OrderedDict of sequence id -> step length; got {type(step_dict).__name__}")
    if len(step_dict) > max_batch_size:
        raise ValueError(
            f"step_dict has {len(step_dict)} sequences; max_batch_size is {max_batch_size}"
        )
    checked = CheckedStepDict()
    for seq, n in step_dict.items():
        if isinstance(seq, torch.Tensor):
            # A tensor hashes by identity: the same id as a fresh tensor each step would never match.
            raise TypeError(f"step_dict keys must be sequence ids such as ints (use .tolist()); got a tensor {seq!r}")
        checked[seq] = _step_length(seq, n, max_ctx_len)
    return checked


def _step_length(seq, n, max_ctx_len: Optional[int]) -> int:
    if type(n) is not int or n < 1:  # the common case (a positive int) costs one test
        n = positive_int(f"step_dict[{seq!r}] (new tokens this step)", n)
    if max_ctx_len is not None and n > max_ctx_len:
        raise ValueError(f"step_dict[{seq!r}]={n} is longer than max_ctx_len={max_ctx_len}, the longest step per sequence")
    return n


def plan_step(cached: "Mapping[Hashable, int]", step_dict: "Mapping[Hashable, int]", max_seqlen: int) -> StepPlan:
    """The plan of one step over the cached sequences (id -> cached length, in batch order) and
    a checked step dict. Raises before anything changes when a sequence would outgrow the cache."""
    rows = {seq: i for i, seq in enumerate(cached)}
    cached_lens = []
    for seq, n in step_dict.items():
        after = cached.get(seq, 0) + n
        if after > max_seqlen:
            raise ValueError(
                f"step_dict[{seq!r}]={n}: sequence {seq!r} would hold {after} tokens "
                f"({cached.get(seq, 0)} cached + {n} new); max_sequence_length is {max_seqlen}"
            )
        cached_lens.append(after)
    return StepPlan(
        seq_ids=tuple(step_dict),
        step_lens=tuple(step_dict.values()),
        cached_lens=tuple(cached_lens),
        old_rows=tuple(rows.get(seq) for seq in step_dict),
        finished=tuple(seq for seq in cached if seq not in step_dict),
    )
