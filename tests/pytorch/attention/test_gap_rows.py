"""Unowned rows (gaps, the tail) zeroed by the Triton kernel and on the CPU; and the FA4 path
(buffers, gap zeroing, the NaN guard) run on the CPU against an emulation of FA4.

The kernel runs on the GPU when there is one, else under Triton's CPU interpreter (set up
by tests/conftest.py). The emulated FA4 reads whole tiles like the
real one, so NaN in a gap leaks exactly when the guard is off: that is what gives the guard
tests their teeth."""

from __future__ import annotations

import math

import pytest
import torch
import triton  # noqa: F401  (a test dependency: without it this file must fail, not skip)
from hypothesis import given, settings
from hypothesis import strategies as st

import transformer_engine.pytorch.attention.dot_product_attention.backends as backends
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention.backends import kernel_ops
from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention.dot_product_attention.backends import gap_rows
from transformer_engine.pytorch.attention.dot_product_attention.backends.gap_rows import FA4_MAX_TILE_ROWS, unowned_rows

from .gpu_helpers import env
from .packing import make_thd
from .reference import reference_thd



def _i32(xs):
    return torch.tensor(xs, dtype=torch.int32)


def test_docstring_example():
    # a a a _ b b _ _ c c c c _
    rows = unowned_rows(_i32([0, 3, 5, 9]), _i32([0, 4, 8, 12]), 13)
    assert rows.nonzero().flatten().tolist() == [3, 6, 7, 12]
    assert unowned_rows(_i32([0, 3, 5, 9]), _i32([0, 4, 8, 12]), 13, max_rows=1).nonzero().flatten().tolist() == [3, 6, 12]


@st.composite
def layouts(draw):
    b = draw(st.integers(0, 5))
    lengths = draw(st.lists(st.integers(0, 40), min_size=b, max_size=b))
    gaps = draw(st.lists(st.integers(0, 40), min_size=b, max_size=b))
    lead, tail = draw(st.integers(0, 5)), draw(st.integers(0, 40))
    max_rows = draw(st.sampled_from([-1, 0, 1, 7, 16, 33]))
    packed = draw(st.booleans())  # q as a strided view of an interleaved qkv tensor
    h, d = draw(st.sampled_from([(1, 4), (3, 5), (2, 600)]))
    return lengths, gaps, lead, tail, max_rows, packed, h, d


@settings(max_examples=25, deadline=None)
@given(layouts())
def test_triton_kernel_writes_exactly_the_unowned_rows(layout):
    from transformer_engine.pytorch.attention.dot_product_attention.backends.gap_rows import launch_triton

    lengths, gaps, lead, tail, max_rows, packed, h, d = layout
    cu, off = [0], [lead]
    for n, g in zip(lengths, gaps):
        cu.append(cu[-1] + n)
        off.append(off[-1] + n + g)
    total = off[-1] + tail
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(total, 3, h, d, device=device)[:, 1]  # packed: a strided view of qkv
    x = x if packed else x.contiguous()
    rows = unowned_rows(_i32(cu), _i32(off), total, max_rows)
    want = x.cpu().clone()
    want[rows] = 0
    # The reference, spelled out: rows after each end (and before the first slot), capped.
    starts = [0] + [o + n for o, n in zip(off, lengths)]
    stops = off[: len(lengths)] + [total] if lengths else [total]
    for r in range(total):
        seg = max(i for i, s in enumerate(starts) if s <= r)
        cap = stops[seg] if max_rows < 0 else min(stops[seg], starts[seg] + max_rows)
        assert bool(rows[r]) == (r < cap)
    launch_triton(x, _i32(cu).to(device), _i32(off).to(device), max_rows)
    assert torch.equal(x.cpu(), want)


def _side(draw, b):
    lengths = draw(st.lists(st.integers(0, 30), min_size=b, max_size=b))
    gaps = draw(st.lists(st.integers(0, 30), min_size=b, max_size=b))
    cu, off = [0], [draw(st.integers(0, 4))]
    for n, g in zip(lengths, gaps):
        cu.append(cu[-1] + n)
        off.append(off[-1] + n + g)
    return cu, off, off[-1] + draw(st.integers(0, 30))


@st.composite
def qkv_layouts(draw):
    b = draw(st.integers(0, 4))
    return b, _side(draw, b), _side(draw, b), draw(st.sampled_from([-1, 0, 5, 16])), draw(st.booleans())


