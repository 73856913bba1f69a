"""Issue #12, case by case: TE's semantics where they were missing, and no input that crashes
or silently corrupts (the CPU checks always run; on CUDA bad metadata is bounded on the device
and NVTE_ATTN_VALIDATE=1 names it). Randomized packings and bad metadata are in
test_thd_properties.py; TE's configuration matrix is in test_te_matrix.py."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention

from .packing import make_thd
from .te_matrix import alibi_bias, allowed, attend64, standard_slopes

H, D = 4, 8


def _dense(b=2, sq=5, skv=5, h=H, d=D, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g, dtype=torch.float64).requires_grad_(grad) for s in (sq, skv, skv)]


def _reference_bshd(q, k, v, mask, bias=None, slopes=None):
    """[b, sq, h*d] float64, one batch entry at a time, with TE's ALiBi alignment."""
    outs = []
    for i in range(q.shape[0]):
        n, m = q.shape[1], k.shape[1]
        b = bias[0, 0] if bias is not None else None
        if slopes is not None:
            b = alibi_bias(n, m, mask, slopes)
        outs.append(attend64(q[i], k[i], v[i], allowed(n, m, mask, None), 1 / math.sqrt(q.shape[-1]), b))
    return torch.stack(outs).flatten(-2)


# ------------------------------------------------------------------------------ TE semantics


def test_bias_one_row_for_every_query_matches_reference_with_its_gradient():
    """core_attention_bias of shape [1, 1, 1, skv] (TE's "111s") adds one row to every query."""
    q, k, v = _dense(sq=6, skv=7)
    bias = torch.randn(1, 1, 1, 7, dtype=torch.float64, requires_grad=True)
    out = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask", attention_type="cross")(
        q, k, v, core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    want = _reference_bshd(*ref_in[:3], "no_mask", bias=ref_in[3].expand(1, 1, 6, 7))
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
    q, k, v = _dense(sq=sq, skv=skv)
    kw = {}
    if "padding" in mask:
        kw["attention_mask"] = (torch.zeros(2, 1, 1, sq, dtype=torch.bool), torch.zeros(2, 1, 1, skv, dtype=torch.bool))
    out = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type=mask, attention_type="cross")(
        q, k, v, core_attention_bias_type="alibi", **kw)
    want = _reference_bshd(q, k, v, mask, slopes=standard_slopes(H))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_alibi_top_left_differs_from_bottom_right_when_sq_exceeds_skv():
    """The two alignments give different numbers here, so the test above has teeth."""
    q, k, v = _dense(sq=7, skv=4, grad=False)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attention_type="cross")
    a = dpa(q, k, v, attn_mask_type="causal", core_attention_bias_type="alibi")
    b = dpa(q, k, v, attn_mask_type="causal_bottom_right", core_attention_bias_type="alibi")
    assert (a - b).abs().max() > 1e-3


def test_thd_ignores_attention_mask():
    """TE takes THD lengths from cu_seqlens; an attention_mask passed along is accepted and unused."""
    p = make_thd([3, 2], gaps_q=[1, 2], h=H, d=D)
    dpa = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal")
    kw = p.kwargs(True, 3, 3, shared=True)
    junk = torch.ones(2, 1, 1, 3, dtype=torch.bool)  # would mask everything if it were read
    # exact: equivalent arguments prepare the same call, so the same ops run on the same data
    torch.testing.assert_close(dpa(p.q, p.k, p.v, attention_mask=junk, **kw), dpa(p.q, p.k, p.v, **kw), rtol=0, atol=0)


