"""The library adapters on the CPU, against stand-in modules that bind every call to the
library's real signature (an unknown keyword, a missing argument or an extra positional one
fails) and compute it in float64 with the library's documented semantics: bottom-right causal,
(left, right) windows with -1 unbounded, ALiBi as -slope * |i + skv - sq - j|, ``seqused``
lengths, rows a varlen call skips left unwritten (NaN here). Results and gradients must equal
the unfused backend's.

Signatures (facts): flash-attn 2.x ``flash_attn_func``/``flash_attn_varlen_func``; FA3 (hopper
``flash_attn_interface``) ``flash_attn_func``/``flash_attn_varlen_func``; flash-attn-4
4.0.0b36's private ``_flash_attn_fwd``/``_flash_attn_bwd`` (called by keyword only)."""

from __future__ import annotations

import inspect
import sys
import types
from dataclasses import dataclass, field
from typing import Callable, List

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention.backends import fa4

from .gpu_helpers import grads_of
from .packing import make_thd
from .reference import allowed_matrix, attend_one
from .test_gap_rows import fake_fa4_bwd, fake_fa4_fwd

H, HG, D = 4, 2, 8
SCALE = 0.3


# ------------------------------------------------------------------ the libraries' signatures


def fa2_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
             alibi_slopes=None, deterministic=False, return_attn_probs=False): ...


def fa2_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, block_table=None): ...


def fa3_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
             window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
             sm_margin=0, return_attn_probs=False): ...


def fa3_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
                    softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
                    window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, sm_margin=0, return_attn_probs=False): ...


FA4_FWD_KEYWORDS = {  # flash-attn-4 4.0.0b36, flash_attn/cute/interface.py: _flash_attn_fwd
    "q", "k", "v", "qv", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k",
    "min_seqlen_k", "page_table", "softmax_scale", "causal", "softcap", "window_size_left", "window_size_right",
    "learnable_sink", "tile_mn", "mma_pv_is_rs", "intra_wg_overlap", "num_threads", "num_splits", "pack_gqa", "_arch",
    "score_mod", "mask_mod", "block_sparse_tensors", "return_lse", "out", "lse", "aux_tensors", "aux_scalars",
    "q_descale", "k_descale", "v_descale", "gather_kv_indices", "scheduler_metadata", "seqlen_k_per_split",
    "disable_scheduler_metadata", "gather_bwd_recompute_p"}
FA4_BWD_KEYWORDS = {  # ... and _flash_attn_bwd
    "q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "softcap", "window_size_left", "window_size_right",
    "m_block_size", "n_block_size", "num_threads", "pack_gqa", "num_stages_Q", "num_stages_dO", "SdP_swapAB",
    "dKV_swapAB", "dQ_swapAB", "AtomLayoutMSdP", "AtomLayoutNdKV", "AtomLayoutMdQ", "V_in_regs", "cu_seqlens_q",
    "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k", "deterministic", "dq", "dk", "dv",
    "score_mod", "score_mod_bwd", "mask_mod", "aux_tensors", "aux_scalars", "block_sparse_tensors", "dlse",
    "learnable_sink"}


@dataclass
class Library:
    """One stand-in library function: each call is bound to ``signature``'s parameters and
    recorded (all arguments by name, and which were passed by keyword), then computed."""

    signature: Callable
    compute: Callable
    calls: List[dict] = field(default_factory=list)

    def __call__(self, *args, **kwargs):
        bound = inspect.signature(self.signature).bind(*args, **kwargs)
        bound.apply_defaults()
        self.calls.append(dict(bound.arguments, _keywords=set(kwargs), _positional=len(args)))
        return self.compute(**bound.arguments)


# ------------------------------------------------------------------ the emulations (float64)


def _allowed(n, m, causal, window):
    window = None if tuple(window) == (-1, -1) else tuple(window)
    return allowed_matrix(n, m, "padding_causal_bottom_right" if causal else "padding", window)


def _alibi_bias(slopes, n, m):
    i, j = torch.arange(n).view(-1, 1), torch.arange(m).view(1, -1)
    return -slopes.double().view(-1, 1, 1) * (i + m - n - j).abs().double()


def _one(q, k, v, causal, window, scale, slopes=None):
    n, m = q.shape[0], k.shape[0]
    bias = None if slopes is None else _alibi_bias(slopes, n, m)
    return attend_one(q, k, v, _allowed(n, m, causal, window), scale, bias)


