"""Declared packed inputs: all 8 dense and 4 THD layouts give the separate-input results
(outputs, and gradients read off the packed buffer); views are zero-copy; validation messages;
DeprecationWarning only when packing had to be detected; torch.compile(fullgraph=True)."""

from __future__ import annotations

import warnings

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention.dot_product_attention import get_qkv_layout


H, HG, D, B, S = 4, 2, 8, 2, 5


def _packed(fmt, n, heads, dim, g):
    lead = {"bshd": (B, S), "sbhd": (S, B), "thd": (B * S,)}[fmt]
    shape = lead + ((n, heads, D) if dim == -3 else (heads, n, D))
    return torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)


def _thd_kwargs():
    cu = torch.tensor([0, 3, B * S], dtype=torch.int32)
    return dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)


def _dpa(fmt, heads_kv):
    mask = "padding_causal" if fmt == "thd" else "causal"
    return DotProductAttention(H, D, num_gqa_groups=heads_kv, qkv_format=fmt, attn_mask_type=mask)


@pytest.mark.parametrize("dim", [-3, -2])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_qkv_layer_equals_separate(fmt, dim):
    g = torch.Generator().manual_seed(0)
    qkv = _packed(fmt, 3, H, dim, g)
    kw = _thd_kwargs() if fmt == "thd" else {}
    dpa = _dpa(fmt, H)
    out = dpa(qkv_layer=qkv, qkv_interleave_dim=dim, **kw)
    assert dpa.last_selection.label == "UnfusedDotProductAttention"
    sep = [qkv.detach().select(dim, i).clone().requires_grad_() for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # separate tensors never warn
        ref = dpa(*sep, **kw)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for i in range(3):
        torch.testing.assert_close(qkv.grad.select(dim, i), sep[i].grad)


@pytest.mark.parametrize("dim", [-3, -2])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_kv_layer_equals_separate_gqa(fmt, dim):
    g = torch.Generator().manual_seed(1)
    kv = _packed(fmt, 2, HG, dim, g)
    q = _packed(fmt, 1, H, -3, g).detach().select(-3, 0).clone().requires_grad_()
    kw = _thd_kwargs() if fmt == "thd" else {}
    dpa = _dpa(fmt, HG)
    out = dpa(q, kv_layer=kv, qkv_interleave_dim=dim, **kw)
    sep = [kv.detach().select(dim, i).clone().requires_grad_() for i in range(2)]
    ref = dpa(q.detach(), *sep, **kw)
    torch.testing.assert_close(out, ref)
    out.backward(torch.ones_like(out))
    ref.backward(torch.ones_like(ref))
    for i in range(2):
        torch.testing.assert_close(kv.grad.select(dim, i), sep[i].grad)


def test_views_are_zero_copy_and_layout_is_declared(monkeypatch):
    import transformer_engine.pytorch.attention.dot_product_attention.prepare.packed_qkv as pq

    seen = {}
    real = pq.resolve_qkv

    def spy(*args):
        r = real(*args)
        seen.update(layout=r.layout, ptr=r.k.data_ptr())
        return r

    def boom(*args):
        raise AssertionError("the declared path must not detect packing")

    monkeypatch.setattr("transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention.resolve_qkv", spy)
    monkeypatch.setattr(pq, "get_qkv_layout", boom)
    qkv = torch.randn(B, S, H, 3, D)
    _dpa("bshd", H)(qkv_layer=qkv, qkv_interleave_dim=-2)
    assert seen["layout"] == "bsh3d" and seen["ptr"] == qkv[..., 1, :].data_ptr()


LAYOUTS = [("bshd", "qkv", -3, "bs3hd"), ("bshd", "qkv", -2, "bsh3d"), ("sbhd", "qkv", -3, "sb3hd"), ("sbhd", "qkv", -2, "sbh3d"),
           ("thd", "qkv", -3, "t3hd"), ("thd", "qkv", -2, "th3d"), ("bshd", "kv", -3, "bshd_bs2hd"), ("bshd", "kv", -2, "bshd_bsh2d"),
           ("sbhd", "kv", -3, "sbhd_sb2hd"), ("sbhd", "kv", -2, "sbhd_sbh2d"), ("thd", "kv", -3, "thd_t2hd"), ("thd", "kv", -2, "thd_th2d")]


@pytest.mark.parametrize("fmt,packing,dim,name", LAYOUTS)
def test_legacy_detection_names_every_layout(fmt, packing, dim, name):
    n = 3 if packing == "qkv" else 2
    buf = _packed(fmt, n, H, dim, torch.Generator().manual_seed(2)).detach()
    views = [buf.select(dim, i) for i in range(n)]
    q = views[0] if packing == "qkv" else torch.randn_like(views[0])
    k, v = views[-2:]
    assert get_qkv_layout(q, k, v, fmt) == (name, packing)


def test_legacy_packed_views_warn():
    qkv = torch.randn(B, S, 3, H, D)
    q, k, v = qkv.unbind(2)
    with pytest.warns(DeprecationWarning, match="pass it as qkv_layer="):
        _dpa("bshd", H)(q, k, v)


ERRORS = [
    (dict(qkv_layer=torch.randn(B, S, 3, H, D), query_layer=torch.randn(B, S, H, D)), "qkv_layer already holds q, k and v; do not also pass query_layer"),
    (dict(qkv_layer=torch.randn(B, S, 3, H, D), kv_layer=torch.randn(B, S, 2, H, D)), "do not also pass kv_layer"),
    (dict(kv_layer=torch.randn(B, S, 2, H, D)), "kv_layer needs query_layer"),
    (dict(qkv_layer=torch.randn(B, 3, H, D)), "qkv_layer must have rank 5 for qkv_format='bshd'"),
    (dict(qkv_layer=torch.randn(B, S, 4, H, D)), "qkv_layer must have size 3 at qkv_interleave_dim=-3"),
    (dict(query_layer=torch.randn(B, S, H, D), kv_layer=torch.randn(B, S, H, 3, D), qkv_interleave_dim=-2), "kv_layer must have size 2"),
    (dict(qkv_layer=torch.randn(B, S, 3, H, 2 * D)[..., ::2]), r"stride\(-1\) must be 1"),
    (dict(qkv_layer=torch.randn(B, S, 3, H, D), qkv_interleave_dim=-1), "qkv_interleave_dim must be -3 or -2; got -1"),
]


@pytest.mark.parametrize("kwargs,msg", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        _dpa("bshd", H)(**kwargs)


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_compile_fullgraph_on_cpu(fmt):
    torch._dynamo.reset()
    dpa = _dpa(fmt, H)
    kw = _thd_kwargs() if fmt == "thd" else {}
    qkv = _packed(fmt, 3, H, -3, torch.Generator().manual_seed(3)).detach().float().requires_grad_()

    def step(x):
        return dpa(qkv_layer=x, **kw)

    out = torch.compile(step, fullgraph=True)(qkv)
    ref = step(qkv.detach())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all()
