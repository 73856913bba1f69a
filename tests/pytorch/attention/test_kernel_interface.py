"""The one kernel interface (kernel_problem.py) on the CPU, from both of its callers: the
module's autograd (a problem made from the prepared inputs and their THD plan) and context
parallelism (``spans.SpanAdapter``, a one-run problem per span call).

The FA4 and cuDNN ops are replaced by a float64 stand-in library that records every call's
arguments and computes it per sequence with each library's documented semantics: FA4 writes
only the rows it runs (the rest hold NaN here) and an LSE [H, T] by physical row; cuDNN too
writes only the rows it runs, leaving the others as the caller made them (the tests run in
deterministic mode, where torch NaN-fills uninitialized memory, so an unwritten row of an
empty buffer shows; like cuDNN, it leaves a query row that sees no key unwritten), and
returns stats [B, H, SQ, 1] by position (NaN past each length); both
backwards use the LSE/stats they are given (as the real ones do, so context parallelism's
final LSE reaches them). Results are compared with the unfused span kernel and backend."""

from __future__ import annotations

import math

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention.backends import kernel_ops
from transformer_engine.pytorch.attention.dot_product_attention.backends import FlashAttentionV4, FusedAttention, UnfusedDotProductAttention
from transformer_engine.pytorch.attention.dot_product_attention.cp.spans import StepMask, make_span, span_kernel

from .packing import make_thd

H, HG, D = 4, 2, 8
SCALE = 0.3


# ------------------------------------------------------------------ the stand-in library (float64)


def _allowed(n, m, causal, left, right, offset):
    """[n, m]: key j visible to query i, the diagonal at i + offset."""
    i, j = torch.arange(n).view(-1, 1), torch.arange(m).view(1, -1)
    right = 0 if causal else right
    ok = torch.ones(n, m, dtype=torch.bool)
    if right >= 0:
        ok &= j <= i + offset + right
    if left >= 0:
        ok &= j >= i + offset - left
    return ok


def _scores(q, k, allowed):
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.einsum("nhd,mhd->hnm", q.double(), kk) * SCALE
    return s.masked_fill(~allowed, -math.inf)


def _probs(s, lse):
    lse = lse.view(*lse.shape, 1)
    return torch.where(torch.isinf(lse), 0.0, torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)))


def _seq_fwd(q, k, v, allowed):
    """out [n, H, Dv], lse [H, n]."""
    s = _scores(q, k, allowed)
    lse = torch.logsumexp(s, dim=-1)
    vv = v.double().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.einsum("hnm,mhd->nhd", _probs(s, lse), vv), lse


def _seq_bwd(dout, q, k, v, out, lse, allowed):
    """dq, dk, dv from the given (final) out and lse, FlashAttention's backward written out."""
    g = q.shape[1] // k.shape[1]
    p = _probs(_scores(q, k, allowed), lse.double())
    do, vv = dout.double(), v.double().repeat_interleave(g, dim=1)
    ds = p * (torch.einsum("nhd,mhd->hnm", do, vv) - (do * out.double()).sum(-1).t().unsqueeze(-1))
    kk = k.double().repeat_interleave(g, dim=1)
    dq = torch.einsum("hnm,mhd->nhd", ds, kk) * SCALE
    dk = (torch.einsum("hnm,nhd->mhd", ds, q.double()) * SCALE).unflatten(1, (k.shape[1], g)).sum(2)
    dv = torch.einsum("hnm,nhd->mhd", p, do).unflatten(1, (v.shape[1], g)).sum(2)
    return dq, dk, dv


def _seqs(off_q, off_kv, len_q, len_kv, b, sq, skv):
    """(start q, start kv, n, m) per sequence; dense problems have offsets None."""
    for i in range(b):
        oq = int(off_q[i]) if off_q is not None else i * sq
        ok = int(off_kv[i]) if off_kv is not None else i * skv
        n = int(len_q[i]) if len_q is not None else (int(off_q[i + 1]) - oq if off_q is not None else sq)
        m = int(len_kv[i]) if len_kv is not None else (int(off_kv[i + 1]) - ok if off_kv is not None else skv)
        yield oq, ok, n, m


def _rows(t):
    return t.flatten(0, 1) if t.dim() == 4 else t


