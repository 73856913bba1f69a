"""FusedAttention (cuDNN) on the CPU: the package's real backend code, its graph building
included, runs on the cuDNN stand-in (``stand_ins/cudnn.py``: a ``cudnn.pygraph`` that records
what is declared and executes it in float64 through those declarations). What the GPU tests cannot see
directly is checked here: one dropout seed per forward, handed unchanged to the backward; no
dropout in eval mode; the bias cast to the inputs' dtype, its gradient routed back; the
bottom-right band sent top-left where both alignments are the same mask; the sink logits sent
as float32 [H] and their gradient (asked for only when wanted); several policies' calls
sharing one set of buffers. Also: the bounded graph cache and the declaration's probed rules."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention import AttentionParams, backends, get_attention_backend
from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import graphs
from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType
from transformer_engine.pytorch.attention.dot_product_attention.selection.libraries import InstalledLibraries

from .gpu_helpers import rel_err
from .packing import make_thd
from .stand_ins.cudnn import pack_of

H, D = 4, 8


@pytest.fixture
def cudnn(cudnn_lib):
    with backend_scope(force=backends.FusedAttention):
        yield cudnn_lib


def _qkv(b=2, sq=16, skv=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, s, H, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for s in (sq, skv, skv)]


def _unfused_grads(dpa, inputs, extra_leaves=(), **kwargs):
    """The unfused backend's output and gradients on float64 copies of ``inputs``."""
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    with backend_scope(force="unfused"):
        out = dpa(*leaves, **kwargs)
    return out, torch.autograd.grad(out.sum(), leaves + list(extra_leaves))


def test_dropout_seed_is_drawn_once_and_reused_by_the_backward(cudnn):
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", attention_dropout=0.25)
    dpa(*_qkv()).sum().backward()
    ((fwd, fwd_pack),), ((bwd, bwd_pack),) = cudnn.of("fwd"), cudnn.of("bwd")
    assert fwd.dropout_p == 0.25 and bwd.dropout_p == 0.25
    rng = [pack_of(fwd_pack, n) for n in ("seed", "offset")]
    assert all(t.dtype == torch.int64 and t.numel() == 1 for t in rng)
    assert [pack_of(bwd_pack, n).data_ptr() for n in ("seed", "offset")] == [t.data_ptr() for t in rng]  # the same [seed, offset]
    dpa(*_qkv())
    again = torch.cat([pack_of(cudnn.runs[-1][1], n).view(-1) for n in ("seed", "offset")])
    assert not torch.equal(again, torch.cat([t.view(-1) for t in rng])), "each forward draws a new seed"


def test_eval_mode_runs_without_dropout(cudnn):
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", attention_dropout=0.25).eval()
    dpa(*_qkv())
    ((fwd, pack),) = cudnn.of("fwd")
    assert fwd.dropout_p == 0.0 and pack_of(pack, "seed") is None


@pytest.mark.parametrize("requires_grad", [True, False])
def test_bias_is_cast_and_its_gradient_routed_back(cudnn, requires_grad):
    q, k, v = _qkv(dtype=torch.bfloat16)
    bias = torch.randn(1, H, 16, 16, dtype=torch.float32, requires_grad=requires_grad)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask")
    out = dpa(q, k, v, core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    out.float().sum().backward()
    ((_, fwd_pack),), ((bwd, _),) = cudnn.of("fwd"), cudnn.of("bwd")
    sent = pack_of(fwd_pack, "bias")
    assert sent.dtype == torch.bfloat16 and sent.is_contiguous() and torch.equal(sent, bias.detach().to(torch.bfloat16))
    assert (bwd.uid("dBias") is not None) is requires_grad
    if requires_grad:
        ref_bias = bias.detach().double().requires_grad_()
        _, (*_, want) = _unfused_grads(dpa, [q, k, v], [ref_bias], core_attention_bias_type="post_scale_bias",
                                       core_attention_bias=ref_bias)
        assert bias.grad.dtype == torch.float32 and rel_err(bias.grad, want) < 2e-2  # through bf16


def test_alibi_flag(cudnn):
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal")
    q, k, v = _qkv(dtype=torch.float64)
    out = dpa(q, k, v, core_attention_bias_type="alibi")
    ((fwd, pack),) = cudnn.of("fwd")
    assert fwd.alibi is True and pack_of(pack, "bias") is None
    want, _ = _unfused_grads(dpa, [q, k, v], core_attention_bias_type="alibi")
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)  # cuDNN's standard slopes