def dense_compute(q, k, v, softmax_scale, causal, window_size, alibi_slopes=None, **_):
    return torch.stack([_one(q[b], k[b], v[b], causal, window_size, softmax_scale, alibi_slopes)
                        for b in range(q.shape[0])]).to(q.dtype)


def varlen_compute(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, seqused_q=None,
                   seqused_k=None, alibi_slopes=None, **_):
    parts, cursor = [], 0
    for b in range(cu_seqlens_q.numel() - 1):
        start, kv_start = int(cu_seqlens_q[b]), int(cu_seqlens_k[b])
        n = int(seqused_q[b]) if seqused_q is not None else int(cu_seqlens_q[b + 1]) - start
        m = int(seqused_k[b]) if seqused_k is not None else int(cu_seqlens_k[b + 1]) - kv_start
        parts.append(torch.full((start - cursor, H, v.shape[-1]), float("nan"), dtype=torch.float64))  # unwritten
        cursor = start + n
        if n:
            parts.append(_one(q[start:cursor], k[kv_start:kv_start + m], v[kv_start:kv_start + m], causal, window_size,
                              softmax_scale, alibi_slopes))
    parts.append(torch.full((q.shape[0] - cursor, H, v.shape[-1]), float("nan"), dtype=torch.float64))
    return torch.cat(parts).to(q.dtype)


def _install(monkeypatch, name, **functions):
    module = types.ModuleType(name)
    for attr, fn in functions.items():
        setattr(module, attr, fn)
    monkeypatch.setitem(sys.modules, name, module)
    return module


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
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
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
def test_fa3_dense(monkeypatch, fmt, mask, sq, skv, window, sent):
    lib = Library(fa3_func, dense_compute)
    _install(monkeypatch, "flash_attn_interface", flash_attn_func=lib)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format=fmt, attn_mask_type=mask, window_size=window,
                              softmax_scale=SCALE)
    # The stand-in takes [B, S, H, D]; sbhd reaches the library transposed, as FA3 needs.
    _parity(dpa, _dense_inputs(fmt, sq, skv), {}, "fa3")
    (call,) = lib.calls
    assert (call["causal"], tuple(call["window_size"])) == sent
    assert call["softmax_scale"] == SCALE and call["deterministic"] is False
    assert call["_positional"] == 3 and call["_keywords"] == {"softmax_scale", "causal", "window_size", "deterministic"}
    assert tuple(call["q"].shape) == (2, sq, H, D)


def test_fa3_varlen_sends_offsets_and_seqused_by_keyword(monkeypatch):
    lib = Library(fa3_varlen_func, varlen_compute)
    _install(monkeypatch, "flash_attn_interface", flash_attn_varlen_func=lib)
    p = make_thd([5, 3, 7], gaps_q=[2, 0, 3], h=H, hg=HG, d=D, tail=2)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal",
                              softmax_scale=SCALE)
    out = _parity(dpa, [p.q, p.k, p.v], p.kwargs(True, 7, 7, shared=True), "fa3")
    assert torch.all(out[~p.valid_q] == 0)
    (call,) = lib.calls
    assert call["_positional"] == 7  # q, k, v, cu_seqlens_q/k, max_seqlen_q/k: FA3's positional head
    assert call["_keywords"] == {"seqused_q", "seqused_k", "softmax_scale", "causal", "window_size", "deterministic"}
    assert torch.equal(call["cu_seqlens_q"], p.off_q) and torch.equal(call["cu_seqlens_k"], p.off_q)  # physical offsets
    assert call["seqused_q"].tolist() == [5, 3, 7] and call["seqused_k"].tolist() == [5, 3, 7]
    assert (call["max_seqlen_q"], call["max_seqlen_k"], call["causal"]) == (7, 7, True)


# ------------------------------------------------------------------ flash-attn 2 (flash_attn)


@pytest.mark.parametrize("fmt,mask,sq,skv,window,sent,alibi",
                         [case + (False,) for case in DENSE_CASES] + [case + (True,) for case in DENSE_CASES if case[4] is None])
