"""The unfused backend's probabilities P (backends/unfused_probs.py): its hand-written backward
against finite differences and a float64 reference, on both code paths (a small call keeps P for
autograd; checkpointed chunks recompute it), the learnable sink and ALiBi slopes' gradients, a
sequence without keys, double backward refused by name; and the probs hook, the one place P is
seen between forming and use, sees P forward and dP backward."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention.dot_product_attention.backends.unfused import UnfusedDotProductAttention
from transformer_engine.pytorch.attention.dot_product_attention.backends.unfused_math import unfused_attention

from .gpu_helpers import env
from .packing import make_thd
from .reference import allowed_matrix, probabilities, reference_dense

H, HG, D = 4, 2, 8


def _close(a, b, tol=1e-12):
    assert (a.detach() - b.detach()).abs().max() <= tol, f"{(a.detach() - b.detach()).abs().max():.3e}"


def _dense_inputs(b, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, D, generator=g, dtype=torch.float64, requires_grad=True) for h in (H, HG, HG)]


def _gradcheck_case(fmt, budget, gather="0"):
    """A tiny float64 call for torch.autograd.gradcheck: q, k, v, a post-scale bias (dense) and
    the learnable sink are the inputs; GQA, sq != skv, bottom-right causal."""
    g = torch.Generator().manual_seed(11)
    dpa = DotProductAttention(2, 3, num_gqa_groups=1, qkv_format=fmt, softmax_type="learnable",
                              attn_mask_type="padding_causal_bottom_right" if fmt == "thd" else "causal_bottom_right")
    dpa = dpa.double()
    if fmt == "thd":
        p = make_thd([3, 4], [5, 2], h=2, hg=1, d=3, seed=5)
        leaves, kw = [p.q, p.k, p.v], p.kwargs(False, 4, 5)
    else:
        leaves = [torch.randn(1, s, h, 3, generator=g, dtype=torch.float64, requires_grad=True)
                  for s, h in ((4, 2), (6, 1), (6, 1))]
        leaves.append(torch.randn(1, 2, 4, 6, generator=g, dtype=torch.float64, requires_grad=True))
        kw = {"core_attention_bias_type": "post_scale_bias"}
    leaves.append(dpa.softmax_offset)

    def f(q, k, v, *rest):
        bias = {"core_attention_bias": rest[0]} if len(rest) == 2 else {}
        with env(NVTE_UNFUSED_ATTN_MAX_SCORES=str(budget), NVTE_UNFUSED_THD_GATHER=gather):
            return dpa(q, k, v, **kw, **bias)

    return f, leaves


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("fmt,gather", [("bshd", "0"), ("thd", "0"), ("thd", "1")])
def test_gradients_match_finite_differences(fmt, gather, checkpointed):
    """The hand-written backward of the probabilities (dS in place, the sink's gradient),
    checked against finite differences: a small call (autograd keeps P, and gradcheck's
    repeated backward passes reuse it) and checkpointed one-row chunks (each pass recomputes)."""
    budget = 1 << 26 if not checkpointed else 2 * 8  # two score copies of one 8-key row
    f, leaves = _gradcheck_case(fmt, budget, gather)
    # fast_mode: the Jacobian against random directions (one backward pass per output direction
    # instead of one per input element); a wrong gradient still shows, at a fraction of the CPU.
    assert torch.autograd.gradcheck(f, leaves, atol=1e-8, fast_mode=True)


@pytest.mark.parametrize("budget", [1 << 26, 2 * 8 * 4])
@pytest.mark.parametrize("mask", ["causal", "causal_bottom_right"])
def test_learnable_alibi_slopes_get_the_reference_gradient(mask, budget):
    """ALiBi slopes that require grad (float32, as the module takes them) against a float64
    reference written with plain autograd: bias = -slope * |j - i - shift|."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, s, 4, 8, generator=g, dtype=torch.float64, requires_grad=True) for s in (5, 8, 8))
    slopes = torch.rand(4, generator=g).requires_grad_()
    dpa = DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type=mask)
    with env(NVTE_UNFUSED_ATTN_MAX_SCORES=str(budget)):
        out = dpa(q, k, v, core_attention_bias_type="alibi", alibi_slopes=slopes)
    got = torch.autograd.grad(out, [q, k, v, slopes], torch.ones_like(out))
    ref_slopes = slopes.detach().double().requires_grad_()
    ref = reference_dense(q, k, v, mask, None, 1 / 8 ** 0.5, slopes=ref_slopes).reshape(2, 5, 32)  # ALiBi on the mask's diagonal
    want = torch.autograd.grad(ref, [q, k, v, ref_slopes], torch.ones_like(ref))
    _close(out, ref, 1e-12)  # float64 inputs: the bias is computed in float64 from the float32 slopes
    for a, b, tol in zip(got, want, (1e-12, 1e-12, 1e-12, 1e-6)):  # the slopes' gradient is float32
        assert (a.double() - b).abs().max() <= tol * max(1.0, float(b.abs().max())), (a, b)


