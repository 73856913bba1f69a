"""Context-parallel test cases and the code each rank runs for one case (shared by the CPU gloo
tests and the GPU tests). The oracle is the independent float64 reference of reference.py on
the GLOBAL batch; each rank compares its own rows, output and dq/dk/dv, and checks that every
padding row is exactly 0."""

from __future__ import annotations

import os
import tempfile
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from transformer_engine.pytorch import DotProductAttention, partition_for_context_parallel

from .dist_helpers import free_port, start_method
from .reference import reference_dense, reference_thd


@dataclass(frozen=True)
class Case:
    id: str
    comm: str
    fmt: str = "thd"
    mask: str = "padding_causal"
    policy: str = "none"  # none | is_causal | dict
    gaps: bool = True
    h: int = 4
    hg: int = 2
    window: Optional[Tuple[int, int]] = None
    policy_windows: Tuple = ()  # for policy="dict": ((mask, window), ...) for sequences 0, 1, 2
    cross: bool = False  # different kv lengths (full masks only)
    packed: str = ""  # declared packed input: "qkv:-3", "qkv:-2" (qkv_layer), "kv:-3", "kv:-2" (kv_layer)
    dropout: float = 0.0  # attention_dropout of the module (training mode)
    dtype: str = "float64"
    error: Optional[Tuple[str, str]] = None  # (exception name, message fragment)
    bad_slots: bool = False
    dense_len: int = 0  # local rows per rank for bshd/sbhd (0: 2 chunks of 4)
    d: int = 8  # head dim
    thd_attention_mask: bool = False  # pass an attention_mask along with THD: ignored, as without CP
    checkpoint: bool = False  # checkpoint_core_attention=True (the schedule runs again in the backward)


