"""Context parallelism for DotProductAttention: TE's contract, on torch.distributed.

Contract (TE's, so callers change nothing):

* bshd/sbhd: the sequence is cut into 2 x cp chunks; rank r holds chunks r and 2cp-1-r.
* THD: every slot of ``cu_seqlens_*_padded`` (``cu_seqlens_*`` when there are no gaps) has a
  length divisible by 2 x cp and is cut the same way, slot by slot, in sequence order. Each rank
  passes the GLOBAL ``cu_seqlens_*``, ``cu_seqlens_*_padded`` and ``max_seqlen_*`` with its local
  rows, and gets its local rows back; padding rows are exactly 0 in outputs and gradients.
* ``cp_comm_type``: ``"p2p"`` (ring of kv blocks), ``"all_gather"`` (kv gathered once),
  ``"a2a"`` (Ulysses: heads scattered, sequence gathered, the backend's ordinary call on the
  whole sequences), ``"a2a+p2p"`` (``cp_group=[a2a_group, p2p_group]``: all-to-all inside
  each a2a group, then a ring across them; the CP rank is p2p_rank * a2a_size + a2a_rank).

How a call travels: ``DotProductAttention.forward`` checks the rules that come before preparing
(:func:`check_layout`, ``support.reject_settings``), prepares the call once like any other
(``prepare(..., cp_size)``: the same record, with global THD metadata), turns it into CP's form
here (:func:`cp_call`, which checks ``support.cp_reasons`` before any communication), selects a
backend from ``selection_params(..., context_parallel=True, cp_comm_type=...)`` and runs
:func:`run_cp`. Ring and all-gather steps call the backend's kernel interface through
``spans.span_kernel``; a2a calls the backend's ``run`` on a whole-sequence record derived from
the prepared one. Nothing here imports the module: arrows run module -> cp -> backends.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from ..prepare.inputs import AttentionInputs
from ..prepare.packed_seqs import value_checks_on
from .algorithms import AllGatherAttention, CPProblem, RingAttention, gather_plan, heads_to_level, level_index, level_to_heads, ring_plan
from .comm import CPComm
from .partition import check_slots
from .spans import span_kernel
from .support import CP_COMM_TYPES, CPFacts, cp_reasons


@dataclass(frozen=True)
class CPConfig:
    """The module's CP settings. ``groups`` is one group, or (a2a_group, p2p_group)."""

    groups: Tuple[Any, ...]
    global_ranks: Optional[Tuple[int, ...]]
    stream: Any
    comm_type: str
    size: int  # ranks sharing each sequence (the product of the groups' sizes)

    @property
    def rank(self) -> int:
        """This process's CP rank: the share of the sequence its inputs hold (for a2a+p2p,
        p2p_rank * a2a_size + a2a_rank)."""
        ranks = [(g.rank, g.size) if isinstance(g, CPComm) else (dist.get_rank(g), dist.get_world_size(g)) for g in self.groups]
        return combined_rank(ranks)


def make_cp_config(cp_group, cp_global_ranks, cp_stream, cp_comm_type) -> Optional[CPConfig]:
    """Parse TE's four CP arguments; None when ``cp_group`` is None."""
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type must be one of {', '.join(CP_COMM_TYPES)}; got {cp_comm_type!r}")
    if cp_group is None:
        return None
    if cp_comm_type == "a2a+p2p":
        if not isinstance(cp_group, (list, tuple)) or len(cp_group) != 2:
            raise TypeError(f"cp_comm_type='a2a+p2p' needs cp_group=[a2a_group, p2p_group]; got {type(cp_group).__name__}")
        groups = tuple(cp_group)
    elif isinstance(cp_group, (list, tuple)):
        raise TypeError(f"cp_group must be one process group for cp_comm_type={cp_comm_type!r}; got a {type(cp_group).__name__}")
    else:
        groups = (cp_group,)
    # A CPComm (a subclass) in place of a process group brings its own transport: how the
    # tests drive a CP step on one GPU without host staging (sync and graph checks).
    if not all(isinstance(g, CPComm) for g in groups) and (not dist.is_available() or not dist.is_initialized()):
        raise ValueError("cp_group was given but torch.distributed is not initialized; call init_process_group first")
    size = 1
    for g in groups:
        size *= g.size if isinstance(g, CPComm) else dist.get_world_size(g)
    ranks = tuple(int(r) for r in cp_global_ranks) if cp_global_ranks is not None else None
    if ranks is not None and len(ranks) != size:
        raise ValueError(f"cp_global_ranks must list the {size} ranks of the CP group; got {len(ranks)}")
    return CPConfig(groups, ranks, cp_stream, cp_comm_type, size)


def combined_rank(ranks: Sequence[Tuple[int, int]]) -> int:
    """The CP rank from each level's (rank, size), a2a level first: for a2a+p2p,
    p2p_rank * a2a_size + a2a_rank (TE's rule); one level: its rank."""
    if len(ranks) == 1:
        return ranks[0][0]
    (a2a_rank, a2a_size), (p2p_rank, _) = ranks
    return p2p_rank * a2a_size + a2a_rank


