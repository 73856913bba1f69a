"""``return_max_logit``: (output, max logit [H]), TE's max over batch, queries and allowed keys
of the scaled (biased, masked) scores, before a sink joins the softmax.

On the unfused backend against the float64 reference; on FusedAttention (cuDNN) through the
real ops down to the graph, on the cuDNN stand-in, whose max-logit graph fills the row-max rows
past a sequence's length with GARBAGE (so the max must come from the valid rows alone) and
leaves a query row that sees no key unwritten: (out, max logit) and the gradients through the
derived stats must equal the unfused backend's. What cuDNN's score_max itself holds is checked
on the H200 (test_gpu_cudnn_features.py, benchmarks/attention/probe_cudnn_max_logit.py). Also
the selection's rules for it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention import AttentionParams, backends, get_attention_backend
from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import ops
from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType
from transformer_engine.pytorch.attention.dot_product_attention.selection.libraries import InstalledLibraries

from .packing import make_thd
from .reference import allowed_matrix, max_logit_one
from .stand_ins.cudnn import GARBAGE

H, HG, D = 4, 2, 8
SCALE = 0.3


# ------------------------------------------------------------------ the module's contract (unfused)


def test_max_logit_includes_the_bias_and_ignores_the_sink():
    """TE: max over (batch, queries, keys) of mask(q k^T * scale + bias), per head, before the
    sink joins the softmax."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 5, H, D, generator=gen, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, H, 5, 5, generator=gen, dtype=torch.float64)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", softmax_type="learnable",
                              return_max_logit=True).double()
    with torch.no_grad():
        dpa.softmax_offset.fill_(50.0)  # a sink far above every score must not show up
    out, max_logit = dpa(q, k, v, core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    allowed = allowed_matrix(5, 5, "causal")
    want = torch.stack([max_logit_one(q[i], k[i], allowed, 1 / math.sqrt(D), bias[0]) for i in range(2)]).amax(0)
    torch.testing.assert_close(max_logit, want, rtol=1e-10, atol=1e-10)
    assert max_logit.shape == (H,) and not max_logit.requires_grad
    assert out.shape == (2, 5, H * D)


def test_return_max_logit_returns_a_pair_and_the_default_a_tensor():
    q = torch.randn(4, 2, H, D)
    assert isinstance(DotProductAttention(H, D)(q, q, q), torch.Tensor)
    out, mx = DotProductAttention(H, D, return_max_logit=True)(q, q, q)
    assert out.shape == (4, 2, H * D) and mx.shape == (H,) and mx.dtype == torch.float32


# ------------------------------------------------------------------ cuDNN, on its stand-in


def _max_logit_parity(inputs, kwargs, grad=True, **module_kwargs):
    """(out, max logit) and gradients of cuDNN (the stand-in) against the unfused backend."""
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
    shape = (lambda s, h: (b, s, h, D)) if fmt == "bshd" else (lambda s, h: (s, b, h, D))
    return [torch.randn(shape(s, h), generator=g, dtype=torch.float64) for s, h in ((sq, H), (skv, HG), (skv, HG))]


def _built(cudnn_lib):
    return [(g.node.direction, g.node.with_max) for g in cudnn_lib.builds]


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("fmt,mask,sq,skv", [
    ("bshd", "no_mask", 6, 6), ("bshd", "causal", 6, 6), ("sbhd", "causal", 5, 5),
    ("bshd", "causal_bottom_right", 7, 4),  # rows that see no key
    ("sbhd", "no_mask", 3, 6),
])
def test_cudnn_dense_matches_unfused(cudnn_lib, fmt, mask, sq, skv, grad):
    _max_logit_parity(_dense(2, sq, skv, fmt), {}, grad, qkv_format=fmt, attn_mask_type=mask)
    assert ("fwd", True) in _built(cudnn_lib) and ("fwd", False) not in _built(cudnn_lib)


def test_cudnn_dense_padding_leaves_out_padded_rows(cudnn_lib):
    mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., 3:] = True  # TE: True = masked out; rows 3.. of sequence 0 are padding
    _max_logit_parity(_dense(2, 6, 6), dict(attention_mask=mask), qkv_format="bshd", attn_mask_type="padding")


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("policies", [False, True])
def test_cudnn_thd_matches_unfused(cudnn_lib, gaps, policies):
    """Packed sequences (gaps NaN-filled), one run or one per mask policy: the max over runs."""
    p = make_thd([5, 3, 6], gaps_q=[2, 0, 1] if gaps else None, h=H, hg=HG, d=D, tail=2)
    kwargs = p.kwargs(gaps, 6, 6, shared=True)
    if policies:
        kwargs["thd_sequence_is_causal"] = torch.tensor([True, False, True])
    _max_logit_parity([p.q, p.k, p.v], kwargs, qkv_format="thd", attn_mask_type="padding_causal")
    assert _built(cudnn_lib).count(("fwd", True)) == (2 if policies else 1)