class StandIn:
    """FA4's and cuDNN's ops with their registered signatures; ``calls`` records each call."""

    def __init__(self):
        self.calls = []
        self._buffers = []  # buffers already handed to a call (held, so their ids stay unique)

    def _fresh(self, *buffers):
        """NaN into each buffer on its first call only: like FA4, a later policy's call leaves
        the rows an earlier one wrote untouched, and rows no call writes stay garbage (NaN)."""
        for t in buffers:
            if t is not None and not any(t is seen for seen in self._buffers):
                self._buffers.append(t)
                t.fill_(math.nan)

    def fa4_fwd(self, q, k, v, out, lse, cu_q, cu_kv, used_q, used_kv, max_q, max_kv, scale, causal, left, right,
                learnable_sink=None, num_splits=None):
        assert q.dim() == 3 and lse is not None and learnable_sink is None and num_splits is None
        self.calls.append(("fa4_fwd", dict(cu_q=cu_q, cu_kv=cu_kv, used_q=used_q, used_kv=used_kv, max_q=max_q,
                                           max_kv=max_kv, scale=scale, mask=(causal, left, right))))
        self._fresh(out, lse)
        for oq, ok, n, m in _seqs(cu_q, cu_kv, used_q, used_kv, cu_q.numel() - 1, 0, 0):
            assert n <= max_q and m <= max_kv
            if n:
                o, l_ = _seq_fwd(q[oq:oq + n], k[ok:ok + m], v[ok:ok + m], _allowed(n, m, causal, left, right, m - n))
                out[oq:oq + n], lse[:, oq:oq + n] = o.to(out.dtype), l_.float()

    def fa4_bwd(self, dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_kv, used_q, used_kv, max_q, max_kv, scale, causal,
                left, right, deterministic):
        self.calls.append(("fa4_bwd", dict(cu_q=cu_q, used_q=used_q, lse=lse, mask=(causal, left, right))))
        self._fresh(dq, dk, dv)
        for oq, ok, n, m in _seqs(cu_q, cu_kv, used_q, used_kv, cu_q.numel() - 1, 0, 0):
            # No query rows: the key blocks' gradients are 0 (assumed, as kernels looping over
            # key blocks write them; a context-parallel step can give a sequence no query rows).
            dk[ok:ok + m], dv[ok:ok + m] = 0, 0
            if n:
                grads = _seq_bwd(dout[oq:oq + n], q[oq:oq + n], k[ok:ok + m], v[ok:ok + m], out[oq:oq + n],
                                 lse[:, oq:oq + n], _allowed(n, m, causal, left, right, m - n))
                dq[oq:oq + n], dk[ok:ok + m], dv[ok:ok + m] = (g.to(dq.dtype) for g in grads)

    def cudnn_fwd(self, q, k, v, out, off_q, off_kv, len_q, len_kv, b, max_q, max_kv, scale, causal, left, right,
                  bottom_right, bias=None, rng=None, alibi=False, dropout_p=0.0, sink=None):
        stats = torch.full((b, q.shape[-2], max(max_q, 1), 1), math.nan)
        self.calls.append(("cudnn_fwd", dict(off_q=off_q, off_kv=off_kv, len_q=len_q, len_kv=len_kv, b=b, max_q=max_q,
                                             max_kv=max_kv, mask=(causal, left, right, bottom_right), stats=stats)))
        qr, kr, vr, orows = _rows(q), _rows(k), _rows(v), _rows(out)
        for i, (oq, ok, n, m) in enumerate(_seqs(off_q, off_kv, len_q, len_kv, b, max_q, max_kv)):
            if n and m:  # a sequence with an empty side: nothing written
                allowed = _allowed(n, m, causal, left, right, m - n if bottom_right else 0)
                o, l_ = _seq_fwd(qr[oq:oq + n], kr[ok:ok + m], vr[ok:ok + m], allowed)
                seen = allowed.any(dim=1)  # cuDNN leaves a row that sees no key unwritten
                orows[oq:oq + n][seen], stats[i, :, :n, 0] = o[seen].to(out.dtype), l_.float()
        return stats

    def cudnn_bwd(self, dout, q, k, v, out, stats, dq, dk, dv, off_q, off_kv, len_q, len_kv, b, max_q, max_kv, scale,
                  causal, left, right, bottom_right, deterministic, bias=None, rng=None, alibi=False, dropout_p=0.0,
                  sink=None, need_dbias=False, need_dsink=False):
        self.calls.append(("cudnn_bwd", dict(off_q=off_q, len_q=len_q, len_kv=len_kv, b=b, stats=stats)))
        grads = [dq, dk, dv]
        rows = [_rows(t) for t in (dout, q, k, v, out, *grads)]
        for i, (oq, ok, n, m) in enumerate(_seqs(off_q, off_kv, len_q, len_kv, b, max_q, max_kv)):
            if n and m:
                d, qq, kk, vv, oo, gq, gk, gv = rows
                allowed = _allowed(n, m, causal, left, right, m - n if bottom_right else 0)
                got = _seq_bwd(d[oq:oq + n], qq[oq:oq + n], kk[ok:ok + m], vv[ok:ok + m], oo[oq:oq + n],
                               stats[i, :, :n, 0], allowed)
                gq[oq:oq + n], gk[ok:ok + m], gv[ok:ok + m] = (g.to(q.dtype) for g in got)
        return q.new_empty(0), q.new_empty(0)

    def of(self, name):
        return [kw for n, kw in self.calls if n == name]


