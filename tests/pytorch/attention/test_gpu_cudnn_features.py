"""FusedAttention's bias, ALiBi, dropout and return_max_logit on the GPU (skipped without CUDA).

Bias and ALiBi are compared with the unfused backend, forward and backward (dBias included).
Dropout cannot be compared value by value (the generators differ), so its tests check what a
correct dropout must satisfy: the backward drops exactly the probabilities the forward dropped
(with V = identity the output IS the dropped probability matrix, and dV must equal
out^T @ dout), the drop rate and the 1/(1-p) scaling, repeatability under torch.manual_seed, and
no dropout in eval mode.

The max logit (``return_max_logit=True``: cuDNN's score_max reduced to [H]) is compared with the
unfused backend's, with the output and the gradients (the backward runs from stats derived from
the row max and sum of exponents), dense and THD, causal and not, GQA, padding, bias and ALiBi.
"""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention

from .gpu_helpers import grads_of, rel_err, run_on
from .packing import make_thd

pytestmark = pytest.mark.gpu
FUSED = "FusedAttention"
TOL = 2e-2  # bf16


def _compare_with_reference(dpa, inputs, kwargs, bias=None):
    """Run cuDNN and the unfused reference on the same inputs (and bias); compare output and
    every gradient, dBias included."""
    leaves = list(inputs) + ([bias] if bias is not None else [])
    call = dict(kwargs, core_attention_bias=bias) if bias is not None else kwargs
    out = run_on(FUSED, dpa, *inputs, **call)
    assert dpa.last_selection.label == FUSED, dpa.last_selection.report()
    g = torch.randn_like(out)
    got = grads_of(out, leaves, g)
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    ref_call = dict(kwargs, core_attention_bias=ref_leaves[-1]) if bias is not None else kwargs
    ref = run_on("unfused", dpa, *ref_leaves[:3], **ref_call)
    want = grads_of(ref, ref_leaves, g)
    assert rel_err(out, ref) < TOL, f"out: {rel_err(out, ref):.2e}"
    for name, a, b in zip(["dq", "dk", "dv", "dbias"], got, want):
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        assert rel_err(a, b) < 4 * TOL, f"{name}: {rel_err(a, b):.2e}"
    return out


def _dense(b, s, h, d, hg=None, requires_grad=True):
    return [torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)
            for n in (h, hg or h, hg or h)]


