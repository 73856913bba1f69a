"""The FlashAttention library adapters (flash-attn 2, FA3, flash-attn-4) on the CPU, against
the library stand-ins (``stand_ins/``: every call bound to the library's real signature, so an
unknown keyword, a missing argument or an extra positional one fails; computed in float64 with
the library's semantics: bottom-right causal, (left, right) windows with -1 unbounded, ALiBi,
``seqused`` lengths, rows a varlen call skips left unwritten). Results and gradients must equal
the unfused backend's; the arguments each library receives are checked by name. Also TE's
``num_splits`` hint: who takes it, who ignores it."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention.backends import fa4

from .gpu_helpers import grads_of
from .packing import make_thd

H, HG, D = 4, 2, 8
SCALE = 0.3


def _parity(dpa, inputs, kwargs, force):
    """Outputs and gradients of ``force`` against the unfused backend (the same module: the
    scope is part of the fast path's key); returns the forced output."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    ref = dpa(*leaves, **kwargs)
    g = torch.randn_like(ref).nan_to_num()
    want = grads_of(ref, leaves, g)
    with backend_scope(force=force):
        out = dpa(*inputs, **kwargs)
    assert dpa.last_selection.name == {"fa2": "FlashAttention", "fa3": "FlashAttention", "fa4": "FlashAttention"}[force]
    got = grads_of(out, inputs, g)
    torch.testing.assert_close(out, ref, equal_nan=False)
    tol = 1e-5 if force == "fa4" else None  # FA4's backward works from its float32 LSE
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    return out


def _dense_inputs(fmt, sq, skv):
    shape = (lambda s, h: (2, s, h, D)) if fmt == "bshd" else (lambda s, h: (s, 2, h, D))
    return [torch.randn(shape(s, h), dtype=torch.float64, requires_grad=True) for s, h in ((sq, H), (skv, HG), (skv, HG))]


# ------------------------------------------------------------------ FA3 (flash_attn_interface)

DENSE_CASES = [
    # (format, mask, sq, skv, window, the (causal, window_size) FlashAttention must receive)
    ("bshd", "no_mask", 6, 6, None, (False, (-1, -1))),
    ("bshd", "causal", 6, 6, None, (True, (-1, -1))),
    ("sbhd", "causal_bottom_right", 4, 7, None, (True, (-1, -1))),
    ("bshd", "no_mask", 5, 5, (2, 1), (False, (2, 1))),
    ("bshd", "causal_bottom_right", 4, 7, (2, 0), (False, (2, 0))),
]


@pytest.mark.parametrize("fmt,mask,sq,skv,window,sent", DENSE_CASES)
def test_fa3_dense(fa3_lib, fmt, mask, sq, skv, window, sent):
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format=fmt, attn_mask_type=mask, window_size=window,
                              softmax_scale=SCALE)
    # The stand-in takes [B, S, H, D]; sbhd reaches the library transposed, as FA3 needs.
    _parity(dpa, _dense_inputs(fmt, sq, skv), {}, "fa3")
    (call,) = fa3_lib.dense.calls
    assert (call["causal"], tuple(call["window_size"])) == sent
    assert call["softmax_scale"] == SCALE and call["deterministic"] is False
    assert call["_positional"] == 3 and call["_keywords"] == {"softmax_scale", "causal", "window_size", "deterministic"}
    assert tuple(call["q"].shape) == (2, sq, H, D)


@pytest.mark.parametrize("case", ["plain", "gaps", "per-seq-gaps"])
def test_fa3_varlen_sends_offsets_and_seqused_by_keyword(fa3_lib, case):
    """FA3's positional head (q, k, v, cu_seqlens_q/k, max_seqlen_q/k), then keywords: physical
    offsets as cu_seqlens and valid lengths as seqused where there are gaps; one call per
    per-sequence policy, each with the other policy's sequences at length 0."""
    gaps = [2, 0, 3, 1] if case != "plain" else None
    p = make_thd([5, 3, 7, 4], gaps_q=gaps, h=H, hg=HG, d=D, tail=2)
    if case == "plain":  # FA3 reads whole tiles: without declared gaps the tail must be finite
        p.fill_outside(3.0)
    kwargs = p.kwargs(gaps is not None, 7, 7, shared=True)
    if case == "per-seq-gaps":
        kwargs["attn_mask_type_per_seq"] = {"padding_causal": torch.tensor([0, 2]), ("padding", (2, 1)): torch.tensor([1, 3])}
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal", softmax_scale=SCALE)
    out = _parity(dpa, [p.q, p.k, p.v], kwargs, "fa3")
    assert torch.all(out[~p.valid_q] == 0)
    calls = fa3_lib.varlen.calls
    for call in calls:
        assert call["_positional"] == 7 and (call["max_seqlen_q"], call["max_seqlen_k"]) == (7, 7)
        assert call["_keywords"] == {"seqused_q", "seqused_k", "softmax_scale", "causal", "window_size", "deterministic"}
    if case == "plain":
        (call,) = calls
        assert call["seqused_q"] is None and call["causal"] and torch.equal(call["cu_seqlens_q"], p.cu_q)
        return
    assert all(torch.equal(c["cu_seqlens_q"], p.off_q) and torch.equal(c["cu_seqlens_k"], p.off_q) for c in calls)
    if case == "gaps":
        (call,) = calls
        assert call["seqused_q"].tolist() == [5, 3, 7, 4] and call["seqused_k"].tolist() == [5, 3, 7, 4] and call["causal"]
    else:
        assert [(c["causal"], tuple(c["window_size"])) for c in calls] == [(True, (-1, -1)), (False, (2, 1))]
        assert calls[0]["seqused_q"].tolist() == [5, 0, 7, 0] and calls[1]["seqused_q"].tolist() == [0, 3, 0, 4]