@pytest.mark.parametrize("splits", [None, 0, 1, 2, 4])
def test_num_splits_is_accepted_and_does_not_change_results(splits):
    q, k, v = _dense(grad=False)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal")
    # exact: num_splits must not change the prepared call
    torch.testing.assert_close(dpa(q, k, v, num_splits=splits), dpa(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("bad", [-1, "2", 2.0, True])
def test_num_splits_bad_values_are_named(bad):
    q, k, v = _dense(grad=False)
    with pytest.raises(ValueError, match=r"num_splits must be None or a non-negative int .*; got " + repr(bad).replace(".", r"\.")):
        DotProductAttention(H, D, qkv_format="bshd")(q, k, v, num_splits=bad)


@pytest.mark.parametrize("mask", ["causal", "causal_bottom_right", "padding_causal", "padding_causal_bottom_right", "no_mask"])
@pytest.mark.parametrize("flag", [True, False])
def test_bottom_right_diagonal_does_not_override_the_mask_type(mask, flag):
    """As in TE, the mask type decides the causal diagonal (causal/padding_causal top-left,
    *_bottom_right bottom-right); the flag only aligns windows/ALiBi of non-causal masks."""
    q, k, v = _dense(sq=4, skv=7, grad=False)
    kw = {}
    if "padding" in mask:
        kw["attention_mask"] = (torch.tensor([[False] * 4, [False] * 3 + [True]]).view(2, 1, 1, 4),
                                torch.tensor([[False] * 7, [False] * 5 + [True] * 2]).view(2, 1, 1, 7))
    dpa = DotProductAttention(H, D, qkv_format="bshd", attention_type="cross")
    got = dpa(q, k, v, attn_mask_type=mask, bottom_right_diagonal=flag, **kw)
    # exact: the flag must not change the prepared call
    torch.testing.assert_close(got, dpa(q, k, v, attn_mask_type=mask, **kw), rtol=0, atol=0)


def test_bottom_right_diagonal_false_refuses_top_left_windows_on_non_causal_masks():
    q, k, v = _dense(sq=4, skv=7, grad=False)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask", attention_type="cross")
    with pytest.raises(NotImplementedError, match="bottom_right_diagonal=False with attn_mask_type='no_mask'"):
        dpa(q, k, v, window_size=(2, 2), bottom_right_diagonal=False)
    dpa(q, k, v, window_size=(2, 2), bottom_right_diagonal=True)  # the default alignment


def test_bottom_right_diagonal_must_be_a_bool():
    q, k, v = _dense(grad=False)
    with pytest.raises(TypeError, match=r"bottom_right_diagonal must be None, True or False; got 1"):
        DotProductAttention(H, D, qkv_format="bshd")(q, k, v, bottom_right_diagonal=1)


# ------------------------------------------------------------------------------ window normalization


def test_causal_window_reaching_right_is_cut_with_a_warning():
    q, k, v = _dense(sq=9, skv=9, grad=False)
    with pytest.warns(UserWarning, match=r"window_size=\(4, 4\) reaches right of the diagonal.*using \(4, 0\)"):
        dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", window_size=(4, 4))
    with pytest.warns(UserWarning, match=r"using \(4, 0\)"):
        got = dpa(q, k, v)
    want = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", window_size=(4, 0))(q, k, v)
    # exact: the normalized window must prepare the same call
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_minus_one_zero_window_without_causal_mask_means_no_window():
    q, k, v = _dense(sq=6, skv=6, grad=False)
    mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    with pytest.warns(UserWarning, match=r"window_size=\(-1, 0\) with attn_mask_type='padding' means no window.*using \(-1, -1\)"):
        got = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding", window_size=(-1, 0))(q, k, v, attention_mask=mask)
    want = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding")(q, k, v, attention_mask=mask)
    # exact: the normalized window must prepare the same call
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (got - DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal")(q, k, v)).abs().max() > 1e-6


def test_unbounded_left_with_right_reach_on_causal_is_an_error():
    with pytest.raises(ValueError, match=r"window_size=\(-1, 4\) does not fit attn_mask_type='causal'"):
        DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", window_size=(-1, 4))
    q, k, v = _dense(grad=False)
    with pytest.raises(ValueError, match=r"window_size=\(-1, 4\) does not fit attn_mask_type='causal'"):
        DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask")(q, k, v, attn_mask_type="causal", window_size=(-1, 4))


def test_float_window_is_rejected_even_on_the_fast_path():
    """A call with (2, 0) fills the module's fast-path cache; (2.0, 0) equals it as a dict key
    but must still be rejected by name."""
    q, k, v = _dense(grad=False)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal")
    dpa(q, k, v, window_size=(2, 0))
    dpa(q, k, v, window_size=(2, 0))
    with pytest.raises(TypeError, match=r"window_size"):
        dpa(q, k, v, window_size=(2.0, 0))


@pytest.mark.parametrize("scale", ["0.1", math.inf, -math.inf, math.nan, True])
def test_softmax_scale_must_be_a_finite_number(scale):
    with pytest.raises(ValueError, match=r"softmax_scale must be a finite float \(or None for 1/sqrt\(head_dim\)\); got " + repr(scale)[:3]):
        DotProductAttention(H, D, softmax_scale=scale)


# ------------------------------------------------------------------------------ bad input, named


@pytest.mark.parametrize("cu,msg", [
    ([0, 7, 9], r"cu_seqlens_q must give each sequence a length in \[0, 5\] \(the padded length\); got lengths \[7, 2\]"),
    ([0, 3, 1], r"cu_seqlens_q must give each sequence a length in \[0, 5\] \(the padded length\); got lengths \[3, -2\]"),
])
def test_dense_cu_seqlens_outside_the_padded_length_are_rejected(cu, msg):
    q, k, v = _dense(grad=False)
    good = torch.tensor([0, 5, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=msg):
        DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding")(
            q, k, v, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), cu_seqlens_kv=good)


def test_thd_sequence_is_causal_errors_name_it():
    p = make_thd([3, 2], h=H, d=D)
    with pytest.raises(ValueError, match=r"thd_sequence_is_causal"):
        DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")(
            p.q, p.k, p.v, **p.kwargs(False, 3, 3), window_size=(-1, 4), thd_sequence_is_causal=torch.tensor([True, False]))


@pytest.mark.parametrize("gather", ["0", "1"])
def test_zero_row_inputs_with_sequences(monkeypatch, gather):
    """q/kv with no rows but sequences of length 0 give an empty output (the gathered path,
    the one CUDA uses, crashed)."""
    monkeypatch.setenv("NVTE_UNFUSED_THD_GATHER", gather)
    q, k, v = (torch.zeros(0, H, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cu = torch.zeros(3, dtype=torch.int32)
    out = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                                               max_seqlen_q=0, max_seqlen_kv=0)
    assert out.shape == (0, H * D)
    out.sum().backward()
    assert q.grad.shape == (0, H, D)


# ------------------------------------------------------------------------------ cuDNN graph cache


def test_cudnn_graph_cache_is_a_bounded_lru(monkeypatch):
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import graphs  # where the cache lives

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


# ------------------------------------------------------------------------------ CUDA: bounded, then named

BAD_CUDA = {
    # what is wrong -> (kwargs changes, the argument the validation error names)
    "past_end": (dict(cu_seqlens_q_padded=[0, 45, 900]), "cu_seqlens_q_padded must end within"),
    "decreasing": (dict(cu_seqlens_kv=[0, 60, 30]), "cu_seqlens_kv must be non-decreasing"),
    "short_slot": (dict(cu_seqlens_q_padded=[0, 10, 110]), "cu_seqlens_q_padded slots must each hold their sequence"),
    "max_seqlen": (dict(max_seqlen_q=8), "max_seqlen for cu_seqlens_q must be at least"),
}


def _cuda_batch():
    p = make_thd([40, 60], gaps_q=[5, 7], h=H, d=64, dtype=torch.bfloat16, device="cuda")
    kw = dict(cu_seqlens_q=p.cu_q, cu_seqlens_kv=p.cu_q.clone(), cu_seqlens_q_padded=p.off_q, cu_seqlens_kv_padded=p.off_q.clone(),
              max_seqlen_q=60, max_seqlen_kv=60)
    return p, kw


def _apply(kw, changes):
    kw = dict(kw)
    for name, value in changes.items():
        kw[name] = torch.tensor(value, dtype=torch.int32, device="cuda") if isinstance(value, list) else value
    return kw


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["default", "FusedAttention", "FlashAttention v4", "unfused"])
@pytest.mark.parametrize("what", list(BAD_CUDA))
def test_cuda_bad_metadata_is_bounded_then_named(monkeypatch, backend, what):
    from .gpu_helpers import GPU_BACKENDS

    if backend == "unfused":
        monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
        monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    elif backend != "default":
        for k, val in dict(GPU_BACKENDS[backend], NVTE_UNFUSED_ATTN="0").items():
            monkeypatch.setenv(k, val)
    monkeypatch.delenv("NVTE_ATTN_VALIDATE", raising=False)
    p, kw = _cuda_batch()
    bad = _apply(kw, BAD_CUDA[what][0])
    dpa = DotProductAttention(H, 64, qkv_format="thd", attn_mask_type="padding")
    out = dpa(p.q, p.k, p.v, **bad)  # every backend runs this batch: a refusal is a failure
    if backend != "default":
        assert dpa.last_selection.label == ("UnfusedDotProductAttention" if backend == "unfused" else backend)
    out.float().sum().backward()
    torch.cuda.synchronize()  # an out-of-bounds access would surface here
    # Bounded, not right: clamped metadata may still point at in-tensor gap rows (NaN in this
    # batch) or leave rows past a too-small max_seqlen unwritten, so values are not checked.
    assert out.shape == (p.q.shape[0], H * 64)
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (p.q, p.k, p.v))
    healthy = dpa(p.q, p.k, p.v, **kw)  # the context still works
    torch.cuda.synchronize()
    assert torch.isfinite(healthy).all()
    monkeypatch.setenv("NVTE_ATTN_VALIDATE", "1")
    with pytest.raises(ValueError, match=BAD_CUDA[what][1]):
        dpa(p.q, p.k, p.v, **bad)