def test_fa2_dense(monkeypatch, fmt, mask, sq, skv, window, sent, alibi):
    lib = Library(fa2_func, dense_compute)
    _install(monkeypatch, "flash_attn", flash_attn_func=lib)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format=fmt, attn_mask_type=mask, window_size=window,
                              softmax_scale=SCALE)
    kwargs = dict(core_attention_bias_type="alibi") if alibi else {}
    _parity(dpa, _dense_inputs(fmt, sq, skv), kwargs, "fa2")
    (call,) = lib.calls
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
def test_fa2_varlen(monkeypatch, mask, window, lengths_kv, sent):
    lib = Library(fa2_varlen_func, varlen_compute)
    _install(monkeypatch, "flash_attn", flash_attn_varlen_func=lib)
    p = make_thd([5, 3, 7], lengths_kv, h=H, hg=HG, d=D, tail=3)  # no gaps: flash-attn 2 has no seqused
    for t in (p.q, p.k, p.v):  # the tail holds finite garbage: nothing reads it, its rows come out 0
        t.data[p.valid_q.numel() - 3 if t is p.q else p.valid_kv.numel() - 3:] = 5.0
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type=mask, window_size=window,
                              softmax_scale=SCALE)
    max_kv = max(lengths_kv or [5, 3, 7])
    out = _parity(dpa, [p.q, p.k, p.v], p.kwargs(False, 7, max_kv, shared=lengths_kv is None), "fa2")
    assert torch.all(out[~p.valid_q] == 0)  # the library leaves the tail unwritten (NaN in the stand-in)
    (call,) = lib.calls
    assert call["_positional"] == 7
    assert (call["causal"], tuple(call["window_size"])) == sent
    assert torch.equal(call["cu_seqlens_q"], p.cu_q) and torch.equal(call["cu_seqlens_k"], p.cu_q if lengths_kv is None else p.cu_kv)
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (7, max_kv)


def test_fa2_dropout_probability_follows_the_training_flag(monkeypatch):
    lib = Library(fa2_func, dense_compute)
    _install(monkeypatch, "flash_attn", flash_attn_func=lib)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, attention_dropout=0.25)
    q, k, v = _dense_inputs("bshd", 4, 4)
    with backend_scope(force="fa2"):
        dpa.eval()
        dpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        dpa.train()
        dpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    assert [c["dropout_p"] for c in lib.calls] == [0.0, 0.25]


# ------------------------------------------------------------------ flash-attn-4 (flash_attn.cute)


def _opt_back(w):
    return -1 if w is None else w


def fa4_library(calls):
    """_flash_attn_fwd/_flash_attn_bwd that accept keywords only, of b36's names, and run the
    CPU emulation of test_gap_rows (which writes into the caller's buffers, like FA4)."""

    def _flash_attn_fwd(*args, **kw):
        assert not args, f"positional arguments: {len(args)}"
        assert set(kw) <= FA4_FWD_KEYWORDS, set(kw) - FA4_FWD_KEYWORDS
        assert kw["return_lse"] == (kw["lse"] is not None)
        calls.append(("fwd", kw))
        fake_fa4_fwd(kw["q"], kw["k"], kw["v"], kw["out"], kw["lse"], kw["cu_seqlens_q"], kw["cu_seqlens_k"],
                     kw["seqused_q"], kw["seqused_k"], kw["max_seqlen_q"], kw["max_seqlen_k"], kw["softmax_scale"],
                     kw["causal"], _opt_back(kw["window_size_left"]), _opt_back(kw["window_size_right"]))

    def _flash_attn_bwd(*args, **kw):
        assert not args, f"positional arguments: {len(args)}"
        assert set(kw) <= FA4_BWD_KEYWORDS, set(kw) - FA4_BWD_KEYWORDS
        calls.append(("bwd", kw))
        fake_fa4_bwd(kw["dout"], kw["q"], kw["k"], kw["v"], kw["out"], kw["lse"], kw["dq"], kw["dk"], kw["dv"],
                     kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["seqused_q"], kw["seqused_k"], kw["max_seqlen_q"],
                     kw["max_seqlen_k"], kw["softmax_scale"], kw["causal"], _opt_back(kw["window_size_left"]),
                     _opt_back(kw["window_size_right"]), kw["deterministic"])
        return kw["dq"], kw["dk"], kw["dv"]

    return _flash_attn_fwd, _flash_attn_bwd


@pytest.fixture
def fa4_calls(monkeypatch):
    calls = []
    fwd, bwd = fa4_library(calls)
    _install(monkeypatch, "flash_attn")
    _install(monkeypatch, "flash_attn.cute")
    _install(monkeypatch, "flash_attn.cute.interface", _flash_attn_fwd=fwd, _flash_attn_bwd=bwd)
    return calls


@pytest.mark.parametrize("mask,window,sent", [("padding_causal", None, (True, None, None)),
                                              ("padding", (3, 1), (False, 3, 1))])
