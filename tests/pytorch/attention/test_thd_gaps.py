"""Gaps between packed (THD) sequences: NaN poured into every gap must never leak, and every
output and gradient row in a gap (or the tail) is exactly 0.

The unfused backend against the same sequences packed without gaps; the ``zero_gap_rows``
Triton kernel (the GPU's, run in Triton's CPU interpreter here) against a plain rule; the FA4
and FA3 paths on their stand-ins, which read whole tiles past each sequence end, so a gap's NaN
leaks exactly when the package's guard is off; the inferred ``pad_between_seqs``; and the
unfused THD paths (per sequence, and the gathered one CUDA uses) on edge batches."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import triton  # noqa: F401  (a test dependency: without it this file must fail, not skip)
from hypothesis import given, settings
from hypothesis import strategies as st

import transformer_engine.pytorch.attention.dot_product_attention.backends as backends
from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention.backends.gap_rows import FA4_MAX_TILE_ROWS, launch_triton, unowned_rows

from .gpu_helpers import env, grads_of
from .packing import GAP_CASES, check_gaps_vs_dense_packing, make_thd
from .reference import reference_thd
from .spies import PeakMemory

H = 4


@pytest.mark.parametrize("mask,window,hg,cross", GAP_CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_unfused_gaps_equal_the_batch_packed_without_them(mask, window, hg, cross, dtype):
    lengths_q = [5, 1, 7, 3]
    lengths_kv = [6, 4, 2, 3] if cross else lengths_q
    p = make_thd(lengths_q, lengths_kv, [2, 3, 0, 1], [1, 0, 4, 2] if cross else None, h=H, hg=hg, d=8, dtype=dtype, tail=3)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    check_gaps_vs_dense_packing("unfused", p, lengths_q, lengths_kv, mask, window, hg, 8, tol, shared=not cross)


def test_inferred_flag_uses_identity_not_values():
    """Equal values in distinct tensors count as gaps (comparing values would sync)."""
    p = make_thd([3, 2], gaps_q=[1, 1])
    dpa = DotProductAttention(H, 8, qkv_format="thd", attn_mask_type="padding")
    out_same = dpa(p.q, p.k, p.v, cu_seqlens_q=p.off_q, cu_seqlens_kv=p.off_q, cu_seqlens_q_padded=p.off_q,
                   cu_seqlens_kv_padded=p.off_q, max_seqlen_q=4, max_seqlen_kv=4)
    assert not torch.isfinite(out_same).all()  # no gaps declared: the NaN rows are read as tokens
    out_gaps = dpa(p.q, p.k, p.v, **p.kwargs(True, 3, 3, shared=True))
    assert torch.isfinite(out_gaps).all()


# ------------------------------------------------------------------ the zero_gap_rows kernel


def _i32(xs):
    return torch.tensor(xs, dtype=torch.int32)


def test_unowned_rows_docstring_example():
    # a a a _ b b _ _ c c c c _
    rows = unowned_rows(_i32([0, 3, 5, 9]), _i32([0, 4, 8, 12]), 13)
    assert rows.nonzero().flatten().tolist() == [3, 6, 7, 12]
    assert unowned_rows(_i32([0, 3, 5, 9]), _i32([0, 4, 8, 12]), 13, max_rows=1).nonzero().flatten().tolist() == [3, 6, 12]


def test_unowned_rows_where_lengths_overrun_their_slots():
    """Unchecked CUDA input can give a sequence more tokens than its slot: the kernel writes
    nothing after it (its end lies past the next slot), and the segments after it still count
    (their starts are then out of order)."""
    rows = unowned_rows(_i32([0, 4, 15, 15]), _i32([8, 10, 15, 18]), 18)
    assert rows.nonzero().flatten().tolist() == list(range(8)) + [15, 16, 17]


@st.composite
def layouts(draw):
    b = draw(st.integers(0, 5))
    lengths = draw(st.lists(st.integers(0, 40), min_size=b, max_size=b))
    # A negative gap shrinks the slot below its sequence (a length overrunning its slot, which
    # only unchecked CUDA input can give): that segment is empty.
    gaps = draw(st.lists(st.integers(-10, 40), min_size=b, max_size=b))
    lead, tail = draw(st.integers(0, 5)), draw(st.integers(0, 40))
    max_rows = draw(st.sampled_from([-1, 0, 1, 7, 16, 33]))
    packed = draw(st.booleans())  # q as a strided view of an interleaved qkv tensor
    h, d = draw(st.sampled_from([(1, 4), (3, 5), (2, 600)]))
    return lengths, gaps, lead, tail, max_rows, packed, h, d


@settings(max_examples=20, deadline=None)
@given(layouts())
def test_triton_kernel_writes_exactly_the_unowned_rows(layout):
    lengths, gaps, lead, tail, max_rows, packed, h, d = layout
    cu, off = [0], [lead]
    for n, g in zip(lengths, gaps):
        cu.append(cu[-1] + n)
        off.append(off[-1] + max(n + g, 0))
    total = off[-1] + tail
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(total, 3, h, d, device=device)[:, 1]  # packed: a strided view of qkv
    x = x if packed else x.contiguous()
    rows = unowned_rows(_i32(cu), _i32(off), total, max_rows)
    want = x.cpu().clone()
    want[rows] = 0
    # The rule, spelled out: rows from each end (and from row 0) up to the next slot (the last
    # one up to T), capped; a row is written when some segment holds it.
    starts = [0] + [o + n for o, n in zip(off, lengths)]
    stops = off[: len(lengths)] + [total] if lengths else [total]
    caps = [stop if max_rows < 0 else min(stop, start + max_rows) for start, stop in zip(starts, stops)]
    for r in range(total):
        assert bool(rows[r]) == any(start <= r < cap for start, cap in zip(starts, caps))
    launch_triton(x, _i32(cu).to(device), _i32(off).to(device), max_rows)
    assert torch.equal(x.cpu(), want)  # bit-exact: rows are zeroed or left alone, never computed


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


@settings(max_examples=15, deadline=None)
@given(qkv_layouts())
def test_triton_kernel_three_tensors_in_one_launch(layout):
    """q by the query side, k and v by the key/value side, each with its own head count and
    head dim (GQA, dv != d), in one launch: each gets exactly its own unowned rows."""
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
        assert torch.equal(got.cpu(), w)  # bit-exact: rows are zeroed or left alone


# ------------------------------------------------------------------ the NaN guard of FA4 and FA3

LENGTHS, GAPS = [37, 5, 300, 20], [3, 290, 9, 0]  # seq 1's gap is longer than the guard's reach


def _run_fa4(p, causal_ids=None, mask="padding_causal"):
    dpa = DotProductAttention(4, 8, qkv_format="thd", attn_mask_type=mask)
    kwargs = p.kwargs(True, max(LENGTHS), max(LENGTHS), shared=True)
    if causal_ids is not None:
        kwargs["thd_sequence_is_causal"] = causal_ids
    with backend_scope(force=backends.FlashAttentionV4):
        return dpa(p.q, p.k, p.v, **kwargs)


@pytest.mark.parametrize("policies", [False, True])
def test_fa4_gaps_and_tail_are_zero_with_nan_inputs(fa4_lib, policies):
    p = make_thd(LENGTHS, gaps_q=GAPS, h=4, d=8, tail=5)
    ids = torch.tensor([True, False, True, False]) if policies else None
    masks = ["padding_causal", "padding", "padding_causal", "padding"] if policies else "padding_causal"
    q_before = p.q.detach().clone()
    out = _run_fa4(p, ids)
    assert torch.equal(out[~p.valid_q], torch.zeros_like(out[~p.valid_q]))
    want = reference_thd(p.q.detach(), p.k.detach(), p.v.detach(), p.cu_q, p.cu_q, p.off_q, p.off_q, masks, None,
                         1 / math.sqrt(8)).view(p.q.shape[0], -1)
    assert (out[p.valid_q] - want[p.valid_q]).abs().max() < 1e-10
    out.backward(torch.randn_like(out))
    for t, valid in ((p.q, p.valid_q), (p.k, p.valid_kv), (p.v, p.valid_kv)):
        assert torch.isfinite(t.grad).all() and torch.all(t.grad[~valid] == 0)
    # In place: only unowned rows within the guard's reach of a sequence end were written.
    reach = unowned_rows(p.cu_q, p.off_q, p.q.shape[0], FA4_MAX_TILE_ROWS)
    assert torch.equal(p.q.detach()[p.valid_q], q_before[p.valid_q])
    assert torch.all(p.q.detach()[reach] == 0)
    assert torch.isnan(p.q.detach()[~p.valid_q & ~reach]).all() and (~p.valid_q & ~reach).any()


def test_fa4_guard_copy_leaves_the_inputs_and_off_leaks(fa4_lib):
    p = make_thd(LENGTHS, gaps_q=GAPS, h=4, d=8, tail=5)
    with env(NVTE_FLASH_ATTN_SANITIZE_GAPS="copy"):
        out = _run_fa4(p)
    assert torch.isfinite(out).all()
    assert torch.isnan(p.q.detach()[~p.valid_q]).all()  # inputs untouched
    out.backward(torch.randn_like(out))
    assert torch.isfinite(p.k.grad).all() and torch.all(p.k.grad[~p.valid_kv] == 0)
    with env(NVTE_FLASH_ATTN_SANITIZE_GAPS="0"):
        leaked = _run_fa4(make_thd(LENGTHS, gaps_q=GAPS, h=4, d=8, tail=5))
    assert torch.isnan(leaked[p.valid_q]).any()  # the stand-in leaks like FA4: the guard matters


def test_fa4_inference_needs_no_lse(fa4_lib):
    """Inference on inputs that need no gradient asks FA4 for no LSE and, by FA4's rule, none is
    allocated or stored; a training call asks for it (FA4 allocates it on the first run)."""
    p = make_thd(LENGTHS, gaps_q=GAPS, h=4, d=8)
    frozen = dataclasses.replace(p, q=p.q.detach(), k=p.k.detach(), v=p.v.detach())
    with torch.no_grad():
        _run_fa4(frozen)
    _run_fa4(p)
    first, second = fa4_lib.of("fwd")
    assert first["lse"] is None and first["return_lse"] is False and second["return_lse"] is True
    assert fa4_lib.lse_allocated == [False, True]


def test_fa4_policies_without_grad_on_inputs_that_require_grad(fa4_lib):
    """Under no_grad with inputs that still require grad, FA4 allocates an LSE on the first
    policy's run (its rule); the second run is handed it and asks for it, and the output matches
    the float64 reference with its unowned rows 0."""
    p = make_thd(LENGTHS, gaps_q=GAPS, h=4, d=8, tail=5)
    with torch.no_grad():
        out = _run_fa4(p, torch.tensor([True, False, True, False]))
    first, second = fa4_lib.of("fwd")
    assert fa4_lib.lse_allocated == [True, False] and first["return_lse"] is False
    assert second["lse"] is not None and second["return_lse"] is True
    masks = ["padding_causal", "padding", "padding_causal", "padding"]
    want = reference_thd(p.q.detach(), p.k.detach(), p.v.detach(), p.cu_q, p.cu_q, p.off_q, p.off_q, masks, None,
                         1 / math.sqrt(8)).view(p.q.shape[0], -1)
    assert (out[p.valid_q] - want[p.valid_q]).abs().max() < 1e-10
    # Exact: these rows are written by the zeroing (a fill with 0), not computed.
    assert torch.equal(out[~p.valid_q], torch.zeros_like(out[~p.valid_q]))


def test_fa3_guard_has_teeth(fa3_lib, monkeypatch):
    """Without the guard FA3's stand-in leaks gap NaN into valid rows, as FA3 would; with the
    copy guard the inputs stay untouched and the result and gradients are finite."""
    dpa = DotProductAttention(H, 8, qkv_format="thd", attn_mask_type="padding_causal")
    p = make_thd([5, 3, 7, 4], gaps_q=[2, 0, 3, 1], h=H, d=8, tail=2)
    with backend_scope(force="fa3"):
        monkeypatch.setenv("NVTE_FLASH_ATTN_SANITIZE_GAPS", "0")
        assert torch.isnan(dpa(p.q, p.k, p.v, **p.kwargs(True, 7, 7, shared=True))[p.valid_q]).any()
        monkeypatch.setenv("NVTE_FLASH_ATTN_SANITIZE_GAPS", "copy")
        out = dpa(p.q, p.k, p.v, **p.kwargs(True, 7, 7, shared=True))
    assert torch.isfinite(out).all() and torch.isnan(p.v.detach()[~p.valid_kv]).all()
    out.backward(torch.randn_like(out))
    assert torch.isfinite(p.v.grad).all() and torch.all(p.v.grad[~p.valid_kv] == 0)


# ------------------------------------------------------------------ the unfused THD paths on edge batches


def test_gathered_path_equals_the_per_sequence_path(monkeypatch):
    """The sync-free path for THD (NVTE_UNFUSED_THD_GATHER=1, what CUDA runs), run on the CPU,
    equals the per-sequence CPU path: gaps, cross lengths, GQA, a bottom-right window."""
    p = make_thd([3, 5, 1, 4], [4, 2, 3, 6], [1, 0, 2, 1], [0, 2, 1, 1], h=H, hg=2, d=8, tail=1)
    dpa = DotProductAttention(H, 8, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal_bottom_right",
                              window_size=(1, 0))
    kw = p.kwargs(True, 5, 6)
    g = torch.randn(p.q.shape[0], H * 8, dtype=torch.float64)
    out_a = dpa(p.q, p.k, p.v, **kw)
    grads_a = grads_of(out_a, [p.q, p.k, p.v], g)
    monkeypatch.setenv("NVTE_UNFUSED_THD_GATHER", "1")
    out_b = dpa(p.q, p.k, p.v, **kw)
    grads_b = grads_of(out_b, [p.q, p.k, p.v], g)
    for a, b in zip([out_a, *grads_a], [out_b, *grads_b]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gather", ["0", "1"])
def test_zero_row_inputs_with_sequences(monkeypatch, gather):
    """q/kv with no rows but sequences of length 0 give an empty output (the gathered path,
    the one CUDA uses, crashed)."""
    monkeypatch.setenv("NVTE_UNFUSED_THD_GATHER", gather)
    q, k, v = (torch.zeros(0, H, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cu = torch.zeros(3, dtype=torch.int32)
    out = DotProductAttention(H, 8, qkv_format="thd", attn_mask_type="padding")(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                                               max_seqlen_q=0, max_seqlen_kv=0)
    assert out.shape == (0, H * 8)
    out.sum().backward()
    assert q.grad.shape == (0, H, 8)


def test_unclaimed_sequence_attends_nothing_on_the_gathered_path(monkeypatch):
    """An id the policies miss (unchecked on CUDA) leaves its sequence with no policy: the
    gathered path must give it 0 (the kernels run it in no call), not the last policy's mask."""
    from transformer_engine.pytorch.attention.dot_product_attention.prepare import packed_seqs, policies

    monkeypatch.setenv("NVTE_UNFUSED_THD_GATHER", "1")
    for module in (packed_seqs, policies):  # as on CUDA without NVTE_ATTN_VALIDATE
        monkeypatch.setattr(module, "value_checks_on", lambda device: False)
    p = make_thd([3, 4, 2], h=H, d=8)
    dpa = DotProductAttention(H, 8, qkv_format="thd", attn_mask_type="padding")
    ids = {"padding": torch.tensor([0, 7]), "padding_causal": torch.tensor([2])}  # 7 is out of range; 1 unclaimed
    out = dpa(p.q, p.k, p.v, **p.kwargs(False, 4, 4, shared=True), attn_mask_type_per_seq=ids)
    assert torch.all(out[3:7] == 0) and torch.isfinite(out).all()