@pytest.fixture
def lib(monkeypatch):
    from transformer_engine.pytorch.attention.dot_product_attention.backends import gap_rows

    stand_in = StandIn()
    stand_in.zero_gap_rows = gap_rows.zero_gap_rows
    stand_in.zero_gap_rows_qkv = gap_rows.zero_gap_rows_qkv
    monkeypatch.setattr(kernel_ops, "ops", stand_in)
    # An empty buffer's unwritten rows are garbage, never silently 0: in deterministic mode torch
    # fills every uninitialized float tensor (empty, new_empty, empty_like) with NaN.
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    yield stand_in
    torch.use_deterministic_algorithms(was)


# ------------------------------------------------------------------ context parallelism: one-run problems

BACKENDS = {"fa4": "FlashAttention v4", "cudnn": "FusedAttention"}
# The span interface context parallelism runs, per selected backend (over its declared KERNEL).
KERNELS = {"FlashAttention v4": span_kernel(FlashAttentionV4, "p2p"), "FusedAttention": span_kernel(FusedAttention, "p2p")}
UnfusedSpanKernel = span_kernel(UnfusedDotProductAttention, "p2p")


def _spans():
    """Three sequences in slots of 8 (q) / 10 (kv) rows; per sequence a shifted q span and a
    kv span, one of them empty (as a ring step gives a sequence no rows)."""
    slots_q = torch.tensor([0, 8, 16, 24], dtype=torch.int32)
    slots_kv = torch.tensor([0, 10, 20, 30], dtype=torch.int32)
    qs = make_span(slots_q, torch.tensor([1, 0, 2], dtype=torch.int32), torch.tensor([5, 0, 4]), 24, 6)
    ks = make_span(slots_kv, torch.zeros(3, dtype=torch.int32), torch.tensor([7, 3, 9]), 30, 9)
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(n, h, D, generator=g, dtype=torch.float64) for n, h in ((24, H), (30, HG), (30, HG), (24, H)))
    return q, k, v, dout, qs, ks


MASKS = [StepMask(False), StepMask(True), StepMask(True, 2)]