@pytest.mark.gpu
def test_cuda_cu_seqlens_on_another_device_is_named():
    p, kw = _cuda_batch()
    kw["cu_seqlens_kv"] = kw["cu_seqlens_kv"].cpu()
    with pytest.raises(ValueError, match=r"cu_seqlens_kv must be on the inputs' device cuda:0; got cpu"):
        DotProductAttention(H, 64, qkv_format="thd", attn_mask_type="padding")(p.q, p.k, p.v, **kw)


# ------------------------------------------------------------------------ probed declarations

def _fused_reasons(**kw):
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import FusedAttention
    from transformer_engine.pytorch.attention.dot_product_attention.selection.libraries import InstalledLibraries
    from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType
    from transformer_engine.pytorch.attention.dot_product_attention.selection.params import AttentionParams

    kw["attn_mask_type"] = AttnMaskType(kw.get("attn_mask_type", "no_mask"))
    libs = InstalledLibraries(cudnn_frontend="1.32.0")
    return [str(r) for r in FusedAttention.not_supported_reasons(AttentionParams(**kw), libs)]


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


# ------------------------------------------------------------------------ review follow-ups

def test_bounded_kv_lengths_follow_the_kv_slots_when_cu_seqlens_are_shared():
    """One cu_seqlens for both sides but different padded offsets: after bounding, the kernels'
    kv lengths must be capped by the kv slots, not reuse the query's (an over-read of kv)."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends.varlen import _valid_lengths
    from transformer_engine.pytorch.attention.dot_product_attention.prepare.packed_seqs import PackedSeqs, made_safe

    cu = torch.tensor([0, 4, 14], dtype=torch.int32)
    pq = PackedSeqs(cu, torch.tensor([0, 4, 20], dtype=torch.int32), 10, 20)
    pk = PackedSeqs(cu, torch.tensor([0, 10, 14], dtype=torch.int32), 10, 14)
    sq, sk = made_safe(pq, pk)
    len_q, len_kv = _valid_lengths(sq, sk)
    assert len_q.tolist() == [4, 10]
    assert len_kv.tolist() == [4, 4]  # the second kv slot holds 4 rows: [10, 14)
    assert int((sk.offsets[:-1] + len_kv).max()) <= sk.total_tokens


def test_unclaimed_sequence_attends_nothing_on_the_gathered_unfused_path(monkeypatch):
    """An id the policies miss (unchecked on CUDA) leaves its sequence with no policy: the
    gathered path must give it 0 (the kernels run it in no call), not the last policy's mask."""
    from transformer_engine.pytorch.attention.dot_product_attention.prepare import packed_seqs as thd

    monkeypatch.setenv("NVTE_UNFUSED_THD_GATHER", "1")
    monkeypatch.setattr(thd, "value_checks_on", lambda device: False)  # as on CUDA without NVTE_ATTN_VALIDATE
    from transformer_engine.pytorch.attention.dot_product_attention.prepare import policies as per_seq_policy

    monkeypatch.setattr(per_seq_policy, "value_checks_on", lambda device: False)
    p = make_thd([3, 4, 2], h=H, d=D)
    dpa = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")
    ids = {"padding": torch.tensor([0, 7]), "padding_causal": torch.tensor([2])}  # 7 is out of range; 1 unclaimed
    out = dpa(p.q, p.k, p.v, **p.kwargs(False, 4, 4, shared=True), attn_mask_type_per_seq=ids)
    assert torch.all(out[3:7] == 0) and torch.isfinite(out).all()


