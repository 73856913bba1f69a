"""Randomized packed (THD) batches on the CPU, where every value check runs.

Well-formed packings (random lengths including 0, gaps, tail rows, cross lengths, per-sequence
policies, windows, both unfused THD paths) must match the float64 reference, with every row
outside a sequence exactly 0 in the output and the gradients and NaN there never leaking.
Malformed metadata must raise ValueError/TypeError naming the argument. (cu_seqlens on another
device cannot be built on a CPU-only machine; test_gpu_validation.py covers it.)
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_engine.pytorch import DotProductAttention

from .reference import reference_thd

H, D = 2, 4
MASKS = ("padding", "padding_causal", "padding_causal_bottom_right")


@dataclass(frozen=True)
class Packing:
    lengths_q: List[int]
    lengths_kv: Optional[List[int]]  # None: self-attention, one cu_seqlens tensor for both sides
    gaps: Optional[List[int]]  # None: no padded offsets passed
    tail: int
    extra_max: int  # max_seqlen above the longest sequence
    hg: int
    mask: str
    window: Optional[tuple]
    policies: Optional[List[int]]  # per sequence: index into POLICIES
    gather: bool  # NVTE_UNFUSED_THD_GATHER=1: the sync-free path CUDA uses


POLICIES = ("padding", "padding_causal", ("padding_causal", (1, 0)), ("padding", (2, 1)))


def _window_for(mask: str, draw) -> Optional[tuple]:
    left = draw(st.sampled_from([-1, 0, 1, 3]))
    if "causal" in mask:
        return draw(st.sampled_from([None, (left, 0)]))
    right = draw(st.sampled_from([0, 1, 2]))  # (-1, 0) warns and means no window: left alone here
    return draw(st.sampled_from([None, (max(left, 0), right)]))


@st.composite
def packings(draw):
    b = draw(st.integers(1, 4))
    lengths = st.lists(st.integers(0, 6), min_size=b, max_size=b)
    lq = draw(lengths)
    lkv = draw(st.one_of(st.none(), lengths))
    gaps = draw(st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=b, max_size=b)))
    mask = draw(st.sampled_from(MASKS))
    per_seq = draw(st.booleans())
    # With policies the call's window is left out: a string key would take it and could then
    # name the same policy as a (mask, window) key, which is rejected (tested elsewhere).
    return Packing(lq, lkv, gaps, draw(st.integers(0, 3)), draw(st.integers(0, 3)), draw(st.sampled_from([1, 2])), mask,
                   None if per_seq else _window_for(mask, draw),
                   [draw(st.integers(0, len(POLICIES) - 1)) for _ in range(b)] if per_seq else None, draw(st.booleans()))


def _offsets(lengths, gaps):
    cu, off = [0], [0]
    for i, n in enumerate(lengths):
        cu.append(cu[-1] + n)
        off.append(off[-1] + n + (gaps[i] if gaps else 0))
    return cu, off


def _side(lengths, gaps, tail, heads, dims, gen):
    """Packed rows (NaN outside the sequences) and the metadata of one side."""
    cu, off = _offsets(lengths, gaps)
    rows = torch.zeros(off[-1] + tail, dtype=torch.bool)
    for a, n in zip(off, lengths):
        rows[a : a + n] = True
    ts = []
    for d in dims:
        t = torch.randn(rows.numel(), heads, d, generator=gen, dtype=torch.float64)
        t[~rows] = float("nan")
        ts.append(t.requires_grad_())
    return ts, torch.tensor(cu, dtype=torch.int32), torch.tensor(off, dtype=torch.int32), rows


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kwargs: dict
    rows_q: torch.Tensor
    rows_kv: torch.Tensor
    off_q: list
    off_kv: list


def build(p: Packing, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    lkv = p.lengths_q if p.lengths_kv is None else p.lengths_kv
    (q,), cu_q, off_q, rows_q = _side(p.lengths_q, p.gaps, p.tail, H, [D], gen)
    (k, v), cu_kv, off_kv, rows_kv = _side(lkv, p.gaps, p.tail, p.hg, [D, D], gen)
    if p.lengths_kv is None:
        cu_kv, off_kv = cu_q, off_q
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=max(p.lengths_q) + p.extra_max,
              max_seqlen_kv=max(lkv) + p.extra_max)
    if p.gaps is not None:
        kw.update(cu_seqlens_q_padded=off_q, cu_seqlens_kv_padded=off_kv)
    if p.policies is not None:
        groups = {}
        for i, pol in enumerate(p.policies):
            groups.setdefault(POLICIES[pol], []).append(i)
        kw["attn_mask_type_per_seq"] = {key: torch.tensor(ids) for key, ids in groups.items()}
    return Batch(q, k, v, kw, rows_q, rows_kv, off_q.tolist(), off_kv.tolist())


def _policy(p: Packing, i: int):
    if p.policies is None:
        return p.mask, p.window
    pol = POLICIES[p.policies[i]]
    return (pol, p.window) if isinstance(pol, str) else pol


def reference(p: Packing, x: Batch):
    lkv = p.lengths_q if p.lengths_kv is None else p.lengths_kv
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v))
    policies = [_policy(p, i) for i in range(len(p.lengths_q))]
    cu_q, cu_kv = _offsets(p.lengths_q, None)[0], _offsets(lkv, None)[0]
    out = reference_thd(qr, kr, vr, cu_q, cu_kv, x.off_q, x.off_kv, [m for m, _ in policies], [w for _, w in policies],
                        1 / math.sqrt(D))
    return out.flatten(-2), (qr, kr, vr)


def _run(p: Packing, x: Batch, monkeypatch):
    monkeypatch.setenv("NVTE_UNFUSED_THD_GATHER", "1" if p.gather else "0")
    dpa = DotProductAttention(H, D, num_gqa_groups=p.hg, qkv_format="thd", attn_mask_type=p.mask, window_size=p.window)
    return dpa(x.q, x.k, x.v, **x.kwargs)


@settings(max_examples=80, deadline=None)
@given(packings())
def test_well_formed_packings_match_the_reference(p):
    with pytest.MonkeyPatch.context() as mp:
        x = build(p)
        out = _run(p, x, mp)
    want, ref = reference(p, x)
    g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out.backward(g)
    if want.requires_grad:  # else no sequence has a query row: every gradient is 0
        want.backward(g)
    assert torch.isfinite(out).all() and torch.all(out[~x.rows_q] == 0)
    torch.testing.assert_close(out[x.rows_q], want[x.rows_q], rtol=1e-9, atol=1e-9)
    for got, exp, rows in zip((x.q, x.k, x.v), ref, (x.rows_q, x.rows_kv, x.rows_kv)):
        assert torch.isfinite(got.grad).all() and torch.all(got.grad[~rows] == 0)
        exp_grad = exp.grad if exp.grad is not None else torch.zeros_like(exp)
        torch.testing.assert_close(got.grad[rows], exp_grad[rows], rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------------------ malformed metadata


def _cu_name(side, padded):
    return f"cu_seqlens_{side}" + ("_padded" if padded else "")


def _corrupt(kind: str, p: Packing, x: Batch, side: str, draw):
    """Apply one corruption to x.kwargs; returns (exception type, regex of the message)."""
    kw = x.kwargs
    lengths = p.lengths_q if side == "q" else (p.lengths_kv or p.lengths_q)
    name = _cu_name(side, False)
    cu = kw[name].clone()
    kw[name] = cu
    if kind == "decreasing":
        i = draw(st.integers(1, len(lengths) - 1))
        cu[i] = cu[i + 1] + 1
        return ValueError, rf"{name} must be non-decreasing \(cumulative\); it decreases at index {i + 1}"
    if kind == "negative_start":
        cu[0] = -1
        return ValueError, rf"{name} must start at 0 or more"
    if kind == "past_end":
        rows = (x.q if side == "q" else x.k).shape[0]
        cu[-1] = rows + draw(st.integers(1, 5))
        return ValueError, rf"{name} must end within the tensor's {rows} rows"
    if kind == "short_slot":
        pname = _cu_name(side, True)
        off = kw[pname].clone()
        kw[pname] = off
        i = draw(st.sampled_from([j for j, n in enumerate(lengths) if n > 0]))
        off[i + 1] = off[i] + lengths[i] - 1
        return ValueError, rf"{pname} slots must each hold their sequence \(slot >= length\); sequences \[{i}\]"
    if kind == "padded_past_end":
        pname = _cu_name(side, True)
        rows = (x.q if side == "q" else x.k).shape[0]
        off = kw[pname].clone()
        off[-1] = rows + 1
        kw[pname] = off
        return ValueError, rf"{pname} must end within the tensor's {rows} rows"
    if kind == "max_seqlen":
        kw[f"max_seqlen_{side}"] = max(lengths) - 1
        return ValueError, rf"max_seqlen for {name} must be at least the longest sequence \({max(lengths)}\); got {max(lengths) - 1}"
    if kind == "max_seqlen_type":
        kw[f"max_seqlen_{side}"] = float(max(lengths))
        return TypeError, rf"max_seqlen for {name} must be a non-negative Python int"
    if kind == "int64":
        kw[name] = cu.long()
        return ValueError, rf"{name} must be a 1-D int32 tensor"
    raise AssertionError(kind)


def _corrupt_policy(kind: str, p: Packing, x: Batch, draw):
    b = len(p.lengths_q)
    ids = list(range(b))
    if kind == "duplicate_id":
        i, j = draw(st.permutations(range(b)))[:2]
        ids[i] = j
        x.kwargs["attn_mask_type_per_seq"] = {"padding": torch.tensor(ids)}
        return ValueError, rf"attn_mask_type_per_seq must name each sequence once; ids \[{j}\] are repeated and \[{i}\] missing"
    bad = -1 if kind == "negative_id" else b + draw(st.integers(0, 3))
    ids[draw(st.integers(0, b - 1))] = bad
    x.kwargs["attn_mask_type_per_seq"] = {"padding_causal": torch.tensor(ids)}
    return ValueError, rf"attn_mask_type_per_seq ids must be sequence indices in \[0, {b}\); got \[{bad}\]"


KINDS = ("decreasing", "negative_start", "past_end", "short_slot", "padded_past_end", "max_seqlen", "max_seqlen_type", "int64",
         "duplicate_id", "negative_id", "out_of_range_id", "pad_between_false")


@st.composite
def bad_calls(draw):
    kind = draw(st.sampled_from(KINDS))
    b = draw(st.integers(2 if kind in ("decreasing", "duplicate_id") else 1, 4))
    lq = draw(st.lists(st.integers(0, 6), min_size=b, max_size=b).filter(lambda ls: max(ls) > 0))
    lkv = draw(st.lists(st.integers(1, 6), min_size=b, max_size=b))
    needs_gaps = kind in ("short_slot", "padded_past_end", "pad_between_false")
    gaps = draw(st.lists(st.integers(0, 3), min_size=b, max_size=b)) if needs_gaps else None
    if kind == "pad_between_false":
        gaps[draw(st.integers(0, b - 1))] = draw(st.integers(1, 3))
    p = Packing(lq, lkv, gaps, draw(st.integers(0, 2)), 0, 2, "padding", None, None, draw(st.booleans()))
    x = build(p)
    if kind in ("duplicate_id", "negative_id", "out_of_range_id"):
        exc, msg = _corrupt_policy(kind, p, x, draw)
    elif kind == "pad_between_false":
        x.kwargs["pad_between_seqs"] = False
        exc, msg = ValueError, r"pad_between_seqs=False says there are no gaps, but cu_seqlens_(q|kv)_padded"
    else:
        side = draw(st.sampled_from(["q", "kv"]))
        if kind == "short_slot" and side == "q" and max(lq) == 0:
            side = "kv"
        exc, msg = _corrupt(kind, p, x, side, draw)
    return p, x, exc, msg


@settings(max_examples=100, deadline=None)
@given(bad_calls())
def test_malformed_metadata_is_rejected_by_name(call):
    p, x, exc, msg = call
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(exc, match=msg):
            _run(p, x, mp)