@pytest.mark.parametrize("shape", ["1hss", "b1ss", "bhss", "11ss"])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_post_scale_bias(shape, mask):
    b, s, h, d = 2, 256, 4, 64
    dims = [b if shape[0] == "b" else 1, h if shape[1] == "h" else 1, s, s]
    bias = torch.randn(dims, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dpa = DotProductAttention(h, d, num_gqa_groups=2, qkv_format="bshd", attn_mask_type=mask)
    _compare_with_reference(dpa, _dense(b, s, h, d, hg=2), dict(core_attention_bias_type="post_scale_bias"), bias)


def test_post_scale_bias_with_padding_and_sbhd():
    b, s, h, d = 2, 128, 4, 64
    bias = torch.randn(1, h, s, s, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    inputs = [t.detach().transpose(0, 1).contiguous().requires_grad_() for t in _dense(b, s, h, d)]
    pad = torch.arange(s, device="cuda").view(1, s) >= torch.tensor([s, 77], device="cuda").view(b, 1)
    dpa = DotProductAttention(h, d, qkv_format="sbhd", attn_mask_type="padding_causal")
    kwargs = dict(core_attention_bias_type="post_scale_bias", attention_mask=pad.view(b, 1, 1, s))
    _compare_with_reference(dpa, inputs, kwargs, bias)


@pytest.mark.parametrize("h", [16, 12])
def test_alibi_dense_causal(h):
    b, s, d = 2, 256, 64
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal")
    _compare_with_reference(dpa, _dense(b, s, h, d), dict(core_attention_bias_type="alibi"))


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("mask,window", [("padding_causal", None), ("padding_causal_bottom_right", None),
                                         ("padding_causal", (64, 0))])
def test_alibi_thd(gaps, mask, window):
    lengths, h, d = [100, 300, 37, 1, 200], 8, 64
    p = make_thd(lengths, gaps_q=[12, 0, 27, 1, 64] if gaps else None, h=h, hg=h, d=d, dtype=torch.bfloat16, device="cuda")
    dpa = DotProductAttention(h, d, qkv_format="thd", attn_mask_type=mask, window_size=window)
    kwargs = dict(p.kwargs(gaps, max(lengths), max(lengths), shared=True), core_attention_bias_type="alibi")
    out = _compare_with_reference(dpa, [p.q, p.k, p.v], kwargs)
    assert torch.all(out[~p.valid_q] == 0)


# ------------------------------------------------------------------------------------- dropout


def _identity_v(rows: int, h: int, d: int, seq_starts_lengths) -> torch.Tensor:
    """V whose row for key j of a sequence is the unit vector e_j: out = dropped P itself."""
    v = torch.zeros(rows, h, d, device="cuda", dtype=torch.bfloat16)
    for start, n in seq_starts_lengths:
        v[start : start + n] = torch.eye(n, d, device="cuda", dtype=torch.bfloat16).unsqueeze(1)
    return v


def _check_dropout_consistency(out, dv, g, seqs, p, window=None):
    """Per sequence and head: the forward's dropped P (= out) must be what the backward used
    (dV = P^T dout); the drop rate (over the entries the mask allows) must be p and the
    surviving entries scaled by 1/(1-p)."""
    dropped, total, row_sums = 0, 0, []
    for start, n in seqs:
        o, gg, d = (t[start : start + n].float().transpose(0, 1) for t in (out, g, dv))  # [H, n, D]
        probs = o[..., :n]  # key j of the sequence landed in column j
        want = probs.transpose(-1, -2) @ gg
        assert rel_err(d[:, :n], want) < 3e-2, f"dV disagrees with the forward's dropout mask: {rel_err(d[:, :n], want):.2e}"
        i, j = torch.arange(n, device=o.device).view(-1, 1), torch.arange(n, device=o.device).view(1, -1)
        allowed = torch.ones(n, n, dtype=torch.bool, device=o.device) if window is None else (j - i).abs() <= window
        dropped += int(((probs == 0) & allowed).sum())
        total += int(allowed.sum()) * probs.shape[0]
        assert torch.all(probs[:, ~allowed] == 0), "dropout let a masked entry through"
        row_sums.append(probs.sum(-1).flatten())
    rate = dropped / total
    assert abs(rate - p) < 0.03, f"drop rate {rate:.3f}, expected {p}"
    mean_row_sum = float(torch.cat(row_sums).mean().detach())
    assert abs(mean_row_sum - 1.0) < 0.05, f"rows sum to {mean_row_sum:.3f} on average; 1/(1-p) scaling keeps 1"


@pytest.mark.parametrize("window", [None, 16])
def test_dropout_backward_uses_the_forward_mask_dense(window):
    b, s, h, d, p = 1, 64, 2, 64, 0.2
    q, k = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) * 0.3 for _ in range(2))
    v = _identity_v(s, h, d, [(0, s)]).unsqueeze(0).requires_grad_()
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="no_mask", attention_dropout=p,
                              window_size=None if window is None else (window, window))
    out = run_on(FUSED, dpa, q, k, v)
    assert dpa.last_selection.label == FUSED
    g = torch.randn_like(out)
    out.backward(g)
    _check_dropout_consistency(out.view(s, h, d), v.grad[0], g.view(s, h, d), [(0, s)], p, window)


