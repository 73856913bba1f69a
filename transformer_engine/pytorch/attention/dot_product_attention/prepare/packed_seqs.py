"""Packed-sequence (THD) metadata: offsets, lengths and per-token facts, all sync-free.

Shape legend: T = total tokens of the packed tensor, B = number of sequences.

``cu_seqlens`` holds cumulative VALID lengths; ``cu_seqlens_padded`` holds cumulative PHYSICAL
offsets (each slot = a sequence followed by its padding). For ``a a a _ b b _ _ c c c c _``::

    cu_seqlens        = [0, 3, 5, 9]
    cu_seqlens_padded = [0, 4, 8, 13]

Everything here reads only shapes on the host; values stay on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..environment import VALIDATE, compiling
from .metadata_cache import derived_from, owns, remembered


def check_cu_seqlens(name: str, t: Optional[torch.Tensor], batch_size: Optional[int] = None, device=None) -> None:
    """Host-only checks of a cu_seqlens tensor: type, rank, dtype, length and device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D int32 tensor of length batch_size+1; got {type(t).__name__}")
    if t.dim() != 1 or t.dtype != torch.int32 or t.numel() < 1:
        raise ValueError(
            f"{name} must be a 1-D int32 tensor of length batch_size+1; got shape {tuple(t.shape)}, dtype {t.dtype}"
        )
    if batch_size is not None and t.numel() != batch_size + 1:
        raise ValueError(
            f"{name} must have length batch_size+1 = {batch_size + 1} like the other cu_seqlens; got {t.numel()}"
        )
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on the inputs' device {device}; got {t.device}")


def infer_pad_between_seqs(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: Optional[torch.Tensor],
    cu_seqlens_kv_padded: Optional[torch.Tensor],
) -> bool:
    """Upstream's sync-free inference: gaps exist unless the padded offsets are absent or are
    the very same tensors as the unpadded ones (identity, not values: comparing values syncs)."""

    def same(padded, plain):
        return padded is None or padded is plain

    return not (same(cu_seqlens_q_padded, cu_seqlens_q) and same(cu_seqlens_kv_padded, cu_seqlens_kv))


def validation_enabled() -> bool:
    """Value checks that need a device-to-host sync run only when NVTE_ATTN_VALIDATE=1."""
    return VALIDATE.get("0") == "1"


def value_checks_on(device: torch.device) -> bool:
    """Whether checks that read tensor values run for tensors on ``device``: always on the CPU
    (reading a value costs nothing there), on CUDA only under NVTE_ATTN_VALIDATE=1 (each one is
    a device-to-host sync). Never while torch.compile traces: a value read would break the graph."""
    if compiling():
        return False
    return device.type == "cpu" or validation_enabled()


