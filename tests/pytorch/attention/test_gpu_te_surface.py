"""TE's module surface on the GPU (skipped without CUDA): a TE-layout MultiheadAttention
checkpoint on each GPU backend against the float64 oracle of te_layout.py, and the RNG tracker
forking the CUDA generator."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import MultiheadAttention
from transformer_engine.pytorch import distributed as te_dist
from transformer_engine.pytorch.attention import backend_scope

from .gpu_helpers import GPU_BACKENDS, rel_err
from .te_layout import Variant, te_forward, te_inputs, te_state_dict

pytestmark = pytest.mark.gpu


GPU_VARIANTS = [Variant(input_layernorm=True, hg=2, fuse=True, hidden=256, head_dim=64),
                Variant(hg=2, hidden=256, head_dim=64),  # TE's default: separate parameters
                Variant("cross", True, hg=1, hidden=256, head_dim=64)]


@pytest.mark.parametrize("label", list(GPU_BACKENDS))
@pytest.mark.parametrize("v", GPU_VARIANTS, ids=str)
def test_te_layout_on_gpu_backends(v, label):
    """A TE-layout checkpoint loaded into a bf16 CUDA module runs on each GPU backend: the
    float64 oracle's output (from the bf16-rounded weights and inputs), and a backward whose
    gradients reach every parameter, finite."""
    sd = te_state_dict(v, seed=7)
    mha = MultiheadAttention(v.hidden, v.heads, **{**v.kwargs(), "params_dtype": torch.bfloat16, "device": "cuda"})
    mha.load_state_dict(sd, strict=True)
    x, enc = (None if t is None else t.to(torch.bfloat16) for t in te_inputs(v))
    with backend_scope(allow=[label]):
        out = mha(x.cuda(), encoder_output=None if enc is None else enc.cuda())
    assert mha.core_attention.last_selection.label == label
    rounded = {k: t.to(torch.bfloat16).double() for k, t in sd.items() if not k.endswith("_extra_state")}
    want = te_forward(rounded, v, x.double(), None if enc is None else enc.double())
    assert rel_err(out.cpu(), want) < 2e-2, f"out: {rel_err(out.cpu(), want):.2e}"
    out.float().square().sum().backward()
    for name, p in mha.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_tracker_on_cuda_forks_the_cuda_stream():
    tracker = te_dist.CudaRNGStatesTracker()
    assert tracker.device == "cuda"
    torch.cuda.manual_seed(5)
    expected_default = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(5)
    tracker.add("model-parallel-rng", 9)
    with tracker.fork():
        drawn = torch.rand(4, device="cuda")
    torch.testing.assert_close(torch.rand(4, device="cuda"), expected_default)
    g = torch.Generator(device="cuda").manual_seed(9)
    torch.testing.assert_close(drawn, torch.rand(4, device="cuda", generator=g))
