"""FA3 (flash_attn_interface) cannot be installed on the lent GPU, so its adapter is checked on
the CPU against a stand-in module that follows FA3's documented varlen interface: physical
offsets as cu_seqlens, valid lengths as seqused_q/k, bottom-right causal, (left, right) windows,
rows it skips left unwritten (NaN here), and whole-tile reads past each sequence end (so NaN in
a gap leaks unless the guard zeroes those rows). Results must equal the unfused backend."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope

from .gpu_helpers import grads_of
from .packing import make_thd
from .reference import allowed_matrix, attend_one

H, D = 4, 8
TILE = 16  # the stand-in's tile along the sequence


def _fake_fa3(calls):
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                               seqused_k=None, softmax_scale=None, causal=False, window_size=(-1, -1), deterministic=False):
        calls.append(dict(cu_seqlens_q=cu_seqlens_q, seqused_q=seqused_q, causal=causal, window_size=window_size,
                          max_seqlen_q=max_seqlen_q))
        parts, cursor = [], 0
        for b in range(cu_seqlens_q.numel() - 1):
            start, kv_start = int(cu_seqlens_q[b]), int(cu_seqlens_k[b])
            n = int(seqused_q[b]) if seqused_q is not None else int(cu_seqlens_q[b + 1]) - start
            m = int(seqused_k[b]) if seqused_k is not None else int(cu_seqlens_k[b + 1]) - kv_start
            parts.append(torch.full((start - cursor, *q.shape[1:]), float("nan"), dtype=q.dtype))
            cursor = start + n
            if n == 0:
                continue
            window = None if tuple(window_size) == (-1, -1) else window_size
            allowed = allowed_matrix(n, m, "padding_causal_bottom_right" if causal else "padding", window)
            o = attend_one(q[start:cursor], k[kv_start:kv_start + m], v[kv_start:kv_start + m], allowed, softmax_scale)
            # Like FA3, read V up to the end of the last tile: P is 0 there, and 0 * NaN = NaN.
            spill = v[kv_start + m : kv_start + -(-m // TILE) * TILE].double()
            parts.append(o + 0 * spill.sum())
        parts.append(torch.full((q.shape[0] - cursor, *q.shape[1:]), float("nan"), dtype=q.dtype))
        return torch.cat(parts).to(q.dtype)

    return types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


@pytest.mark.parametrize("case", ["plain", "gaps", "per-seq-gaps"])
def test_fa3_varlen_mapping_matches_unfused(case, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn_interface", _fake_fa3(calls))
    gaps = [2, 0, 3, 1] if case != "plain" else None
    p = make_thd([5, 3, 7, 4], gaps_q=gaps, h=H, d=D, tail=2)
    if case == "plain":  # FA3 reads whole tiles: the tail holds finite garbage, not NaN
        for t in (p.q, p.k, p.v):
            t.data[~p.valid_q] = 3.0
    kwargs = p.kwargs(gaps is not None, 7, 7, shared=True)
    if case == "per-seq-gaps":
        kwargs["attn_mask_type_per_seq"] = {"padding_causal": torch.tensor([0, 2]), ("padding", (2, 1)): torch.tensor([1, 3])}
    dpa = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal")
    ref = dpa(p.q, p.k, p.v, **kwargs)
    g = torch.randn_like(ref)
    want = grads_of(ref, [p.q, p.k, p.v], g)
    with backend_scope(force="fa3"):  # the same module: the scope is part of the fast path's key
        out = dpa(p.q, p.k, p.v, **kwargs)
    assert dpa.last_selection.label == "FlashAttention v3"
    got = grads_of(out, [p.q, p.k, p.v], g)
    assert calls, "the FA3 stand-in never ran"
    torch.testing.assert_close(out, ref)
    for a, b, valid in zip(got, want, (p.valid_q, p.valid_kv, p.valid_kv)):
        torch.testing.assert_close(a, b)
        assert torch.all(a[~valid] == 0)
    assert all(c["max_seqlen_q"] == 7 for c in calls)
    if case == "plain":
        assert len(calls) == 1 and calls[0]["seqused_q"] is None and calls[0]["causal"]
    else:
        assert all(torch.equal(c["cu_seqlens_q"], p.off_q) for c in calls)
    if case == "per-seq-gaps":
        assert [(c["causal"], c["window_size"]) for c in calls] == [(True, (-1, -1)), (False, (2, 1))]
        assert calls[0]["seqused_q"].tolist() == [5, 0, 7, 0] and calls[1]["seqused_q"].tolist() == [0, 3, 0, 4]


def test_fa3_gap_guard_has_teeth(monkeypatch):
    """Without the guard the stand-in leaks gap NaN into valid rows, as FA3 would; with the copy
    guard the inputs stay untouched and the result is finite."""
    monkeypatch.setitem(sys.modules, "flash_attn_interface", _fake_fa3([]))
    dpa = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal")
    p = make_thd([5, 3, 7, 4], gaps_q=[2, 0, 3, 1], h=H, d=D, tail=2)
    with backend_scope(force="fa3"):
        monkeypatch.setenv("NVTE_FLASH_ATTN_SANITIZE_GAPS", "0")
        assert torch.isnan(dpa(p.q, p.k, p.v, **p.kwargs(True, 7, 7, shared=True))[p.valid_q]).any()
        monkeypatch.setenv("NVTE_FLASH_ATTN_SANITIZE_GAPS", "copy")
        out = dpa(p.q, p.k, p.v, **p.kwargs(True, 7, 7, shared=True))
    assert torch.isfinite(out).all() and torch.isnan(p.v.detach()[~p.valid_kv]).all()
    out.backward(torch.randn_like(out))
    assert torch.isfinite(p.v.grad).all() and torch.all(p.v.grad[~p.valid_kv] == 0)