def test_cudnn_thd_cross_attention_rows_that_see_no_key(cudnn_lib):
    """Bottom-right causal with more queries than keys: leading rows see no key, one sequence
    has no keys at all; their rows count as nothing scored, and their gradients are 0."""
    p = make_thd([5, 2, 4], [3, 0, 4], gaps_q=[1, 0, 2], gaps_kv=[0, 2, 1], h=H, hg=HG, d=D, tail=1)
    _max_logit_parity([p.q, p.k, p.v], p.kwargs(True, 5, 4), qkv_format="thd", attn_mask_type="padding_causal_bottom_right")


def test_cudnn_max_logit_of_a_head_that_scores_nothing_is_the_lowest_float32(cudnn_lib):
    """No sequence has a key: the unfused reference gives its dtype's lowest value; cuDNN's
    float32 buffer gives float32's (its -inf clamped), with the output 0."""
    p = make_thd([3, 2], [0, 0], h=H, hg=HG, d=D)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding", return_max_logit=True,
                              softmax_scale=SCALE)
    with backend_scope(force=backends.FusedAttention):
        out, max_logit = dpa(p.q, p.k, p.v, **p.kwargs(False, 3, 1))
    assert torch.all(max_logit == torch.finfo(torch.float32).min) and torch.all(out == 0)


def test_no_max_logit_graph_unless_asked(cudnn_lib):
    with backend_scope(force=backends.FusedAttention):
        DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="bshd")(*(t.requires_grad_() for t in _dense(2, 6, 6))).sum().backward()
    assert _built(cudnn_lib) == [("fwd", False), ("bwd", False)]


def test_a_kernel_forced_past_its_declaration_returns_no_max_logit(fa4_lib):
    """FA4 returns no max logit: forced with return_max_logit, the module gives (out, None),
    as for any backend forced past its declaration."""
    p = make_thd([5, 3], h=H, hg=H, d=D)
    with backend_scope(force="fa4"):
        out, max_logit = DotProductAttention(H, D, qkv_format="thd", return_max_logit=True)(p.q, p.k, p.v,
                                                                                             **p.kwargs(False, 5, 5))
    assert max_logit is None and out.shape == (8, H * D)


def test_max_logit_ops_reduce_valid_rows_and_derive_stats():
    """The two pure pieces of cudnn_fwd_max: the max over valid rows only, and the stats from
    the row max and sum of exponents (+inf where a row scored nothing)."""
    row_max = torch.tensor([[1.0, 7.0, GARBAGE], [2.0, float("-inf"), GARBAGE]]).view(2, 1, 3, 1).expand(2, 2, 3, 1)
    assert ops._max_over_rows(row_max, torch.tensor([2, 1], dtype=torch.int32)).tolist() == [7.0, 7.0]
    assert torch.equal(ops._max_over_rows(row_max, None), torch.full((2,), GARBAGE))
    stats = ops._stats_of(torch.tensor([0.5, float("-inf")]), torch.tensor([2.0, float("nan")]))
    assert stats[1] == float("inf") and stats[0].item() == pytest.approx(0.5 + math.log(2.0), rel=1e-6)


# ------------------------------------------------------------------ selection: who returns it

ALL_LIBS = InstalledLibraries("2", "3", "4", "1.32.0")
THD = AttentionParams(qkv_format="thd", qkv_layout="thd_thd_thd", attn_mask_type=AttnMaskType.PADDING_CAUSAL,
                      head_dim_qk=128, head_dim_v=128)


def test_selection_return_max_logit_goes_to_cudnn_with_reasons():
    sel = get_attention_backend(replace(THD, return_max_logit=True), ALL_LIBS)
    assert sel.label == "FusedAttention"
    fa4 = "; ".join(map(str, sel.reasons_for("FlashAttention v4")))
    assert fa4.startswith("return_max_logit=True (supported: False; FlashAttention returns only the log-sum-exp")
    # With a sink, cuDNN's score max takes the sink in: the unfused backend runs it.
    sel = get_attention_backend(replace(THD, return_max_logit=True, softmax_type="learnable"), replace(ALL_LIBS, cudnn=92600))
    assert sel.label == "UnfusedDotProductAttention"
    assert "cuDNN's score max includes the sink logit" in "; ".join(map(str, sel.reasons_for("FusedAttention")))


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
    params = replace(THD, return_max_logit=True, compute_capability=(9, 0), softmax_type=softmax_type)
    reasons = "; ".join(map(str, backends.FusedAttention.not_supported_reasons(params, libs)))
    if reason is None:
        assert reasons == ""
    else:
        assert reason in reasons
