"""The one kernel interface (kernel_problem.py) on the CPU. The unfused kernel against the float64
reference (span calls as context parallelism makes them, drawn by hypothesis; a varlen problem
with two policies; a dense problem with padding and sq != skv; forward, and the backward from the
kernel's own out/LSE, as a schedule hands them). FA4's and cuDNN's, from both callers: the
module's autograd (a problem made from the prepared inputs and their THD plan) and context
parallelism (``spans.SpanAdapter``, a one-run problem per span call).

FA4 and cuDNN are the library stand-ins (``stand_ins/``: they write only the rows they run,
cuDNN leaves a query row that sees no key unwritten, and both backwards use the LSE / stats
they are handed, as context parallelism's final LSE reaches them); unwritten buffer rows are
NaN. Results are compared with the unfused span kernel and backend."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention.backends import (FlashAttentionV4, FusedAttention,
                                                                                UnfusedDotProductAttention, kernel_autograd, kernel_ops)
from transformer_engine.pytorch.attention.dot_product_attention.backends.kernel_problem import KernelProblem, KernelRun, ScoreFeatures
from transformer_engine.pytorch.attention.dot_product_attention.backends.unfused_kernel import UnfusedKernel
from transformer_engine.pytorch.attention.dot_product_attention.cp.spans import StepMask, make_span, span_kernel
from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType, MaskSpec

from .packing import make_thd
from .reference import reference_dense, reference_thd
from .stand_ins.cudnn import lengths_of, offsets_of, pack_of

H, HG, D = 4, 2, 8
SCALE = 0.3


UNFUSED_SCALE = 0.35
TOL = dict(rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------ the unfused kernel against the reference


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _grads(ref_fn, tensors, dout):
    """out and dq, dk, dv of the reference by autograd."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = ref_fn(*leaves)
    if not out.requires_grad:  # no sequence has a query row: nothing depends on the inputs
        return [out] + [torch.zeros_like(t) for t in leaves]
    out.backward(dout)
    return [out.detach()] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


@st.composite
def span_calls(draw):
    """Per sequence a slot, a q span (shifted inside it) and a kv span (from the slot start)."""
    b = draw(st.integers(1, 3))
    slot_q = [draw(st.integers(1, 7)) for _ in range(b)]
    slot_k = [draw(st.integers(1, 7)) for _ in range(b)]
    len_q = [draw(st.integers(0, s)) for s in slot_q]
    shift = [draw(st.integers(0, s - n)) for s, n in zip(slot_q, len_q)]
    len_k = [draw(st.integers(0, s)) for s in slot_k]
    mask = draw(st.sampled_from([StepMask(False), StepMask(True), StepMask(True, 0), StepMask(True, 2)]))
    return slot_q, slot_k, shift, len_q, len_k, mask


def _cum(xs):
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


@settings(max_examples=25, deadline=None)
@given(span_calls())
def test_span_calls_match_the_reference(call):
    """The span interface over the unfused kernel (what the ring and all-gather call)."""
    slot_q, slot_k, shift, len_q, len_k, mask = call
    sq, sk = _cum(slot_q), _cum(slot_k)
    it = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    qs = make_span(it(sq), it(shift), it(len_q), sq[-1], max(len_q + [1]))
    ks = make_span(it(sk), torch.zeros(len(slot_k), dtype=torch.int32), it(len_k), sk[-1], max(len_k + [1]))
    q, k, v, dout = _rand(sq[-1], H, D, seed=1), _rand(sk[-1], HG, D, seed=2), _rand(sk[-1], HG, D, seed=3), _rand(sq[-1], H, D, seed=4)
    kernel = span_kernel(UnfusedDotProductAttention, "p2p")
    out, lse = kernel.forward(q, k, v, qs, ks, mask, UNFUSED_SCALE)
    got = kernel.backward(dout, q, k, v, out, lse, qs, ks, mask, UNFUSED_SCALE)
    masks = ["padding_causal_bottom_right" if mask.causal else "padding"] * len(slot_q)
    windows = [(mask.window_left, 0) if mask.causal else None] * len(slot_q)
    starts_q = [a + s for a, s in zip(sq, shift)]
    ref = lambda q_, k_, v_: reference_thd(q_, k_, v_, _cum(len_q), _cum(len_k), starts_q, sk, masks, windows, UNFUSED_SCALE)  # noqa: E731
    want = _grads(ref, (q, k, v), dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *got), want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name}: {m}")
    assert lse.dtype == torch.float64 and torch.all(torch.isneginf(lse[:, ~qs.covered]))


