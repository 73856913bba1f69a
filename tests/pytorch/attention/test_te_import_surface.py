"""The TE names around attention that training code imports: the version, the FP8 surface,
the RNG-state tracker, the recompute context, and the stand-ins that must fail by name."""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

import transformer_engine
import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import distributed as te_dist
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager, fp8_autocast


def test_version_is_a_te_api_level_megatron_accepts():
    v = Version(transformer_engine.__version__)
    assert v.local == "teattention"
    assert Version("2.9.0") <= v < Version("2.12.0")  # megatron-core 0.16 declares TE >= 2.9, < 2.12
    assert v >= Version("2.10.0")  # its newest gate (num_splits)
    assert transformer_engine.DISTRIBUTION_VERSION != transformer_engine.__version__


def test_megatron_sees_the_version():
    from megatron.core.utils import get_te_version, is_te_min_version

    assert get_te_version() == Version(transformer_engine.__version__)
    assert is_te_min_version("2.10.0") and not is_te_min_version("2.12.0")


def test_megatron_imports_its_te_extension():
    import megatron.core  # noqa: F401
    from megatron.core.extensions import transformer_engine as ext

    assert issubclass(ext.TEDotProductAttention, te.DotProductAttention)
    assert issubclass(ext.TECudaRNGStatesTracker, te_dist.CudaRNGStatesTracker)


PLACEHOLDERS = [
    (lambda: te.Linear(4, 4), "transformer_engine.pytorch.Linear"),
    (lambda: te.LayerNormLinear(4, 4), "transformer_engine.pytorch.LayerNormLinear"),
    (lambda: te.GroupedLinear(2, 4, 4), "transformer_engine.pytorch.GroupedLinear"),
    (lambda: te.LayerNorm(4), "transformer_engine.pytorch.LayerNorm"),
    (lambda: te.ops.Sequential(), "transformer_engine.pytorch.ops.Sequential"),
    (lambda: te.ops.SwiGLU(), "transformer_engine.pytorch.ops.SwiGLU"),
    (lambda: te.router.fused_moe_aux_loss(None), "transformer_engine.pytorch.router.fused_moe_aux_loss"),
    (lambda: te.tensor.QuantizedTensor(), "transformer_engine.pytorch.tensor.QuantizedTensor"),
]


@pytest.mark.parametrize("make,name", PLACEHOLDERS, ids=[p[1].rsplit(".", 1)[-1] for p in PLACEHOLDERS])
def test_placeholders_raise_naming_themselves(make, name):
    with pytest.raises(NotImplementedError, match=rf"^{name} is not implemented by te-attention"):
        make()


def test_placeholders_can_be_subclassed_and_fail_on_construction():
    class MyLinear(te.Linear):
        def __init__(self):
            super().__init__(4, 4)

    with pytest.raises(NotImplementedError, match="transformer_engine.pytorch.Linear"):
        MyLinear()
    assert not isinstance(torch.zeros(1), te.tensor.QuantizedTensor)
    from transformer_engine.pytorch.float8_tensor import Float8Tensor

    assert issubclass(Float8Tensor, te.tensor.QuantizedTensor)


def test_fp8_surface_is_te_2_10s(monkeypatch):
    """The names TE 2.10 exports (details and behaviour: test_fp8.py)."""
    monkeypatch.delenv("NVTE_UnfusedDPA_Emulate_FP8", raising=False)
    assert FP8GlobalStateManager.is_fp8_enabled() is False
    assert te.autocast is te.quantization.autocast and te.fp8.fp8_autocast is te.quantization.fp8_autocast
    assert te.quantized_model_init is te.quantization.quantized_model_init
    assert isinstance(FP8GlobalStateManager.get_fp8_recipe(), recipe.DelayedScaling)
    if not torch.cuda.is_available():
        available, reason = FP8GlobalStateManager.is_fp8_available()
        assert available is False and "NVTE_UnfusedDPA_Emulate_FP8=1" in reason
        assert te.is_fp8_available() is False
    with pytest.warns(DeprecationWarning, match="fp8_autocast is deprecated; use autocast"):
        with fp8_autocast(enabled=False):
            assert not FP8GlobalStateManager.is_fp8_enabled()


def test_recipes_are_records_with_checked_formats():
    r = recipe.DelayedScaling(margin=1, fp8_format=recipe.Format.E4M3, amax_history_len=16)
    assert (r.margin, r.fp8_format, r.amax_history_len, r.fp8_dpa) == (1, recipe.Format.E4M3, 16, False)
    assert r.delayed() and not r.mxfp8() and recipe.MXFP8BlockScaling().mxfp8()
    with pytest.raises(ValueError, match="fp8_format must be one of Format.E4M3, Format.HYBRID; got <Format.E5M2"):
        recipe.Float8CurrentScaling(fp8_format=recipe.Format.E5M2)


def _draws(tracker, name, n=4):
    with tracker.fork(name):
        return torch.rand(n)


def test_tracker_streams_are_seeded_independent_and_leave_the_default_stream_alone():
    tracker = te_dist.CudaRNGStatesTracker(device="cpu")
    torch.manual_seed(123)
    expected_default = torch.rand(4)
    torch.manual_seed(123)
    tracker.add("model-parallel-rng", 7)
    tracker.add("data-parallel-rng", 8)
    a1 = _draws(tracker, "model-parallel-rng")
    a2 = _draws(tracker, "model-parallel-rng")
    torch.testing.assert_close(torch.rand(4), expected_default)  # forks did not move it
    g = torch.Generator().manual_seed(7)
    torch.testing.assert_close(torch.cat([a1, a2]), torch.rand(8, generator=g))  # stream continues across forks
    torch.testing.assert_close(_draws(tracker, "data-parallel-rng"), torch.rand(4, generator=torch.Generator().manual_seed(8)))


def test_tracker_get_set_states_replays_and_reset_forgets():
    tracker = te_dist.CudaRNGStatesTracker(device="cpu")
    tracker.add("model-parallel-rng", 3)
    saved = {k: v.clone() for k, v in tracker.get_states().items()}
    first = _draws(tracker, "model-parallel-rng")
    tracker.set_states(saved)
    torch.testing.assert_close(_draws(tracker, "model-parallel-rng"), first)
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.add("model-parallel-rng", 3)  # the seed is free again after reset


def test_tracker_errors_name_the_problem():
    tracker = te_dist.CudaRNGStatesTracker(device="cpu")
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1 is already tracked"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="RNG state 'a' is already tracked"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match=r"RNG state 'zz' is not tracked \(tracked: \['a'\]\)"):
        with tracker.fork("zz"):
            pass
    with pytest.raises(ValueError, match="device must be 'cuda', 'cpu' or None; got 'tpu'"):
        te_dist.CudaRNGStatesTracker(device="tpu")


def test_activation_recompute_forward_sets_and_restores_the_phase():
    assert not te_dist.in_fp8_activation_recompute_phase()
    with te_dist.activation_recompute_forward(activation_recompute=True, recompute_phase=True):
        assert te_dist.in_fp8_activation_recompute_phase()
        assert not te_dist.is_fp8_activation_recompute_enabled()  # FP8 is off, so nothing to recompute in FP8
        with te_dist.activation_recompute_forward(activation_recompute=True, recompute_phase=False):
            assert not te_dist.in_fp8_activation_recompute_phase()
        assert te_dist.in_fp8_activation_recompute_phase()
    assert not te_dist.in_fp8_activation_recompute_phase()
