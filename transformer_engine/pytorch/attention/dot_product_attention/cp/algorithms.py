"""The three ways context parallelism moves keys/values: a p2p ring, one all-gather, and
all-to-all (Ulysses), each an autograd function on the span kernel interface (cp/spans.py).

Shape legend: T/TQ/TK = local rows (THD; dense batches arrive flattened to [B*S, H, D]),
B = sequences, H/HG = query/key heads, D/Dv = head dims, P = ranks of the level.

Everything is a device tensor op: no host syncs. Per-sequence mask policies are [B] masks
that zero the lengths of the other policies' sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

from .comm import CPComm
from .spans import RowSpan, StepMask, make_span
from .partition import ZigzagLayout, source_of_global_rows
from ..masks import MaskSpec

Call = Tuple[RowSpan, RowSpan, StepMask]


@dataclass
class CPProblem:
    """One CP attention call, prepared once (host facts plus device metadata).

    ``slots_*`` are global padded offsets ([B+1] int64; a dense batch has one slot of S per
    entry), ``lengths_*`` the global valid lengths ([B] int64), ``policy_of_seq`` [B] int64
    indexes ``specs``; ``live`` says which specs may own a sequence (host fact)."""

    slots_q: torch.Tensor
    slots_kv: torch.Tensor
    lengths_q: torch.Tensor
    lengths_kv: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int
    specs: Tuple[MaskSpec, ...]
    live: Tuple[bool, ...]
    policy_of_seq: torch.Tensor
    scale: float

    def layouts(self, size: int, rank: int) -> Tuple[ZigzagLayout, ZigzagLayout]:
        return (ZigzagLayout(self.slots_q, self.lengths_q, size, rank),
                ZigzagLayout(self.slots_kv, self.lengths_kv, size, rank))

    def seqs_of(self, p: int) -> torch.Tensor:
        return self.policy_of_seq == p

    def causal_seqs(self) -> torch.Tensor:
        """[B] bool: sequences whose policy is causal (p2p supports causal and full only)."""
        # Built on the device from host facts: a tensor made from a Python list is a blocking
        # host-to-device copy (a sync).
        causal = torch.zeros_like(self.policy_of_seq, dtype=torch.bool)
        for p, spec in enumerate(self.specs):
            if spec.mask_type.is_causal:
                causal |= self.policy_of_seq == p
        return causal

    def policy_kinds(self) -> Tuple[bool, bool]:
        """(some live policy is causal, some live policy is full)."""
        kinds = [s.mask_type.is_causal for s, live in zip(self.specs, self.live) if live]
        return any(kinds), not all(kinds)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def merge_partial(acc: Optional[Tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor, lse: torch.Tensor):
    """Combine two softmax partials by their log-sum-exp ([TQ, H, Dv], [H, TQ]); rows with
    -inf on both sides stay 0 / -inf."""
    out = out.to(_acc_dtype(out))
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new = torch.logaddexp(acc_lse, lse)
    safe = torch.where(torch.isinf(new), 0, new)
    w_old = torch.exp(acc_lse - safe).t().unsqueeze(-1)
    w_new = torch.exp(lse - safe).t().unsqueeze(-1)
    return acc_out * w_old.to(acc_out.dtype) + out * w_new.to(acc_out.dtype), new


def _flat_cat(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _flat_split(buf: torch.Tensor, like: Tuple[torch.Tensor, ...]) -> List[torch.Tensor]:
    out, at = [], 0
    for t in like:
        out.append(buf[at : at + t.numel()].view(t.shape))
        at += t.numel()
    return out


# ---------------------------------------------------------------------------------- p2p ring


@dataclass
class RingPlan:
    """A ring over ``comm``: per step, the kernel calls for the block that step holds."""

    comm: CPComm
    kernel: Any
    scale: float
    steps: List[List[Call]]


def ring_plan(prob: CPProblem, comm: CPComm, kernel: Any, tq: int, tk: int) -> RingPlan:
    """Step t holds the kv block of rank src = rank - t. Diagonal (src == rank): the local slot
    pair keeps global order, so causal over it is exact; other policies attend fully. src <
    rank: causal sequences see only the block's first chunk (all of it). src > rank: only the
    second q chunk of causal sequences sees the block (all of it). Full sequences: all rows."""
    size, rank = comm.size, comm.rank
    lq, lk = prob.layouts(size, rank)
    causal = prob.causal_seqs()
    has_causal, has_full = prob.policy_kinds()
    zero = torch.zeros_like(prob.lengths_q)
    q_all = lq.local_valid()
    sq = lambda shift, n: make_span(lq.local_offsets, shift, n, tq, prob.max_seqlen_q)  # noqa: E731
    sk = lambda n: make_span(lk.local_offsets, zero, n, tk, prob.max_seqlen_kv)  # noqa: E731
    steps = []
    for t in range(size):
        src = (rank - t) % size
        k_all = lk.local_valid(src)
        if src == rank:
            calls = []
            if has_causal:
                calls.append((sq(zero, torch.where(causal, q_all, 0)), sk(torch.where(causal, k_all, 0)), StepMask(True)))
            if has_full:
                calls.append((sq(zero, torch.where(causal, 0, q_all)), sk(torch.where(causal, 0, k_all)), StepMask(False)))
        elif src < rank:
            calls = [(sq(zero, q_all), sk(torch.where(causal, lk.first_valid(src), k_all)), StepMask(False))]
        else:
            shift = torch.where(causal, lq.chunk, 0)
            calls = [(sq(shift, torch.where(causal, lq.second_valid(), q_all)), sk(k_all), StepMask(False))]
        steps.append(calls)
    return RingPlan(comm, kernel, prob.scale, steps)


def _neighbours(comm: CPComm) -> Tuple[int, int]:
    return (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size


def ring_forward(q, k, v, plan: RingPlan):
    nxt, prv = _neighbours(plan.comm)
    kv = _flat_cat(k, v)
    acc = None
    for t, calls in enumerate(plan.steps):
        pending = plan.comm.exchange(kv, nxt, prv) if t + 1 < len(plan.steps) else None
        kc, vc = _flat_split(kv, (k, v))
        for qs, ks, mask in calls:
            acc = merge_partial(acc, *plan.kernel.forward(q, kc, vc, qs, ks, mask, plan.scale))
        if pending is not None:
            kv = pending.wait()  # the transfer ran beside this step's kernels
    return acc


def ring_backward(dout, q, k, v, out, lse, plan: RingPlan):
    """The ring again; each block's dk/dv accumulator travels with it and arrives home last."""
    nxt, prv = _neighbours(plan.comm)
    acc = _acc_dtype(q)
    kv = _flat_cat(k, v)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    pending_dkv, dkv = None, None
    for t, calls in enumerate(plan.steps):
        pending_kv = plan.comm.exchange(kv, nxt, prv) if t + 1 < len(plan.steps) else None
        kc, vc = _flat_split(kv, (k, v))
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for qs, ks, mask in calls:
            gq, gk, gv = plan.kernel.backward(dout, q, kc, vc, out, lse, qs, ks, mask, plan.scale)
            dq += gq
            dk += gk
            dv += gv
        step = _flat_cat(dk, dv)
        dkv = step if pending_dkv is None else pending_dkv.wait() + step
        if plan.comm.size > 1:
            pending_dkv = plan.comm.exchange(dkv, nxt, prv)
        if pending_kv is not None:
            kv = pending_kv.wait()
    if pending_dkv is not None:
        dkv = pending_dkv.wait()
    dk, dv = _flat_split(dkv, (k, v))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """p2p context parallelism: out = attention of local q over every rank's kv."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan):
        out, lse = ring_forward(q, k, v, plan)
        out = out.to(q.dtype)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.plan), None)


# ---------------------------------------------------------------------------------- all-gather


@dataclass
class GatherPlan:
    comm: CPComm
    kernel: Any
    scale: float
    calls: List[Call]
    index: torch.Tensor  # [P*TK] gathered row (rank-major) of each global kv row


def gather_plan(prob: CPProblem, comm: CPComm, kernel: Any, tq: int, tk: int) -> GatherPlan:
    """Each local q chunk attends the gathered kv up to the end of its chunk (causal, with its
    window, aligned bottom-right there) or all of it (full), one call per chunk and policy."""
    size, rank = comm.size, comm.rank
    lq, lk = prob.layouts(size, rank)
    tg = size * tk
    rows = torch.arange(tg, device=prob.slots_kv.device)
    src_rank, src_row = source_of_global_rows(prob.slots_kv, size, rows, tk)
    zero = torch.zeros_like(prob.lengths_q)
    calls = []
    for chunk, shift, n_q in ((rank, zero, lq.first_valid()), (2 * size - 1 - rank, lq.chunk, lq.second_valid())):
        for p, (spec, live) in enumerate(zip(prob.specs, prob.live)):
            if not live:
                continue
            mine = prob.seqs_of(p)
            causal = spec.mask_type.is_causal
            n_kv = lk.end_of_chunk(chunk) if causal else prob.lengths_kv
            qs = make_span(lq.local_offsets, shift, torch.where(mine, n_q, 0), tq, prob.max_seqlen_q)
            ks = make_span(prob.slots_kv, zero, torch.where(mine, n_kv, 0), tg, prob.max_seqlen_kv)
            calls.append((qs, ks, StepMask(causal, spec.window[0] if causal else -1)))
    return GatherPlan(comm, kernel, prob.scale, calls, src_rank * tk + src_row)


class AllGatherAttention(torch.autograd.Function):
    """all_gather context parallelism: kv gathered once; backward reduce-scatters dk/dv."""

    @staticmethod
    def forward(ctx, q, k, v, plan: GatherPlan):
        kv = torch.cat([k, v], dim=-1)
        gathered = plan.comm.all_gather(kv).flatten(0, 1).index_select(0, plan.index)
        kg, vg = gathered.split([k.shape[-1], v.shape[-1]], dim=-1)
        acc = None
        for qs, ks, mask in plan.calls:
            acc = merge_partial(acc, *plan.kernel.forward(q, kg, vg, qs, ks, mask, plan.scale))
        out = acc[0].to(q.dtype)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, kg, vg, out, acc[1])
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, kg, vg, out, lse = ctx.saved_tensors
        plan = ctx.plan
        acc = _acc_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(*kg.shape[:-1], kg.shape[-1] + vg.shape[-1], dtype=acc, device=q.device)
        dout = dout.contiguous()
        for qs, ks, mask in plan.calls:
            gq, gk, gv = plan.kernel.backward(dout, q, kg, vg, out, lse, qs, ks, mask, plan.scale)
            dq += gq
            dkv += torch.cat([gk, gv], dim=-1)
        by_rank = torch.zeros_like(dkv).index_copy_(0, plan.index, dkv)  # a permutation
        mine = plan.comm.reduce_scatter(by_rank.view(plan.comm.size, -1, *dkv.shape[1:]))
        dk, dv = mine.split([k.shape[-1], v.shape[-1]], dim=-1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


# ---------------------------------------------------------------------------------- all-to-all


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all over dim 0; its own adjoint."""

    @staticmethod
    def forward(ctx, x, comm: CPComm):
        ctx.comm = comm
        return comm.all_to_all(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_to_all(grad), None


def level_index(slots: torch.Tensor, lengths: torch.Tensor, cp: int, comm: CPComm, group_rank: int, t: int) -> torch.Tensor:
    """[A*T] rows of the all-to-all result (rank-major: a*T + local row of CP rank
    group_rank*A + a) that make up, in order, the zigzag layout of P = cp/A ranks at rank
    ``group_rank``. With P = 1 that is plain global order."""
    a_size = comm.size
    level = ZigzagLayout(slots, lengths, cp // a_size, group_rank)
    g = level.global_rows(a_size * t)
    rank, local = source_of_global_rows(slots, cp, g, t)
    return (rank - group_rank * a_size) * t + local


def heads_to_level(x: torch.Tensor, comm: CPComm, index: torch.Tensor) -> torch.Tensor:
    """[T, H, D] sequence-split -> [A*T, H/A, D]: all tokens of the A ranks, H/A heads."""
    t, h, d = x.shape
    a = comm.size
    send = x.reshape(t, a, h // a, d).transpose(0, 1)
    recv = _AllToAll.apply(send, comm)
    return recv.reshape(a * t, h // a, d).index_select(0, index)


def level_to_heads(y: torch.Tensor, comm: CPComm, index: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`heads_to_level`."""
    a = comm.size
    rows, hl, d = y.shape
    t = rows // a
    z = torch.zeros_like(y).index_copy(0, index, y)
    recv = _AllToAll.apply(z.view(a, t, hl, d), comm)
    return recv.transpose(0, 1).reshape(t, a * hl, d)