# ---------------------------------------------------------------------------------- before preparing


def check_layout(size: int, qkv_format: str, qkv, cus, pad_between_seqs) -> None:
    """CP's layout rule, before the preparation reads any value: every THD slot (of the offsets
    the slots come from) or the global dense length divides by 2 x cp. Slot values are read on
    the CPU always, on CUDA under NVTE_ATTN_VALIDATE=1 (:func:`.partition.check_slots`)."""
    if qkv_format == "thd":
        for name, cu, pad in (("cu_seqlens_q", cus[0], cus[2]), ("cu_seqlens_kv", cus[1], cus[3])):
            padded = pad is not None and pad is not cu and pad_between_seqs is not False
            offsets = pad if padded else cu
            if isinstance(offsets, torch.Tensor) and offsets.dim() == 1:
                check_slots(name + "_padded" if padded else name, offsets, size, value_checks_on(offsets.device))
        return
    seq_dim = 0 if qkv_format == "sbhd" else 1
    for name, t in (("query_layer", qkv.q), ("key_layer", qkv.k)):
        s = t.shape[seq_dim] if t.dim() == 4 else 0  # a wrong rank is the preparation's error
        if s % 2:  # s x size divides by 2 x size exactly when s is even
            raise ValueError(f"{name}: the global sequence length ({s} local rows x cp size {size}) must be divisible by "
                             f"2 x cp size = {2 * size} under context parallelism")


# ---------------------------------------------------------------------------------- the call in CP's form


@dataclass(frozen=True)
class CPCall:
    """A prepared record in CP's form: its rows [T, H, D] (a dense batch flattened), the
    problem the schedules plan from, and the groups. Built by :func:`cp_call`."""

    inp: AttentionInputs
    cfg: CPConfig
    comms: Tuple[CPComm, ...]
    problem: CPProblem
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dense_shape: Optional[Tuple[int, int]]  # (B, S_local) of a dense batch, None for THD


def cp_call(inp: AttentionInputs, cfg: CPConfig, training: bool) -> CPCall:
    """``inp`` (prepared with ``cp_size=cfg.size``) in CP's form; every rule of the comm type it
    breaks is one NotImplementedError here, before any communication."""
    comms = tuple(g if isinstance(g, CPComm) else CPComm(g, cfg.stream) for g in cfg.groups)
    problem, shared = _thd_problem(inp) if inp.is_thd else _dense_problem(inp)
    q, k, v = inp.q, inp.k, inp.v
    dense_shape = None
    if not inp.is_thd:
        dense_shape = (q.shape[0], q.shape[1])
        q, k, v = (t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) for t in (q, k, v))
    facts = CPFacts(cfg.comm_type, problem.specs, shared, inp.dropout_p > 0 and training, inp.bias_type,
                    any(t is not None for t in (inp.q_valid, inp.kv_valid, inp.arbitrary_mask)), q.shape[-2], k.shape[-2],
                    comms[0].size if cfg.comm_type.startswith("a2a") else 1)
    reasons = cp_reasons(facts)
    if reasons:
        raise NotImplementedError(f"context parallelism (cp_comm_type={cfg.comm_type!r}) cannot run this call: "
                                  + "; ".join(str(r) for r in reasons))
    return CPCall(inp, cfg, comms, problem, q, k, v, dense_shape)


def _thd_problem(inp: AttentionInputs) -> Tuple[CPProblem, bool]:
    """The problem of a THD record (its packed sides are the global ones) and whether q and kv
    share lengths and slots."""
    pq, pk = inp.packed_q, inp.packed_kv
    b = pq.batch_size
    if inp.policies is None:
        specs, live, policy_of_seq = (inp.mask,), (True,), torch.zeros(b, dtype=torch.int64, device=inp.q.device)
    else:
        specs, live, policy_of_seq = inp.policies.specs, inp.policies.maybe_nonempty, inp.policies.policy_of_seq
    shared = pq.cu_seqlens is pk.cu_seqlens and pq.offsets is pk.offsets
    slots_q = pq.offsets.long()
    slots_kv = slots_q if shared else pk.offsets.long()
    problem = CPProblem(slots_q, slots_kv, pq.seqlens().long(), pk.seqlens().long(), pq.max_seqlen, pk.max_seqlen, specs, live,
                        policy_of_seq, inp.softmax_scale)
    return problem, shared