def test_dropout_backward_uses_the_forward_mask_thd_with_gaps():
    lengths, gaps, h, d, p = [64, 17, 50], [3, 0, 9], 2, 64, 0.25
    pk = make_thd(lengths, gaps_q=gaps, h=h, hg=h, d=d, dtype=torch.bfloat16, device="cuda")
    starts = pk.off_q[:-1].tolist()
    seqs = list(zip(starts, lengths))
    q, k = (torch.where(pk.valid_q.view(-1, 1, 1), t.detach() * 0.3, 0.0) for t in (pk.q, pk.k))
    v = _identity_v(q.shape[0], h, d, seqs).requires_grad_()
    dpa = DotProductAttention(h, d, qkv_format="thd", attn_mask_type="padding", attention_dropout=p)
    out = run_on(FUSED, dpa, q, k, v, **pk.kwargs(True, max(lengths), max(lengths), shared=True))
    assert dpa.last_selection.label == FUSED
    g = torch.randn_like(out)
    out.backward(g)
    _check_dropout_consistency(out.view(-1, h, d), v.grad, g.view(-1, h, d), seqs, p)
    assert torch.all(out[~pk.valid_q] == 0) and torch.all(v.grad[~pk.valid_q] == 0)


def test_dropout_follows_torch_seed_and_training_flag():
    b, s, h, d = 2, 128, 4, 64
    inputs = _dense(b, s, h, d, requires_grad=False)
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal", attention_dropout=0.3)
    torch.manual_seed(1)
    first = run_on(FUSED, dpa, *inputs)
    assert dpa.last_selection.label == FUSED
    torch.manual_seed(1)
    again = run_on(FUSED, dpa, *inputs)
    other = run_on(FUSED, dpa, *inputs)
    # exact: the same cuDNN call from the same seed
    assert torch.equal(first, again), "same torch seed, different dropout"
    assert not torch.equal(first, other), "the generator did not advance"
    dpa.eval()
    no_drop = run_on(FUSED, dpa, *inputs)
    ref = run_on("unfused", dpa, *inputs)
    assert rel_err(no_drop, ref) < TOL, "eval mode must not drop"


def test_dropout_in_cuda_graph_draws_fresh_masks():
    b, s, h, d = 1, 128, 2, 64
    inputs = _dense(b, s, h, d, requires_grad=False)
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="no_mask", attention_dropout=0.5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_on(FUSED, dpa, *inputs)  # builds the cuDNN plan off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_on(FUSED, dpa, *inputs)
    graph.replay()
    first = out.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(first).all()
    assert not torch.equal(first, out), "each replay must draw a new dropout mask"


# ----------------------------------------------------------------------------- return_max_logit

MAX_TOL = 5e-3  # scores are float32 sums of bf16 products on both sides; a wrong scale would be off by 10%+


def _compare_max_logit(dpa, inputs, kwargs, grad=True):
    """cuDNN's (out, max logit) and gradients against the unfused backend's on the same inputs."""
    leaves = [t.detach().clone().requires_grad_(grad) for t in inputs]
    ref_leaves = [t.detach().clone().requires_grad_(grad) for t in inputs]
    with torch.set_grad_enabled(grad):
        out, max_logit = run_on(FUSED, dpa, *leaves, **kwargs)
        ref, ref_max = run_on("unfused", dpa, *ref_leaves, **kwargs)
    assert max_logit.dtype == torch.float32 and max_logit.shape == (inputs[0].shape[-2],)
    assert not max_logit.requires_grad and torch.isfinite(max_logit).all(), max_logit
    assert rel_err(out, ref) < TOL, f"out: {rel_err(out, ref):.2e}"
    torch.testing.assert_close(max_logit, ref_max.float(), rtol=MAX_TOL, atol=MAX_TOL)
    if grad:
        g = torch.randn_like(out)
        for name, a, b in zip(["dq", "dk", "dv"], grads_of(out, leaves, g), grads_of(ref, ref_leaves, g)):
            assert torch.isfinite(a).all(), f"{name} has non-finite values"
            assert rel_err(a, b) < 4 * TOL, f"{name}: {rel_err(a, b):.2e}"
    return out, max_logit


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
@pytest.mark.parametrize("hg", [8, 2])
def test_max_logit_dense(fmt, mask, hg, grad):
    b, s, h, d = 2, 256, 8, 64
    inputs = _dense(b, s, h, d, hg=hg)
    if fmt == "sbhd":
        inputs = [t.detach().transpose(0, 1).contiguous() for t in inputs]
    dpa = DotProductAttention(h, d, num_gqa_groups=hg, qkv_format=fmt, attn_mask_type=mask, return_max_logit=True)
    _compare_max_logit(dpa, inputs, {}, grad)


