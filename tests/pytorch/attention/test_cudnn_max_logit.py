"""return_max_logit on FusedAttention (cuDNN), on the CPU: the real cuDNN ops run down to the
graph, whose building and execution are emulated per sequence in float64 (the stand-in helpers
of test_kernel_interface), reading and writing the variant pack by uid as the graph does. The
emulated graph leaves a query row that sees no key unwritten (as cuDNN leaves its output row)
and fills the row-max rows past a sequence's length with GARBAGE, so the max logit must come
from the valid rows alone; (out, max logit) and the gradients through the derived stats must
equal the unfused backend's. What this cannot show, what cuDNN's score_max itself holds, is
checked on the H200 by test_gpu_cudnn_features.py and benchmarks/attention/probe_cudnn_max_logit.py.
Also: the per-run maxima combined, the op asked for only when wanted, and the declaration's rules."""

from __future__ import annotations

import math

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention import backends
from transformer_engine.pytorch.attention.dot_product_attention.backends import gap_rows, kernel_ops
from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import graphs, ops
from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.graphs import UID
from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType
from transformer_engine.pytorch.attention.dot_product_attention.selection.libraries import InstalledLibraries
from transformer_engine.pytorch.attention.dot_product_attention.selection.params import AttentionParams

from .packing import make_thd
from .test_cudnn_wiring import _qkv, _RecordingOps
from .test_gap_rows import fake_fa4_bwd, fake_fa4_fwd
from .test_kernel_interface import HG, SCALE, _allowed, _rows, _scores, _seq_bwd, _seq_fwd, _seqs

GARBAGE = 1e30


class _EmulatedGraph:
    """One built graph: ``execute(pack)`` computes what cuDNN's would, per sequence."""

    def __init__(self, direction, b, sq, skv, band, varlen, with_max=False):
        self.direction, self.b, self.sq, self.skv = direction, b, sq, skv
        self.band, self.varlen, self.with_max = band, varlen, with_max

    def _sequences(self, pack, q, k):
        off_q = off_kv = None
        if self.varlen:  # ragged offsets are ELEMENT offsets: token offset times the token stride
            off_q, off_kv = pack[UID["rq"]].view(-1) // q.stride(0), pack[UID["rk"]].view(-1) // k.stride(0)
        len_q, len_kv = (pack[UID[n]].view(-1) if UID[n] in pack else None for n in ("len_q", "len_kv"))
        band = self.band
        for i, (oq, ok, n, m) in enumerate(_seqs(off_q, off_kv, len_q, len_kv, self.b, self.sq, self.skv)):
            offset = m - n if band["bottom_right"] else 0
            yield i, oq, ok, n, m, _allowed(n, m, band["causal"], band["left"], band["right"], offset)

    def execute(self, pack):
        q, k, v, out = (_rows(pack[UID[n]]) for n in ("q", "k", "v", "o"))
        if self.direction == "fwd":
            self._forward(pack, q, k, v, out)
        else:
            dout, dq, dk, dv = (_rows(pack[UID[n]]) for n in ("do", "dq", "dk", "dv"))
            self._backward(pack, q, k, v, out, dout, dq, dk, dv)

    def _forward(self, pack, q, k, v, out):
        for i, oq, ok, n, m, allowed in self._sequences(pack, q, k):
            if self.with_max:
                pack[UID["max"]][i, :, n:, 0] = GARBAGE
            if not (n and m):
                continue
            o, lse = _seq_fwd(q[oq:oq + n], k[ok:ok + m], v[ok:ok + m], allowed)
            seen = allowed.any(dim=1)
            out[oq:oq + n][seen] = o[seen].to(out.dtype)
            if not self.with_max:
                pack[UID["stats"]][i, :, :n, 0] = lse.float()
                continue
            s = _scores(q[oq:oq + n], k[ok:ok + m], allowed)  # [H, n, m], -inf where not allowed
            row_max = s.amax(dim=-1)
            sum_exp = torch.exp(s - row_max.unsqueeze(-1)).sum(dim=-1)
            pack[UID["max"]][i, :, :n, 0][:, seen] = row_max[:, seen].float()
            pack[UID["sum_exp"]][i, :, :n, 0][:, seen] = sum_exp[:, seen].float()

    def _backward(self, pack, q, k, v, out, dout, dq, dk, dv):
        stats = pack[UID["stats"]]
        for i, oq, ok, n, m, allowed in self._sequences(pack, q, k):
            if n and m:
                got = _seq_bwd(dout[oq:oq + n], q[oq:oq + n], k[ok:ok + m], v[ok:ok + m], out[oq:oq + n],
                               stats[i, :, :n, 0], allowed)
                dq[oq:oq + n], dk[ok:ok + m], dv[ok:ok + m] = (g.to(dq.dtype) for g in got)


