"""DotProductAttention's masks and windows on the unfused backend against the float64
reference: every mask type, dense (bshd/sbhd, padding as attention_mask, arbitrary masks) and
THD (with and without gaps, cross lengths), windows, GQA, forward and every input gradient;
TE's window normalization and ``bottom_right_diagonal``; output shapes and dtypes."""

from __future__ import annotations

import math

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention

from .grid import cycled
from .packing import make_thd
from .reference import reference_dense, reference_thd

H, D = 4, 8
SCALE = 1.0 / math.sqrt(D)
DENSE_MASKS = ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right", "arbitrary"]
THD_MASKS = ["padding", "padding_causal", "padding_causal_bottom_right", "causal"]


def _window(mask: str, windowed: bool):
    if not windowed:
        return None
    return (2, 0) if "causal" in mask else (2, 1)


def _grads(out, leaves, g):
    for t in leaves:
        t.grad = None
    (out * g).sum().backward()
    return [t.grad.clone() for t in leaves]


def _leaf64(t):
    return t.detach().double().nan_to_num(0.0).requires_grad_()


def _close(a, b, tol):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("mask,windowed,gaps,cross,hg",
                         cycled([THD_MASKS, [False, True], [False, True], [False, True]], [(4,), (2,), (1,)]))
def test_thd_matches_reference(mask, windowed, gaps, cross, hg):
    lengths_q = [3, 5, 1, 4, 0]
    lengths_kv = [4, 2, 3, 6, 2] if cross else lengths_q
    gq = [1, 0, 2, 1, 1] if gaps else None
    gkv = ([0, 2, 1, 1, 0] if cross else gq) if gaps else None
    p = make_thd(lengths_q, lengths_kv, gq, gkv, h=H, hg=hg, d=D, tail=2)
    window = _window(mask, windowed)
    dpa = DotProductAttention(H, D, num_gqa_groups=hg, qkv_format="thd", attn_mask_type=mask, window_size=window)
    out = dpa(p.q, p.k, p.v, **p.kwargs(gaps, max(lengths_q), max(lengths_kv), shared=not cross)).view(-1, H, D)
    refs = [_leaf64(t) for t in (p.q, p.k, p.v)]
    thd_mask = mask if mask.startswith("padding") else "padding_" + mask
    off_q, off_kv = (p.off_q, p.off_kv) if gaps else (p.cu_q, p.cu_kv)
    ref = reference_thd(*refs, p.cu_q, p.cu_kv, off_q, off_kv, thd_mask, window, SCALE)
    _close(out, ref, 1e-10)
    assert torch.all(out[~p.valid_q] == 0)
    g = torch.randn_like(ref)
    for got, want, valid in zip(_grads(out, [p.q, p.k, p.v], g), _grads(ref, refs, g), [p.valid_q, p.valid_kv, p.valid_kv]):
        _close(got, want, 1e-10)
        assert torch.all(got[~valid] == 0) and torch.isfinite(got).all()