def test_double_backward_is_refused_by_name():
    f, leaves = _gradcheck_case("bshd", 1 << 26)
    out = f(*leaves)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(out.sum(), leaves[:1], create_graph=True)


@pytest.mark.parametrize("gather", ["0", "1"])
@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_a_sequence_without_keys_comes_out_zero(gather, softmax_type):
    p = make_thd([3, 2, 4], [4, 0, 3], h=2, hg=2, d=4)
    dpa = DotProductAttention(2, 4, qkv_format="thd", attn_mask_type="padding", softmax_type=softmax_type).double()
    with env(NVTE_UNFUSED_THD_GATHER=gather):
        out = dpa(p.q, p.k, p.v, **p.kwargs(False, 4, 4))
        out.sum().backward()
    assert torch.all(out[3:5] == 0) and torch.isfinite(out).all()
    assert all(torch.isfinite(t.grad).all() for t in (p.q, p.k, p.v))
    assert torch.all(p.q.grad[3:5] == 0)


# ---------------------------------------------------------- the probs hook: P forward, dP backward

class _Seen(torch.autograd.Function):
    """A hook as FP8 emulation will write one: records P forward and dP backward."""

    @staticmethod
    def forward(ctx, probs, log):
        ctx.log = log
        log["P"].append(probs.detach().clone())
        return probs.clone()

    @staticmethod
    def backward(ctx, dprobs):
        ctx.log["dP"].append(dprobs.detach().clone())
        return dprobs, None


def _hooked(monkeypatch, hook):
    monkeypatch.setattr(UnfusedDotProductAttention, "run",
                        staticmethod(lambda inp, training: unfused_attention(inp, training, probs_hook=hook)))


def _reference_probs(q, k, v, sink, g):
    """Float64 P [B, H, SQ, SKV] (causal, with a sink logit per head) and dP = dO @ V^T."""
    s = q.shape[1]
    probs = torch.stack([probabilities(q[b], k[b], allowed_matrix(s, s, "causal"), q.shape[-1] ** -0.5, sink=sink)
                         for b in range(q.shape[0])])
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    return probs, torch.einsum("bqhd,bkhd->bhqk", g.view(*q.shape[:3], -1), v)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_probs_hook_sees_p_forward_and_dp_backward(monkeypatch, checkpointed):
    q, k, v = _dense_inputs(b=2, s=6)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="bshd", attn_mask_type="causal",
                              softmax_type="learnable").double()
    with torch.no_grad():
        dpa.softmax_offset.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    log = {"P": [], "dP": []}
    _hooked(monkeypatch, lambda p: _Seen.apply(p, log))
    g = torch.randn(2, 6, H * D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    budget = 1 << 26 if not checkpointed else 2 * (2 * H * 6 * 2)  # 2 score copies of 2-row chunks
    with env(NVTE_UNFUSED_ATTN_MAX_SCORES=str(budget)):
        dpa(q, k, v).backward(g)
    want_p, want_dp = _reference_probs(q.detach(), k.detach(), v.detach(), dpa.softmax_offset.detach(), g)
    chunks = 3 if checkpointed else 1
    # forward, then (checkpointed) once more per chunk when the backward recomputes it
    assert len(log["P"]) == (2 * chunks if checkpointed else 1)
    assert all(p.shape == (2, H, 6 // chunks, 6) for p in log["P"])
    _close(torch.cat(log["P"][:chunks], dim=2), want_p)
    assert len(log["dP"]) == chunks
    blocks = list(want_dp.split(6 // chunks, dim=2))
    for dp in log["dP"]:  # the backward order of the chunks is autograd's; match each to its rows
        hits = [i for i, b in enumerate(blocks) if (dp - b).abs().max() <= 1e-12]
        assert len(hits) == 1, "a dP the hook saw is no block of the reference dP"
        blocks.pop(hits[0])


def test_probs_hook_output_is_what_multiplies_v(monkeypatch):
    q, k, v = _dense_inputs(b=1, s=8)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="bshd", attn_mask_type="causal").double()
    plain = dpa(q, k, v)
    (dv_plain,) = torch.autograd.grad(plain.sum(), [v])
    _hooked(monkeypatch, lambda p: 2 * p)
    doubled = dpa(q, k, v)
    (dv,) = torch.autograd.grad(doubled.sum(), [v])
    _close(doubled, 2 * plain)
    _close(dv, 2 * dv_plain)


@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_no_query_rows_give_an_empty_output_and_zero_gradients(softmax_type):
    q = torch.randn(2, 0, H, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, H, D, dtype=torch.float64, requires_grad=True)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask", attention_type="cross",
                              softmax_type=softmax_type).double()
    out = dpa(q, k, k)
    out.sum().backward()
    assert out.shape == (2, 0, H * D) and torch.all(k.grad == 0)