@pytest.fixture
def emulated_graphs(monkeypatch):
    """The cuDNN ops' graphs, emulated: building records the configuration, executing computes."""
    built = []

    def build_fwd(handle, q, k, v, o, b, sq, skv, scale, band, varlen, padded, features, with_max):
        assert scale == SCALE and features == (None, False, 0.0, None)
        built.append(("fwd", with_max))
        return _EmulatedGraph("fwd", b, sq, skv, band, varlen, with_max)

    def build_bwd(handle, q, k, v, o, do, dq, dk, dv, grads, b, sq, skv, scale, band, varlen, padded, det, features):
        built.append(("bwd", False))
        return _EmulatedGraph("bwd", b, sq, skv, band, varlen)

    graphs.band.cache_clear()  # masks cached with the real band_kwargs (or another stand-in) must not answer
    monkeypatch.setattr(graphs, "band_kwargs", lambda causal, left, right, bottom_right: dict(
        causal=causal, left=left, right=right, bottom_right=bottom_right))
    monkeypatch.setattr(graphs, "build_fwd", build_fwd)
    monkeypatch.setattr(graphs, "build_bwd", build_bwd)
    monkeypatch.setattr(graphs, "run_graph", lambda key, build, pack, device: build(None).execute(pack))
    # Unwritten rows of an empty buffer are garbage, never silently 0 (NaN in deterministic mode).
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield built
    torch.use_deterministic_algorithms(was)
    graphs.band.cache_clear()


def _max_logit_parity(inputs, kwargs, grad=True, **module_kwargs):
    """(out, max logit) and gradients of cuDNN (emulated graphs) against the unfused backend."""
    h, d = inputs[0].shape[-2], inputs[0].shape[-1]
    dpa = DotProductAttention(h, d, num_gqa_groups=HG, softmax_scale=SCALE, return_max_logit=True, **module_kwargs)
    ref_in, got_in = ([t.detach().clone().requires_grad_(grad) for t in inputs] for _ in range(2))
    with backend_scope(force="unfused"):
        ref, ref_max = dpa(*ref_in, **kwargs)
    with backend_scope(force=backends.FusedAttention), torch.set_grad_enabled(grad):
        out, max_logit = dpa(*got_in, **kwargs)
    assert dpa.last_selection.name == "FusedAttention"
    assert max_logit.dtype == torch.float32 and max_logit.shape == (h,) and not max_logit.requires_grad
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(max_logit.double(), ref_max.double(), rtol=1e-6, atol=1e-6)
    if grad:
        g = torch.randn_like(ref).nan_to_num()
        want = torch.autograd.grad(ref, ref_in, g)
        got = torch.autograd.grad(out, got_in, g)
        for a, b in zip(got, want):  # float32 stats: float32 accuracy
            torch.testing.assert_close(a.nan_to_num(), b.nan_to_num(), rtol=1e-5, atol=1e-5)
    return out, max_logit


def _dense(b, sq, skv, fmt="bshd", seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda s, h: (b, s, h, 8)) if fmt == "bshd" else (lambda s, h: (s, b, h, 8))
    return [torch.randn(shape(s, h), generator=g, dtype=torch.float64) for s, h in ((sq, 4), (skv, HG), (skv, HG))]


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("fmt,mask,sq,skv", [
    ("bshd", "no_mask", 6, 6), ("bshd", "causal", 6, 6), ("sbhd", "causal", 5, 5),
    ("bshd", "causal_bottom_right", 7, 4),  # rows that see no key
    ("sbhd", "no_mask", 3, 6),
])
def test_max_logit_dense_matches_unfused(emulated_graphs, fmt, mask, sq, skv, grad):
    _max_logit_parity(_dense(2, sq, skv, fmt), {}, grad, qkv_format=fmt, attn_mask_type=mask)
    assert ("fwd", True) in emulated_graphs and ("fwd", False) not in emulated_graphs