def _dense_inputs(fmt, b, sq, skv, hg, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = lambda s, h: (b, s, h, D) if fmt == "bshd" else (s, b, h, D)  # noqa: E731
    return [torch.randn(shape(s, h), generator=g, dtype=torch.float64).requires_grad_() for s, h in ((sq, H), (skv, hg), (skv, hg))]


def _to_bshd(t, fmt):
    return t if fmt == "bshd" else t.transpose(0, 1)


@pytest.mark.parametrize("mask,windowed,cross,fmt,hg",
                         cycled([DENSE_MASKS, [False, True], [False, True]], [("bshd", 4), ("sbhd", 1), ("sbhd", 4), ("bshd", 1)]))
def test_dense_matches_reference(mask, windowed, cross, fmt, hg):
    b, sq = 3, 5
    skv = 7 if cross else sq
    q, k, v = _dense_inputs(fmt, b, sq, skv, hg)
    window = _window(mask, windowed)
    len_q, len_kv = torch.tensor([5, 3, 1]), torch.tensor([skv, skv - 2, 2])
    kwargs, arbitrary = {}, None
    if mask.startswith("padding"):
        pad_q = torch.arange(sq).view(1, sq) >= len_q.view(b, 1)
        pad_kv = torch.arange(skv).view(1, skv) >= len_kv.view(b, 1)
        kwargs["attention_mask"] = (pad_q.view(b, 1, 1, sq), pad_kv.view(b, 1, 1, skv))
    else:
        len_q = len_kv = None
    if mask == "arbitrary":
        arbitrary = torch.rand(b, 1, sq, skv, generator=torch.Generator().manual_seed(1)) > 0.6
        kwargs["attention_mask"] = arbitrary
    dpa = DotProductAttention(H, D, num_gqa_groups=hg, qkv_format=fmt, attn_mask_type=mask, window_size=window,
                              attention_type="cross" if cross else "self")
    out = dpa(q, k, v, **kwargs)
    out = _to_bshd(out.view(*out.shape[:2], H, D), fmt)
    refs = [_leaf64(_to_bshd(t, fmt)) for t in (q, k, v)]
    ref = reference_dense(*refs, mask, window, SCALE, len_q, len_kv, arbitrary)
    _close(out, ref, 1e-10)
    g = torch.randn_like(ref)
    got = [_to_bshd(t, fmt) for t in _grads(out, [q, k, v], g)]
    for a, w in zip(got, _grads(ref, refs, g)):
        _close(a, w, 1e-10)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_low_precision_thd(dtype, tol):
    p = make_thd([6, 3, 7], gaps_q=[2, 0, 1], h=H, hg=2, d=D, dtype=dtype)
    dpa = DotProductAttention(H, D, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal")
    out = dpa(p.q, p.k, p.v, **p.kwargs(True, 7, 7, shared=True)).view(-1, H, D)
    refs = [_leaf64(t) for t in (p.q, p.k, p.v)]
    ref = reference_thd(*refs, p.cu_q, p.cu_kv, p.off_q, p.off_kv, "padding_causal", None, SCALE)
    assert out.dtype == dtype
    _close(out, ref, tol)
    assert torch.all(out[~p.valid_q] == 0)


def test_unfused_inside_torch_autocast_computes_in_float32():
    """Inside torch.autocast the unfused reference still computes in float32 (its matmuls would
    otherwise run in bf16 and the masked fill overflow): same result as outside, in the inputs'
    dtype."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 5, 4, 8, dtype=torch.bfloat16) for _ in range(3))
    dpa = DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type="causal")
    want = dpa(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dpa(q, k, v)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same float32 ops on the same data


def test_output_shapes():
    for fmt, shape in (("sbhd", (5, 2, H * D)), ("bshd", (2, 5, H * D))):
        q, k, v = _dense_inputs(fmt, 2, 5, 5, H)
        assert DotProductAttention(H, D, qkv_format=fmt)(q, k, v).shape == shape
    p = make_thd([3, 2])
    out = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")(p.q, p.k, p.v, **p.kwargs(False, 3, 3))
    assert out.shape == (5, H * D)


def test_mixed_head_dims():
    p = make_thd([3, 4], h=H, hg=H, d=D, dv=16)
    dpa = DotProductAttention(H, (D, 16), qkv_format="thd", attn_mask_type="padding_causal")
    out = dpa(p.q, p.k, p.v, **p.kwargs(False, 4, 4)).view(-1, H, 16)
    refs = [_leaf64(t) for t in (p.q, p.k, p.v)]
    ref = reference_thd(*refs, p.cu_q, p.cu_kv, p.cu_q, p.cu_kv, "padding_causal", None, SCALE)
    _close(out, ref, 1e-10)


def test_thd_ignores_attention_mask():
    """TE takes THD lengths from cu_seqlens; an attention_mask passed along is accepted and unused."""
    p = make_thd([3, 2], gaps_q=[1, 2], h=H, d=D)
    dpa = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal")
    kw = p.kwargs(True, 3, 3, shared=True)
    junk = torch.ones(2, 1, 1, 3, dtype=torch.bool)  # would mask everything if it were read
    # Bit-exact: the same call with an argument that is never read.
    torch.testing.assert_close(dpa(p.q, p.k, p.v, attention_mask=junk, **kw), dpa(p.q, p.k, p.v, **kw), rtol=0, atol=0)


# ------------------------------------------------------------------------------ bottom_right_diagonal


def _cross(sq=4, skv=7):
    return [t.detach() for t in _dense_inputs("bshd", 2, sq, skv, H)]


@pytest.mark.parametrize("mask", ["causal", "causal_bottom_right", "padding_causal", "padding_causal_bottom_right", "no_mask"])
@pytest.mark.parametrize("flag", [True, False])
def test_bottom_right_diagonal_does_not_override_the_mask_type(mask, flag):
    """As in TE, the mask type decides the causal diagonal (causal/padding_causal top-left,
    *_bottom_right bottom-right); the flag only aligns windows/ALiBi of non-causal masks."""
    q, k, v = _cross()
    kw = {}
    if "padding" in mask:
        kw["attention_mask"] = (torch.tensor([[False] * 4, [False] * 3 + [True]]).view(2, 1, 1, 4),
                                torch.tensor([[False] * 7, [False] * 5 + [True] * 2]).view(2, 1, 1, 7))
    dpa = DotProductAttention(H, D, qkv_format="bshd", attention_type="cross")
    got = dpa(q, k, v, attn_mask_type=mask, bottom_right_diagonal=flag, **kw)
    # Bit-exact: the flag changes nothing here, so both calls run the same arithmetic.
    torch.testing.assert_close(got, dpa(q, k, v, attn_mask_type=mask, **kw), rtol=0, atol=0)


def test_bottom_right_diagonal_false_refuses_top_left_windows_on_non_causal_masks():
    q, k, v = _cross()
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask", attention_type="cross")
    with pytest.raises(NotImplementedError, match="bottom_right_diagonal=False with attn_mask_type='no_mask'"):
        dpa(q, k, v, window_size=(2, 2), bottom_right_diagonal=False)
    dpa(q, k, v, window_size=(2, 2), bottom_right_diagonal=True)  # the default alignment


def test_bottom_right_diagonal_must_be_a_bool():
    q, k, v = _cross(5, 5)
    with pytest.raises(TypeError, match=r"bottom_right_diagonal must be None, True or False; got 1"):
        DotProductAttention(H, D, qkv_format="bshd")(q, k, v, bottom_right_diagonal=1)


# ------------------------------------------------------------------------------ window normalization


def test_causal_window_reaching_right_is_cut_with_a_warning():
    q, k, v = _cross(9, 9)
    with pytest.warns(UserWarning, match=r"window_size=\(4, 4\) reaches right of the diagonal.*using \(4, 0\)"):
        dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", window_size=(4, 4))
    with pytest.warns(UserWarning, match=r"using \(4, 0\)"):
        got = dpa(q, k, v)
    want = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", window_size=(4, 0))(q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # bit-exact: the same normalized call
    with pytest.warns(UserWarning, match=r"window_size=\(2, 2\) reaches right of the diagonal.*using \(2, 0\)"):
        forward_cut = dpa(q, k, v, attn_mask_type="causal", window_size=(2, 2))  # a forward's own window too
    torch.testing.assert_close(forward_cut, dpa(q, k, v, attn_mask_type="causal", window_size=(2, 0)), rtol=0, atol=0)


def test_minus_one_zero_window_without_causal_mask_means_no_window():
    q, k, v = _cross(6, 6)
    mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    with pytest.warns(UserWarning, match=r"window_size=\(-1, 0\) with attn_mask_type='padding' means no window.*using \(-1, -1\)"):
        got = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding", window_size=(-1, 0))(q, k, v, attention_mask=mask)
    want = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding")(q, k, v, attention_mask=mask)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # bit-exact: the same normalized call
    assert (got - DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal")(q, k, v)).abs().max() > 1e-6


def test_unbounded_left_with_right_reach_on_causal_is_an_error():
    with pytest.raises(ValueError, match=r"window_size=\(-1, 4\) does not fit attn_mask_type='causal'"):
        DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", window_size=(-1, 4))
    q, k, v = _cross(5, 5)
    with pytest.raises(ValueError, match=r"window_size=\(-1, 4\) does not fit attn_mask_type='causal'"):
        DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask")(q, k, v, attn_mask_type="causal", window_size=(-1, 4))