@pytest.mark.parametrize("sq,skv,bottom_right", [(16, 16, False), (8, 16, True)])
def test_bottom_right_band_runs_top_left_where_lengths_match(cudnn, sq, skv, bottom_right):
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal_bottom_right")
    q, k, v = _qkv(sq=sq, skv=skv, dtype=torch.float64)
    out = dpa(q, k, v)
    ((fwd, _),) = cudnn.of("fwd")
    assert fwd.window == (-1, 0) and fwd.bottom_right is bottom_right
    torch.testing.assert_close(out, _unfused_grads(dpa, [q, k, v])[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
def test_sink_logits_sent_and_their_gradient_routed_back(cudnn, softmax_type):
    q, k, v = _qkv(dtype=torch.float64)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", softmax_type=softmax_type)
    if softmax_type == "learnable":
        with torch.no_grad():
            dpa.softmax_offset.copy_(torch.arange(4, dtype=torch.float32).view(dpa.softmax_offset.shape))
    dpa(q, k, v).sum().backward()
    ((_, fwd_pack),), ((bwd, bwd_pack),) = cudnn.of("fwd"), cudnn.of("bwd")
    expected = torch.arange(4.0) if softmax_type == "learnable" else torch.zeros(4)
    sink = pack_of(fwd_pack, "sink")
    assert sink.dtype == torch.float32 and torch.equal(sink.view(-1), expected)
    assert pack_of(bwd_pack, "sink").data_ptr() == sink.data_ptr()
    assert (bwd.uid("dSink_token") is not None) is (softmax_type == "learnable")
    if softmax_type == "learnable":
        grad = dpa.softmax_offset.grad.clone()
        dpa.softmax_offset.grad = None
        _, (*_, want) = _unfused_grads(dpa, [q, k, v], [dpa.softmax_offset])
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-5)


def test_no_sink_for_vanilla_softmax(cudnn):
    DotProductAttention(H, D, qkv_format="bshd")(*_qkv()).sum().backward()
    ((_, pack),), ((bwd, _),) = cudnn.of("fwd"), cudnn.of("bwd")
    assert pack_of(pack, "sink") is None and bwd.uid("dSink_token") is None


def test_policy_calls_share_buffers_without_row_owners(cudnn, monkeypatch):
    """THD with two mask policies: two calls write into one output (one dQ/dK/dV), rows no
    sequence owns are zeroed after the calls (gaps and the tail: 0, not the NaN the buffers
    started with), no row owners are made, the sink's gradient is the sum of the calls'; the
    results equal the unfused backend's."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends import varlen

    monkeypatch.setattr(varlen, "_owners", lambda inp: pytest.fail("row owners made"))
    p = make_thd([5, 3, 6], gaps_q=[2, 0, 1], h=H, hg=H, d=D, tail=2)
    kwargs = dict(p.kwargs(True, 6, 6, shared=True), thd_sequence_is_causal=torch.tensor([True, False, True]))
    dpa = DotProductAttention(H, D, qkv_format="thd", softmax_type="learnable")
    out = dpa(p.q, p.k, p.v, **kwargs)
    out.sum().backward()
    fwds, bwds = cudnn.of("fwd"), cudnn.of("bwd")
    assert sorted(g.window for g, _ in fwds) == [(-1, -1), (-1, 0)] and len(bwds) == 2
    assert pack_of(fwds[0][1], "o") is pack_of(fwds[1][1], "o"), "the policies' calls share one output"
    assert all(pack_of(bwds[0][1], n) is pack_of(bwds[1][1], n) for n in ("dq", "dk", "dv")), "and one set of gradients"
    assert all(g.uid("dSink_token") is not None for g, _ in bwds)
    assert len({pack_of(pack, "sink").data_ptr() for _, pack in fwds + bwds}) == 1, "one sink tensor for every call"
    grads = [t.grad for t in (p.q, p.k, p.v)] + [dpa.softmax_offset.grad.clone()]
    dpa.softmax_offset.grad = None
    want_out, want = _unfused_grads(dpa, [p.q, p.k, p.v], [dpa.softmax_offset], **kwargs)
    torch.testing.assert_close(out, want_out.nan_to_num(), rtol=1e-10, atol=1e-10)
    for a, b, valid in zip(grads, want, (p.valid_q, p.valid_kv, p.valid_kv, None)):
        torch.testing.assert_close(a, b.nan_to_num(), rtol=1e-5, atol=1e-5)  # from float32 stats
        assert valid is None or torch.all(a[~valid] == 0)
    assert torch.all(out[~p.valid_q] == 0)


# ------------------------------------------------------------------ the graph cache


def test_cudnn_graph_cache_is_a_bounded_lru(monkeypatch):
    monkeypatch.setattr(graphs, "_graphs", type(graphs._graphs)())
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 3)
    built = []

    def build(key):
        return lambda: built.append(key) or ("graph", key)

    for key in "abc":
        assert graphs.cached(key, build(key)) == ("graph", key)
    assert graphs.cached("a", build("a")) == ("graph", "a")  # a hit: not rebuilt, now most recent
    graphs.cached("d", build("d"))  # evicts the least recently used: b
    assert built == ["a", "b", "c", "d"]
    assert list(graphs._graphs) == ["c", "a", "d"]
    graphs.cached("b", build("b"))  # rebuilt after eviction
    assert built[-1] == "b" and len(graphs._graphs) == 3


# ------------------------------------------------------------------ the declaration's probed rules

LIBS = InstalledLibraries(cudnn_frontend="1.32.0")


def _fused_reasons(**kw):
    kw["attn_mask_type"] = AttnMaskType(kw.get("attn_mask_type", "no_mask"))
    return [str(r) for r in backends.FusedAttention.not_supported_reasons(AttentionParams(**kw), LIBS)]


@pytest.mark.parametrize("layout", ["t3hd", "th3d"])
def test_cudnn_refuses_packed_q_thd_backward_but_runs_its_forward(layout):
    """te_matrix.log (H200): dQ ~80% off for t3hd/th3d through cuDNN's ragged backward."""
    base = dict(qkv_format="thd", qkv_layout=layout, attn_mask_type="padding_causal")
    assert any(f"qkv_layout={layout} with gradients" in r for r in _fused_reasons(**base, requires_grad=True))
    assert _fused_reasons(**base, requires_grad=False) == []
    assert _fused_reasons(**dict(base, qkv_layout="thd_t2hd"), requires_grad=True) == []


@pytest.mark.parametrize("mask,refused", [("causal", True), ("padding_causal", True), ("causal_bottom_right", False), ("no_mask", False)])
def test_cudnn_refuses_decode_shaped_top_left_causal_backward(mask, refused):
    """te_matrix.log (H200): sq=1, skv=512 top-left causal gave dQ/dK of ~1e24."""
    reasons = _fused_reasons(qkv_format="bshd", attn_mask_type=mask, max_seqlen_q=1, max_seqlen_kv=512, requires_grad=True)
    assert any("max_seqlen_q=1 < max_seqlen_kv" in r for r in reasons) == refused
    assert _fused_reasons(qkv_format="bshd", attn_mask_type=mask, max_seqlen_q=1, max_seqlen_kv=512, requires_grad=False) == []
    assert not any("max_seqlen_q=1" in r for r in _fused_reasons(qkv_format="bshd", attn_mask_type=mask, max_seqlen_q=256,
                                                                    max_seqlen_kv=512, requires_grad=True))


@pytest.mark.parametrize("mask", ["causal_bottom_right", "padding_causal_bottom_right"])
def test_bottom_right_with_more_queries_than_keys_needs_lengths(mask):
    """cudnn-frontend refuses a bottom-right causal band with s_q > s_kv unless per-sequence
    lengths come with it (H200, frontend 1.32): a dense call without a padding mask is refused by
    name; with one, THD, s_q <= s_kv, or top-left causal it is not."""
    base = AttentionParams(qkv_format="bshd", qkv_layout="bshd_bshd_bshd", attn_mask_type=AttnMaskType(mask),
                           window_size=(-1, 0), max_seqlen_q=192, max_seqlen_kv=128, head_dim_qk=64, head_dim_v=64)
    why = " ".join(map(str, get_attention_backend(base, LIBS).reasons_for("FusedAttention")))
    assert "max_seqlen_q=192 > max_seqlen_kv=128 and no padding mask" in why
    for ok in (replace(base, has_padding_mask=True), replace(base, max_seqlen_q=128),
               replace(base, attn_mask_type=AttnMaskType.CAUSAL),
               replace(base, qkv_format="thd", qkv_layout="thd_thd_thd")):
        assert "max_seqlen_kv" not in " ".join(map(str, get_attention_backend(ok, LIBS).reasons_for("FusedAttention")))