@pytest.mark.parametrize("mask", MASKS, ids=["full", "causal", "causal-window2"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_span_adapter_matches_the_unfused_span_kernel(lib, backend, mask):
    q, k, v, dout, qs, ks = _spans()
    kernel = KERNELS[BACKENDS[backend]]
    out, lse = kernel.forward(q, k, v, qs, ks, mask, SCALE)
    want_out, want_lse = UnfusedSpanKernel.forward(q, k, v, qs, ks, mask, SCALE)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    assert lse.dtype == torch.float32 and lse.shape == (H, 24)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)  # -inf outside the spans on both
    assert torch.all(out[~qs.covered] == 0) and torch.all(torch.isneginf(lse[:, ~qs.covered]))
    # The backward from the unfused kernel's out/lse (a schedule hands the FINAL ones).
    got = kernel.backward(dout, q, k, v, want_out, want_lse.float(), qs, ks, mask, SCALE)
    want = UnfusedSpanKernel.backward(dout, q, k, v, want_out, want_lse.float(), qs, ks, mask, SCALE)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.all(got[0][~qs.covered] == 0) and torch.all(got[1][~ks.covered] == 0)


@pytest.mark.parametrize("mask,fa,cudnn", [
    (StepMask(False), (False, -1, -1), (False, -1, -1, False)),
    (StepMask(True), (True, -1, -1), (True, -1, 0, True)),
    (StepMask(True, 2), (False, 2, 0), (True, 2, 0, True)),
])
def test_span_call_arguments(lib, mask, fa, cudnn):
    """A span call is one run: span starts as offsets, span lengths as valid lengths, the
    spans' bounds as max_seqlen, the mask bottom-right (FA's convention, cuDNN's alignment)."""
    q, k, v, dout, qs, ks = _spans()
    out, lse = KERNELS["FlashAttention v4"].forward(q, k, v, qs, ks, mask, SCALE)
    KERNELS["FlashAttention v4"].backward(dout, q, k, v, out, lse, qs, ks, mask, SCALE)
    (fwd,), (bwd,) = lib.of("fa4_fwd"), lib.of("fa4_bwd")
    assert fwd["cu_q"] is qs.offsets and fwd["cu_kv"] is ks.offsets
    assert fwd["used_q"] is qs.lengths and fwd["used_kv"] is ks.lengths
    assert (fwd["max_q"], fwd["max_kv"], fwd["scale"], fwd["mask"]) == (6, 9, SCALE, fa)
    assert bwd["cu_q"] is qs.offsets and bwd["mask"] == fa and bwd["lse"].is_contiguous()
    out, lse = KERNELS["FusedAttention"].forward(q, k, v, qs, ks, mask, SCALE)
    KERNELS["FusedAttention"].backward(dout, q, k, v, out, lse, qs, ks, mask, SCALE)
    (fwd,), (bwd,) = lib.of("cudnn_fwd"), lib.of("cudnn_bwd")
    # cuDNN's offsets arrive as int64 (its ragged offsets are int64; see the module path below).
    assert torch.equal(fwd["off_q"], qs.offsets.long()) and torch.equal(fwd["off_kv"], ks.offsets.long())
    assert fwd["off_q"].dtype == torch.int64
    assert fwd["len_q"] is qs.lengths and fwd["len_kv"] is ks.lengths
    assert (fwd["b"], fwd["max_q"], fwd["max_kv"], fwd["mask"]) == (3, 6, 9, cudnn)
    # The stats handed back: [B, H, SQ, 1] by position, the forward's at every valid position.
    assert bwd["stats"].shape == (3, H, 6, 1) and bwd["b"] == 3
    for i, n in enumerate([5, 0, 4]):
        # exact: the stats are handed over, not recomputed
        torch.testing.assert_close(bwd["stats"][i, :, :n], fwd["stats"][i, :, :n], rtol=0, atol=0)


# ------------------------------------------------------------------ the module path


def _thd(gaps):
    p = make_thd([5, 3, 6], gaps_q=[2, 0, 1] if gaps else None, h=H, hg=HG, d=D, tail=2)
    return p, p.kwargs(gaps, 6, 6, shared=True)


def _module_parity(backend, inputs, kwargs, **module_kwargs):
    """Output and gradients of ``backend`` (stand-in ops) against the unfused backend."""
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, softmax_scale=SCALE, **module_kwargs)
    ref_in = [t.detach().clone().requires_grad_() for t in inputs]
    with backend_scope(force="unfused"):
        ref = dpa(*ref_in, **kwargs)
    g = torch.randn_like(ref).nan_to_num()
    want = torch.autograd.grad(ref, ref_in, g)
    with backend_scope(force=backend):
        out = dpa(*inputs, **kwargs)
    got = torch.autograd.grad(out, inputs, g)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.nan_to_num(), b.nan_to_num(), rtol=1e-6, atol=1e-6)
    return out, got


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("policies", [False, True])
def test_module_thd_cudnn_runs(lib, gaps, policies):
    """cuDNN always takes valid lengths (also without gaps: the plan makes them once for the
    forward and backward); several policies are runs over the whole batch into one buffer."""
    p, kwargs = _thd(gaps)
    if policies:
        kwargs["thd_sequence_is_causal"] = torch.tensor([True, False, True])
    out, grads = _module_parity("FusedAttention", [p.q, p.k, p.v], kwargs, qkv_format="thd", attn_mask_type="padding_causal")
    assert torch.all(out[~p.valid_q] == 0) and all(torch.all(t[~p.valid_q] == 0) for t in grads)
    fwds, bwds = lib.of("cudnn_fwd"), lib.of("cudnn_bwd")
    assert len(fwds) == len(bwds) == (2 if policies else 1)
    offsets = p.off_q if gaps else p.cu_q
    for fwd, bwd in zip(fwds, bwds):
        assert torch.equal(fwd["off_q"], offsets.long()) and fwd["b"] == 3 and (fwd["max_q"], fwd["max_kv"]) == (6, 6)
        # Made once per forward, reused by the backward: lengths and the int64 offsets.
        assert bwd["len_q"] is fwd["len_q"] and bwd["len_kv"] is fwd["len_kv"] and bwd["off_q"] is fwd["off_q"]
    lengths = {True: [5, 3, 6]} if not policies else {True: [5, 0, 6], False: [0, 3, 0]}  # by causal
    assert {f["mask"][0]: f["len_q"].tolist() for f in fwds} == lengths