def test_max_logit_dense_padding_leaves_out_padded_rows(emulated_graphs):
    mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., 3:] = True  # TE: True = masked out; rows 3.. of sequence 0 are padding
    _max_logit_parity(_dense(2, 6, 6), dict(attention_mask=mask), qkv_format="bshd", attn_mask_type="padding")


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("policies", [False, True])
def test_max_logit_thd_matches_unfused(emulated_graphs, gaps, policies):
    """Packed sequences (gaps NaN-filled), one run or one per mask policy: the max over runs."""
    p = make_thd([5, 3, 6], gaps_q=[2, 0, 1] if gaps else None, h=4, hg=2, d=8, tail=2)
    kwargs = p.kwargs(gaps, 6, 6, shared=True)
    if policies:
        kwargs["thd_sequence_is_causal"] = torch.tensor([True, False, True])
    _max_logit_parity([p.q, p.k, p.v], kwargs, qkv_format="thd", attn_mask_type="padding_causal")
    assert emulated_graphs.count(("fwd", True)) == (2 if policies else 1)


def test_max_logit_thd_cross_attention_rows_that_see_no_key(emulated_graphs):
    """Bottom-right causal with more queries than keys: leading rows see no key, one sequence
    has no keys at all; their rows count as nothing scored, and their gradients are 0."""
    p = make_thd([5, 2, 4], [3, 0, 4], gaps_q=[1, 0, 2], gaps_kv=[0, 2, 1], h=4, hg=2, d=8, tail=1)
    _max_logit_parity([p.q, p.k, p.v], p.kwargs(True, 5, 4), qkv_format="thd", attn_mask_type="padding_causal_bottom_right")


def test_max_logit_of_a_head_that_scores_nothing_is_the_lowest_float32(emulated_graphs):
    """No sequence has a key: the unfused reference gives its dtype's lowest value; cuDNN's
    float32 buffer gives float32's (its -inf clamped), with the output 0."""
    p = make_thd([3, 2], [0, 0], h=4, hg=2, d=8)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding", return_max_logit=True,
                              softmax_scale=SCALE)
    with backend_scope(force=backends.FusedAttention):
        out, max_logit = dpa(p.q, p.k, p.v, **p.kwargs(False, 3, 1))
    assert torch.all(max_logit == torch.finfo(torch.float32).min) and torch.all(out == 0)


class _MaxRecordingOps(_RecordingOps):
    """The recorder, with cudnn_fwd_max returning a given max logit per call."""

    def __init__(self, maxes):
        super().__init__()
        self.maxes = list(maxes)

    def cudnn_fwd_max(self, q, k, v, out, *args):
        stats = self.cudnn_fwd(q, k, v, out, *args)
        self.fwd[-1]["max_op"] = True
        return stats, torch.tensor(self.maxes.pop(0), dtype=torch.float32)


def test_max_logit_is_the_max_over_the_policy_runs(monkeypatch):
    """Two policies, two calls of cudnn_fwd_max: the module returns their elementwise max,
    without gradient, and the backward takes each call's stats."""
    ops = _MaxRecordingOps([[1.0, 5.0, -2.0, float("-inf")], [3.0, 4.0, -1.0, float("-inf")]])
    monkeypatch.setattr(kernel_ops, "ops", ops)
    p = make_thd([5, 3, 6], gaps_q=[2, 0, 1], h=4, hg=4, d=8, dtype=torch.bfloat16)
    dpa = DotProductAttention(4, 8, qkv_format="thd", return_max_logit=True)
    kwargs = dict(p.kwargs(True, 6, 6, shared=True), thd_sequence_is_causal=torch.tensor([True, False, True]))
    with backend_scope(force=backends.FusedAttention):
        out, max_logit = dpa(p.q, p.k, p.v, **kwargs)
    out.float().sum().backward()
    assert [c.get("max_op") for c in ops.fwd] == [True, True] and len(ops.bwd) == 2
    lowest = torch.finfo(torch.float32).min
    assert max_logit.tolist() == [3.0, 5.0, -1.0, lowest] and not max_logit.requires_grad