@settings(max_examples=20, deadline=None)
@given(qkv_layouts())
def test_triton_kernel_three_tensors_in_one_launch(layout):
    """q by the query side, k and v by the key/value side, each with its own head count and
    head dim (GQA, dv != d), in one launch: each gets exactly its own unowned rows."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends.gap_rows import launch_triton

    b, (cu_q, off_q, tq), (cu_kv, off_kv, tkv), max_rows, shared_kv = layout
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(tq, 4, 6, device=device)
    k = torch.randn(tkv, 2, 6, device=device)
    v = k if shared_kv else torch.randn(tkv, 2, 3, device=device)
    want = []
    for t, cu, off in ((q, cu_q, off_q), (k, cu_kv, off_kv), (v, cu_kv, off_kv)):
        w = t.cpu().clone()
        w[unowned_rows(_i32(cu), _i32(off), t.shape[0], max_rows)] = 0
        want.append(w)
    launch_triton(q, _i32(cu_q).to(device), _i32(off_q).to(device), max_rows, (k,) if shared_kv else (k, v),
                  _i32(cu_kv).to(device), _i32(off_kv).to(device))
    for got, w in zip((q, k, v), want):
        assert torch.equal(got.cpu(), w)


# ------------------------------------------------------------------ FA4 emulated on the CPU

TILE = 16  # the emulation's tile: rows up to the next multiple of TILE enter the products


def _tile_rows(offset: int, n: int, total: int) -> slice:
    return slice(offset, min(offset + math.ceil(n / TILE) * TILE, total))


def _emulated_attention(q, k, v, nq, nk, scale, causal, left, right):
    """FA4's arithmetic on whole tiles: masked scores are replaced (not added), so NaN in a
    masked K row vanishes, but P (0 there) times a NaN V row is NaN, as on the GPU."""
    h, hg = q.shape[1], k.shape[1]
    k, v = (t.repeat_interleave(h // hg, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    i = torch.arange(q.shape[0]).view(-1, 1)
    j = torch.arange(k.shape[0]).view(1, -1)
    rel = j - i - (nk - nq)
    ok = (j < nk) & (rel <= (0 if causal else (right if right >= 0 else nk)))
    if left >= 0:
        ok &= rel >= -left
    probs = torch.softmax(torch.where(ok, scores, -math.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def fake_fa4_fwd(q, k, v, out, lse, cu_q, cu_kv, used_q, used_kv, max_q, max_kv, scale, causal, left, right, learnable_sink=None,
                 num_splits=None):
    assert learnable_sink is None  # vanilla softmax in these tests (num_splits: a hint, results do not depend on it)
    for b, (oq, ok_, nq, nk) in enumerate(_sequences(cu_q, cu_kv, used_q, used_kv)):
        if nq == 0:
            continue  # FA4 skips the sequence: its rows stay unwritten
        tq, tk = _tile_rows(oq, nq, q.shape[0]), _tile_rows(ok_, nk, k.shape[0])
        o = _emulated_attention(q[tq].double(), k[tk].double(), v[tk].double(), nq, nk, scale, causal, left, right)
        out[oq : oq + nq] = o[:nq].to(out.dtype)


def fake_fa4_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_kv, used_q, used_kv, max_q, max_kv, scale, causal,
                 left, right, deterministic):
    for oq, ok_, nq, nk in _sequences(cu_q, cu_kv, used_q, used_kv):
        if nq == 0:
            continue
        # Queries: the sequence's own rows (FA4 masks a tile's rows past its end); keys and
        # values: whole tiles (masked scores still meet NaN there, 0 * NaN = NaN).
        tq, tk = slice(oq, oq + nq), _tile_rows(ok_, nk, k.shape[0])
        leaves = [t[s].double().requires_grad_() for t, s in ((q, tq), (k, tk), (v, tk))]
        with torch.enable_grad():  # backward runs with grad mode off
            o = _emulated_attention(*leaves, nq, nk, scale, causal, left, right)
            o.backward(dout[tq].double())
        dq[oq : oq + nq] = leaves[0].grad[:nq].to(dq.dtype)
        dk[ok_ : ok_ + nk] = leaves[1].grad[:nk].to(dk.dtype)
        dv[ok_ : ok_ + nk] = leaves[2].grad[:nk].to(dv.dtype)


def _sequences(cu_q, cu_kv, used_q, used_kv):
    lens_q = (cu_q[1:] - cu_q[:-1]) if used_q is None else used_q
    lens_kv = (cu_kv[1:] - cu_kv[:-1]) if used_kv is None else used_kv
    return list(zip(cu_q[:-1].tolist(), cu_kv[:-1].tolist(), lens_q.tolist(), lens_kv.tolist()))


class _FakeOps:
    fa4_fwd = staticmethod(fake_fa4_fwd)
    fa4_bwd = staticmethod(fake_fa4_bwd)
    zero_gap_rows = staticmethod(gap_rows.zero_gap_rows)  # the real ops (their CPU branches)
    zero_gap_rows_qkv = staticmethod(gap_rows.zero_gap_rows_qkv)


@pytest.fixture
def fa4_on_cpu(monkeypatch):
    """DotProductAttention on the CPU through the real FA4 backend code, FA4 emulated."""
    monkeypatch.setattr(kernel_ops, "ops", _FakeOps())
    with backend_scope(force=backends.FlashAttentionV4):
        yield


LENGTHS, GAPS = [37, 5, 300, 20], [3, 290, 9, 0]  # seq 1's gap is longer than the guard's reach


def _run(p, causal_ids=None, mask="padding_causal"):
    dpa = DotProductAttention(4, 8, qkv_format="thd", attn_mask_type=mask)
    kwargs = p.kwargs(True, max(LENGTHS), max(LENGTHS), shared=True)
    if causal_ids is not None:
        kwargs["thd_sequence_is_causal"] = causal_ids
    return dpa(p.q, p.k, p.v, **kwargs)


def _expected(p, masks):
    b = len(LENGTHS)
    return reference_thd(p.q.detach(), p.k.detach(), p.v.detach(), p.cu_q, p.cu_q, p.off_q, p.off_q, masks, [None] * b,
                         1 / math.sqrt(8)).view(p.q.shape[0], -1)


@pytest.mark.parametrize("policies", [False, True])
def test_fa4_path_gaps_and_tail_zero_with_nan_inputs(fa4_on_cpu, policies):
    p = make_thd(LENGTHS, gaps_q=GAPS, h=4, d=8, tail=5)
    ids = torch.tensor([True, False, True, False]) if policies else None
    masks = ["padding_causal", "padding", "padding_causal", "padding"] if policies else ["padding_causal"] * 4
    q_before = p.q.detach().clone()
    out = _run(p, ids)
    assert torch.equal(out[~p.valid_q], torch.zeros_like(out[~p.valid_q]))
    assert (out[p.valid_q] - _expected(p, masks)[p.valid_q]).abs().max() < 1e-10
    out.backward(torch.randn_like(out))
    for t, valid in ((p.q, p.valid_q), (p.k, p.valid_kv), (p.v, p.valid_kv)):
        assert torch.isfinite(t.grad).all() and torch.all(t.grad[~valid] == 0)
    # In place: only unowned rows within the guard's reach of a sequence end were written.
    reach = unowned_rows(p.cu_q, p.off_q, p.q.shape[0], FA4_MAX_TILE_ROWS)
    assert torch.equal(p.q.detach()[p.valid_q], q_before[p.valid_q])
    assert torch.all(p.q.detach()[reach] == 0)
    assert torch.isnan(p.q.detach()[~p.valid_q & ~reach]).all() and (~p.valid_q & ~reach).any()


def test_fa4_guard_copy_leaves_inputs_and_off_leaks(fa4_on_cpu):
    p = make_thd(LENGTHS, gaps_q=GAPS, h=4, d=8, tail=5)
    with env(NVTE_FLASH_ATTN_SANITIZE_GAPS="copy"):
        out = _run(p)
    assert torch.isfinite(out).all()
    assert torch.isnan(p.q.detach()[~p.valid_q]).all()  # inputs untouched
    out.backward(torch.randn_like(out))
    assert torch.isfinite(p.k.grad).all() and torch.all(p.k.grad[~p.valid_kv] == 0)
    with env(NVTE_FLASH_ATTN_SANITIZE_GAPS="0"):
        leaked = _run(make_thd(LENGTHS, gaps_q=GAPS, h=4, d=8, tail=5))
    assert torch.isnan(leaked[p.valid_q]).any()  # the emulation leaks like FA4: the guard matters


def test_fa4_inference_needs_no_lse(fa4_on_cpu, monkeypatch):
    seen = []

    def spy(q, k, v, out, lse, *args, **kwargs):
        seen.append(lse)
        fake_fa4_fwd(q, k, v, out, lse, *args, **kwargs)

    monkeypatch.setattr(_FakeOps, "fa4_fwd", staticmethod(spy))
    p = make_thd(LENGTHS, gaps_q=GAPS, h=4, d=8)
    with torch.no_grad():
        _run(p)
    _run(p)
    assert seen[0] is None and seen[1] is not None