def test_module_thd_cudnn_cross_attention_with_empty_sides(lib):
    """Cross attention where one sequence has keys but no queries and another queries but no
    keys: the first's dK/dV rows and the second's output and dQ rows are 0. The stand-in writes
    nothing for a sequence with an empty side (stricter than cuDNN, which leaves only the output
    rows of a sequence without keys unwritten), so the kernel must not hand those rows an empty
    (garbage) buffer."""
    p = make_thd([4, 0, 3], [5, 6, 0], h=H, hg=HG, d=D, tail=1)
    out, grads = _module_parity("FusedAttention", [p.q, p.k, p.v], p.kwargs(False, 4, 6), qkv_format="thd",
                                attn_mask_type="padding")
    assert torch.all(grads[1][5:11] == 0) and torch.all(grads[2][5:11] == 0)  # sequence 1's keys
    assert torch.all(out[4:7] == 0) and torch.all(grads[0][4:7] == 0)  # sequence 2's queries
    assert torch.all(out[~p.valid_q] == 0) and all(torch.all(t[~p.valid_kv] == 0) for t in grads[1:])


@pytest.mark.parametrize("gaps", [False, True])
def test_module_thd_fa4_runs(lib, gaps):
    """FA4 takes valid lengths only where the offsets do not bound them (gaps)."""
    p, kwargs = _thd(gaps)
    out, grads = _module_parity("FlashAttention v4", [p.q, p.k, p.v], kwargs, qkv_format="thd",
                                attn_mask_type="padding_causal")
    assert torch.all(out[~p.valid_q] == 0) and all(torch.all(t[~p.valid_q] == 0) for t in grads)
    (fwd,), (bwd,) = lib.of("fa4_fwd"), lib.of("fa4_bwd")
    assert torch.equal(fwd["cu_q"], p.off_q if gaps else p.cu_q) and bwd["cu_q"] is fwd["cu_q"]
    assert (fwd["used_q"] is None) is (not gaps)
    if gaps:
        assert fwd["used_q"].tolist() == [5, 3, 6] and bwd["used_q"] is fwd["used_q"]
    assert (fwd["max_q"], fwd["max_kv"], fwd["mask"]) == (6, 6, (True, -1, -1))


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("compact", ["0", "1"])
@pytest.mark.parametrize("gaps", [False, True])
def test_module_thd_several_policies(lib, backend, compact, gaps, monkeypatch):
    """Two policies (dict spelling: sizes known, so NVTE_THD_POLICY_COMPACT=1 compacts them):
    the runs share buffers on both backends, match the unfused backend, rows no sequence owns
    are 0, and each run covers only its policy's sequences."""
    monkeypatch.setenv("NVTE_THD_POLICY_COMPACT", compact)
    p, kwargs = _thd(gaps)
    kwargs["attn_mask_type_per_seq"] = {"padding_causal": torch.tensor([0, 2]), "padding": torch.tensor([1])}
    out, grads = _module_parity(BACKENDS[backend], [p.q, p.k, p.v], kwargs, qkv_format="thd", attn_mask_type="padding")
    assert torch.all(out[~p.valid_q] == 0) and all(torch.all(t[~p.valid_q] == 0) for t in grads)
    fwds = lib.of(f"{backend}_fwd")
    used = [f["used_q" if backend == "fa4" else "len_q"].tolist() for f in fwds]
    assert sorted(used) == ([[3], [5, 6]] if compact == "1" else [[0, 3, 0], [5, 0, 6]])


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("compact", ["0", "1"])
@pytest.mark.parametrize("gaps", [False, True])
def test_module_thd_several_policies_cross_attention(lib, backend, compact, gaps, monkeypatch):
    """Several policies with keys laid out apart from the queries (their own lengths, gaps and
    offsets): each run must take the keys' offsets and lengths, not the queries'."""
    monkeypatch.setenv("NVTE_THD_POLICY_COMPACT", compact)
    p = make_thd([5, 3, 6], [4, 7, 2], gaps_q=[2, 0, 1] if gaps else None, gaps_kv=[1, 3, 0] if gaps else None,
                 h=H, hg=HG, d=D, tail=2)
    kwargs = p.kwargs(gaps, 6, 7)
    kwargs["attn_mask_type_per_seq"] = {"padding_causal_bottom_right": torch.tensor([0, 2]), "padding": torch.tensor([1])}
    out, grads = _module_parity(BACKENDS[backend], [p.q, p.k, p.v], kwargs, qkv_format="thd", attn_mask_type="padding")
    assert torch.all(out[~p.valid_q] == 0) and torch.all(grads[0][~p.valid_q] == 0)
    assert all(torch.all(t[~p.valid_kv] == 0) for t in grads[1:])


