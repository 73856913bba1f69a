"""Context parallelism for DotProductAttention: TE's contract, on torch.distributed.

Contract (TE's, so callers change nothing):

* bshd/sbhd: the sequence is cut into 2 x cp chunks; rank r holds chunks r and 2cp-1-r.
* THD: every slot of ``cu_seqlens_*_padded`` (``cu_seqlens_*`` when there are no gaps) has a
  length divisible by 2 x cp and is cut the same way, slot by slot, in sequence order. Each rank
  passes the GLOBAL ``cu_seqlens_*``, ``cu_seqlens_*_padded`` and ``max_seqlen_*`` with its local
  rows, and gets its local rows back; padding rows are exactly 0 in outputs and gradients.
* ``cp_comm_type``: ``"p2p"`` (ring of kv blocks), ``"all_gather"`` (kv gathered once),
  ``"a2a"`` (Ulysses: heads scattered, sequence gathered, the ordinary attention path run on
  the whole sequence), ``"a2a+p2p"`` (``cp_group=[a2a_group, p2p_group]``: all-to-all inside
  each a2a group, then a ring across them; the CP rank is p2p_rank * a2a_size + a2a_rank).

What each comm type supports is data (:data:`COMM_TYPES`), checked by :func:`cp_reasons`
before any communication; see :func:`cp_support_markdown`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

from .algorithms import (AllGatherAttention, CPProblem, RingAttention, gather_plan, heads_to_level, level_index, level_to_heads, ring_plan)
from .comm import CPComm
from .kernels import KERNELS
from .partition import check_slots
from ..masks import AttnMaskType, MaskSpec, normalize_window
from ..prepare.policies import parse_policies, reject_per_seq
from ..selection.support import Reason
from ..prepare.packed_seqs import prepare_sides, value_checks_on

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


@dataclass(frozen=True)
class CommTypeSupport:
    """What one comm type runs (the README's CP table is rendered from these)."""

    name: str
    windows: str  # "none", "causal" (left windows on causal masks), "all"
    dropout: bool
    any_backend: bool  # runs the ordinary (non-CP) path, so every backend and feature applies
    needs_heads_divisible: bool


COMM_TYPES = {
    "p2p": CommTypeSupport("p2p", "none", False, False, False),
    "all_gather": CommTypeSupport("all_gather", "causal", False, False, False),
    "a2a": CommTypeSupport("a2a", "all", True, True, True),
    "a2a+p2p": CommTypeSupport("a2a+p2p", "none", False, False, True),
}


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
        import torch.distributed as dist

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
    import torch.distributed as dist

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


# ---------------------------------------------------------------------------------- support


@dataclass(frozen=True)
class CPFacts:
    """Host facts about one CP call that decide whether its comm type can run it."""

    comm_type: str
    specs: Tuple[MaskSpec, ...]
    shared_qkv_meta: bool  # q and kv share cu_seqlens and slots (sq == skv per sequence)
    dropout: bool
    bias_type: str
    dense_padding_mask: bool
    num_heads: int
    num_gqa_groups: int
    a2a_size: int


def cp_reasons(f: CPFacts) -> List[Reason]:
    """Every rule of the comm type that this call breaks (empty: it can run)."""
    sup = COMM_TYPES[f.comm_type]
    out = []
    if f.bias_type != "no_bias":
        out.append(Reason("core_attention_bias_type", f"{f.bias_type} with context parallelism", "no_bias"))
    if f.dense_padding_mask:
        out.append(Reason("attention_mask", "a padding mask with context parallelism", "None (use qkv_format='thd' with cu_seqlens)"))
    if f.dropout and not sup.dropout:
        out.append(Reason("attention_dropout", f"> 0 with cp_comm_type={f.comm_type!r}", "0.0, or cp_comm_type='a2a'"))
    if sup.needs_heads_divisible and (f.num_heads % f.a2a_size or f.num_gqa_groups % f.a2a_size):
        out.append(Reason("num_attention_heads", f"{f.num_heads} (num_gqa_groups {f.num_gqa_groups}) with a2a size {f.a2a_size}",
                          "both divisible by the a2a group size"))
    for spec in f.specs:
        out.extend(_spec_reasons(spec, sup, f))
    return out


def _spec_reasons(spec: MaskSpec, sup: CommTypeSupport, f: CPFacts) -> List[Reason]:
    if sup.any_backend:
        return []
    out = []
    causal, windowed = spec.mask_type.is_causal, spec.window[0] >= 0 or (spec.window[1] >= 0 and not spec.mask_type.is_causal)
    if windowed and not (sup.windows == "causal" and causal):
        allowed = "causal masks with (left, 0) windows, or cp_comm_type='a2a'" if sup.windows == "causal" else "none: use cp_comm_type='all_gather' or 'a2a'"
        out.append(Reason("window_size", f"{spec.window} ({spec.mask_type.value}) with cp_comm_type={f.comm_type!r}", allowed))
    if causal and not f.shared_qkv_meta:
        out.append(Reason("attn_mask_type", f"{spec.mask_type.value} with q and kv lengths that may differ, cp_comm_type={f.comm_type!r}",
                          "self-attention sharing cu_seqlens_q/kv (and the padded ones), or cp_comm_type='a2a'"))
    return out


def cp_support_markdown() -> str:
    """The CP table of the README, from :data:`COMM_TYPES`."""
    rows = ["| cp_comm_type | masks | sliding windows | per-seq policies, pad_between_seqs | dropout | backends | heads |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in COMM_TYPES.values():
        masks = "all but arbitrary" if s.any_backend else "full and causal (causal needs sq == skv)"
        windows = {"none": "no", "causal": "causal (left, 0)", "all": "yes"}[s.windows]
        backends = "any (ordinary path)" if s.any_backend else "FA4, cuDNN, unfused"
        heads = "divisible by the a2a size" if s.needs_heads_divisible else "any"
        rows.append(f"| {s.name} | {masks} | {windows} | yes | {'yes' if s.dropout else 'no'} | {backends} | {heads} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------- entry


@dataclass
class CPCall:
    """The call in CP's internal form: THD rows [T, H, D], and how to give the output back."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    problem: CPProblem
    fmt: str
    dense_shape: Optional[Tuple[int, int]]  # (B, S_local) of a dense batch
    thd_args: dict  # global metadata for the a2a path's ordinary call
    facts: CPFacts


def context_parallel_forward(dpa, cfg: CPConfig, qkv, fmt: str, attention_mask, cus, max_seqlens, attn_mask_type, window_size,
                             checkpoint: bool, bias_type: str, bias, alibi_slopes, pad_between, per_seq, is_causal) -> torch.Tensor:
    """DotProductAttention.forward under context parallelism; returns the flattened output."""
    from ..prepare.validation import check_mask_and_format, check_qkv

    q, k, v = qkv.q, qkv.k, qkv.v
    check_qkv(q, k, v, fmt, dpa.num_attention_heads_per_partition, dpa.num_gqa_groups_per_partition, dpa.head_dims)
    mask = AttnMaskType.parse(attn_mask_type if attn_mask_type is not None else dpa.attn_mask_type)
    mask = check_mask_and_format(mask, fmt, attention_mask, cus[0] is not None)
    raw_window = window_size if window_size is not None else dpa.window_size
    window = normalize_window(raw_window, mask)
    if bias is not None or alibi_slopes is not None:
        bias_type = bias_type if bias_type != "no_bias" else "post_scale_bias"
    comms = [g if isinstance(g, CPComm) else CPComm(g, cfg.stream) for g in cfg.groups]
    if fmt == "thd":
        call = _thd_call(dpa, q, k, v, cus, max_seqlens, mask, window, raw_window, pad_between, per_seq, is_causal, cfg)
    else:
        call = _dense_call(dpa, q, k, v, fmt, mask, window, per_seq, is_causal, cfg)
    facts = CPFacts(cfg.comm_type, call.problem.specs, call.facts.shared_qkv_meta, dpa.attention_dropout > 0 and dpa.training,
                    bias_type, fmt != "thd" and (attention_mask is not None or cus[0] is not None), q.shape[-2], k.shape[-2],
                    comms[0].size if cfg.comm_type.startswith("a2a") else 1)
    reasons = cp_reasons(facts)
    if reasons:
        raise NotImplementedError(f"context parallelism (cp_comm_type={cfg.comm_type!r}) cannot run this call: "
                                  + "; ".join(str(r) for r in reasons))
    run = lambda q_, k_, v_: _run(dpa, cfg, comms, call, q_, k_, v_)  # noqa: E731
    if checkpoint and torch.is_grad_enabled():
        out = torch.utils.checkpoint.checkpoint(run, call.q, call.k, call.v, use_reentrant=False)
    else:
        out = run(call.q, call.k, call.v)
    return _give_back(out, call)


def _sanitize(t: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Padding rows to exactly 0 (NaN there must not leak; their gradients come back 0)."""
    return torch.where(valid.view(-1, 1, 1), t, torch.zeros((), dtype=t.dtype, device=t.device))


def _run(dpa, cfg: CPConfig, comms: Sequence[CPComm], call: CPCall, q, k, v) -> torch.Tensor:
    prob = call.problem
    size = cfg.size
    rank = _cp_rank(comms)
    lq, lk = prob.layouts(size, rank)
    q = _sanitize(q, _valid_rows(lq, q.shape[0]))
    k = _sanitize(k, _valid_rows(lk, k.shape[0]))
    v = _sanitize(v, _valid_rows(lk, v.shape[0]))
    if cfg.comm_type in ("p2p", "all_gather"):
        kernel = _select_kernel(dpa, q, k, v, call)
        if cfg.comm_type == "p2p":
            return RingAttention.apply(q, k, v, ring_plan(prob, comms[0], kernel, q.shape[0], k.shape[0]))
        return AllGatherAttention.apply(q, k, v, gather_plan(prob, comms[0], kernel, q.shape[0], k.shape[0]))
    return _run_a2a(dpa, cfg, comms, call, q, k, v, size)


def _run_a2a(dpa, cfg, comms, call, q, k, v, size: int) -> torch.Tensor:
    a2a = comms[0]
    p2p_rank = comms[1].rank if len(comms) > 1 else 0
    prob = call.problem
    iq = level_index(prob.slots_q, prob.lengths_q, size, a2a, p2p_rank, q.shape[0])
    ik = iq if (prob.slots_kv is prob.slots_q and k.shape[0] == q.shape[0]) else level_index(
        prob.slots_kv, prob.lengths_kv, size, a2a, p2p_rank, k.shape[0])
    ql, kl, vl = heads_to_level(q, a2a, iq), heads_to_level(k, a2a, ik), heads_to_level(v, a2a, ik)
    if len(comms) == 1:
        out = _inner(dpa, ql.shape[-2], kl.shape[-2])(ql, kl, vl, **call.thd_args).view(ql.shape[0], ql.shape[-2], -1)
    else:
        kernel = _select_kernel(dpa, ql, kl, vl, call)
        out = RingAttention.apply(ql, kl, vl, ring_plan(prob, comms[1], kernel, ql.shape[0], kl.shape[0]))
    return level_to_heads(out, a2a, iq)


def _cp_rank(comms: Sequence[CPComm]) -> int:
    return combined_rank([(c.rank, c.size) for c in comms])


def combined_rank(ranks: Sequence[Tuple[int, int]]) -> int:
    """The CP rank from each level's (rank, size), a2a level first: for a2a+p2p,
    p2p_rank * a2a_size + a2a_rank (TE's rule); one level: its rank."""
    if len(ranks) == 1:
        return ranks[0][0]
    (a2a_rank, a2a_size), (p2p_rank, _) = ranks
    return p2p_rank * a2a_size + a2a_rank


def _valid_rows(layout, total_rows: int) -> torch.Tensor:
    seq, pos = layout.seq_of_local_rows(total_rows)
    rows = torch.arange(total_rows, device=seq.device)
    inside = rows < layout.local_offsets[-1]
    return inside & (pos < layout.local_valid()[seq]) if layout.lengths.numel() else rows < 0


def _inner(dpa, heads: int, groups: int):
    """An ordinary DotProductAttention for the a2a path's whole-sequence call (its heads are
    this rank's share), kept on the module (not as a submodule: it has no parameters)."""
    from ..dot_product_attention import DotProductAttention

    cache = dpa.__dict__.setdefault("_cp_inner", {})
    key = (heads, groups)
    if key not in cache:
        cache[key] = DotProductAttention(heads, dpa.head_dims, num_gqa_groups=groups, attention_dropout=dpa.attention_dropout,
                                         qkv_format="thd", attn_mask_type=dpa.attn_mask_type.value,
                                         window_size=dpa.window_size, softmax_scale=dpa.softmax_scale,
                                         get_rng_state_tracker=dpa.get_rng_state_tracker)
    inner = cache[key]
    inner.train(dpa.training)
    return inner


def _select_kernel(dpa, q, k, v, call: CPCall):
    """The local kernel for ring/all-gather steps: the first backend (in preference order)
    that supports this call with context parallelism and has a CP kernel."""
    from ..selection.params import AttentionParams
    from ..selection.backend_selection import require_backend
    from ..selection.libraries import compute_capability

    prob = call.problem
    cuda = q.device.type == "cuda"
    params = AttentionParams(
        qkv_dtype=q.dtype, device_type=q.device.type,
        compute_capability=compute_capability(q.device.index if q.device.index is not None else torch.cuda.current_device()) if cuda else None,
        qkv_format="thd", qkv_layout="thd_thd_thd", batch_size=prob.lengths_q.numel(), num_heads=q.shape[-2],
        num_gqa_groups=k.shape[-2], max_seqlen_q=prob.max_seqlen_q, max_seqlen_kv=prob.max_seqlen_kv,
        head_dim_qk=q.shape[-1], head_dim_v=v.shape[-1], attn_mask_type=prob.specs[0].mask_type,
        window_size=prob.specs[0].window, pad_between_seqs=True,
        per_seq_policies=prob.specs if len(prob.specs) > 1 else None, shared_cu_seqlens=call.facts.shared_qkv_meta,
        is_training=dpa.training, requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
        context_parallel=True, cp_comm_type=call.facts.comm_type,
    )
    selection = require_backend(params)
    object.__setattr__(dpa, "last_selection", selection)
    if selection.label not in KERNELS:  # a scope forcing a backend without a CP kernel
        raise NotImplementedError(f"cp_comm_type={call.facts.comm_type!r} runs its steps on FA4, cuDNN or the unfused backend; "
                                  f"{selection.label} has no context-parallel kernel (use cp_comm_type='a2a')")
    return KERNELS[selection.label]


def _thd_call(dpa, q, k, v, cus, max_seqlens, mask, window, raw_window, pad_between, per_seq, is_causal, cfg) -> CPCall:
    size = cfg.size
    # CP's own rule first (slots divisible by 2 x cp), on the offsets the slots come from.
    for name, cu, pad in (("cu_seqlens_q", cus[0], cus[2]), ("cu_seqlens_kv", cus[1], cus[3])):
        padded = pad is not None and pad is not cu and pad_between is not False
        offsets = pad if padded else cu
        if isinstance(offsets, torch.Tensor) and offsets.dim() == 1:
            check_slots(name + "_padded" if padded else name, offsets, size, value_checks_on(offsets.device))
    # Global metadata (each rank passes the global cu_seqlens and max_seqlen): checked on the
    # CPU (or when asked), bounded on the device otherwise, as without CP.
    pq, pk = prepare_sides(cus, max_seqlens, pad_between, (q.shape[0] * size, k.shape[0] * size), q.device)
    b = pq.batch_size
    cu_q, cu_kv = pq.cu_seqlens, pk.cu_seqlens  # bounded copies on CUDA; sharing (identity) is kept
    policies = parse_policies(per_seq, is_causal, b, q.device, raw_window)
    if policies is None:
        specs, live, policy_of_seq = (MaskSpec(mask, window),), (True,), torch.zeros(b, dtype=torch.int64, device=q.device)
    else:
        specs, live, policy_of_seq = policies.specs, policies.maybe_nonempty, policies.policy_of_seq
    slots_q, slots_kv = pq.offsets.long(), pk.offsets.long()
    shared = cu_q is cu_kv and pq.offsets is pk.offsets
    if shared:
        slots_kv = slots_q
    prob = CPProblem(slots_q, slots_kv, pq.seqlens().long(), pk.seqlens().long(), pq.max_seqlen, pk.max_seqlen, specs, live,
                     policy_of_seq, dpa.softmax_scale)
    thd_args = dict(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, cu_seqlens_q_padded=pq.offsets,
                    cu_seqlens_kv_padded=pk.offsets, max_seqlen_q=pq.max_seqlen, max_seqlen_kv=pk.max_seqlen,
                    attn_mask_type=mask.value, window_size=raw_window, pad_between_seqs=pq.has_gaps or pk.has_gaps,
                    attn_mask_type_per_seq=per_seq, thd_sequence_is_causal=is_causal)
    facts = CPFacts(cfg.comm_type, specs, shared, False, "no_bias", False, q.shape[-2], k.shape[-2], 1)
    return CPCall(q, k, v, prob, "thd", None, thd_args, facts)


def _dense_call(dpa, q, k, v, fmt, mask, window, per_seq, is_causal, cfg) -> CPCall:
    """bshd/sbhd as THD with one slot of the global length per batch entry (no copies for
    bshd; sbhd is transposed once)."""
    reject_per_seq(per_seq, is_causal, f"qkv_format={fmt!r}")
    if fmt == "sbhd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    size = cfg.size
    b, sq, skv = q.shape[0], q.shape[1], k.shape[1]
    for name, s in (("query_layer", sq), ("key_layer", skv)):
        if (s * size) % (2 * size):
            raise ValueError(f"{name}: the global sequence length ({s} local rows x cp size {size}) must be divisible by "
                             f"2 x cp size = {2 * size} under context parallelism")
    dev = q.device
    slots_q = torch.arange(b + 1, device=dev, dtype=torch.int64) * (sq * size)
    slots_kv = slots_q if skv == sq else torch.arange(b + 1, device=dev, dtype=torch.int64) * (skv * size)
    spec = MaskSpec(mask, window)
    prob = CPProblem(slots_q, slots_kv, torch.diff(slots_q), torch.diff(slots_kv), sq * size, skv * size, (spec,), (True,),
                     torch.zeros(b, dtype=torch.int64, device=dev), dpa.softmax_scale)
    cu_q = slots_q.to(torch.int32)
    cu_kv = cu_q if skv == sq else slots_kv.to(torch.int32)
    thd_args = dict(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=sq * size, max_seqlen_kv=skv * size,
                    attn_mask_type=mask.with_padding().value, window_size=window if window != (-1, -1) else None)
    flat = [t.reshape(b * t.shape[1], *t.shape[2:]) for t in (q, k, v)]
    facts = CPFacts(cfg.comm_type, (spec,), sq == skv, False, "no_bias", False, q.shape[-2], k.shape[-2], 1)
    return CPCall(*flat, prob, fmt, (b, sq), thd_args, facts)


def _give_back(out: torch.Tensor, call: CPCall) -> torch.Tensor:
    """[T, H, Dv] -> the caller's format, heads flattened."""
    if call.dense_shape is not None:
        b, s = call.dense_shape
        out = out.reshape(b, s, -1)
        return out.transpose(0, 1) if call.fmt == "sbhd" else out
    return out.reshape(out.shape[0], -1)