def _varlen_problem():
    """Three sequences with gaps, q and kv laid out apart; two policies as two runs, each with
    the other's sequences at length 0 (top-left causal; full with a window)."""
    off_q, off_k = torch.tensor([0, 6, 9, 16], dtype=torch.int32), torch.tensor([0, 4, 12, 15], dtype=torch.int32)
    len_q, len_k = torch.tensor([5, 3, 6], dtype=torch.int32), torch.tensor([4, 7, 2], dtype=torch.int32)
    causal, windowed = torch.tensor([1, 0, 1], dtype=torch.int32), torch.tensor([0, 1, 0], dtype=torch.int32)
    runs = (KernelRun(0, MaskSpec(AttnMaskType.PADDING_CAUSAL, (-1, 0)), off_q, off_k, len_q * causal, len_k * causal, 3),
            KernelRun(1, MaskSpec(AttnMaskType.PADDING, (2, 1)), off_q, off_k, len_q * windowed, len_k * windowed, 3))
    problem = KernelProblem(runs, 6, 7, UNFUSED_SCALE, True)
    masks, windows = ["padding_causal", "padding", "padding_causal"], [None, (2, 1), None]
    ref = lambda q_, k_, v_: reference_thd(q_, k_, v_, [0, 5, 8, 14], [0, 4, 11, 13], off_q.tolist(), off_k.tolist(),  # noqa: E731
                                           masks, windows, UNFUSED_SCALE)
    return problem, (18, 16), ref


def _dense_problem():
    """[B=2, SQ=5, SKV=7] with per-entry valid lengths, bottom-right causal with a left window."""
    len_q, len_k = torch.tensor([5, 3], dtype=torch.int32), torch.tensor([6, 7], dtype=torch.int32)
    run = KernelRun(0, MaskSpec(AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT, (3, 0)), None, None, len_q, len_k, 2)
    problem = KernelProblem((run,), 5, 7, UNFUSED_SCALE, False)
    ref = lambda q_, k_, v_: reference_dense(q_, k_, v_, "padding_causal_bottom_right", (3, 0), UNFUSED_SCALE, len_q, len_k)  # noqa: E731
    return problem, ((2, 5), (2, 7)), ref


@pytest.mark.parametrize("make", [_varlen_problem, _dense_problem], ids=["varlen-two-runs", "dense-padded"])
def test_problems_match_the_reference(make):
    problem, (rows_q, rows_k), ref = make()
    rows_q, rows_k = (r if isinstance(r, tuple) else (r,) for r in (rows_q, rows_k))
    q, k, v, dout = _rand(*rows_q, H, D, seed=5), _rand(*rows_k, HG, D, seed=6), _rand(*rows_k, HG, D, seed=7), _rand(*rows_q, H, D, seed=8)
    out, stats = UnfusedKernel.forward(q, k, v, problem, ScoreFeatures(), True)
    dq, dk, dv, dbias, dsink = UnfusedKernel.backward(dout, q, k, v, out, stats, problem, ScoreFeatures(), False)
    want = _grads(ref, (q, k, v), dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name}: {m}")
    assert dbias is None and dsink is None and stats[0].shape == (H, out.shape[0] * (out.shape[1] if out.dim() == 4 else 1))