def test_fa4_library_calls_by_keyword(fa4_calls, mask, window, sent):
    p = make_thd([5, 3, 7], gaps_q=[2, 0, 3], h=H, hg=HG, d=D, tail=2)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type=mask, window_size=window,
                              softmax_scale=SCALE)
    out = _parity(dpa, [p.q, p.k, p.v], p.kwargs(True, 7, 7, shared=True), "fa4")
    assert torch.all(out[~p.valid_q] == 0)
    (_, fwd), (_, bwd) = fa4_calls
    for kw in (fwd, bwd):
        assert (kw["causal"], kw["window_size_left"], kw["window_size_right"]) == sent
        assert torch.equal(kw["cu_seqlens_q"], p.off_q) and kw["seqused_q"].tolist() == [5, 3, 7]
        assert (kw["max_seqlen_q"], kw["max_seqlen_k"], kw["softmax_scale"]) == (7, 7, SCALE)
        assert "learnable_sink" not in kw
    assert bwd["softcap"] == 0.0 and bwd["deterministic"] is False
    assert fwd["out"].shape == p.q.shape and fwd["lse"].shape == (H, p.q.shape[0])


def test_fa4_dense_call_passes_no_max_seqlen(fa4_calls):
    """Dense calls: FA4 reads lengths from the shapes, so max_seqlen_q/k are None."""
    q, k, v = (torch.zeros(2, 6, H, D) for _ in range(3))
    out, lse = torch.empty_like(q), None
    sink = torch.zeros(H)
    fwd_kw = []
    sys.modules["flash_attn.cute.interface"]._flash_attn_fwd = lambda **kw: fwd_kw.append(kw)
    fa4.fa4_fwd(q, k, v, out, lse, None, None, None, None, 6, 6, SCALE, True, -1, -1, sink)
    (kw,) = fwd_kw
    assert kw["max_seqlen_q"] is None and kw["max_seqlen_k"] is None and kw["cu_seqlens_q"] is None
    assert kw["return_lse"] is False and kw["learnable_sink"] is sink and kw["out"] is out


# ------------------------------------------------------------------ num_splits (TE's split-KV hint)


@pytest.mark.parametrize("splits", [0, 1, 3])
def test_fa3_takes_num_splits_dense_and_varlen(monkeypatch, splits):
    dense, varlen = Library(fa3_func, dense_compute), Library(fa3_varlen_func, varlen_compute)
    _install(monkeypatch, "flash_attn_interface", flash_attn_func=dense, flash_attn_varlen_func=varlen)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="bshd", attn_mask_type="causal", softmax_scale=SCALE)
    _parity(dpa, _dense_inputs("bshd", 5, 5), dict(num_splits=splits), "fa3")
    p = make_thd([5, 3, 7], gaps_q=[2, 0, 3], h=H, hg=HG, d=D, tail=2)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal", softmax_scale=SCALE)
    _parity(dpa, [p.q, p.k, p.v], dict(p.kwargs(True, 7, 7, shared=True), num_splits=splits), "fa3")
    for call in dense.calls + varlen.calls:
        assert "num_splits" in call["_keywords"] and call["num_splits"] == splits


def test_fa4_takes_num_splits_in_the_forward_only(fa4_calls):
    p = make_thd([5, 3, 7], gaps_q=[2, 0, 3], h=H, hg=HG, d=D, tail=2)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal", softmax_scale=SCALE)
    _parity(dpa, [p.q, p.k, p.v], dict(p.kwargs(True, 7, 7, shared=True), num_splits=4), "fa4")
    (_, fwd), (_, bwd) = fa4_calls
    assert fwd["num_splits"] == 4 and "num_splits" not in bwd  # split-KV is a forward feature


def test_num_splits_is_a_per_call_value_on_the_fast_path(fa4_calls):
    """Two calls with the same host facts share the fast path's cached recipe; each still sends
    its own num_splits (a per-call field of the prepared record), and a call without sends none."""
    p = make_thd([5, 3, 7], h=H, hg=HG, d=D)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal", softmax_scale=SCALE)
    with backend_scope(force="fa4"), torch.no_grad():
        for splits in (2, 5, None):
            dpa(p.q, p.k, p.v, **p.kwargs(False, 7, 7, shared=True), num_splits=splits)
    assert len(dpa._recipes) == 1, "one recipe: num_splits is not part of the fast path's key"
    assert [kw.get("num_splits") for _, kw in fa4_calls] == [2, 5, None]


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