def test_module_dense_padding_lengths_made_once(lib):
    """A dense cuDNN call with a padding mask: lengths from the mask, made once per forward."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 6, h, D, generator=g, dtype=torch.float64, requires_grad=True) for h in (H, HG, HG))
    mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., 4:] = True  # TE: True = masked out
    _module_parity("FusedAttention", [q, k, v], dict(attention_mask=mask), qkv_format="bshd", attn_mask_type="padding")
    (fwd,), (bwd,) = lib.of("cudnn_fwd"), lib.of("cudnn_bwd")
    assert fwd["off_q"] is None and fwd["b"] == 2 and (fwd["max_q"], fwd["max_kv"]) == (6, 6)
    assert fwd["len_q"].tolist() == [4, 6] and fwd["len_q"].dtype == torch.int32
    assert bwd["len_q"] is fwd["len_q"] and bwd["len_kv"] is fwd["len_kv"]


@pytest.mark.parametrize("sq,skv,mask", [(6, 3, "causal_bottom_right"), (3, 6, "causal"), (5, 5, "causal"), (4, 6, "no_mask")])
def test_module_dense_rows_that_see_no_key(lib, sq, skv, mask):
    """Dense cuDNN calls without a padding mask: with a band and sq != skv some query rows see
    no key (bottom-right, sq > skv) or some keys no query (top-left, sq < skv); those output rows
    and dK/dV rows are 0, though cuDNN leaves such output rows unwritten (the stand-in too)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, s, h, D, generator=g, dtype=torch.float64, requires_grad=True)
               for s, h in ((sq, H), (skv, HG), (skv, HG)))
    out, grads = _module_parity("FusedAttention", [q, k, v], {}, qkv_format="bshd", attn_mask_type=mask)
    if mask == "causal_bottom_right":
        assert torch.all(out[:, :sq - skv] == 0) and torch.all(grads[0][:, :sq - skv] == 0)
    if sq < skv and mask == "causal":
        assert torch.all(grads[1][:, sq:] == 0) and torch.all(grads[2][:, sq:] == 0)


def test_cudnn_run_without_lengths_reads_them_from_the_offsets():
    """KernelRun's "no lengths: up to the next offset", as cuDNN's ragged graphs need lengths."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.kernel import _run_args
    from transformer_engine.pytorch.attention.dot_product_attention.backends.kernel_problem import KernelProblem, KernelRun
    from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType, MaskSpec

    off_q, off_kv = torch.tensor([0, 5, 8, 14], dtype=torch.int32), torch.tensor([0, 4, 9, 9], dtype=torch.int32)
    run = KernelRun(0, MaskSpec(AttnMaskType.PADDING, (-1, -1)), off_q, off_kv, None, None, 3)
    args = _run_args(KernelProblem((run,), 6, 5, SCALE, True), run)
    assert args[2].tolist() == [5, 3, 6] and args[3].tolist() == [4, 5, 0] and args[4] == 3
