"""FP8 attention's emulation on CUDA (skipped without it): a training step makes no host sync
and computes what the CPU emulation computes (test_fp8_emulation.py)."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.common import recipe
from transformer_engine.pytorch.attention import backend_scope

from .fp8_helpers import bshd, delayed, fp8_clean, module, step  # noqa: F401 (fp8_clean: an autouse fixture)
from .packing import make_thd
from .test_fp8_emulation import _share_unequal

pytestmark = pytest.mark.gpu


def _gpu_case(fmt: str, device: str):
    if fmt == "thd":
        p = make_thd([40, 17, 64], gaps_q=[3, 0, 5], h=4, hg=2, d=64, dtype=torch.bfloat16, device=device, seed=90)
        return module(h=4, hg=2, d=64, fmt="thd", mask="padding_causal"), (p.q, p.k, p.v), p.kwargs(True, 64, 64, shared=True)
    return module(h=4, hg=2, d=64), tuple(t.detach().to(device).requires_grad_() for t in bshd(91, h=4, hg=2)), {}


RECIPES = {"delayed": delayed, "current": lambda: recipe.Float8CurrentScaling(fp8_dpa=True)}


@pytest.mark.parametrize("scaling", sorted(RECIPES))
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_gpu_emulation_is_sync_free_and_matches_the_cpu(fmt, scaling):
    """The emulation on CUDA: a training step (forward in the region, its exit's update, the
    backward and its update) makes no host sync, and computes what the CPU emulation computes;
    under delayed scaling and under current scaling (scales from the tensors at hand)."""
    results = {}
    for device in ("cpu", "cuda"):
        dpa, inputs, kwargs = _gpu_case(fmt, device)
        dout = torch.randn(inputs[0].shape[0], *inputs[0].shape[1:-2], 256, generator=torch.Generator().manual_seed(92))
        dout = dout.to(torch.bfloat16).to(device)
        with backend_scope(allow=["unfused"]):  # the emulation, also where cuDNN would run FP8
            step(dpa, *(t.detach().requires_grad_() for t in inputs), RECIPES[scaling](), dout, **kwargs)  # warm-up: lazy inits
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            with backend_scope(allow=["unfused"]):
                out = step(dpa, *inputs, RECIPES[scaling](), dout, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results[device] = [out.cpu()] + [t.grad.cpu() for t in inputs] + [dpa._fp8_state.fwd.scale.cpu(), dpa._fp8_state.bwd.scale.cpu()]
    for got, want in zip(results["cuda"], results["cpu"]):
        got, want = torch.nan_to_num(got), torch.nan_to_num(want)
        assert _share_unequal(got, want) < 0.02 or torch.allclose(got.float(), want.float(), rtol=1e-5)
