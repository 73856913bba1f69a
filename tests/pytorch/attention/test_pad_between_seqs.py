"""Padding between packed sequences: NaN poured into every gap; output and gradient rows there
exactly 0 and finite; valid rows equal to the same sequences packed without gaps."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention

from .gpu_helpers import GPU_BACKENDS, grads_of, rel_err, run_on
from .packing import make_thd

H = 4


def _pack_without_gaps(t, valid):
    return t.detach()[valid].clone().requires_grad_()


def _check_gaps_vs_dense_packing(label, p, lengths_q, lengths_kv, mask, window, hg, d, tol, shared):
    dpa = DotProductAttention(H, d, num_gqa_groups=hg, qkv_format="thd", attn_mask_type=mask, window_size=window)
    kwargs = p.kwargs(True, max(lengths_q), max(lengths_kv), shared=shared)
    # FlashAttention aligns causal masks bottom-right only: top-left causal cross-attention is
    # refused by selection (its reason), and the test skips with that reason.
    top_left_cross = mask in ("padding_causal", "causal") and not shared and label.startswith("FlashAttention")
    out = run_on(label, dpa, p.q, p.k, p.v, expect_refusal="with sq != skv possible" if top_left_cross else None, **kwargs)
    g = torch.randn_like(out)
    grads = grads_of(out, [p.q, p.k, p.v], g)
    packed = [_pack_without_gaps(t, m) for t, m in ((p.q, p.valid_q), (p.k, p.valid_kv), (p.v, p.valid_kv))]
    plain = dict(cu_seqlens_q=p.cu_q, cu_seqlens_kv=p.cu_q if shared else p.cu_kv,
                 max_seqlen_q=max(lengths_q), max_seqlen_kv=max(lengths_kv))
    ref = run_on(label, dpa, *packed, **plain)
    ref_grads = grads_of(ref, packed, g[p.valid_q])
    assert torch.all(out[~p.valid_q] == 0) and torch.isfinite(out).all()
    assert rel_err(out[p.valid_q], ref) <= tol
    for got, want, valid in zip(grads, ref_grads, (p.valid_q, p.valid_kv, p.valid_kv)):
        assert torch.isfinite(got).all() and torch.all(got[~valid] == 0)
        assert rel_err(got[valid], want) <= tol * 4


CASES = [
    # (mask, window, hg, cross)
    ("padding", None, 4, False),
    ("padding_causal", None, 2, False),
    ("padding_causal", (3, 0), 1, False),
    ("padding_causal_bottom_right", None, 4, True),
    ("padding", (2, 1), 2, True),
    ("padding_causal", None, 4, True),  # top-left cross: distinct q and kv offsets
]


@pytest.mark.parametrize("mask,window,hg,cross", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu(mask, window, hg, cross, dtype):
    lengths_q = [5, 1, 7, 3]
    lengths_kv = [6, 4, 2, 3] if cross else lengths_q
    p = make_thd(lengths_q, lengths_kv, [2, 3, 0, 1], [1, 0, 4, 2] if cross else None, h=H, hg=hg, d=8, dtype=dtype, tail=3)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    _check_gaps_vs_dense_packing("unfused", p, lengths_q, lengths_kv, mask, window, hg, 8, tol, shared=not cross)


def test_inferred_flag_uses_identity_not_values():
    """Equal values in distinct tensors count as gaps (comparing values would sync)."""
    p = make_thd([3, 2], gaps_q=[1, 1])
    dpa = DotProductAttention(H, 8, qkv_format="thd", attn_mask_type="padding")
    out_same = dpa(p.q, p.k, p.v, cu_seqlens_q=p.off_q, cu_seqlens_kv=p.off_q, cu_seqlens_q_padded=p.off_q,
                   cu_seqlens_kv_padded=p.off_q, max_seqlen_q=4, max_seqlen_kv=4)
    assert not torch.isfinite(out_same).all()  # no gaps declared: the NaN rows are read as tokens
    out_gaps = dpa(p.q, p.k, p.v, **p.kwargs(True, 3, 3, shared=True))
    assert torch.isfinite(out_gaps).all()


@pytest.mark.gpu
@pytest.mark.parametrize("label", list(GPU_BACKENDS))
@pytest.mark.parametrize("mask,window,hg,cross", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu(label, mask, window, hg, cross, dtype):
    if dtype == torch.float16 and (window is not None or cross):
        pytest.skip("fp16 runs the plain cases only (keeps the JIT compile count down)")
    lengths_q = [200, 17, 333, 64]
    lengths_kv = [150, 220, 40, 64] if cross else lengths_q
    p = make_thd(lengths_q, lengths_kv, [8, 31, 0, 100], [3, 0, 77, 5] if cross else None, h=H, hg=hg, d=128,
                 dtype=dtype, device="cuda", tail=9)
    window = None if window is None else tuple(16 * w for w in window)
    _check_gaps_vs_dense_packing(label, p, lengths_q, lengths_kv, mask, window, hg, 128, 2e-2, shared=not cross)