def _slots(lengths: List[int], multiple: int, gaps: bool) -> List[int]:
    out = [0]
    for n in lengths:
        slot = -(-n // multiple) * multiple
        if gaps and slot == n:
            slot += multiple  # a gap even where the length already fits
        out.append(out[-1] + slot)
    return out


def _cumsum(lengths: List[int]) -> List[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    kwargs: dict
    valid_q: torch.Tensor  # [T] bool (THD) or None
    valid_kv: torch.Tensor
    ref_masks: List[str] = field(default_factory=list)
    ref_windows: List = field(default_factory=list)
    cu: Tuple = ()


def _thd_batch(case: Case, cp: int, device, dtype) -> Batch:
    m = 2 * cp
    lengths_q = [5, 3 * m + 1, 1] if case.gaps else [m, 2 * m, m]
    lengths_kv = [2 * m - 1, 2, m + 3] if case.cross else lengths_q
    if case.cross and not case.gaps:
        lengths_kv = [m, 3 * m, 2 * m]
    cu_q, cu_kv = _cumsum(lengths_q), _cumsum(lengths_kv)
    off_q = _slots(lengths_q, m, case.gaps) if case.gaps else cu_q
    off_kv = (_slots(lengths_kv, m, case.gaps) if case.gaps else cu_kv) if case.cross else off_q
    if case.bad_slots:
        off_q = off_kv = [0, 6, 6 + 3 * m, 8 + 3 * m]
    tq, tkv = off_q[-1], off_kv[-1]
    g = torch.Generator().manual_seed(1234)
    hd = case.d
    q = torch.randn(tq, case.h, hd, generator=g, dtype=torch.float64)
    k = torch.randn(tkv, case.hg, hd, generator=g, dtype=torch.float64)
    v = torch.randn(tkv, case.hg, hd, generator=g, dtype=torch.float64)
    dout = torch.randn(tq, case.h, hd, generator=g, dtype=torch.float64)
    valid_q, valid_kv = _valid(cu_q, off_q, tq), _valid(cu_kv, off_kv, tkv)
    q[~valid_q], k[~valid_kv], v[~valid_kv] = float("nan"), float("nan"), float("nan")
    it = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    cu_q_t = it(cu_q)
    cu_kv_t = cu_q_t if not case.cross else it(cu_kv)
    kwargs = dict(qkv_format="thd", cu_seqlens_q=cu_q_t, cu_seqlens_kv=cu_kv_t, max_seqlen_q=max(lengths_q),
                  max_seqlen_kv=max(lengths_kv), attn_mask_type=case.mask, window_size=case.window)
    if case.gaps or case.bad_slots:
        off_q_t = it(off_q)
        kwargs.update(cu_seqlens_q_padded=off_q_t, cu_seqlens_kv_padded=off_q_t if not case.cross else it(off_kv))
    masks, windows = [case.mask] * 3, [case.window] * 3
    if case.policy == "is_causal":
        flags = [True, False, True]
        kwargs["thd_sequence_is_causal"] = torch.tensor(flags, device=device)
        masks = ["padding_causal" if f else "padding" for f in flags]
    elif case.policy == "dict":
        keys = {}
        for i, (mk, w) in enumerate(case.policy_windows):
            keys.setdefault((mk, w), []).append(i)
        kwargs["attn_mask_type_per_seq"] = {key: torch.tensor(ids, device=device) for key, ids in keys.items()}
        masks, windows = [mk for mk, _ in case.policy_windows], [w for _, w in case.policy_windows]
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return Batch(cast(q), cast(k), cast(v), cast(dout), kwargs, valid_q, valid_kv, masks, windows,
                 (cu_q, cu_kv, off_q, off_kv))


def _valid(cu: List[int], off: List[int], total: int) -> torch.Tensor:
    valid = torch.zeros(total, dtype=torch.bool)
    for i in range(len(cu) - 1):
        valid[off[i] : off[i] + cu[i + 1] - cu[i]] = True
    return valid


def _reference(case: Case, batch: Batch, scale: float):
    """Global output and grads from the independent reference (float64, on the CPU)."""
    leaves = [t.detach().cpu().double().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    if case.fmt == "thd":
        cu_q, cu_kv, off_q, off_kv = batch.cu
        out = reference_thd(*leaves, cu_q, cu_kv, off_q, off_kv, batch.ref_masks, batch.ref_windows, scale)
    else:
        out = reference_dense(*leaves, case.mask, case.window, scale)
    out.backward(batch.dout.detach().cpu().double())
    return [out.detach()] + [t.grad for t in leaves]


def _dense_batch(case: Case, cp: int, device, dtype) -> Batch:
    s = (case.dense_len or 4) * cp
    g = torch.Generator().manual_seed(99)
    q = torch.randn(2, s, case.h, case.d, generator=g, dtype=torch.float64)
    k = torch.randn(2, s, case.hg, case.d, generator=g, dtype=torch.float64)
    v = torch.randn(2, s, case.hg, case.d, generator=g, dtype=torch.float64)
    dout = torch.randn(2, s, case.h, case.d, generator=g, dtype=torch.float64)
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return Batch(cast(q), cast(k), cast(v), cast(dout), dict(qkv_format=case.fmt, attn_mask_type=case.mask,
                                                             window_size=case.window), None, None)


def _local(x: torch.Tensor, case: Case, cp: int, rank: int, slots) -> torch.Tensor:
    if case.error is not None:  # shapes only: the call must fail before reading rows
        return x[: x.shape[0] // cp] if case.fmt == "thd" else x[:, : x.shape[1] // cp]
    if case.fmt == "thd":
        return partition_for_context_parallel(x, cp, rank, "thd", slots)
    return partition_for_context_parallel(x, cp, rank, "bshd")


def _to_fmt(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return x.transpose(0, 1).contiguous() if fmt == "sbhd" else x


def groups_for(comm: str, world: int):
    """(cp_group argument, the groups made here must be made on every rank in one order)."""
    if comm != "a2a+p2p":
        return dist.group.WORLD
    a = 2
    a2a = [dist.new_group(list(range(i, i + a))) for i in range(0, world, a)]
    p2p = [dist.new_group(list(range(j, world, a))) for j in range(a)]
    rank = dist.get_rank()
    return [a2a[rank // a], p2p[rank % a]]


def run_case(case: Case, world: int, rank: int, cp_group, device="cpu", check_tol=None) -> None:
    """One case on one rank; raises AssertionError on a mismatch."""
    dtype = getattr(torch, case.dtype)
    batch = _thd_batch(case, world, device, dtype) if case.fmt == "thd" else _dense_batch(case, world, device, dtype)
    if case.thd_attention_mask:
        batch.kwargs["attention_mask"] = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)  # would mask all
    if case.checkpoint:
        batch.kwargs["checkpoint_core_attention"] = True
    dpa = DotProductAttention(case.h, case.d, num_gqa_groups=case.hg, qkv_format=case.fmt, attn_mask_type=case.mask,
                              cp_group=cp_group, cp_comm_type=case.comm, attention_dropout=case.dropout)
    slots = batch.kwargs.get("cu_seqlens_q_padded", batch.kwargs.get("cu_seqlens_q"))
    slots_kv = batch.kwargs.get("cu_seqlens_kv_padded", batch.kwargs.get("cu_seqlens_kv"))
    lq = [_local(t, case, world, rank, slots).detach().requires_grad_() for t in (batch.q,)]
    lkv = [_local(t, case, world, rank, slots_kv).detach().requires_grad_() for t in (batch.k, batch.v)]
    leaves = lq + lkv
    inputs = [_to_fmt(t, case.fmt) for t in leaves]
    if case.error is not None:
        name, fragment = case.error
        try:
            dpa(*inputs, **batch.kwargs)
        except Exception as err:  # noqa: BLE001 - the type is checked by name
            assert type(err).__name__ == name and fragment in str(err), f"got {type(err).__name__}: {err}"
            return
        raise AssertionError(f"expected {name} containing {fragment!r}; nothing raised")
    dout = _to_fmt(_local(batch.dout, case, world, rank, slots), case.fmt)
    if case.packed:
        out, grads = _run_packed(dpa, case, leaves, batch.kwargs, dout)
    else:
        out = dpa(*inputs, **batch.kwargs)
        out.backward(dout.reshape(out.shape))
        grads = [t.grad for t in leaves]
    selection = getattr(dpa, "last_selection", None)
    _LAST["label"] = selection.label if selection is not None else "ordinary path (a2a)"
    out = out.view(*inputs[0].shape[:-1], -1)
    out = out.transpose(0, 1) if case.fmt == "sbhd" else out
    ref = _reference(case, batch, dpa.softmax_scale)
    tol = check_tol or {torch.float64: 1e-9, torch.float32: 2e-5}.get(dtype, 3e-2)
    names = ("out", "dq", "dk", "dv")
    for name, got, want, sl in zip(names, [out] + grads, ref, (slots, slots, slots_kv, slots_kv)):
        want = _local(want, case, world, rank, sl)
        got = got.detach().cpu().double()
        err = float((got - want).abs().max()) if got.numel() else 0.0
        scale = float(want.abs().max()) if want.numel() else 1.0
        assert err <= tol * max(scale, 1.0), f"{name}: max abs error {err:.3g} (scale {scale:.3g}) on rank {rank}"
    if case.fmt == "thd":
        for name, got, valid, sl in zip(names, [out] + grads, (batch.valid_q, batch.valid_q, batch.valid_kv, batch.valid_kv),
                                        (slots, slots, slots_kv, slots_kv)):
            pad = ~_local(valid, case, world, rank, sl.cpu())
            assert bool((got.detach().cpu()[pad] == 0).all()), f"{name}: a padding row is not exactly 0 on rank {rank}"


def _dropout_run(dpa, case: Case, world: int, rank: int, batch: Batch, seed: int):
    """Forward and backward of this rank's rows with dropout drawn after ``manual_seed(seed)``."""
    slots = batch.kwargs.get("cu_seqlens_q_padded", batch.kwargs["cu_seqlens_q"])
    leaves = [_local(t, case, world, rank, slots).detach().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    torch.manual_seed(seed)
    out = dpa(*leaves, **batch.kwargs)
    out.backward(_local(batch.dout, case, world, rank, slots).reshape(out.shape))
    return [out.detach().view(leaves[0].shape[0], case.h, -1)] + [t.grad for t in leaves]


def _head_group_oracle(case: Case, world: int, batch: Batch, seed: int):
    """What a2a with dropout must give: head group g (of ``world``) is attended over the whole
    sequence by rank g's ordinary call, so it equals one single-process call on those heads
    with the same seed (every rank seeds alike). Returns global [out, dq, dk, dv], all heads."""
    h, hg = case.h // world, case.hg // world
    parts = []
    for g in range(world):
        dpa = DotProductAttention(h, case.d, num_gqa_groups=hg, qkv_format="thd", attn_mask_type=case.mask,
                                  attention_dropout=case.dropout)
        leaves = [batch.q[:, g * h : (g + 1) * h], batch.k[:, g * hg : (g + 1) * hg], batch.v[:, g * hg : (g + 1) * hg]]
        leaves = [t.detach().clone().requires_grad_() for t in leaves]
        torch.manual_seed(seed)
        out = dpa(*leaves, **batch.kwargs)
        out.backward(batch.dout[:, g * h : (g + 1) * h].reshape(out.shape))
        parts.append([out.detach().view(-1, h, case.d)] + [t.grad for t in leaves])
    return [torch.cat(ts, dim=1) for ts in zip(*parts)]


def run_dropout_case(case: Case, world: int, rank: int, cp_group) -> None:
    """a2a with dropout: each rank's rows and gradients equal the per-head-group oracle, two
    runs with one seed agree bit for bit, padding rows stay exactly 0, dropout really acts
    (the result differs from the dropout-free reference), and in eval mode it is the reference."""
    batch = _thd_batch(case, world, "cpu", getattr(torch, case.dtype))
    dpa = DotProductAttention(case.h, case.d, num_gqa_groups=case.hg, qkv_format="thd", attn_mask_type=case.mask,
                              cp_group=cp_group, cp_comm_type=case.comm, attention_dropout=case.dropout)
    first, again = _dropout_run(dpa, case, world, rank, batch, 7), _dropout_run(dpa, case, world, rank, batch, 7)
    slots = batch.kwargs.get("cu_seqlens_q_padded", batch.kwargs["cu_seqlens_q"])
    names = ("out", "dq", "dk", "dv")
    for name, a, b in zip(names, first, again):
        # exact: the same schedule run twice on one rank repeats the same ops
        assert torch.equal(a, b), f"{name}: two runs with one seed differ on rank {rank}"
    oracle = _head_group_oracle(case, world, batch, 7)
    plain = _reference(case, batch, dpa.softmax_scale)
    for name, got, want, free in zip(names, first, oracle, plain):
        want, free = _local(want, case, world, rank, slots), _local(free, case, world, rank, slots)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), f"{name}: differs from the head-group oracle on rank {rank}"
        assert not torch.allclose(got, free.view(got.shape), atol=1e-3), f"{name}: dropout had no effect on rank {rank}"
        valid = batch.valid_kv if name in ("dk", "dv") else batch.valid_q  # one slot layout: not cross
        assert bool((got[~_local(valid, case, world, rank, slots)] == 0).all()), f"{name}: a padding row is not exactly 0 on rank {rank}"
    dpa.eval()
    leaves = [_local(t, case, world, rank, slots).detach() for t in (batch.q, batch.k, batch.v)]
    with torch.no_grad():
        out = dpa(*leaves, **batch.kwargs).view(leaves[0].shape[0], case.h, -1)
    want = _local(plain[0], case, world, rank, slots)
    assert torch.allclose(out, want, rtol=1e-9, atol=1e-9), f"eval-mode output differs from the reference on rank {rank}"


def _run_packed(dpa, case: Case, leaves, kwargs, dout):
    """The call through a declared packed buffer (``qkv_layer``, or ``query_layer`` with
    ``kv_layer``) stacked at ``qkv_interleave_dim``; the gradients are the packed buffer's
    gradient taken apart again (and the query's for ``kv_layer``), in [B,S]/[T] order."""
    kind, dim = case.packed.split(":")
    dim = int(dim)
    fmt = [_to_fmt(t.detach(), case.fmt) for t in leaves]
    if kind == "qkv":
        buf = torch.stack(fmt, dim=dim).requires_grad_()
        out = dpa(qkv_layer=buf, qkv_interleave_dim=dim, **kwargs)
    else:
        q = fmt[0].requires_grad_()
        buf = torch.stack(fmt[1:], dim=dim).requires_grad_()
        out = dpa(query_layer=q, kv_layer=buf, qkv_interleave_dim=dim, **kwargs)
    out.backward(dout.reshape(out.shape))
    grads = ([] if kind == "qkv" else [q.grad]) + list(buf.grad.unbind(dim))
    if case.fmt == "sbhd":
        grads = [g_.transpose(0, 1) for g_ in grads]
    return out, grads


_LAST = {}


def _last_label(device: str):
    return _LAST.get("label") if device == "cuda" else None


def worker(rank: int, world: int, port: int, cases: List[Case], outdir: str, device: str = "cpu", env=None) -> None:
    """Spawned once per world size: runs every case, records 'ok' or the failure per case.
    ``device='cuda'``: every rank on the one GPU, gloo with host staging (test mode);
    ``env`` sets backend switches (e.g. NVTE_FUSED_ATTN=0 leaves FA4)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(env or {}))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    if device == "cuda":
        os.environ["NVTE_CP_HOST_STAGING"] = "1"
    results = []
    try:
        group_cache = {}
        for case in cases:
            key = case.comm == "a2a+p2p"
            if key not in group_cache:
                group_cache[key] = groups_for(case.comm, world)
            try:
                if case.dropout > 0 and case.error is None:
                    run_dropout_case(case, world, rank, group_cache[key])
                else:
                    run_case(case, world, rank, group_cache[key], device)
                label = _last_label(device)
                results.append(f"{case.id}\tok" if label is None else f"{case.id}\tok\t{label}")
            except Exception:  # noqa: BLE001 - reported to the test by case id
                results.append(f"{case.id}\t" + traceback.format_exc().replace("\n", "\\n"))
    finally:
        with open(os.path.join(outdir, f"rank{rank}.tsv"), "w") as f:
            f.write("\n".join(results))
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------- the test side

CAUSAL_WINDOW = (("padding_causal", (3, 0)), ("padding", None), ("padding_causal", None))


def spawn(world, cases, device="cpu", env=None):
    with tempfile.TemporaryDirectory() as outdir:
        method = "spawn" if device == "cuda" else start_method()  # ranks that use CUDA must not be forked
        mp.start_processes(worker, args=(world, free_port(), cases, outdir, device, env), nprocs=world, join=True,
                           start_method=method)
        results = {}
        for rank in range(world):
            with open(f"{outdir}/rank{rank}.tsv") as f:
                for line in f.read().splitlines():
                    case_id, status = line.split("\t", 1)
                    results.setdefault(case_id, []).append(status.replace("\\n", "\n"))
    return results


def check_case(results, case_id, world):
    statuses = results.get(case_id)
    assert statuses is not None and len(statuses) == world, f"{case_id}: not run on every rank"
    failures = [s for s in statuses if not s.startswith("ok")]
    assert not failures, failures[0]
