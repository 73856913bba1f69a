"""THD routing: how a packed batch maps onto varlen kernel calls (one run per mask policy), the
row owners and combine of the libraries with their own autograd (FA3, flash-attn 2), and the NaN
guard for kernels that read whole tiles.

Packed (THD) batches reach every GPU library the same way (:class:`VarlenPlan`): physical slot
offsets as ``cu_seqlens``, valid lengths as per-sequence lengths (``seqused``), and one call per
live mask policy in which the other policies' sequences have length 0; with
NVTE_THD_POLICY_COMPACT=1 and policy sizes known from shapes, each call instead gets only its
own sequences (gathered offsets and lengths: a :class:`KernelRun` of fewer sequences). Rows no
call owns (gaps between sequences, the tail, other policies' rows) come out exactly 0, forward
and backward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..environment import SANITIZE_GAPS, THD_POLICY_COMPACT, compiling
from .gap_rows import FA4_MAX_TILE_ROWS
from .kernel_problem import KernelRun, PackedRows
from ..prepare.inputs import AttentionInputs
from ..prepare.metadata_cache import LateFact, derived_from, owns
from ..prepare.packed_seqs import PackedSeqs, one_layout
from . import kernel_ops



@dataclass
class VarlenPlan:
    """How a packed batch maps onto varlen kernel calls: one run per live policy, each with the
    offsets it passes (the batch's physical ones, or, compacted, its own), and whether the batch
    has gaps. A remembered plan also carries ``rows_fact``: whether every row of the q and kv
    tensors belongs to a sequence (:func:`rows_fact`)."""

    calls: List[KernelRun]
    has_gaps: bool
    rows_fact: Optional[LateFact] = None

    def every_row_owned(self) -> bool:
        """Known (never waited for) that no row is left to zero: no gap, no tail, so neither
        the gap-row zeroing nor FA4's NaN guard has a row to write."""
        return self.rows_fact is not None and self.rows_fact.holds()


def plan_varlen(inp: AttentionInputs, always_lengths: bool = False) -> VarlenPlan:
    """``always_lengths``: give the runs valid lengths even where the offsets bound them (no
    gaps, one policy), for kernels that always take lengths (cuDNN); the FlashAttention
    libraries run without them there."""
    pq, pk = inp.packed_q, inp.packed_kv
    policies = inp.policies
    if policies is None and owns(pk):
        # Both sides remembered (metadata_cache.py): so is their one-run plan (its runs hold
        # only their tensors; cuDNN keeps its int64 offsets on the run), with its rows fact.
        return derived_from(pq, ("plan", id(pk), inp.mask, always_lengths),
                            lambda: _remembered_plan(pq, pk, inp.mask, always_lengths))
    return _plan(pq, pk, policies, inp.mask if policies is None else policies.uniform_spec(), always_lengths)


def _remembered_plan(pq: PackedSeqs, pk: PackedSeqs, spec, always_lengths: bool) -> VarlenPlan:
    plan = _plan(pq, pk, None, spec, always_lengths)
    # One fact per remembered pair of sides, shared by every plan over them (FA4's and cuDNN's).
    if pq.batch_size:
        plan.rows_fact = derived_from(pq, ("rows", id(pk)), lambda: rows_fact(pq, pk))
    return plan


def rows_fact(pq: PackedSeqs, pk: PackedSeqs) -> LateFact:
    """Whether ``zero_gap_rows`` would find no row to write in the q and kv tensors, as a
    :class:`LateFact` (one or two small launches for self-attention without gaps, about a dozen
    with gaps or distinct sides, and the copy; once per remembered pair of sides of at least one
    sequence). On a short batch the zeroing launch costs as much host time as the rest of the
    call's own Python (a Triton launch: 71-126 us of the H200's host), and most packed batches
    fill their tensors: the calls made after the fact has landed (the later layers of a step and
    their backwards) skip it."""
    if one_layout(pq, pk):
        return LateFact(_owned_rows(pq), [pq.total_tokens])
    return LateFact(torch.cat([_owned_rows(pq), _owned_rows(pk)]), [pq.total_tokens, pk.total_tokens])


def _owned_rows(p: PackedSeqs) -> torch.Tensor:
    """[1] int64: how many rows of the side's tensor ``zero_gap_rows`` leaves alone, for
    bounded offsets (non-decreasing within [0, T]). Sequence b holds min(len_b, slot_b) rows of
    its slot, the last slot running to T; the rest of the tensor is what the zeroing writes."""
    cu, off = p.cu_seqlens, p.offsets
    if off is cu:  # rows [cu[0], cu[B]) belong to sequences
        return (cu[-1:] - cu[:1]).long()
    slots = torch.nn.functional.pad(off[1:-1], (0, 1), value=p.total_tokens) - off[:-1]
    return torch.minimum(torch.diff(cu), slots).sum(dtype=torch.int64).view(1)


def _plan(pq: PackedSeqs, pk: PackedSeqs, policies, spec, always_lengths: bool) -> VarlenPlan:
    gaps = pq.has_gaps or pk.has_gaps
    b = pq.batch_size
    if spec is not None:
        if not gaps:
            len_q, len_kv = _valid_lengths(pq, pk) if always_lengths else (None, None)
            return VarlenPlan([KernelRun(0, spec, pq.cu_seqlens, pk.cu_seqlens, len_q, len_kv, b)], False)
        len_q, len_kv = _valid_lengths(pq, pk)
        return VarlenPlan([KernelRun(0, spec, pq.offsets, pk.offsets, len_q, len_kv, b)], True)
    len_q, len_kv = _valid_lengths(pq, pk)
    if policies.sizes is not None and THD_POLICY_COMPACT.get("0") == "1":
        return VarlenPlan(_compacted_calls(policies, pq, pk, len_q, len_kv), gaps)
    calls = []
    for p in policies.active():
        mine = policies.seq_mask(p)
        used_q = torch.where(mine, len_q, 0)
        # One tensor for both sides when the lengths are one tensor (a launch saved per policy).
        used_kv = used_q if len_kv is len_q else torch.where(mine, len_kv, 0)
        calls.append(KernelRun(p, policies.specs[p], pq.offsets, pk.offsets, used_q, used_kv, b))
    return VarlenPlan(calls, gaps)


def _compacted_calls(policies, pq: PackedSeqs, pk: PackedSeqs, len_q, len_kv) -> List[KernelRun]:
    """One call per live policy over only its sequences, in batch order, sizes from shapes.

    ``nonzero_static`` finds a policy's sequences on the device with a size known on the host
    (no sync). Ascending order matters: FA's varlen backward places each sequence's dQ
    accumulator by its start offset plus a per-index pad, which stays disjoint only while starts
    grow with the index, as in the whole batch. Ids that are malformed (repeated, out of range)
    leave fewer sequences than the shape says; the spare entries run a length of 0 at the last
    sequence's start (never past the tensor)."""
    b = pq.batch_size
    lengths_q, lengths_kv = (torch.nn.functional.pad(t, (0, 1)) for t in (len_q, len_kv))  # index b: length 0
    calls = []
    for p in policies.active():
        ids = torch.nonzero_static(policies.seq_mask(p), size=policies.sizes[p], fill_value=b).view(-1)
        starts = torch.nn.functional.pad(ids.clamp(max=max(b - 1, 0)), (0, 1), value=b)  # [n + 1]
        offsets_q = pq.offsets[starts]
        offsets_kv = offsets_q if pk.offsets is pq.offsets else pk.offsets[starts]
        used_q = lengths_q[ids]
        used_kv = used_q if len_kv is len_q else lengths_kv[ids]
        calls.append(KernelRun(p, policies.specs[p], offsets_q, offsets_kv, used_q, used_kv, policies.sizes[p]))
    return calls


def _valid_lengths(pq: PackedSeqs, pk: PackedSeqs) -> Tuple[torch.Tensor, torch.Tensor]:
    len_q = pq.seqlens()
    # The queries' lengths serve the keys only when every fact bounding them is the same: after
    # made_safe they are also capped by each side's own slots and max_seqlen.
    same = (pk.cu_seqlens is pq.cu_seqlens and pk.offsets is pq.offsets and pk.max_seqlen == pq.max_seqlen
            and pk.total_tokens == pq.total_tokens)
    return len_q, len_q if same else pk.seqlens()


def _row_owner(p: PackedSeqs, seq_policy: Optional[torch.Tensor]) -> torch.Tensor:
    """[T] int64: the policy of each row's sequence (0 without policies), -1 where no sequence lives."""
    if p.batch_size == 0:
        return torch.full((p.total_tokens,), -1, dtype=torch.int64, device=p.offsets.device)
    if seq_policy is None:
        seq_policy = torch.zeros(p.batch_size, dtype=torch.int64, device=p.offsets.device)
    seq = p.token_seq_ids().clamp(0, p.batch_size - 1)
    return torch.where(p.token_valid(), seq_policy[seq], -1)


def _owners(inp: AttentionInputs) -> Tuple[torch.Tensor, torch.Tensor]:
    seq_policy = inp.policies.policy_of_seq if inp.policies is not None else None
    return _row_owner(inp.packed_q, seq_policy), _row_owner(inp.packed_kv, seq_policy)


def combine_rows(owner: torch.Tensor, parts: Sequence[Tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Row r of the result is row r of the part whose policy owns it; unowned rows are 0."""
    view = tuple(owner.shape) + (1,) * (parts[0][1].dim() - owner.dim())
    result = torch.zeros((), dtype=parts[0][1].dtype, device=parts[0][1].device)
    for policy, part in parts:
        result = torch.where(owner.view(view) == policy, part, result)
    return result


class _MaskRowGrad(torch.autograd.Function):
    """Identity forward; the backward keeps only rows where ``keep`` is True (others exactly 0).

    Used around libraries with their own autograd, which allocate gradients without zeroing
    the rows they skip."""

    @staticmethod
    def forward(ctx, x, keep):
        ctx.save_for_backward(keep)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return torch.where(keep.view(-1, *([1] * (grad.dim() - 1))), grad, 0), None


def gap_guard(plan: Optional[VarlenPlan], kernel) -> str:
    """How the NaN guard of FA4 (and FA3) runs for this call: "inplace" (default), "copy", "off".

    FA4 loads whole tiles, so the rows just past a sequence end enter its products with weight
    0, and 0 * NaN = NaN: NaN in a gap would leak into valid rows (seen on the H200). The guard
    zeroes the first FA4_MAX_TILE_ROWS unowned rows after each sequence (no kernel reads further).
    In place, it writes only those rows of the caller's q/k/v, which belong to no sequence;
    NVTE_FLASH_ATTN_SANITIZE_GAPS=copy works on copies instead (inputs untouched, one copy per
    tensor); =0 skips the guard (gap rows known to be finite). Under torch.compile the guard
    copies: an in-place write to graph inputs would become a copy there anyway. Off once the
    plan's rows fact says every row belongs to a sequence (no row for the guard to write)."""
    if plan is None or not plan.has_gaps or not kernel.SANITIZE_GAPS or plan.every_row_owned():
        return "off"
    mode = SANITIZE_GAPS.get("1")
    if mode == "0":
        return "off"
    if mode == "copy" or compiling():
        return "copy"
    return "inplace"



def packed_rows(inp: AttentionInputs) -> Tuple[PackedRows, PackedRows]:
    """(cu_seqlens, slot offsets) of q's and kv's packed rows."""
    return (inp.packed_q.cu_seqlens, inp.packed_q.offsets), (inp.packed_kv.cu_seqlens, inp.packed_kv.offsets)


def zero_spill_rows(rows_q: PackedRows, rows_kv: PackedRows, q, k, v):
    """Zero, in place, the rows of q/k/v that FA4 may load past each sequence end."""
    if k is v:  # one tensor passed as both: the registered fused op must not get it twice
        kernel_ops.ops.zero_gap_rows(q, *rows_q, FA4_MAX_TILE_ROWS)
        kernel_ops.ops.zero_gap_rows(k, *rows_kv, FA4_MAX_TILE_ROWS)
    else:
        kernel_ops.ops.zero_gap_rows_qkv(q, k, v, *rows_q, *rows_kv, FA4_MAX_TILE_ROWS)
    return q, k, v


def zero_spill_rows_in_place(inp: AttentionInputs) -> None:
    with torch.no_grad():
        zero_spill_rows(*packed_rows(inp), inp.q.detach(), inp.k.detach(), inp.v.detach())
    # The eager kernel writes through raw pointers; tell autograd the tensors changed, so a node
    # that saved one of them before this call fails loudly instead of using the new values.
    torch.autograd.graph.increment_version([inp.q, inp.k, inp.v])


def guard_library_inputs(inp: AttentionInputs, plan: VarlenPlan, backend) -> AttentionInputs:
    """FA4's NaN guard (see ``gap_guard``) for a library with its own autograd: FA3 reads whole
    tiles too. The copy variant clones under autograd, so gradients still reach the inputs."""
    guard = gap_guard(plan, backend)
    if guard == "inplace":
        zero_spill_rows_in_place(inp)
    elif guard == "copy":
        copies = [t.clone() for t in (inp.q, inp.k, inp.v)]
        with torch.no_grad():
            zero_spill_rows(*packed_rows(inp), *(t.detach() for t in copies))
        inp = dataclasses.replace(inp, q=copies[0], k=copies[1], v=copies[2])
    return inp



def run_library_varlen(inp: AttentionInputs, plan: VarlenPlan, call_fn) -> torch.Tensor:
    """For libraries with their own autograd, which allocate outputs and gradients themselves
    (skipped rows, the tail included, hold garbage): each call sees inputs whose gradient keeps
    only that call's rows, and the outputs are combined row by row."""
    owner_q, owner_kv = _owners(inp)
    parts = []
    for call in plan.calls:
        q = _MaskRowGrad.apply(inp.q, owner_q == call.policy)
        k = _MaskRowGrad.apply(inp.k, owner_kv == call.policy)
        v = _MaskRowGrad.apply(inp.v, owner_kv == call.policy)
        parts.append((call.policy, call_fn(q, k, v, inp, call)))
    return combine_rows(owner_q, parts)

