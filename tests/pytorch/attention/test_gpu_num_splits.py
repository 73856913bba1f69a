"""TE's num_splits (a split-KV hint) on the GPU, skipped without CUDA: with any value the result
equals the call without it, on FA4 (dense and THD with gaps and two mask policies sharing one
output, whose rows each call must leave to the other) and on cuDNN, which ignores it. On sm9x
FA4 drops the hint (flash-attn-4 4.0.0b36 has no split-KV there and asserts); on sm10x it splits."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention

from .gpu_helpers import rel_err, run_on
from .packing import make_thd

pytestmark = pytest.mark.gpu
H, D = 8, 128


@pytest.mark.parametrize("label", ["FlashAttention v4", "FusedAttention"])
@pytest.mark.parametrize("splits", [0, 1, 4])
def test_num_splits_leaves_results_unchanged(label, splits):
    lengths = [300, 17, 1024, 64]
    p = make_thd(lengths, gaps_q=[8, 0, 3, 0], h=H, hg=2, d=D, dtype=torch.bfloat16, device="cuda")
    dpa = DotProductAttention(H, D, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding")
    kwargs = dict(p.kwargs(True, max(lengths), max(lengths), shared=True),
                  thd_sequence_is_causal=torch.tensor([True, False, True, False], device="cuda"))
    with torch.no_grad():
        want = run_on(label, dpa, p.q, p.k, p.v, **kwargs)
        got = run_on(label, dpa, p.q, p.k, p.v, num_splits=splits, **kwargs)
    assert torch.all(got[~p.valid_q] == 0) and torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-2, f"{label}, num_splits={splits}: {rel_err(got, want):.2e}"
    q = torch.randn(2, 2048, H, D, device="cuda", dtype=torch.bfloat16)
    dense = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal")
    with torch.no_grad():
        assert rel_err(run_on(label, dense, q, q, q, num_splits=splits), run_on(label, dense, q, q, q)) < 1e-2