def test_no_max_logit_op_unless_asked(monkeypatch):
    ops = _MaxRecordingOps([])
    monkeypatch.setattr(kernel_ops, "ops", ops)
    with backend_scope(force=backends.FusedAttention):
        DotProductAttention(4, 8, qkv_format="bshd")(*_qkv()).sum().backward()
    assert len(ops.fwd) == 1 and "max_op" not in ops.fwd[0]


def test_a_kernel_forced_past_its_declaration_returns_no_max_logit(monkeypatch):
    """FA4 returns no max logit: forced with return_max_logit, the module gives (out, None),
    as for any backend forced past its declaration."""
    class _FA4:
        zero_gap_rows = staticmethod(gap_rows.zero_gap_rows)
        zero_gap_rows_qkv = staticmethod(gap_rows.zero_gap_rows_qkv)
        fa4_fwd, fa4_bwd = staticmethod(fake_fa4_fwd), staticmethod(fake_fa4_bwd)

    monkeypatch.setattr(kernel_ops, "ops", _FA4())
    p = make_thd([5, 3], h=4, hg=4, d=8)
    with backend_scope(force="fa4"):
        out, max_logit = DotProductAttention(4, 8, qkv_format="thd", return_max_logit=True)(p.q, p.k, p.v,
                                                                                               **p.kwargs(False, 5, 5))
    assert max_logit is None and out.shape == (8, 32)


def test_max_logit_ops_reduce_valid_rows_and_derive_stats():
    """The two pure pieces of cudnn_fwd_max: the max over valid rows only, and the stats from
    the row max and sum of exponents (+inf where a row scored nothing)."""
    row_max = torch.tensor([[1.0, 7.0, GARBAGE], [2.0, float("-inf"), GARBAGE]]).view(2, 1, 3, 1).expand(2, 2, 3, 1)
    assert ops._max_over_rows(row_max, torch.tensor([2, 1], dtype=torch.int32)).tolist() == [7.0, 7.0]
    assert torch.equal(ops._max_over_rows(row_max, None), torch.full((2,), GARBAGE))
    stats = ops._stats_of(torch.tensor([0.5, float("-inf")]), torch.tensor([2.0, float("nan")]))
    assert stats[1] == float("inf") and stats[0].item() == pytest.approx(0.5 + math.log(2.0), rel=1e-6)


# ------------------------------------------------------------------ declaration: the max logit's rules


def _params(**kw):
    base = dict(qkv_format="thd", qkv_layout="thd_thd_thd", attn_mask_type=AttnMaskType.PADDING_CAUSAL, head_dim_qk=128,
                head_dim_v=128, return_max_logit=True, compute_capability=(9, 0))
    base.update(kw)
    return AttentionParams(**base)


@pytest.mark.parametrize("frontend,softmax_type,reason", [
    ("1.32.0", "vanilla", None),
    ("1.33.1", "vanilla", None),
    ("1.31.0", "vanilla", "return_max_logit=True with cudnn-frontend 1.31.0 (supported: False, or cudnn-frontend >= 1.32"),
    ("1.32.0", "learnable", "return_max_logit=True with softmax_type='learnable' (supported: False, or softmax_type='vanilla' "
                            "(cuDNN's score max includes the sink logit))"),
    ("1.32.0", "off-by-one", "return_max_logit=True with softmax_type='off-by-one'"),
])
def test_cudnn_max_logit_rules(frontend, softmax_type, reason):
    libs = InstalledLibraries(cudnn_frontend=frontend, cudnn=92600)
    reasons = "; ".join(map(str, backends.FusedAttention.not_supported_reasons(_params(softmax_type=softmax_type), libs)))
    if reason is None:
        assert reasons == ""
    else:
        assert reason in reasons