def test_bounded_kv_lengths_follow_the_kv_slots_when_cu_seqlens_are_shared():
    """One cu_seqlens for both sides but different padded offsets: after bounding, the kernels'
    kv lengths must be capped by the kv slots, not reuse the query's (an over-read of kv)."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends.varlen import _valid_lengths
    from transformer_engine.pytorch.attention.dot_product_attention.prepare.packed_seqs import PackedSeqs, made_safe

    cu = torch.tensor([0, 4, 14], dtype=torch.int32)
    pq = PackedSeqs(cu, torch.tensor([0, 4, 20], dtype=torch.int32), 10, 20)
    pk = PackedSeqs(cu, torch.tensor([0, 10, 14], dtype=torch.int32), 10, 14)
    sq, sk = made_safe(pq, pk)
    len_q, len_kv = _valid_lengths(sq, sk)
    assert len_q.tolist() == [4, 10]
    assert len_kv.tolist() == [4, 4]  # the second kv slot holds 4 rows: [10, 14)
    assert int((sk.offsets[:-1] + len_kv).max()) <= sk.total_tokens


def test_large_batch_of_short_sequences_runs_on_cpu():
    """32k tokens of short sequences: memory follows sum(s_i^2), not b * max_s^2."""
    lengths, h = [64] * 500 + [768], 2
    p = make_thd(lengths, h=h, hg=h, d=16, dtype=torch.float32)
    dpa = DotProductAttention(h, 16, qkv_format="thd", attn_mask_type="padding_causal")
    with PeakMemory([p.q, p.k, p.v]) as mode:
        out = dpa(p.q, p.k, p.v, **p.kwargs(False, 768, 768))
    assert out.shape == (sum(lengths), 32) and torch.isfinite(out).all()
    # With gradients this small call keeps every sequence's P (1.5 float32 copies of the sum
    # measured). b * max_s^2 would be 2.4 GB of float32 scores, 268 MB even cut into chunks of the
    # default budget (2**26 scores), where the bound below is 42 MB.
    per_sequence_scores = 4 * h * sum(s * s for s in lengths)
    assert h * 768 * 768 * 4 <= mode.peak <= 2 * per_sequence_scores, mode.peak