# ------------------------------------------------------------------ flash-attn 2 (flash_attn)


@pytest.mark.parametrize("fmt,mask,sq,skv,window,sent,alibi",
                         [case + (False,) for case in DENSE_CASES] + [case + (True,) for case in DENSE_CASES if case[4] is None])
def test_fa2_dense(fa2_lib, fmt, mask, sq, skv, window, sent, alibi):
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format=fmt, attn_mask_type=mask, window_size=window,
                              softmax_scale=SCALE)
    kwargs = dict(core_attention_bias_type="alibi") if alibi else {}
    _parity(dpa, _dense_inputs(fmt, sq, skv), kwargs, "fa2")
    (call,) = fa2_lib.dense.calls
    assert (call["causal"], tuple(call["window_size"])) == sent
    assert call["softmax_scale"] == SCALE and call["dropout_p"] == 0.0 and call["deterministic"] is False
    assert call["_positional"] == 3
    assert call["_keywords"] == {"dropout_p", "softmax_scale", "causal", "window_size", "alibi_slopes", "deterministic"}
    if alibi:  # the standard slopes for 4 heads: 2^(-8 (i + 1) / 4), as float32
        assert call["alibi_slopes"].dtype == torch.float32
        assert call["alibi_slopes"].tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
    else:
        assert call["alibi_slopes"] is None


@pytest.mark.parametrize("mask,window,lengths_kv,sent", [
    ("padding_causal", None, None, (True, (-1, -1))),
    ("padding", (2, 1), None, (False, (2, 1))),
    ("padding_causal_bottom_right", None, [6, 4, 9], (True, (-1, -1))),
])
def test_fa2_varlen(fa2_lib, mask, window, lengths_kv, sent):
    p = make_thd([5, 3, 7], lengths_kv, h=H, hg=HG, d=D, tail=3)  # no gaps: flash-attn 2 has no seqused
    p.fill_outside(5.0)  # finite garbage in the tail: nothing may read it into a sequence, its rows come out 0
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type=mask, window_size=window,
                              softmax_scale=SCALE)
    max_kv = max(lengths_kv or [5, 3, 7])
    out = _parity(dpa, [p.q, p.k, p.v], p.kwargs(False, 7, max_kv, shared=lengths_kv is None), "fa2")
    assert torch.all(out[~p.valid_q] == 0)  # the library leaves the tail unwritten (NaN in the stand-in)
    (call,) = fa2_lib.varlen.calls
    assert call["_positional"] == 7
    assert (call["causal"], tuple(call["window_size"])) == sent
    assert torch.equal(call["cu_seqlens_q"], p.cu_q) and torch.equal(call["cu_seqlens_k"], p.cu_q if lengths_kv is None else p.cu_kv)
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (7, max_kv)


def test_fa2_dropout_probability_follows_the_training_flag(fa2_lib):
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, attention_dropout=0.25)
    q, k, v = _dense_inputs("bshd", 4, 4)
    with backend_scope(force="fa2"):
        dpa.eval()
        dpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        dpa.train()
        dpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    assert [c["dropout_p"] for c in fa2_lib.dense.calls] == [0.0, 0.25]


# ------------------------------------------------------------------ flash-attn-4 (flash_attn.cute)


@pytest.mark.parametrize("mask,window,sent", [("padding_causal", None, (True, None, None)),
                                              ("padding", (3, 1), (False, 3, 1))])
def test_fa4_library_calls_by_keyword(fa4_lib, mask, window, sent):
    p = make_thd([5, 3, 7], gaps_q=[2, 0, 3], h=H, hg=HG, d=D, tail=2)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type=mask, window_size=window,
                              softmax_scale=SCALE)
    out = _parity(dpa, [p.q, p.k, p.v], p.kwargs(True, 7, 7, shared=True), "fa4")
    assert torch.all(out[~p.valid_q] == 0)
    (fwd,), (bwd,) = fa4_lib.of("fwd"), fa4_lib.of("bwd")
    for kw in (fwd, bwd):
        assert (kw["causal"], kw["window_size_left"], kw["window_size_right"]) == sent
        assert torch.equal(kw["cu_seqlens_q"], p.off_q) and kw["seqused_q"].tolist() == [5, 3, 7]
        assert (kw["max_seqlen_q"], kw["max_seqlen_k"], kw["softmax_scale"]) == (7, 7, SCALE)
        assert "learnable_sink" not in kw
    assert bwd["softcap"] == 0.0 and bwd["deterministic"] is torch.are_deterministic_algorithms_enabled()
    # One policy, eager: FA4 is handed no output or LSE buffer (it allocates them) and asked for the
    # LSE, which reaches the backward as FA4 made it ([H, T]).
    assert fwd["return_lse"] is True and fwd["out"] is None and fwd["lse"] is None and out.shape == (p.q.shape[0], H * D)
    assert bwd["lse"].shape == (H, p.q.shape[0]) and bwd["dq"] is None