def test_multihead_thd_rotary_without_cu_seqlens_is_named():
    from transformer_engine.pytorch import MultiheadAttention

    mha = MultiheadAttention(32, 4, qkv_format="thd", attn_mask_type="padding")
    with pytest.raises(ValueError, match="qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv"):
        mha(torch.randn(10, 32), rotary_pos_emb=torch.randn(16, 1, 1, 8))


def test_sq_equals_skv_is_one_fact_for_selection_and_the_cudnn_runner(monkeypatch):
    """One cu_seqlens tensor for both sides means sq == skv for every sequence, whatever the
    padded offsets: selection (shared_cu_seqlens) and the cuDNN runner read the same property
    (before, selection also required the same offsets and refused what the runner would run)."""
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa_module

    seen = {}
    real = dpa_module.selection_params

    def spy(module, inp, fmt, layout):
        params = real(module, inp, fmt, layout)
        seen["params"], seen["inp"] = params, inp
        return params

    monkeypatch.setattr(dpa_module, "selection_params", spy)
    p = make_thd([3, 4], gaps_q=[1, 2], h=H, d=D)
    kw = dict(cu_seqlens_q=p.cu_q, cu_seqlens_kv=p.cu_q, cu_seqlens_q_padded=p.off_q,
              cu_seqlens_kv_padded=p.off_q.clone(), max_seqlen_q=4, max_seqlen_kv=4)
    DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal")(p.q, p.k, p.v, **kw)
    assert seen["params"].shared_cu_seqlens and seen["params"].same_lengths and seen["inp"].same_lengths
    kw["cu_seqlens_kv"] = p.cu_q.clone()  # equal values, another tensor: not known without reading them
    DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal")(p.q, p.k, p.v, **kw)
    assert not seen["params"].shared_cu_seqlens and not seen["inp"].same_lengths


def test_rotary_table_shorter_than_a_sequence_is_named():
    """MultiheadAttention's THD rotary positions index rotary_pos_emb: a table shorter than the
    longest sequence is named on the CPU (on CUDA it is clamped, never an out-of-range index)."""
    from transformer_engine.pytorch import MultiheadAttention

    mha = MultiheadAttention(32, 4, qkv_format="thd", attn_mask_type="padding")
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    with pytest.raises(ValueError, match="rotary_pos_emb must hold a row for every position: a sequence reaches position 5"):
        mha(torch.randn(10, 32), rotary_pos_emb=torch.randn(4, 1, 1, 8), **kw)
    assert mha(torch.randn(10, 32), rotary_pos_emb=torch.randn(6, 1, 1, 8), **kw).shape == (10, 32)
