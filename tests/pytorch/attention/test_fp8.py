"""FP8 attention's state on the CPU: recipes, regions, delayed and current scaling step by step
(expected values written out here), the amax reduction over a gloo group of 2, checkpoints in
TE's format, selection reasons and every refusal. The numbers the emulated FP8 path computes:
test_fp8_emulation.py."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.attention.dot_product_attention.fp8.state import ScalingState, delayed_update
from transformer_engine.pytorch.attention.dot_product_attention.selection.backend_selection import NoBackendError
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

from .dist_helpers import run_distributed
from .fp8_helpers import DO, DP, DQKV, E4M3_MAX, E5M2_MAX, EMULATE, O, QKV, S, bshd, delayed, fp8_clean, module, step  # noqa: F401

F32 = torch.float32


# ---------------------------------------------------------------------------------- recipes


def test_recipes_keep_te_fields_and_defaults():
    r = recipe.DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.scaling_factor_compute_algo,
            r.reduce_amax, r.fp8_dpa, r.fp8_mha) == (0, recipe.Format.HYBRID, 1024, "max", None, True, False, False)
    c = recipe.Float8CurrentScaling(fp8_dpa=True)
    assert (c.fp8_format, c.fp8_dpa, c.fp8_mha) == (recipe.Format.HYBRID, True, False)
    assert recipe.Format.HYBRID.value == (448, 57344) and recipe.Format.E4M3.value.max_bwd == 448


def test_recipes_ignore_the_keywords_te_callers_pass_and_refuse_others():
    r = recipe.DelayedScaling(margin=1, override_linear_precision=(False, False, True), params_dtype=torch.bfloat16,
                              device="cpu", interval=1)
    assert r.margin == 1 and not hasattr(r, "override_linear_precision")
    with pytest.raises(TypeError, match="amax_histroy_len"):
        recipe.DelayedScaling(amax_histroy_len=4)


@pytest.mark.parametrize("kwargs,error,message", [
    ({"amax_history_len": 0}, ValueError, "amax_history_len must be a positive int; got 0"),
    ({"amax_compute_algo": "mean"}, ValueError, "amax_compute_algo must be 'max', 'most_recent' or a callable; got 'mean'"),
    ({"fp8_format": recipe.Format.E5M2}, ValueError, "fp8_format must be one of Format.E4M3, Format.HYBRID; got <Format.E5M2"),
    ({"margin": 1.5}, TypeError, "margin must be an int; got 1.5"),
    ({"fp8_dpa": 1}, TypeError, "fp8_dpa must be a bool; got 1"),
    ({"scaling_factor_compute_algo": 3}, TypeError, "scaling_factor_compute_algo must be None or a callable; got 3"),
])
def test_delayed_scaling_checks_its_fields(kwargs, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        recipe.DelayedScaling(**kwargs)


def test_megatron_builds_its_delayed_scaling_recipe():
    from megatron.core.extensions.transformer_engine import TEDelayedScaling
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, fp8="hybrid",
                               fp8_dot_product_attention=True, fp8_amax_history_len=16, fp8_amax_compute_algo="max")
    r = TEDelayedScaling(config, recipe.Format.HYBRID, override_linear_precision=(False, False, True))
    assert isinstance(r, recipe.DelayedScaling) and (r.fp8_dpa, r.amax_history_len) == (True, 16)


# ---------------------------------------------------------------------------------- regions


def test_regions_nest_and_restore():
    outer, inner = delayed(margin=1), recipe.Float8CurrentScaling(fp8_dpa=True)
    with te.autocast(recipe=outer, amax_reduction_group="g"):
        assert FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.get_fp8_recipe() is outer
        assert FP8GlobalStateManager.get_fp8_group() == "g"
        with te.autocast(enabled=False, recipe=inner):
            assert not FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.get_fp8_recipe() is inner
        assert FP8GlobalStateManager.get_fp8_recipe() is outer
    assert not FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.get_fp8_group() is None


def test_first_fp8_module_is_answered_once_per_outermost_region():
    with te.autocast(recipe=delayed()):
        assert FP8GlobalStateManager.is_first_fp8_module()
        with te.autocast(recipe=delayed()):
            assert not FP8GlobalStateManager.is_first_fp8_module()
    with te.autocast(recipe=delayed()):
        assert FP8GlobalStateManager.peek_first_fp8_module() and FP8GlobalStateManager.is_first_fp8_module()


def test_fp8_autocast_is_the_deprecated_name():
    r = delayed()
    with pytest.warns(DeprecationWarning, match="fp8_autocast is deprecated"):
        region = te.fp8_autocast(enabled=True, fp8_recipe=r, fp8_group="g")
    with region:
        assert FP8GlobalStateManager.get_fp8_recipe() is r and FP8GlobalStateManager.get_fp8_group() == "g"


@pytest.mark.parametrize("make,message", [
    (recipe.MXFP8BlockScaling, "MXFP8BlockScaling is not implemented by te-attention (MXFP8 needs Blackwell"),
    (recipe.NVFP4BlockScaling, "NVFP4BlockScaling is not implemented by te-attention (NVFP4 needs Blackwell"),
    (recipe.Float8BlockScaling, "Float8BlockScaling is not implemented by te-attention (FP8 block scaling is a GEMM recipe"),
    (recipe.CustomRecipe, "CustomRecipe is not implemented by te-attention"),
])
def test_recipes_nothing_here_runs_are_refused_by_name(make, message):
    with pytest.raises(NotImplementedError, match=message.replace("(", r"\(")):
        te.autocast(recipe=make())
    with te.autocast(enabled=False, recipe=make()):  # a region that quantizes nothing takes any recipe
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_fp8_needs_a_device_or_the_emulation(monkeypatch):
    monkeypatch.delenv(EMULATE)
    with pytest.raises(NotImplementedError, match="FP8 needs a CUDA device of compute capability 8.9 or newer") as info:
        te.autocast(recipe=delayed())
    assert isinstance(info.value, RuntimeError)  # what TE raises
    assert "NVTE_UnfusedDPA_Emulate_FP8=1" in str(info.value)
    monkeypatch.setenv(EMULATE, "1")
    assert te.is_fp8_available() and FP8GlobalStateManager.is_fp8_available() == (True, "")
    assert te.is_mxfp8_available() is False and "MXFP8" in te.is_mxfp8_available(return_reason=True)[1]


def test_region_arguments_are_checked():
    with pytest.raises(TypeError, match="enabled must be a bool; got 1"):
        te.autocast(enabled=1)
    with pytest.raises(TypeError, match="recipe must be a transformer_engine.common.recipe.Recipe or None; got dict"):
        te.autocast(recipe={})


def test_fp8_parameters_are_refused_by_name():
    for init in (te.quantized_model_init, te.fp8_model_init):
        with pytest.raises(NotImplementedError, match=r"quantized_model_init\(enabled=True\) / fp8_model_init\(enabled=True\)"):
            init(enabled=True)
        with init(enabled=False):
            assert not FP8GlobalStateManager.with_fp8_parameters()


# ---------------------------------------------------------------------------------- delayed scaling


def _qkv_amax(q, k, v) -> torch.Tensor:
    return torch.stack([t.detach().abs().max().float() for t in (q, k, v)]).max()


def test_forward_history_and_scales_step_by_step():
    """History length 3, "max", margin 1; input amaxes a_t. After step t the QKV column holds
    [0, a_{t-1}, a_t] and the scale is 224 / max(a_{t-2}, a_{t-1}, a_t) (224 = 448 / 2**1)."""
    dpa, r = module(), delayed(amax_history_len=3, amax_compute_algo="max", margin=1)
    base = bshd(0)
    amaxes = []
    for factor in (1.0, 4.0, 0.5, 0.25, 2.0):
        q, k, v = (t.detach() * factor for t in base)
        amaxes.append(_qkv_amax(q, k, v))
        step(dpa, q, k, v, r)
        st = dpa._fp8_state
        prev = amaxes[-2] if len(amaxes) > 1 else torch.zeros((), dtype=F32)
        assert torch.equal(st.fwd.amax_history[:, QKV], torch.stack([torch.zeros((), dtype=F32), prev, amaxes[-1]]))
        window = torch.stack(amaxes[-3:]).max()
        assert torch.equal(st.fwd.scale[QKV], torch.tensor(224.0, dtype=F32) / window)
    assert torch.equal(st.fwd.scale[[0, 1, 4, 5, 6, 7]], torch.ones(6))  # slots attention does not use


def test_most_recent_and_a_region_without_the_module():
    dpa, r = module(), delayed(amax_history_len=2)
    q, k, v = bshd(1)
    step(dpa, q, k, v, r)
    scale = dpa._fp8_state.fwd.scale.clone()
    history = dpa._fp8_state.fwd.amax_history.clone()
    assert torch.equal(scale[QKV], torch.tensor(E4M3_MAX, dtype=F32) / _qkv_amax(q, k, v))
    with te.autocast(recipe=r):  # the module is registered but does not run: its amax is 0
        pass
    assert torch.equal(dpa._fp8_state.fwd.scale, scale) and torch.equal(dpa._fp8_state.fwd.amax_history, history)


def test_no_update_without_gradients_or_after_an_exception():
    dpa, r = module(), delayed()
    q, k, v = bshd(2)
    with torch.no_grad():
        step(dpa, q, k, v, r)
    assert torch.equal(dpa._fp8_state.fwd.scale, torch.ones(9))  # amax waits in row 0 for a training exit
    assert dpa._fp8_state.fwd.amax_history[0, QKV] > 0
    with pytest.raises(RuntimeError, match="boom"):
        with te.autocast(recipe=r):
            dpa(q, k, v)
            raise RuntimeError("boom")
    assert torch.equal(dpa._fp8_state.fwd.scale, torch.ones(9))


def test_backward_scales_update_at_the_end_of_the_backward():
    dpa, r = module(), delayed()
    q, k, v = bshd(3)
    dout = torch.randn(2, 32, 4 * 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    step(dpa, q, k, v, r, dout)
    bwd = dpa._fp8_state.bwd
    assert torch.equal(bwd.scale[DO], torch.tensor(E5M2_MAX, dtype=F32) / dout.abs().max().float())
    grads_amax = torch.stack([t.grad.abs().max().float() for t in (q, k, v)]).max()
    torch.testing.assert_close(bwd.scale[DQKV], torch.tensor(E5M2_MAX) / grads_amax, rtol=0.15, atol=0)  # dQKV: E5M2-rounded
    assert bwd.scale[DP] > 1 and torch.equal(bwd.amax_history[0], torch.zeros(6))


def test_high_precision_backward_records_no_backward_amax(monkeypatch):
    monkeypatch.setenv("NVTE_FP8_DPA_BWD", "0")
    dpa = module()
    q, k, v = bshd(4)
    step(dpa, q, k, v, delayed(), torch.ones(2, 32, 256, dtype=torch.bfloat16))
    assert torch.equal(dpa._fp8_state.bwd.scale, torch.ones(6)) and torch.equal(dpa._fp8_state.bwd.amax_history, torch.zeros(1, 6))
    assert dpa._fp8_state.fwd.scale[QKV] != 1


@pytest.mark.parametrize("amax,expected", [(0.0, 7.0), (float("inf"), 7.0), (float("nan"), 7.0), (1e-45, torch.finfo(F32).max),
                                           (2.0, 112.0)])
def test_scale_rules_at_the_edges(amax, expected):
    """TE's rules: an amax of 0 (nothing ran), inf or NaN keeps the scale; an overflowing one
    becomes FP32_MAX; otherwise fp8_max / 2**margin / amax."""
    state = ScalingState(torch.full((1,), 7.0), torch.zeros(1, 1))
    delayed_update(state, torch.tensor([amax]), delayed(margin=1), E4M3_MAX)
    assert state.scale.item() == pytest.approx(expected)


def test_callable_algorithms_get_the_history_and_the_amax():
    seen = {}

    def amax_algo(history):
        seen["history"] = history.clone()
        return history.mean(dim=0)

    def scale_algo(amax, scale, fp8_max, r):
        return fp8_max / (2 * amax)

    state = ScalingState(torch.ones(2), torch.tensor([[4.0, 2.0], [2.0, 6.0]]))
    delayed_update(state, torch.zeros(2), delayed(amax_history_len=2, amax_compute_algo=amax_algo,
                                                  scaling_factor_compute_algo=scale_algo), 448.0)
    assert torch.equal(seen["history"], torch.tensor([[4.0, 2.0], [2.0, 6.0]]))
    torch.testing.assert_close(state.scale, torch.tensor([448.0 / 6, 448.0 / 8]))
    assert torch.equal(state.amax_history, torch.tensor([[0.0, 0.0], [4.0, 2.0]]))


@pytest.mark.parametrize("length", [1, 2, 5, 300])  # 300: three tiles of rows
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_the_one_launch_update_equals_the_pytorch_one(length, algo):
    """The Triton update (CUDA's; here through Triton's CPU interpreter) against the PyTorch
    formulation, bit for bit: slots that ran and did not, amaxes of 0, inf, NaN and tiny ones,
    NaN in the history, old scales of inf, a margin."""
    pytest.importorskip("triton")
    from transformer_engine.pytorch.attention.dot_product_attention.fp8 import state as state_mod

    gen = torch.Generator().manual_seed(length)
    history = torch.rand(length, 9, generator=gen) * 4
    history[0, 1] = float("nan") if length > 1 else 0.0
    history[-1, 2] = float("nan")
    reduced = torch.tensor([0.0, 3.0, 0.5, float("inf"), float("nan"), 1e-45, 0.0, 2.0, 7.0])
    history[0, 6] = 0.0  # slot 6: nothing ran this step
    scale = torch.rand(9, generator=gen) + 0.5
    scale[7] = float("inf")
    recipe_ = delayed(amax_history_len=length, amax_compute_algo=algo, margin=1)
    want, got = ScalingState(scale.clone(), history.clone()), ScalingState(scale.clone(), history.clone())
    delayed_update(want, reduced.clone(), recipe_, E4M3_MAX)  # CPU tensors: the PyTorch formulation
    state_mod._launch_update(got.amax_history, reduced.clone(), got.scale, recipe_, E4M3_MAX)
    # Exact on any CPU by construction: both sides take maxima, selections and one correctly
    # rounded float32 division per slot (the kernel's div_rn, torch's true division), no sums.
    assert torch.equal(got.amax_history.nan_to_num(-1.0), want.amax_history.nan_to_num(-1.0))
    assert torch.equal(got.scale, want.scale)


def test_the_one_launch_update_runs_where_its_kernel_applies(monkeypatch):
    """CUDA and the built-in algorithms take the kernel; a callable recipe hook keeps PyTorch."""
    from transformer_engine.pytorch.attention.dot_product_attention.fp8 import state as state_mod

    cuda_like = torch.zeros(2, 3)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(state_mod, "triton_available", lambda: True)
    assert state_mod._one_launch(cuda_like, delayed())
    assert not state_mod._one_launch(cuda_like, delayed(amax_compute_algo=lambda h: h.amax(0)))
    assert not state_mod._one_launch(cuda_like, delayed(scaling_factor_compute_algo=lambda a, s, m, r: s))
    assert not state_mod._one_launch(cuda_like.t(), delayed())


# ---------------------------------------------------------------------------------- current scaling


def test_current_scaling_keeps_delayed_scaling_for_s_and_dp(monkeypatch):
    monkeypatch.setenv("NVTE_DPA_FP8DS_AMAX_HISTLEN", "3")
    dpa, r = module(), recipe.Float8CurrentScaling(fp8_dpa=True)
    q, k, v = bshd(5)
    step(dpa, q, k, v, r, torch.ones(2, 32, 256, dtype=torch.bfloat16))
    st = dpa._fp8_state
    assert isinstance(st.recipe, recipe.DelayedScaling) and (st.recipe.amax_history_len, st.recipe.amax_compute_algo) == (3, "most_recent")
    assert st.fwd.scale[S] != 1 and st.bwd.scale[DP] != 1  # S and dP: delayed
    assert st.fwd.scale[QKV] == 1 and st.fwd.scale[O] == 1 and st.bwd.scale[DO] == 1 and st.bwd.scale[DQKV] == 1
    monkeypatch.setenv("NVTE_DPA_FP8DS_AMAX_HISTLEN", "x")
    with pytest.raises(ValueError, match="NVTE_DPA_FP8DS_AMAX_HISTLEN must be a positive int; got 'x'"):
        step(dpa, q, k, v, r)


# ---------------------------------------------------------------------------------- reduction over a group


def _reduction_body(rank: int, world: int) -> None:
    """One spawn for the three cases (a spawn costs more than the cases): the default group,
    a given group, and no reduction."""
    import torch.distributed as dist

    for reduce_amax, group in ((True, None), (True, dist.new_group([0, 1])), (False, None)):
        FP8GlobalStateManager.reset()
        dpa = module()
        q, k, v = (t.detach() * (rank + 1) * 3 for t in bshd(10 + rank))
        with te.autocast(recipe=delayed(reduce_amax=reduce_amax), amax_reduction_group=group):
            dpa(q, k, v)
        local = _qkv_amax(q, k, v).reshape(1)
        every = [torch.zeros(1, dtype=F32) for _ in range(world)]
        dist.all_gather(every, local)
        expected = torch.cat(every).max() if reduce_amax else local[0]
        assert torch.equal(dpa._fp8_state.fwd.scale[QKV], torch.tensor(E4M3_MAX, dtype=F32) / expected), (reduce_amax, group)
        assert torch.equal(dpa._fp8_state.fwd.amax_history[0], torch.zeros(9))


def test_amax_reduction_over_a_gloo_group_of_two():
    run_distributed(_reduction_body, 2)


# ---------------------------------------------------------------------------------- checkpoints


def test_extra_state_is_empty_without_fp8_and_te_shaped_with_it():
    dpa = module()
    assert torch.equal(dpa.state_dict()["_extra_state"], torch.empty(0, dtype=torch.uint8))
    q, k, v = bshd(6)
    step(dpa, q, k, v, delayed(amax_history_len=4))
    blob = dpa.state_dict()["_extra_state"]
    assert blob.dtype == torch.uint8
    payload = pickle.loads(blob.numpy().tobytes())
    assert set(payload) == {"recipe", "scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd", "extra_fp8_variables"}
    assert [tuple(payload[k].shape) for k in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")] == [(9,), (4, 9), (6,), (4, 6)]
    assert payload["extra_fp8_variables"]["num_gemms"] == 3 and payload["recipe"] == delayed(amax_history_len=4)
    assert b"transformer_engine.common.recipe" in blob.numpy().tobytes() and b"_FormatHelper" in blob.numpy().tobytes()


def _train(dpa, steps, seed, r):
    out = None
    for i in range(steps):
        q, k, v = bshd(seed + i)
        out = step(dpa, q, k, v, r, torch.ones(2, 32, 256, dtype=torch.bfloat16))
    return out, (q.grad, k.grad, v.grad)


def test_a_restored_module_computes_the_same_fp8_result():
    r = delayed(amax_history_len=3, amax_compute_algo="max")
    trained = module()
    _train(trained, 3, 20, r)
    restored = module()
    restored.load_state_dict(trained.state_dict())
    out_a, grads_a = _train(trained, 2, 40, r)
    out_b, grads_b = _train(restored, 2, 40, r)
    assert torch.equal(out_a, out_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert torch.equal(trained._fp8_state.bwd.amax_history, restored._fp8_state.bwd.amax_history)


def _te_pickled_recipe(fields, cls=recipe.DelayedScaling):
    """A recipe as TE 2.x pickles its (pydantic) records: the class path and the instance dict,
    which carries the fields of that release (here one this release lacks, and one missing)."""
    r = object.__new__(cls)
    r.__dict__.update(fields)
    return r


def test_a_state_pickled_the_way_te_does_loads():
    te_fields = {"margin": 0, "fp8_format": recipe.Format.HYBRID, "amax_history_len": 2, "amax_compute_algo": "max",
                 "reduce_amax": True, "fp8_dpa": True, "fp8_mha": False, "backward_override": None, "_cached_repr": None}
    history = torch.tensor([[0.0] * 9, [0.0, 0.0, 3.0, 2.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    state = {"recipe": _te_pickled_recipe(te_fields), "scale_fwd": torch.full((9,), 2.0), "amax_history_fwd": history,
             "scale_bwd": torch.full((6,), 3.0), "amax_history_bwd": torch.zeros(2, 6),
             "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": 3, "fp8_max_fwd": 448, "fp8_max_bwd": 57344,
                                     "local_recipes": []}}
    blob = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
    dpa = module()
    dpa.load_state_dict({"_extra_state": blob})
    st = dpa._fp8_state
    assert isinstance(st.recipe, recipe.DelayedScaling) and st.recipe.amax_history_len == 2
    assert st.recipe.scaling_factor_compute_algo is None  # a field TE's pickle lacked takes its default
    assert b"transformer_engine.common.recipe" in blob.numpy().tobytes()
    assert torch.equal(st.fwd.scale, torch.full((9,), 2.0)) and torch.equal(st.fwd.amax_history, history)
    q, k, v = bshd(7)
    step(dpa, q, k, v, st.recipe)  # the history continues: the window is the loaded 3.0 and this step's amax
    assert torch.equal(dpa._fp8_state.fwd.amax_history[:, QKV], torch.stack([torch.zeros(()), _qkv_amax(q, k, v)]))
    assert torch.equal(dpa._fp8_state.fwd.scale[QKV], torch.tensor(E4M3_MAX, dtype=F32) / torch.clamp(_qkv_amax(q, k, v), min=3.0))


def test_a_te_state_naming_classes_this_package_lacks_loads(monkeypatch):
    """TE's current-scaling runs pickle a Float8CurrentScaling (with TE's QParams records) among
    extra_fp8_variables["local_recipes"]: the state still loads; the unknown records are kept."""

    class QParams:  # stands for TE's class while pickling; absent when loading
        def __init__(self):
            self.power_2_scale = False

    QParams.__module__, QParams.__qualname__ = "transformer_engine.common.recipe", "QParams"
    monkeypatch.setattr(recipe, "QParams", QParams, raising=False)
    current = _te_pickled_recipe({"fp8_format": recipe.Format.HYBRID, "fp8_dpa": True, "fp8_mha": False,
                                  "fp8_quant_fwd_inp": QParams()}, recipe.Float8CurrentScaling)
    state = {"recipe": delayed(), "scale_fwd": torch.full((9,), 2.0), "amax_history_fwd": torch.zeros(1, 9),
             "scale_bwd": torch.ones(6), "amax_history_bwd": torch.zeros(1, 6),
             "extra_fp8_variables": {"num_gemms": 3, "local_recipes": [current, delayed()]}}
    blob = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
    monkeypatch.delattr(recipe, "QParams")
    dpa = module()
    dpa.load_state_dict({"_extra_state": blob})
    assert torch.equal(dpa._fp8_state.fwd.scale, torch.full((9,), 2.0))


def test_older_te_states_and_keys_load():
    v1 = {"scale_fwd": torch.full((9,), 5.0), "scale_inv_fwd": torch.full((9,), 0.2), "amax_history_fwd": torch.zeros(1, 9),
          "scale_bwd": torch.ones(6), "scale_inv_bwd": torch.ones(6), "amax_history_bwd": torch.zeros(1, 6)}
    buffer = io.BytesIO()
    torch.save(v1, buffer)
    dpa = module()
    dpa.load_state_dict({"fused_attention._extra_state": buffer})  # TE 1.6's key, TE 1.x's torch.save format
    assert dpa._fp8_state.recipe == recipe.DelayedScaling() and torch.equal(dpa._fp8_state.fwd.scale, torch.full((9,), 5.0))


@pytest.mark.parametrize("state,error,message", [
    (torch.zeros(3, dtype=torch.int32), TypeError, r"_extra_state must be a 1-D uint8 tensor .*got a \(3,\) torch.int32 tensor"),
    ("blob", TypeError, "_extra_state must be a 1-D uint8 tensor .*got str"),
    (torch.frombuffer(bytearray(pickle.dumps({"recipe": recipe.DelayedScaling(), "scale_fwd": torch.ones(4)})), dtype=torch.uint8),
     ValueError, r"scale_fwd must be a float32 tensor of shape \(9,\); got \(4,\)"),
])
def test_bad_extra_state_is_named(state, error, message):
    with pytest.raises(error, match=message):
        module().set_extra_state(state)


# ---------------------------------------------------------------------------------- selection and refusals


def test_fp8_selects_the_emulation_and_names_why_not_the_others():
    dpa = module()
    q, k, v = bshd(8)
    step(dpa, q, k, v, delayed())
    selection = dpa.last_selection
    assert selection.label == "UnfusedDotProductAttention"
    report = selection.report()
    fused = next(line for line in report.splitlines() if line.strip().startswith("FusedAttention:"))
    assert "device=cpu" in fused and "fp8" not in fused, "cuDNN runs FP8 (test_fp8_cudnn.py has its FP8 rules)"
    assert "FA3's FP8 kernels are forward-only" in report


def test_without_the_emulation_no_backend_runs_fp8(monkeypatch):
    dpa = module()
    q, k, v = bshd(8)
    with te.autocast(recipe=delayed()):
        monkeypatch.setenv(EMULATE, "0")
        with pytest.raises(NoBackendError, match="NVTE_UnfusedDPA_Emulate_FP8=0 \\(supported: 1 \\(this backend runs FP8"):
            dpa(q, k, v)


def test_fp8_attention_takes_half_precision_inputs():
    dpa = module()
    q, k, v = bshd(8, dtype=torch.float32)
    with te.autocast(recipe=delayed()), pytest.raises(NoBackendError, match="qkv_dtype=torch.float32 with FP8 attention"):
        dpa(q, k, v)


def test_recipes_without_fp8_dpa_leave_attention_in_high_precision():
    dpa = module()
    q, k, v = bshd(8)
    expected = dpa(q, k, v)
    with te.autocast(recipe=delayed(fp8_dpa=False)):
        out = dpa(q, k, v)
    assert torch.equal(out, expected) and getattr(dpa, "_fp8_state", None) is None
    with te.autocast(enabled=False, calibrating=True, recipe=delayed()):  # attention records nothing, as in TE
        assert torch.equal(dpa(q, k, v), expected)


def test_fp8_mha_and_fp8_output_are_refused_by_name():
    dpa = module()
    q, k, v = bshd(8)
    with te.autocast(recipe=delayed(fp8_mha=True)), pytest.raises(NotImplementedError, match=r"DelayedScaling\(fp8_mha=True\) is not implemented: FP8 multi-head attention"):
        dpa(q, k, v)
    with te.autocast(recipe=delayed()), pytest.raises(NotImplementedError, match="^fp8_output is not implemented; pass False"):
        dpa(q, k, v, fp8_output=True)


def test_fp8_with_context_parallelism_is_refused_before_any_collective(monkeypatch):
    from types import SimpleNamespace

    dpa = module()
    monkeypatch.setattr(type(dpa), "cp_config", property(lambda self: SimpleNamespace(size=2)))  # as a 2-rank group's
    dpa.cp_group = "a group of two ranks"
    q, k, v = bshd(8)
    with te.autocast(recipe=delayed()), pytest.raises(NotImplementedError, match="FP8 attention \\(fp8_dpa=True\\) with context parallelism is not implemented"):
        dpa(q, k, v)


def test_fast_path_key_carries_the_fp8_mode():
    dpa = module()
    q, k, v = bshd(8)
    high = dpa(q, k, v)
    low = step(dpa, q, k, v, delayed())
    assert not torch.equal(high, low) and torch.equal(dpa(q, k, v), high)
    assert len(dpa._recipes) == 2  # one cached recipe per mode


def test_fp8_under_torch_compile_is_refused_by_name(monkeypatch):
    from transformer_engine.pytorch.attention.dot_product_attention.fp8 import context

    monkeypatch.setattr(context, "compiling", lambda: True)  # what torch.compile's tracing reports
    dpa = module()
    q, k, v = bshd(8)
    with te.autocast(recipe=delayed()), pytest.raises(NotImplementedError, match="FP8 attention \\(fp8_dpa=True\\) under torch.compile is not supported"):
        dpa(q, k, v)