def test_max_logit_dense_cross_attention_bottom_right():
    """sq < skv, bottom-right causal: each row sees a different number of keys. (sq > skv without a
    padding mask is cudnn-frontend's refusal: see test_cudnn_adapter.py's probed rules.)"""
    q = _dense(2, 128, 4, 64)[0]
    k, v = _dense(2, 192, 4, 64)[1:]
    dpa = DotProductAttention(4, 64, qkv_format="bshd", attn_mask_type="causal_bottom_right", return_max_logit=True)
    _compare_max_logit(dpa, [q, k, v], {})


def test_max_logit_dense_padding():
    b, s, h, d = 3, 128, 4, 64
    pad = torch.arange(s, device="cuda").view(1, s) >= torch.tensor([s, 77, 5], device="cuda").view(b, 1)
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="padding_causal", return_max_logit=True)
    _compare_max_logit(dpa, _dense(b, s, h, d), dict(attention_mask=pad.view(b, 1, 1, s)))


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
@pytest.mark.parametrize("hg", [8, 2])
def test_max_logit_thd(gaps, mask, hg):
    lengths, h, d = [100, 300, 37, 1, 200], 8, 64
    p = make_thd(lengths, gaps_q=[12, 0, 27, 1, 64] if gaps else None, h=h, hg=hg, d=d, dtype=torch.bfloat16, device="cuda")
    dpa = DotProductAttention(h, d, num_gqa_groups=hg, qkv_format="thd", attn_mask_type=mask, return_max_logit=True)
    out, _ = _compare_max_logit(dpa, [p.q, p.k, p.v], p.kwargs(gaps, max(lengths), max(lengths), shared=True))
    assert torch.all(out[~p.valid_q] == 0)


def test_max_logit_thd_cross_attention_and_policies():
    """Own key lengths (one sequence without keys), and two mask policies (two cuDNN runs)."""
    lq, lkv, h, d = [64, 130, 17, 90], [80, 0, 33, 90], 8, 64
    p = make_thd(lq, lkv, gaps_q=[3, 0, 5, 0], gaps_kv=[0, 4, 0, 2], h=h, hg=4, d=d, dtype=torch.bfloat16, device="cuda")
    dpa = DotProductAttention(h, d, num_gqa_groups=4, qkv_format="thd", attn_mask_type="padding", return_max_logit=True)
    kwargs = dict(p.kwargs(True, max(lq), max(lkv)),
                  attn_mask_type_per_seq={"padding_causal_bottom_right": torch.tensor([0, 2], device="cuda"),
                                          "padding": torch.tensor([1, 3], device="cuda")})
    _compare_max_logit(dpa, [p.q, p.k, p.v], kwargs)


def test_max_logit_with_bias_and_alibi():
    b, s, h, d = 2, 128, 4, 64
    bias = torch.randn(1, h, s, s, device="cuda", dtype=torch.bfloat16) * 3
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="no_mask", return_max_logit=True)
    _compare_max_logit(dpa, _dense(b, s, h, d), dict(core_attention_bias_type="post_scale_bias", core_attention_bias=bias))
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal", return_max_logit=True)
    _compare_max_logit(dpa, _dense(b, s, h, d), dict(core_attention_bias_type="alibi"))


def test_max_logit_with_a_sink_runs_on_the_unfused_backend():
    """cuDNN's score max takes the sink in; selection sends such a call to the unfused backend."""
    q = _dense(1, 64, 4, 64, requires_grad=False)[0]
    dpa = DotProductAttention(4, 64, qkv_format="bshd", softmax_type="learnable", return_max_logit=True).cuda()
    dpa(q, q, q)
    assert dpa.last_selection.label == "UnfusedDotProductAttention"
    assert "cuDNN's score max includes the sink logit" in dpa.last_selection.report()