def _dense_problem(inp: AttentionInputs) -> Tuple[CPProblem, bool]:
    """bshd (sbhd arrives as its view) as THD with one slot of the global length per entry."""
    size, dev = inp.cp_size, inp.q.device
    b, sq, skv = inp.q.shape[0], inp.q.shape[1], inp.k.shape[1]
    slots_q = torch.arange(b + 1, device=dev, dtype=torch.int64) * (sq * size)
    slots_kv = slots_q if skv == sq else torch.arange(b + 1, device=dev, dtype=torch.int64) * (skv * size)
    problem = CPProblem(slots_q, slots_kv, torch.diff(slots_q), torch.diff(slots_kv), sq * size, skv * size, (inp.mask,), (True,),
                        torch.zeros(b, dtype=torch.int64, device=dev), inp.softmax_scale)
    return problem, sq == skv


# ---------------------------------------------------------------------------------- running it


def run_cp(call: CPCall, backend: type, training: bool, checkpoint: bool) -> torch.Tensor:
    """Attention of this rank's rows over the whole sequences, on ``backend``: [T, H, Dv], or
    [B, S_local, H, Dv] for a dense record (the caller flattens it into its format)."""
    if checkpoint and torch.is_grad_enabled():
        out = torch.utils.checkpoint.checkpoint(_run, call, backend, training, call.q, call.k, call.v, use_reentrant=False)
    else:
        out = _run(call, backend, training, call.q, call.k, call.v)
    if call.dense_shape is not None:
        out = out.view(*call.dense_shape, *out.shape[1:])
    return out


def _sanitize(t: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Padding rows to exactly 0 (NaN there must not leak; their gradients come back 0)."""
    return torch.where(valid.view(-1, 1, 1), t, torch.zeros((), dtype=t.dtype, device=t.device))


def _valid_rows(layout, total_rows: int) -> torch.Tensor:
    seq, pos = layout.seq_of_local_rows(total_rows)
    rows = torch.arange(total_rows, device=seq.device)
    inside = rows < layout.local_offsets[-1]
    return inside & (pos < layout.local_valid()[seq]) if layout.lengths.numel() else rows < 0


def _run(call: CPCall, backend: type, training: bool, q, k, v) -> torch.Tensor:
    prob, comms, comm_type = call.problem, call.comms, call.cfg.comm_type
    lq, lk = prob.layouts(call.cfg.size, combined_rank([(c.rank, c.size) for c in comms]))
    q = _sanitize(q, _valid_rows(lq, q.shape[0]))
    k = _sanitize(k, _valid_rows(lk, k.shape[0]))
    v = _sanitize(v, _valid_rows(lk, v.shape[0]))
    if comm_type == "p2p":
        return RingAttention.apply(q, k, v, ring_plan(prob, comms[0], span_kernel(backend, comm_type), q.shape[0], k.shape[0]))
    if comm_type == "all_gather":
        return AllGatherAttention.apply(q, k, v, gather_plan(prob, comms[0], span_kernel(backend, comm_type), q.shape[0], k.shape[0]))
    return _run_a2a(call, backend, training, q, k, v)


def _run_a2a(call: CPCall, backend: type, training: bool, q, k, v) -> torch.Tensor:
    """All-to-all to whole sequences (or, for a2a+p2p, to the p2p level's zigzag share) of
    H / a2a_size heads; then the backend's ordinary call (a2a) or the ring (a2a+p2p); back."""
    prob, comms = call.problem, call.comms
    a2a = comms[0]
    p2p_rank = comms[1].rank if len(comms) > 1 else 0
    size = call.cfg.size
    iq = level_index(prob.slots_q, prob.lengths_q, size, a2a, p2p_rank, q.shape[0])
    ik = iq if (prob.slots_kv is prob.slots_q and k.shape[0] == q.shape[0]) else level_index(
        prob.slots_kv, prob.lengths_kv, size, a2a, p2p_rank, k.shape[0])
    ql, kl, vl = heads_to_level(q, a2a, iq), heads_to_level(k, a2a, ik), heads_to_level(v, a2a, ik)
    if len(comms) == 1:
        out = backend.run(whole_sequences(call, ql, kl, vl), training)
        out = out.reshape(ql.shape[0], ql.shape[-2], -1)
    else:
        kernel = span_kernel(backend, call.cfg.comm_type)
        out = RingAttention.apply(ql, kl, vl, ring_plan(prob, comms[1], kernel, ql.shape[0], kl.shape[0]))
    return level_to_heads(out, a2a, iq)


def whole_sequences(call: CPCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AttentionInputs:
    """The record of a2a's whole-sequence call, derived from the prepared one: every row of
    every sequence in global order ([T_global, H/A, D], dense as [B, S_global, H/A, D]), an
    ordinary record (``cp_size`` 1). Its packed sides are the prepared ones: under CP they
    already index the global rows. Bias, ALiBi and sinks are refused under CP, so the fields
    that carry heads need no slicing."""
    if call.dense_shape is not None:
        b = call.dense_shape[0]
        q, k, v = (t.view(b, t.shape[0] // b, *t.shape[1:]) for t in (q, k, v))
    return replace(call.inp, q=q, k=k, v=v, cp_size=1)
