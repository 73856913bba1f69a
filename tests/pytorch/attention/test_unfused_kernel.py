"""The unfused backend's kernel interface (backends/unfused_kernel.py) against the independent
float64 reference (reference.py): span calls as context parallelism makes them (shapes drawn by
hypothesis), a varlen problem with two policies, a dense problem with padding and sq != skv.
Forward and backward; the backward from the kernel's own out/LSE, as a schedule hands them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_engine.pytorch.attention.dot_product_attention.backends.kernel_problem import (KernelProblem, KernelRun,
                                                                                            ScoreFeatures)
from transformer_engine.pytorch.attention.dot_product_attention.backends.unfused import UnfusedDotProductAttention
from transformer_engine.pytorch.attention.dot_product_attention.backends.unfused_kernel import UnfusedKernel
from transformer_engine.pytorch.attention.dot_product_attention.cp.spans import StepMask, make_span, span_kernel
from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType, MaskSpec

from .reference import reference_dense, reference_thd

H, HG, D, SCALE = 4, 2, 8, 0.35
TOL = dict(rtol=1e-10, atol=1e-10)


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


@settings(max_examples=40, deadline=None)
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
    out, lse = kernel.forward(q, k, v, qs, ks, mask, SCALE)
    got = kernel.backward(dout, q, k, v, out, lse, qs, ks, mask, SCALE)
    masks = ["padding_causal_bottom_right" if mask.causal else "padding"] * len(slot_q)
    windows = [(mask.window_left, 0) if mask.causal else None] * len(slot_q)
    starts_q = [a + s for a, s in zip(sq, shift)]
    ref = lambda q_, k_, v_: reference_thd(q_, k_, v_, _cum(len_q), _cum(len_k), starts_q, sk, masks, windows, SCALE)  # noqa: E731
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
    problem = KernelProblem(runs, 6, 7, SCALE, True)
    masks, windows = ["padding_causal", "padding", "padding_causal"], [None, (2, 1), None]
    ref = lambda q_, k_, v_: reference_thd(q_, k_, v_, [0, 5, 8, 14], [0, 4, 11, 13], off_q.tolist(), off_k.tolist(),  # noqa: E731
                                           masks, windows, SCALE)
    return problem, (18, 16), ref


def _dense_problem():
    """[B=2, SQ=5, SKV=7] with per-entry valid lengths, bottom-right causal with a left window."""
    len_q, len_k = torch.tensor([5, 3], dtype=torch.int32), torch.tensor([6, 7], dtype=torch.int32)
    run = KernelRun(0, MaskSpec(AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT, (3, 0)), None, None, len_q, len_k, 2)
    problem = KernelProblem((run,), 5, 7, SCALE, False)
    ref = lambda q_, k_, v_: reference_dense(q_, k_, v_, "padding_causal_bottom_right", (3, 0), SCALE, len_q, len_k)  # noqa: E731
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