def test_float32_inputs_keep_their_dtype_and_a_float32_lse():
    problem, (rows_q, rows_k), ref = _varlen_problem()
    q, k, v = (_rand(n, h, D, seed=s).float() for n, h, s in ((rows_q, H, 1), (rows_k, HG, 2), (rows_k, HG, 3)))
    out, stats = UnfusedKernel.forward(q, k, v, problem, ScoreFeatures(), True)
    assert out.dtype == torch.float32 and stats[0].dtype == torch.float32
    torch.testing.assert_close(out.double(), ref(q.double(), k.double(), v.double()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("features,named", [(ScoreFeatures(dropout_p=0.1), "dropout"), (ScoreFeatures(alibi=True), "ALiBi"),
                                            (ScoreFeatures(sink=torch.zeros(H)), "a sink")])
def test_score_features_are_refused_by_name(features, named):
    problem, (rows_q, rows_k), _ = _varlen_problem()
    q, k, v = _rand(rows_q, H, D, seed=1), _rand(rows_k, HG, D, seed=2), _rand(rows_k, HG, D, seed=3)
    with pytest.raises(NotImplementedError, match=f"the unfused kernel interface runs plain softmax attention; got {named} "
                                                  r"\(the module's unfused path runs them\)"):
        UnfusedKernel.forward(q, k, v, problem, features, True)


# ------------------------------------------------------------------ FA4 and cuDNN, on their stand-ins


@pytest.fixture
def libs(fa4_lib, cudnn_lib):
    return {"fa4": fa4_lib, "cudnn": cudnn_lib}


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
def test_span_adapter_matches_the_unfused_span_kernel(libs, backend, mask):
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
    (StepMask(False), (False, None, None), (False, (-1, -1))),
    (StepMask(True), (True, None, None), (True, (-1, 0))),
    (StepMask(True, 2), (False, 2, 0), (True, (2, 0))),
])
def test_span_call_arguments(libs, mask, fa, cudnn):
    """A span call is one run: span starts as offsets, span lengths as valid lengths, the
    spans' bounds as max_seqlen, the mask bottom-right (FA's convention, cuDNN's alignment)."""
    q, k, v, dout, qs, ks = _spans()
    out, lse = KERNELS["FlashAttention v4"].forward(q, k, v, qs, ks, mask, SCALE)
    KERNELS["FlashAttention v4"].backward(dout, q, k, v, out, lse, qs, ks, mask, SCALE)
    (fwd,), (bwd,) = libs["fa4"].of("fwd"), libs["fa4"].of("bwd")
    assert fwd["cu_seqlens_q"] is qs.offsets and fwd["cu_seqlens_k"] is ks.offsets
    assert fwd["seqused_q"] is qs.lengths and fwd["seqused_k"] is ks.lengths
    assert (fwd["max_seqlen_q"], fwd["max_seqlen_k"], fwd["softmax_scale"]) == (6, 9, SCALE)
    for kw in (fwd, bwd):
        assert (kw["causal"], kw["window_size_left"], kw["window_size_right"]) == fa
    assert bwd["cu_seqlens_q"] is qs.offsets and bwd["lse"].is_contiguous()
    out, lse = KERNELS["FusedAttention"].forward(q, k, v, qs, ks, mask, SCALE)
    KERNELS["FusedAttention"].backward(dout, q, k, v, out, lse, qs, ks, mask, SCALE)
    ((fwd, fwd_pack),), ((bwd, bwd_pack),) = libs["cudnn"].of("fwd"), libs["cudnn"].of("bwd")
    assert offsets_of(fwd_pack, "q").tolist() == qs.offsets.tolist() and offsets_of(fwd_pack, "k").tolist() == ks.offsets.tolist()
    assert lengths_of(fwd_pack, "q").tolist() == qs.lengths.tolist() and lengths_of(fwd_pack, "kv").tolist() == ks.lengths.tolist()
    assert all(pack_of(pack, "r" + side).dtype == torch.int64 for pack in (fwd_pack, bwd_pack) for side in "qkv"), \
        "cuDNN's ragged offsets are int64"
    assert (fwd.b, fwd.sq, fwd.skv, fwd.bottom_right, fwd.window) == (3, 6, 9, *cudnn)
    # The stats handed back: [B, H, SQ, 1] by position, the forward's at every valid position.
    stats_fwd, stats_bwd = pack_of(fwd_pack, "stats"), pack_of(bwd_pack, "stats")
    assert stats_bwd.shape == (3, H, 6, 1) and bwd.b == 3
    for i, n in enumerate([5, 0, 4]):
        # exact: the stats are handed over, not recomputed
        torch.testing.assert_close(stats_bwd[i, :, :n], stats_fwd[i, :, :n], rtol=0, atol=0)


# ------------------------------------------------------------------ the module path


def _thd(gaps):
    p = make_thd([5, 3, 6], gaps_q=[2, 0, 1] if gaps else None, h=H, hg=HG, d=D, tail=2)
    if not gaps:
        p.fill_outside(7.0)  # FA4 reads the tail in whole tiles; without declared gaps it must be finite
    return p, p.kwargs(gaps, 6, 6, shared=True)