def test_fa4_dense_call_passes_no_max_seqlen(fa4_lib):
    """Dense calls: FA4 reads lengths from the shapes, so max_seqlen_q/k are None."""
    q, k, v = (torch.zeros(2, 6, H, D) for _ in range(3))
    out, lse = torch.empty_like(q), None
    sink = torch.zeros(H)
    fa4.fa4_fwd(q, k, v, out, lse, None, None, None, None, 6, 6, SCALE, True, -1, -1, sink)
    (kw,) = fa4_lib.of("fwd")
    assert kw["max_seqlen_q"] is None and kw["max_seqlen_k"] is None and kw["cu_seqlens_q"] is None
    assert kw["return_lse"] is False and kw["learnable_sink"] is sink and kw["out"] is out


# ------------------------------------------------------------------ num_splits (TE's split-KV hint)


@pytest.mark.parametrize("splits", [None, 0, 1, 2, 4])
def test_num_splits_is_accepted_and_ignored_by_the_unfused_backend(splits):
    q, k, v = _dense_inputs("bshd", 5, 5)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="bshd", attn_mask_type="causal")
    # Bit-exact: the hint is not read, so both calls run the same arithmetic.
    torch.testing.assert_close(dpa(q, k, v, num_splits=splits), dpa(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("splits", [0, 1, 3])
def test_fa3_takes_num_splits_dense_and_varlen(fa3_lib, splits):
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="bshd", attn_mask_type="causal", softmax_scale=SCALE)
    _parity(dpa, _dense_inputs("bshd", 5, 5), dict(num_splits=splits), "fa3")
    p = make_thd([5, 3, 7], gaps_q=[2, 0, 3], h=H, hg=HG, d=D, tail=2)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal", softmax_scale=SCALE)
    _parity(dpa, [p.q, p.k, p.v], dict(p.kwargs(True, 7, 7, shared=True), num_splits=splits), "fa3")
    for call in fa3_lib.dense.calls + fa3_lib.varlen.calls:
        assert "num_splits" in call["_keywords"] and call["num_splits"] == splits


def test_fa4_takes_num_splits_in_the_forward_only(fa4_lib):
    p = make_thd([5, 3, 7], gaps_q=[2, 0, 3], h=H, hg=HG, d=D, tail=2)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal", softmax_scale=SCALE)
    _parity(dpa, [p.q, p.k, p.v], dict(p.kwargs(True, 7, 7, shared=True), num_splits=4), "fa4")
    (fwd,), (bwd,) = fa4_lib.of("fwd"), fa4_lib.of("bwd")
    assert fwd["num_splits"] == 4 and "num_splits" not in bwd  # split-KV is a forward feature


def test_num_splits_is_a_per_call_value_on_the_fast_path(fa4_lib):
    """Two calls with the same host facts share the fast path's cached recipe; each still sends
    its own num_splits (a per-call field of the prepared record), and a call without sends none."""
    p = make_thd([5, 3, 7], h=H, hg=HG, d=D)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal", softmax_scale=SCALE)
    with backend_scope(force="fa4"), torch.no_grad():
        for splits in (2, 5, None):
            dpa(p.q, p.k, p.v, **p.kwargs(False, 7, 7, shared=True), num_splits=splits)
    assert len(dpa._recipes) == 1, "one recipe: num_splits is not part of the fast path's key"
    assert [kw.get("num_splits") for kw in fa4_lib.of("fwd")] == [2, 5, None]


@pytest.mark.parametrize("cc,passed", [((9, 0), False), ((10, 0), True)])
def test_fa4_drops_num_splits_where_it_has_no_split_kv(monkeypatch, cc, passed):
    """flash-attn-4 4.0.0b36 asserts "SplitKV not supported on SM 9.0" (and its heuristic,
    num_splits=0, may split there too): on sm9x the hint is dropped, on sm10x passed."""
    monkeypatch.setattr(fa4, "compute_capability", lambda index: cc)
    assert fa4._split_hint(torch.device("cuda", 0)) is passed
    assert fa4.FlashAttentionV4.NUM_SPLITS_MAJORS == frozenset({10})


def test_the_declarations_say_who_honours_num_splits():
    from transformer_engine.pytorch.attention.dot_product_attention.backends import BACKENDS, backend_label

    rows = {backend_label(b): b.matrix_row()["num_splits"] for b in BACKENDS}
    assert rows == {"FlashAttention v4": "sm10x", "FlashAttention v3": "sm9x", "FusedAttention": "ignored",
                    "FlashAttention v2": "ignored", "UnfusedDotProductAttention": "ignored"}
