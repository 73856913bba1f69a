"""core_attention_bias and ALiBi on the unfused backend against the float64 reference: the bias
types, a bias of one row for every query (TE's "111s") with its gradient, ALiBi's diagonal
(top-left for causal/padding_causal, bottom-right otherwise) with standard and custom slopes;
and the reference's ALiBi against numbers worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention

from .reference import alibi_bias, reference_dense, standard_slopes

H, D = 4, 8
SCALE = 1.0 / math.sqrt(D)


def _dense(b=2, sq=5, skv=5, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, H, D, generator=g, dtype=torch.float64).requires_grad_(grad) for s in (sq, skv, skv)]


@pytest.mark.parametrize("bias_type", ["pre_scale_bias", "post_scale_bias", "alibi"])
def test_bias_types(bias_type):
    b, s = 2, 5
    q, k, v = _dense(b, s, s, grad=False)
    bias = torch.randn(1, H, s, s, dtype=torch.float64)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask")
    kwargs = dict(core_attention_bias_type=bias_type)
    slopes = torch.rand(H, dtype=torch.float32)
    if bias_type == "alibi":
        kwargs["alibi_slopes"] = slopes
        want = reference_dense(q, k, v, "no_mask", None, SCALE, slopes=slopes.double())
    else:
        kwargs["core_attention_bias"] = bias
        # pre-scale: (qk + bias) * scale, i.e. a post-scale bias of bias * scale.
        want = reference_dense(q, k, v, "no_mask", None, SCALE, bias=bias * SCALE if bias_type == "pre_scale_bias" else bias)
    torch.testing.assert_close(dpa(q, k, v, **kwargs).view(b, s, H, D), want, rtol=1e-10, atol=1e-10)


def test_bias_one_row_for_every_query_matches_reference_with_its_gradient():
    """core_attention_bias of shape [1, 1, 1, skv] (TE's "111s") adds one row to every query."""
    q, k, v = _dense(sq=6, skv=7)
    bias = torch.randn(1, 1, 1, 7, dtype=torch.float64, requires_grad=True)
    out = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask", attention_type="cross")(
        q, k, v, core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    want = reference_dense(*ref_in[:3], "no_mask", None, SCALE, bias=ref_in[3].expand(1, 1, 6, 7)).flatten(-2)
    g = torch.randn_like(want)
    out.backward(g)
    want.backward(g)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    assert bias.grad.shape == (1, 1, 1, 7)
    for got, exp in zip((q, k, v, bias), ref_in):
        torch.testing.assert_close(got.grad, exp.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask", ["causal", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right", "no_mask"])
@pytest.mark.parametrize("sq,skv", [(7, 4), (4, 7)])
def test_alibi_alignment_follows_the_mask(mask, sq, skv):
    """TE: ALiBi is -slope*|j - i| for the top-left masks (causal, padding_causal) and
    -slope*|j - i - (skv - sq)| for the others; it matters when sq > skv."""
    q, k, v = _dense(sq=sq, skv=skv, grad=False)
    kw = {}
    if "padding" in mask:
        kw["attention_mask"] = (torch.zeros(2, 1, 1, sq, dtype=torch.bool), torch.zeros(2, 1, 1, skv, dtype=torch.bool))
    out = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type=mask, attention_type="cross")(
        q, k, v, core_attention_bias_type="alibi", **kw)
    want = reference_dense(q, k, v, mask, None, SCALE, slopes=standard_slopes(H)).flatten(-2)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_alibi_top_left_differs_from_bottom_right_when_sq_exceeds_skv():
    """The two alignments give different numbers here, so the test above has teeth."""
    q, k, v = _dense(sq=7, skv=4, grad=False)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attention_type="cross")
    a = dpa(q, k, v, attn_mask_type="causal", core_attention_bias_type="alibi")
    b = dpa(q, k, v, attn_mask_type="causal_bottom_right", core_attention_bias_type="alibi")
    assert (a - b).abs().max() > 1e-3


def test_reference_alibi_by_hand():
    """The oracle's slopes and diagonal, worked out by hand (ALiBi's paper; TE's alignment)."""
    assert torch.allclose(standard_slopes(8), torch.tensor([2.0 ** -i for i in range(1, 9)], dtype=torch.float64))
    twelve = standard_slopes(12)
    assert torch.allclose(twelve[:8], standard_slopes(8))
    assert torch.allclose(twelve[8:], torch.tensor([2.0 ** (-0.5 - i) for i in range(4)], dtype=torch.float64))
    one = torch.tensor([1.0], dtype=torch.float64)
    # 3 queries, 2 keys: top-left -> |j - i|; bottom-right -> |j - i + 1|
    assert alibi_bias(3, 2, "causal", one)[0].tolist() == [[0, -1], [-1, 0], [-2, -1]]
    assert alibi_bias(3, 2, "causal_bottom_right", one)[0].tolist() == [[-1, -2], [0, -1], [-1, 0]]