def _module_parity(backend, inputs, kwargs, **module_kwargs):
    """Output and gradients of ``backend`` (a stand-in library) against the unfused backend."""
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
def test_module_thd_cudnn_runs(cudnn_lib, monkeypatch, gaps, policies):
    """cuDNN always takes valid lengths (also without gaps: the plan makes them once for the
    forward and backward); several policies are runs over the whole batch into one buffer."""
    offsets = {}  # the ops' offsets_q argument, per op: int64 (cuDNN's ragged offsets), made once per forward
    for name, at in (("cudnn_fwd", 4), ("cudnn_bwd", 9)):
        real = kernel_ops._EAGER[name]
        monkeypatch.setitem(kernel_ops._EAGER, name, lambda *a, real=real, name=name, at=at: (
            offsets.setdefault(name, []).append(a[at]), real(*a))[1])
    p, kwargs = _thd(gaps)
    if policies:
        kwargs["thd_sequence_is_causal"] = torch.tensor([True, False, True])
    out, grads = _module_parity("FusedAttention", [p.q, p.k, p.v], kwargs, qkv_format="thd", attn_mask_type="padding_causal")
    assert torch.all(out[~p.valid_q] == 0) and all(torch.all(t[~p.valid_q] == 0) for t in grads)
    fwds, bwds = cudnn_lib.of("fwd"), cudnn_lib.of("bwd")
    assert len(fwds) == len(bwds) == (2 if policies else 1)
    assert len(offsets["cudnn_fwd"]) == len(offsets["cudnn_bwd"]) == len(fwds)
    assert all(f.dtype == torch.int64 and b is f for f, b in zip(offsets["cudnn_fwd"], offsets["cudnn_bwd"]))
    for (fwd, fwd_pack), (_, bwd_pack) in zip(fwds, bwds):
        assert offsets_of(fwd_pack, "q").tolist() == (p.off_q if gaps else p.cu_q).tolist() and (fwd.b, fwd.sq, fwd.skv) == (3, 6, 6)
        for side in ("q", "kv"):  # made once per forward: the backward's lengths are the same tensor
            assert lengths_of(bwd_pack, side).data_ptr() == lengths_of(fwd_pack, side).data_ptr()
    lengths = {True: [5, 3, 6]} if not policies else {True: [5, 0, 6], False: [0, 3, 0]}  # by causal
    assert {g.window == (-1, 0): lengths_of(pack, "q").tolist() for g, pack in fwds} == lengths


def test_module_thd_cudnn_cross_attention_with_empty_sides(cudnn_lib):
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
def test_module_thd_fa4_runs(fa4_lib, gaps):
    """FA4 takes valid lengths only where the offsets do not bound them (gaps)."""
    p, kwargs = _thd(gaps)
    out, grads = _module_parity("FlashAttention v4", [p.q, p.k, p.v], kwargs, qkv_format="thd",
                                attn_mask_type="padding_causal")
    assert torch.all(out[~p.valid_q] == 0) and all(torch.all(t[~p.valid_q] == 0) for t in grads)
    (fwd,), (bwd,) = fa4_lib.of("fwd"), fa4_lib.of("bwd")
    assert torch.equal(fwd["cu_seqlens_q"], p.off_q if gaps else p.cu_q) and bwd["cu_seqlens_q"] is fwd["cu_seqlens_q"]
    assert (fwd["seqused_q"] is None) is (not gaps)
    if gaps:
        assert fwd["seqused_q"].tolist() == [5, 3, 6] and bwd["seqused_q"] is fwd["seqused_q"]
    assert (fwd["max_seqlen_q"], fwd["max_seqlen_k"], fwd["causal"], fwd["window_size_left"]) == (6, 6, True, None)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("compact", ["0", "1"])