@dataclass(frozen=True)
class PackedSeqs:
    """One side (queries or keys/values) of a packed batch.

    ``offsets`` are the physical starts ([B+1]); they are ``cu_seqlens`` itself when the batch
    has no gaps. ``max_seqlen`` is a Python int bounding every valid length.
    """

    cu_seqlens: torch.Tensor
    offsets: torch.Tensor
    max_seqlen: int
    total_tokens: int
    # Set by made_safe(): lengths are also bounded by their slots and by max_seqlen.
    bounded: bool = False

    @property
    def batch_size(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def has_gaps(self) -> bool:
        return self.offsets is not self.cu_seqlens

    def seqlens(self) -> torch.Tensor:
        """Valid length of each sequence, [B] int32 (one op: diff costs less host time than two
        slices and a subtraction). After :func:`made_safe`, also at most its slot and max_seqlen."""
        if self.bounded and owns(self.offsets):
            # Bounded by made_safe from remembered offsets: the lengths are remembered with them,
            # keyed on the bounded cu_seqlens (metadata_cache.py); otherwise derived per call (a
            # cached_property would not trace under torch.compile).
            return derived_from(self.cu_seqlens, ("lengths", id(self.offsets), self.max_seqlen), self._lengths)
        return self._lengths()

    def _lengths(self) -> torch.Tensor:
        lengths = torch.diff(self.cu_seqlens)
        if not self.bounded:
            return lengths
        if self.has_gaps:
            lengths = torch.minimum(lengths, torch.diff(self.offsets))
        return lengths.clamp(max=self.max_seqlen)

    def token_seq_ids(self) -> torch.Tensor:
        """Sequence index of each token row, [T] int64; rows past the last slot get B."""
        rows = torch.arange(self.total_tokens, device=self.offsets.device, dtype=torch.int32)
        return torch.searchsorted(self.offsets, rows, right=True) - 1

    def token_valid(self) -> torch.Tensor:
        """[T] bool: True on rows that hold a token of some sequence (not gaps, not the tail)."""
        rows = torch.arange(self.total_tokens, device=self.offsets.device, dtype=torch.int64)
        seq = self.token_seq_ids().clamp(0, max(self.batch_size - 1, 0))
        if self.batch_size == 0:
            return torch.zeros_like(rows, dtype=torch.bool)
        start = self.offsets.long()[seq]
        length = self.seqlens().long()[seq]
        return (rows >= start) & (rows < start + length)

    def validate_values(self, name: str, padded_name: Optional[str] = None) -> None:
        """Checks that read values (on CUDA each is a sync; see :func:`value_checks_on`):
        non-decreasing offsets from 0 or more, slots that hold their sequence, the last one
        within the tensor, and max_seqlen bounding every length."""
        cu = self.cu_seqlens.tolist()
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        _check_sorted(name, cu)
        if self.has_gaps:
            padded_name = padded_name or f"{name}_padded"
            offsets = self.offsets.tolist()
            _check_sorted(padded_name, offsets)
            slots = [b - a for a, b in zip(offsets, offsets[1:])]
            short = [i for i, (n, s) in enumerate(zip(lengths, slots)) if s < n]
            if short:
                raise ValueError(
                    f"{padded_name} slots must each hold their sequence (slot >= length); sequences {short} have "
                    f"slots {[slots[i] for i in short]} for lengths {[lengths[i] for i in short]}"
                )
            end, end_name = offsets[-1], padded_name
        else:
            end, end_name = cu[-1], name
        if end > self.total_tokens:
            raise ValueError(f"{end_name} must end within the tensor's {self.total_tokens} rows; its last entry is {end}")
        if lengths and max(lengths) > self.max_seqlen:
            raise ValueError(
                f"max_seqlen for {name} must be at least the longest sequence ({max(lengths)}); got {self.max_seqlen}"
            )


def packed_side(cu_seqlens: torch.Tensor, offsets: torch.Tensor, max_seqlen: int, total_tokens: int,
                bounded: bool = False) -> PackedSeqs:
    """``PackedSeqs(...)`` without the frozen dataclass's ``__init__``, for the per-call paths
    (the fast path, :func:`made_safe`): its five ``object.__setattr__`` calls cost about 1 us,
    filling the instance dict 0.3 us (measured on a CPU core). The caller passes checked values.
    Under torch.compile the dataclass's own ``__init__`` runs: dynamo cannot trace the dict fill."""
    if torch.compiler.is_compiling():
        return PackedSeqs(cu_seqlens, offsets, max_seqlen, total_tokens, bounded)
    side = object.__new__(PackedSeqs)
    side.__dict__.update(cu_seqlens=cu_seqlens, offsets=offsets, max_seqlen=max_seqlen, total_tokens=total_tokens,
                         bounded=bounded)
    return side


def made_safe(pq: PackedSeqs, pk: PackedSeqs) -> "tuple[PackedSeqs, PackedSeqs]":
    """Both sides of a call with their offsets bounded on the device, keeping shared tensors
    shared (selection and the kernels tell self-attention and gaps apart by identity). A
    tensor used by both sides is clamped to the smaller side. Remembered for later calls with
    the same unchanged tensors and bounds (metadata_cache.py): the same two records, so what
    is derived from them is remembered too."""
    return safe_sides(pq.cu_seqlens, pq.offsets, pq.max_seqlen, pq.total_tokens,
                      pk.cu_seqlens, pk.offsets, pk.max_seqlen, pk.total_tokens)


def safe_sides(cu_q: torch.Tensor, off_q: torch.Tensor, max_q: int, total_q: int,
               cu_kv: torch.Tensor, off_kv: torch.Tensor, max_kv: int, total_kv: int) -> "tuple[PackedSeqs, PackedSeqs]":
    """:func:`made_safe` from the sides' fields: a remembered pair is found without building
    the two unbounded records first (only a derivation builds them)."""
    if off_q is cu_q and cu_kv is cu_q and off_kv is cu_q:
        sources: tuple = (cu_q,)  # self-attention without gaps (the common case): one tensor to key on
    else:
        sources = (cu_q, off_q, cu_kv, off_kv)
    return remembered("sides", sources, (max_q, total_q, max_kv, total_kv),
                      lambda: _made_safe(packed_side(cu_q, off_q, max_q, total_q), packed_side(cu_kv, off_kv, max_kv, total_kv)))


def one_layout(pq: PackedSeqs, pk: PackedSeqs) -> bool:
    """Whether both sides lay out the same rows: the same cu_seqlens and offsets tensors over
    tensors of the same length (self-attention; max_seqlen may differ)."""
    return pk.cu_seqlens is pq.cu_seqlens and pk.offsets is pq.offsets and pk.total_tokens == pq.total_tokens


def _made_safe(pq: PackedSeqs, pk: PackedSeqs) -> "tuple[PackedSeqs, PackedSeqs]":
    total = pq.total_tokens
    if one_layout(pq, pk):
        # Self-attention sharing its metadata (the common case): one bound tensor per distinct
        # tensor, one record for both sides when their max_seqlen agree.
        cu = _clamp_sorted(pq.cu_seqlens, total)
        offsets = cu if pq.offsets is pq.cu_seqlens else _clamp_sorted(pq.offsets, total)
        q_side = packed_side(cu, offsets, min(pq.max_seqlen, total), total, True)
        if pk.max_seqlen == pq.max_seqlen:
            return q_side, q_side
        return q_side, packed_side(cu, offsets, min(pk.max_seqlen, total), total, True)
    bound: dict = {}
    for p in (pq, pk):
        for t in (p.cu_seqlens, p.offsets):
            bound[id(t)] = min(bound.get(id(t), p.total_tokens), p.total_tokens)
    made: dict = {}

    def clamp(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = _clamp_sorted(t, bound[id(t)])
        return made[id(t)]

    return tuple(  # type: ignore[return-value]
        packed_side(clamp(p.cu_seqlens), clamp(p.offsets), min(p.max_seqlen, p.total_tokens), p.total_tokens, True)
        for p in (pq, pk)
    )


def bounded_on_device(device: torch.device) -> bool:
    """Whether THD offsets on ``device`` are bounded on the device (:func:`made_safe`) rather
    than value-checked: CUDA unless NVTE_ATTN_VALIDATE=1 (CPU tests patch this to take the
    CUDA path's route)."""
    return device.type == "cuda" and not value_checks_on(device)


def checked_or_safe(pq: PackedSeqs, pk: PackedSeqs) -> "tuple[PackedSeqs, PackedSeqs]":
    """Both sides of a THD call as the kernels may take them: on the CPU (or under
    NVTE_ATTN_VALIDATE=1) their values are checked and bad ones rejected by name; on CUDA
    otherwise they are bounded on the device (:func:`made_safe`), with no sync."""
    device = pq.cu_seqlens.device
    if bounded_on_device(device):
        return made_safe(pq, pk)
    if value_checks_on(device):
        pq.validate_values("cu_seqlens_q")
        pk.validate_values("cu_seqlens_kv")
    return pq, pk


def sides_of(cu_q: torch.Tensor, off_q: torch.Tensor, max_q: int, total_q: int,
             cu_kv: torch.Tensor, off_kv: torch.Tensor, max_kv: int, total_kv: int) -> "tuple[PackedSeqs, PackedSeqs]":
    """:func:`checked_or_safe` of the two sides these fields make, for arguments whose host
    checks have passed (the fast path): on CUDA a remembered pair comes back without the two
    records being built (0.7 us of a repeated call's host time on a CPU core)."""
    if bounded_on_device(cu_q.device):
        return safe_sides(cu_q, off_q, max_q, total_q, cu_kv, off_kv, max_kv, total_kv)
    return checked_or_safe(packed_side(cu_q, off_q, max_q, total_q), packed_side(cu_kv, off_kv, max_kv, total_kv))


def check_unpadded_offsets(name: str, cu_seqlens: torch.Tensor, padded: Optional[torch.Tensor]) -> None:
    """pad_between_seqs=False says the padded offsets equal cu_seqlens; a value check (see
    :func:`value_checks_on`) that they do, instead of silently ignoring them."""
    if padded is None or padded is cu_seqlens:
        return
    if not torch.equal(padded, cu_seqlens):
        raise ValueError(
            f"pad_between_seqs=False says there are no gaps, but {name}_padded {padded.tolist()} differs from "
            f"{name} {cu_seqlens.tolist()}; pass pad_between_seqs=True (or None to infer it)"
        )


def _check_sorted(name: str, values) -> None:
    if values and values[0] < 0:
        raise ValueError(f"{name} must start at 0 or more; got {values}")
    drops = [i for i in range(1, len(values)) if values[i] < values[i - 1]]
    if drops:
        raise ValueError(f"{name} must be non-decreasing (cumulative); it decreases at index {drops[0]}: {values}")


def _clamp_sorted(t: torch.Tensor, total: int) -> torch.Tensor:
    """``t`` made non-decreasing within [0, total]: two launches per call, so remembered for
    the later layers of a step that pass the same unchanged tensor (metadata_cache.py)."""
    return remembered("bounded", (t,), total, lambda: torch.cummax(t.clamp(0, total), dim=0)[0])


def make_packed(
    name: str,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: Optional[torch.Tensor],
    pad_between_seqs: bool,
    max_seqlen: Optional[int],
    total_tokens: int,
) -> PackedSeqs:
    """Build one side's metadata. ``max_seqlen`` is derived (with a sync) only when absent."""
    if pad_between_seqs and cu_seqlens_padded is None:
        raise ValueError(f"pad_between_seqs=True needs {name}_padded (the physical offsets); got None")
    offsets = cu_seqlens_padded if (pad_between_seqs and cu_seqlens_padded is not cu_seqlens) else cu_seqlens
    if max_seqlen is None:
        # Upstream does the same .item(); callers on the hot path pass it as an int.
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    elif not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < 0:
        raise TypeError(
            f"max_seqlen for {name} must be a non-negative Python int; got {max_seqlen!r} "
            f"(a tensor would force a device-to-host sync)"
        )
    return PackedSeqs(cu_seqlens, offsets, max_seqlen, total_tokens)


def prepare_sides(cus, max_seqlens, pad_between_seqs, totals, device) -> "tuple[PackedSeqs, PackedSeqs]":
    """Both sides of a THD call, checked and ready for the kernels: the one preparation the
    ordinary path and context parallelism share. ``cus`` = (cu_seqlens_q, cu_seqlens_kv,
    cu_seqlens_q_padded, cu_seqlens_kv_padded); ``totals`` = (q rows, kv rows) the offsets
    index (global rows under context parallelism)."""
    cu_q, cu_kv, cu_q_pad, cu_kv_pad = cus
    if cu_q is None or cu_kv is None:
        raise ValueError("qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv (int32, [batch_size+1]); got None")
    check_cu_seqlens("cu_seqlens_q", cu_q, device=device)
    b = cu_q.numel() - 1
    for name, t in (("cu_seqlens_kv", cu_kv), ("cu_seqlens_q_padded", cu_q_pad), ("cu_seqlens_kv_padded", cu_kv_pad)):
        if t is not None:
            check_cu_seqlens(name, t, b, device)
    if pad_between_seqs is None:
        pad_between_seqs = infer_pad_between_seqs(cu_q, cu_kv, cu_q_pad, cu_kv_pad)
    elif not isinstance(pad_between_seqs, bool):
        raise TypeError(f"pad_between_seqs must be None, True or False; got {pad_between_seqs!r}")
    elif not pad_between_seqs and value_checks_on(cu_q.device):
        check_unpadded_offsets("cu_seqlens_q", cu_q, cu_q_pad)
        check_unpadded_offsets("cu_seqlens_kv", cu_kv, cu_kv_pad)
    pq = make_packed("cu_seqlens_q", cu_q, cu_q_pad, pad_between_seqs, max_seqlens[0], totals[0])
    pk = make_packed("cu_seqlens_kv", cu_kv, cu_kv_pad, pad_between_seqs, max_seqlens[1], totals[1])
    return checked_or_safe(pq, pk)
