"""The kernel interface every backend that writes into caller buffers implements (FA4, cuDNN),
and the description of one attention problem it runs, independent of :class:`AttentionInputs`.

Shape legend: T = rows of a packed (varlen) tensor, B = sequences (or the dense batch),
S = dense length, H = query heads, D/Dv = head dims.

A backend's kernel class (``_FA4Kernel``, ``_CudnnKernel``) implements::

    forward(q, k, v, problem, features, need_lse)                 -> out, stats (a list)
    backward(dout, q, k, v, out, stats, problem, features, need_dbias) -> dq, dk, dv, dbias, dsink
    stats_to_rows(stats, qs)   -> lse [H, TQ] float32, one value per row of q
    stats_from_rows(lse, qs, q) -> stats as its backward takes them
                                  (these two for one-run varlen problems: the span calls)

and is the only place that builds its library's arguments. Two callers sit on top of it: the
module's autograd (``backends/kernel_autograd.run_kernel``, a problem made from the prepared
inputs and their THD plan) and context parallelism (``spans.SpanAdapter``, a one-run problem
per span call).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import torch

from ..masks import MaskSpec

# (cu_seqlens, slot offsets) of one side of a packed batch: the rows some sequence owns.
PackedRows = Tuple[torch.Tensor, torch.Tensor]


@dataclass
class KernelRun:
    """One library call: one mask policy over the sequences it runs.

    ``offsets_*`` are the [B+1] int32 start offsets the library takes as ``cu_seqlens`` (None
    for a dense problem); ``seqused_*`` the [B] int32 valid lengths (None: up to the next
    offset for varlen, the whole S for dense; the module's plans give cuDNN lengths always, as
    its ragged graphs read them). Sequences of other policies have length 0, or,
    in a compacted call, are left out (then ``batch_size`` counts only this policy's).

    ``derived`` holds device tensors a kernel derives from this run's metadata in the forward
    and reuses in the backward, so the backward does not launch them again (cuDNN's int64
    offsets); eager calls only (under torch.compile each call derives its own)."""

    policy: int
    spec: MaskSpec
    offsets_q: Optional[torch.Tensor]
    offsets_kv: Optional[torch.Tensor]
    seqused_q: Optional[torch.Tensor]
    seqused_kv: Optional[torch.Tensor]
    batch_size: int
    derived: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


class KernelProblem(NamedTuple):
    """One attention problem over the kernel's tensors: q/k/v are [T, H, D] (``varlen``) or
    [B, S, H, D]; one :class:`KernelRun` per live mask policy.

    Immutable and typed (its runs are the plan's, shared, and nothing changes them after
    planning); a NamedTuple rather than a frozen dataclass because the module makes one per
    forward, and a frozen dataclass's ``__init__`` costs about 0.8 us more there (measured on
    a CPU core: 1.1 us against 0.34 us).

    Rows no run owns must come out exactly 0, forward and backward. What a backend needs for
    that: ``rows_q``/``rows_kv`` (a packed batch's (cu_seqlens, slot offsets), for kernels
    that leave skipped rows unwritten; None where the caller zeroes them itself, as context
    parallelism does with its spans' covered rows). FA4 and cuDNN both leave skipped rows
    unwritten, so every run of a problem writes into one set of buffers (cuDNN also leaves
    a query row that sees no key unwritten: its buffers start zero-filled where that can
    happen, see ``backends/cudnn/kernel.py``)."""

    runs: Sequence[KernelRun]
    max_seqlen_q: int
    max_seqlen_kv: int
    softmax_scale: float
    varlen: bool
    # Every sequence has sq == skv (host fact): bottom-right and top-left diagonals coincide.
    same_lengths: bool = False
    rows_q: Optional[PackedRows] = None
    rows_kv: Optional[PackedRows] = None
    # TE's num_splits: a split-KV hint for kernels that have one (None: the library's default).
    # Results do not depend on it; a kernel without split-KV ignores it.
    num_splits: Optional[int] = None
    # Known that every row of the packed tensors belongs to a sequence (VarlenPlan.rows_fact):
    # nothing is left to zero.
    every_row_owned: bool = False
    # The kernel's own scratch for library arguments that depend only on this problem (FA4's
    # keyword dicts), filled on first use by eager calls: a THD problem of a remembered
    # KernelCall lives as long as the call, so later calls and their backwards reuse what the
    # first built (a dense problem, made per call, reuses it only in its backward). None
    # (context parallelism's per-span problems): built per call.
    host: Optional[Dict[str, Any]] = None

    @property
    def zeroes_rows(self) -> bool:
        """Whether the kernel zeroes the rows no sequence owns after its runs (``rows_q`` named
        and not every row known to be owned)."""
        return self.rows_q is not None and not self.every_row_owned


@dataclass
class ScoreFeatures:
    """What a kernel adds on the way from scores to output: a post-scale ``bias`` (already in
    the inputs' dtype), ALiBi, dropout with its Philox ``rng`` (int64 [seed, offset], drawn
    once per forward from torch's generator and reused by the backward, so both see one mask),
    and the attention ``sink`` logits (float32 [H]; off-by-one passes zeros). Each backend file
    translates these into its library's arguments.

    ``max_logit`` (forward only) asks for TE's max logit: a float32 [H] buffer holding -inf,
    which a kernel whose class sets ``RETURNS_MAX_LOGIT`` raises to the max, over its runs'
    sequences, queries and allowed keys, of the scores its softmax takes."""

    bias: Optional[torch.Tensor] = None
    alibi: bool = False
    dropout_p: float = 0.0
    rng: Optional[torch.Tensor] = None
    sink: Optional[torch.Tensor] = None
    need_dsink: bool = False  # backward only: whether the sink's gradient is wanted
    max_logit: Optional[torch.Tensor] = None


# The span interface (context parallelism) carries none of them: CP refuses a bias and, on its
# span schedules, dropout.
NO_FEATURES = ScoreFeatures()


@dataclass(frozen=True)
class RowSpan:
    """One side of a call: per-sequence row ranges and which rows of the tensor they cover."""

    offsets: torch.Tensor  # [B+1] int32, non-decreasing (span starts; the last entry bounds them)
    lengths: torch.Tensor  # [B] int32
    max_len: int  # a host bound on every length
    seq: torch.Tensor  # [T] int64 sequence of each row (clamped)
    covered: torch.Tensor  # [T] bool

    @property
    def pos(self) -> torch.Tensor:
        rows = torch.arange(self.seq.numel(), device=self.seq.device)
        return rows - self.offsets.long()[self.seq]