@pytest.mark.parametrize("gaps", [False, True])
def test_module_thd_several_policies(libs, backend, compact, gaps, monkeypatch):
    """Two policies (dict spelling: sizes known, so NVTE_THD_POLICY_COMPACT=1 compacts them):
    the runs share buffers on both backends, match the unfused backend, rows no sequence owns
    are 0, and each run covers only its policy's sequences."""
    monkeypatch.setenv("NVTE_THD_POLICY_COMPACT", compact)
    p, kwargs = _thd(gaps)
    kwargs["attn_mask_type_per_seq"] = {"padding_causal": torch.tensor([0, 2]), "padding": torch.tensor([1])}
    out, grads = _module_parity(BACKENDS[backend], [p.q, p.k, p.v], kwargs, qkv_format="thd", attn_mask_type="padding")
    assert torch.all(out[~p.valid_q] == 0) and all(torch.all(t[~p.valid_q] == 0) for t in grads)
    if backend == "fa4":
        used = [kw["seqused_q"].tolist() for kw in libs["fa4"].of("fwd")]
    else:
        used = [lengths_of(pack, "q").tolist() for _, pack in libs["cudnn"].of("fwd")]
    assert sorted(used) == ([[3], [5, 6]] if compact == "1" else [[0, 3, 0], [5, 0, 6]])


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("compact", ["0", "1"])
@pytest.mark.parametrize("gaps", [False, True])
def test_module_thd_several_policies_cross_attention(libs, backend, compact, gaps, monkeypatch):
    """Several policies with keys laid out apart from the queries (their own lengths, gaps and
    offsets): each run must take the keys' offsets and lengths, not the queries'."""
    monkeypatch.setenv("NVTE_THD_POLICY_COMPACT", compact)
    p = make_thd([5, 3, 6], [4, 7, 2], gaps_q=[2, 0, 1] if gaps else None, gaps_kv=[1, 3, 0] if gaps else None,
                 h=H, hg=HG, d=D, tail=2)
    if not gaps:
        p.fill_outside(7.0)
    kwargs = p.kwargs(gaps, 6, 7)
    kwargs["attn_mask_type_per_seq"] = {"padding_causal_bottom_right": torch.tensor([0, 2]), "padding": torch.tensor([1])}
    out, grads = _module_parity(BACKENDS[backend], [p.q, p.k, p.v], kwargs, qkv_format="thd", attn_mask_type="padding")
    assert torch.all(out[~p.valid_q] == 0) and torch.all(grads[0][~p.valid_q] == 0)
    assert all(torch.all(t[~p.valid_kv] == 0) for t in grads[1:])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_the_c_apply_entry_gives_the_public_applys_gradients(libs, backend, monkeypatch):
    """kernel_autograd binds autograd.Function's C entry (``_C_APPLY``) to skip apply's Python
    layer; were a torch release to move work into that layer, this entry would skip it. Same
    call, same stand-in, both entries: equal outputs and gradients (q, k, v and the learnable
    sink, the Function's fifth input)."""
    if kernel_autograd._C_APPLY is None:
        pytest.skip("this torch has no C apply entry to bind: the public apply runs")
    p, kwargs = _thd(gaps=True)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, softmax_scale=SCALE, qkv_format="thd", attn_mask_type="padding_causal",
                              softmax_type="learnable")
    g = torch.randn(p.q.shape[0], H * D, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    entered = []
    real = kernel_autograd._C_APPLY
    results = []
    for entry in (lambda *a: entered.append(1) or real(*a), None):  # None: run_kernel takes the public apply
        monkeypatch.setattr(kernel_autograd, "_C_APPLY", entry)
        leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]
        with backend_scope(force=BACKENDS[backend]):
            out = dpa(*leaves, **kwargs)
        results.append((out, *torch.autograd.grad(out, [*leaves, dpa.softmax_offset], g)))
    assert entered == [1], "the C entry did not run"
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsink"), *results):
        torch.testing.assert_close(a.nan_to_num(), b.nan_to_num(), rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    assert results[0][4].abs().sum() > 0  # the sink's gradient reached its input


def test_module_dense_padding_lengths_made_once(cudnn_lib):
    """A dense cuDNN call with a padding mask: lengths from the mask, made once per forward."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 6, h, D, generator=g, dtype=torch.float64, requires_grad=True) for h in (H, HG, HG))
    mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., 4:] = True  # TE: True = masked out
    _module_parity("FusedAttention", [q, k, v], dict(attention_mask=mask), qkv_format="bshd", attn_mask_type="padding")
    ((fwd, fwd_pack),), ((_, bwd_pack),) = cudnn_lib.of("fwd"), cudnn_lib.of("bwd")
    assert not fwd.varlen and fwd.padded and (fwd.b, fwd.sq, fwd.skv) == (2, 6, 6)
    assert lengths_of(fwd_pack, "q").tolist() == [4, 6] and lengths_of(fwd_pack, "q").dtype == torch.int32
    for side in ("q", "kv"):
        assert lengths_of(bwd_pack, side).data_ptr() == lengths_of(fwd_pack, side).data_ptr()


@pytest.mark.parametrize("sq,skv,mask", [(6, 3, "causal_bottom_right"), (3, 6, "causal"), (5, 5, "causal"), (4, 6, "no_mask")])
def test_module_dense_rows_that_see_no_key(cudnn_lib, sq, skv, mask):
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
