"""Shared pieces of the FP8 tests: a clean FP8 state per test, the emulation switch, TE's
fp8_vs_f16 error measure, and a module plus inputs in TE's FP8 test shapes (small, for the CPU)."""

from __future__ import annotations

import math

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

EMULATE = "NVTE_UnfusedDPA_Emulate_FP8"
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
# TE's fp8_vs_f16 slots (FP8FwdTensors / FP8BwdTensors), written out here rather than imported.
QKV, O, S = 2, 3, 8
DQKV, DO, DP = 0, 3, 5


@pytest.fixture(autouse=True)
def fp8_clean(monkeypatch):
    """Every test starts with no FP8 region or registrant and the emulation switched on."""
    FP8GlobalStateManager.reset()
    monkeypatch.setenv(EMULATE, "1")
    for name in ("NVTE_FP8_DPA_BWD", "NVTE_DPA_FP8DS_AMAX_HISTLEN", "NVTE_DPA_FP8DS_AMAX_ALGO", "NVTE_DPA_FP8DS_REDUCE_AMAX"):
        monkeypatch.delenv(name, raising=False)
    yield
    FP8GlobalStateManager.reset()


def delayed(**kw) -> recipe.DelayedScaling:
    """TE's fp8_vs_f16 recipe unless told otherwise: HYBRID, history 1, most recent."""
    kw = {"fp8_format": recipe.Format.HYBRID, "amax_history_len": 1, "amax_compute_algo": "most_recent", "fp8_dpa": True, **kw}
    return recipe.DelayedScaling(**kw)


def rmse_within(a: torch.Tensor, b: torch.Tensor, tol: float = 0.11) -> None:
    """TE's fp8_vs_f16 criterion: RMSE below ``tol`` times the joint value range."""
    a, b = a.double(), b.double()
    rmse = math.sqrt(((a - b) ** 2).mean().item())
    span = (torch.maximum(a.max(), b.max()) - torch.minimum(a.min(), b.min())).item()
    assert rmse < tol * span, f"RMSE {rmse:.5f} over {tol} x range {span:.5f}"


def rel_rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    """RMSE of ``a`` against ``b``, over ``b``'s value range (on the host, in float64)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).pow(2).mean().sqrt() / (b.max() - b.min())).item()


def bshd(seed: int, b=2, s=32, h=4, hg=4, d=64, dtype=torch.bfloat16, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, s, n, d, generator=g) * scale).to(dtype).requires_grad_() for n in (h, hg, hg)]


def module(h=4, hg=4, d=64, fmt="bshd", mask="causal", **kw) -> te.DotProductAttention:
    return te.DotProductAttention(h, d, num_gqa_groups=hg, qkv_format=fmt, attn_mask_type=mask, **kw)


def step(dpa, q, k, v, fp8_recipe, dout=None, **kw):
    """One training step in an FP8 region: forward inside it, backward after it (as TE's tests)."""
    with te.autocast(recipe=fp8_recipe):
        out = dpa(q, k, v, **kw)
    if dout is not None:
        out.backward(dout)
    return out
