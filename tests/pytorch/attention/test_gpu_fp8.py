"""FusedAttention in FP8 (cuDNN's sdpa_fp8 / sdpa_fp8_backward) on the GPU, on TE's FP8 test
configurations (bshd/sbhd, causal and not, GQA, head dims 64 and 128; b=2, s=512, 4 heads):

- against the float64 reference: TE's fp8_vs_f16 bar, RMSE < 0.11 x the value range, for the
  output and dQ, dK, dV, with the FP8 backward and with NVTE_FP8_DPA_BWD=0;
- against the unfused emulation (the CPU oracle of part 1), same module state, same scales:
  "closely" is RMSE < 0.01 x range for the output and < 0.03 x range for the gradients (the
  emulation quantizes at the same points, but cuDNN's S, O and dP come from its own fp32 order,
  and its backward reads the FP8 O in rowsum(dO * O): a value near an FP8 grid edge rounds to
  the other side, by 6% (E4M3) or 25% (E5M2) of itself). The FP8 Q/K/V are the emulation's
  bytes exactly, so the QKV and dO slots must agree exactly;
- the delayed-scaling state after three steps against the emulation's, slot by slot (dP is
  softmax_scale x the emulation's: cuDNN's dP is the gradient of Q K^T, attn_scale included);
- THD forward in FP8 (ragged offsets, NaN gaps), a declared qkv_layer (one cast, zero-copy views)
  against separate tensors, the one-pass cast's and dequantization's bits, the scale update's
  bits, a sync-free step, the cast kernel count, and megatron-core's fp8_dot_product_attention
  reaching this path (skipped where megatron-core is not installed, as on the lent H200 so far:
  test_fp8_emulation.py runs megatron's configuration on the CPU).

With TE_FP8_GPU_RESULTS=<file> every comparison appends its numbers there as JSON lines
(benchmarks/results/ keeps them). Skipped without CUDA."""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.attention import backend_scope

from .fp8_helpers import DO, DP, DQKV, O, QKV, S as SLOT_S, fp8_clean, rel_rmse  # noqa: F401 (fp8_clean: autouse)
from .gpu_helpers import env, run_on, sync_errors
from .packing import make_thd
from .reference import reference_dense, reference_thd

pytestmark = pytest.mark.gpu
B, S, H = 2, 512, 4
E4M3 = torch.float8_e4m3fn
TE_TOL, OUT_TOL, GRAD_TOL = 0.11, 0.01, 0.03


def _recipe():
    return recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=4, amax_compute_algo="max", fp8_dpa=True)


def _record(case: str, **numbers) -> None:
    path = os.environ.get("TE_FP8_GPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(dict(case=case, **numbers)) + "\n")


def _inputs(seed, fmt, hg, d):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (S, B) if fmt == "sbhd" else (B, S)
    qkv = [torch.randn(*shape, n, d, generator=g, device="cuda").to(torch.bfloat16).requires_grad_() for n in (H, hg, hg)]
    dout = torch.randn(*shape, H * d, generator=g, device="cuda").to(torch.bfloat16)
    return qkv, dout


def _reference(qkv, dout, fmt, mask, d):
    """float64 attention and its gradients, in bshd order (CPU)."""
    to_bshd = (lambda t: t.transpose(0, 1)) if fmt == "sbhd" else (lambda t: t)
    leaves = [to_bshd(t.detach()).double().cpu().requires_grad_() for t in qkv]
    out = reference_dense(*leaves, mask, None, 1 / math.sqrt(d))
    out.reshape(B, S, -1).backward(to_bshd(dout).double().cpu())
    return out.reshape(B, S, -1), [t.grad for t in leaves]


def _steps(label, fmt, mask, hg, d, steps=3):
    """``steps`` training steps of one module on ``label``; the last step's (out, grads) in bshd
    order, and the module's FP8 state."""
    dpa = te.DotProductAttention(H, d, num_gqa_groups=hg, qkv_format=fmt, attn_mask_type=mask)
    to_bshd = (lambda t: t.transpose(0, 1)) if fmt == "sbhd" else (lambda t: t)
    for i in range(steps):
        qkv, dout = _inputs(i, fmt, hg, d)
        with te.autocast(recipe=_recipe()):
            out = run_on(label, dpa, *qkv)
        out.backward(dout)
    return (to_bshd(out), [to_bshd(t.grad) for t in qkv]), dpa._fp8_state, (qkv, dout)


CONFIGS = [(fmt, mask, hg) for fmt in ("bshd", "sbhd") for mask in ("no_mask", "causal") for hg in (4, 1)]


@pytest.mark.parametrize("bwd", ["fp8", "f16"])
@pytest.mark.parametrize("fmt,mask,hg", CONFIGS, ids=[f"{f}-{m}-hg{g}" for f, m, g in CONFIGS])
def test_fp8_vs_f16_and_the_emulation(fmt, mask, hg, bwd):
    """d=128, three steps: TE's bar against float64, "closely" against the emulation, and the
    states slot by slot."""
    with env(NVTE_FP8_DPA_BWD="1" if bwd == "fp8" else "0"):
        (out, grads), state, (qkv, dout) = _steps("FusedAttention", fmt, mask, hg, 128)
        (emu_out, emu_grads), emu_state, _ = _steps("unfused", fmt, mask, hg, 128)
    ref, ref_grads = _reference(qkv, dout, fmt, mask, 128)
    numbers = dict(out_vs_f16=rel_rmse(out.reshape(ref.shape), ref), out_vs_emulation=rel_rmse(out, emu_out),
                   emulation_vs_f16=rel_rmse(emu_out.reshape(ref.shape), ref))
    for name, g, e, r in zip("qkv", grads, emu_grads, ref_grads):
        numbers[f"d{name}_vs_f16"], numbers[f"d{name}_vs_emulation"] = rel_rmse(g, r), rel_rmse(g, e)
    _record(f"fp8-{bwd}-bwd {fmt} {mask} {H}:{hg} d128", **numbers)
    assert all(v < TE_TOL for k, v in numbers.items() if k.endswith("vs_f16")), numbers
    assert numbers["out_vs_emulation"] < OUT_TOL, numbers
    assert all(numbers[f"d{n}_vs_emulation"] < GRAD_TOL for n in "qkv"), numbers
    _check_states(state, emu_state, bwd == "fp8")


def _check_states(state, emu, backward_fp8: bool):
    """QKV and dO: the same casts of the same tensors (exact); O, dQKV: close; S: cuDNN's amax of
    the softmax output against the emulation's; dP: softmax_scale x the emulation's."""
    f, ef = state.fwd.amax_history, emu.fwd.amax_history
    assert torch.equal(f[:, QKV], ef[:, QKV])
    torch.testing.assert_close(f[:, O], ef[:, O], rtol=0.02, atol=0)
    torch.testing.assert_close(f[:, SLOT_S], ef[:, SLOT_S], rtol=0.02, atol=0,
                               msg=lambda m: f"amax_S: cuDNN {f[:, SLOT_S].tolist()} vs the emulation {ef[:, SLOT_S].tolist()}\n{m}")
    if not backward_fp8:
        return
    b, eb = state.bwd.amax_history, emu.bwd.amax_history
    assert torch.equal(b[:, DO], eb[:, DO])
    # cuDNN's backward quantizes the softmax it recomputes from the stats (normalized); the
    # emulation differentiates through the forward's row-relative S: the largest gradient moves
    # by up to ~6% (5.6% on the H200 at dc4c5e6) while the gradients stay within 0.008 of the range.
    torch.testing.assert_close(b[:, DQKV], eb[:, DQKV], rtol=0.08, atol=0)
    filled = eb[:, DP] > 0  # history rows a step wrote (row 0 is cleared by the update)
    assert torch.equal(b[:, DP] > 0, filled)
    ratio = (b[filled, DP] / eb[filled, DP]).tolist()
    assert ratio and all(abs(r * math.sqrt(128) - 1) < 0.05 for r in ratio), \
        f"amax_dP / the emulation's = {ratio}, expected {1 / math.sqrt(128):.4f}"


@pytest.mark.parametrize("case", ["dense-padding", "bottom-right-cross"])
def test_padding_and_bottom_right(case):
    """Dense padding through per-sequence lengths (FP8 forward and backward) and a bottom-right
    causal cross-attention forward (sq 256 < skv 512; no gradients: its FP8 backward is
    Blackwell-only): TE's bar against float64, close to the emulation, rows past a length 0.
    cuDNN 9.19 builds no FP8 forward with a bottom-right diagonal on sm90 (its first run here):
    there the declaration refuses it by name and the test is skipped with that reason."""
    (q, k, v), _ = _inputs(60, "bshd", 2, 128)
    if case == "dense-padding":
        lengths = torch.tensor([400, 512], dtype=torch.int32)
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0, dtype=torch.int32)]).cuda()
        mask, kwargs, grad = "padding_causal", dict(cu_seqlens_q=cu, cu_seqlens_kv=cu), True
    else:
        q, lengths = q[:, :256].detach(), None
        mask, kwargs, grad = "causal_bottom_right", {}, False
        if torch.cuda.get_device_capability()[0] == 9:
            dpa = te.DotProductAttention(H, 128, num_gqa_groups=2, qkv_format="bshd", attn_mask_type=mask)
            with te.autocast(recipe=_recipe()), torch.no_grad():
                run_on("FusedAttention", dpa, q, k, v, expect_refusal="only supported on Blackwell")
    results = {}
    for label in ("FusedAttention", "unfused"):
        leaves = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
        dpa = te.DotProductAttention(H, 128, num_gqa_groups=2, qkv_format="bshd", attn_mask_type=mask)
        with te.autocast(recipe=_recipe()), torch.set_grad_enabled(grad):
            out = run_on(label, dpa, *leaves, **kwargs)
        if grad:
            out.float().pow(2).sum().backward()
        results[label] = [out] + ([t.grad for t in leaves] if grad else [])
    ref_leaves = [t.detach().double().cpu() for t in (q, k, v)]
    ref = reference_dense(*ref_leaves, mask, None, 1 / math.sqrt(128), lengths, lengths).reshape(results["unfused"][0].shape)
    got, emu = results["FusedAttention"], results["unfused"]
    numbers = dict(out_vs_f16=rel_rmse(got[0], ref), out_vs_emulation=rel_rmse(got[0], emu[0]))
    numbers.update({f"d{n}_vs_emulation": rel_rmse(g, e) for n, g, e in zip("qkv", got[1:], emu[1:])})
    _record(f"fp8 {case} 4:2 d128", **numbers)
    assert numbers["out_vs_f16"] < TE_TOL and numbers["out_vs_emulation"] < OUT_TOL, numbers
    assert all(v < GRAD_TOL for k_, v in numbers.items() if k_.startswith("d")), numbers
    if lengths is not None:
        assert (got[0][0, 400:] == 0).all() and all((g[0, 400:] == 0).all() for g in got[1:])


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_head_dim_64(fmt):
    """d=64: forward in FP8; on Hopper the FP8 backward refused by name (its sdpa_fp8_backward
    takes 128 only; on Blackwell, which takes 64, only the forward is checked here)."""
    dpa = te.DotProductAttention(H, 64, num_gqa_groups=2, qkv_format=fmt, attn_mask_type="causal")
    qkv, dout = _inputs(5, fmt, 2, 64)
    if torch.cuda.get_device_capability()[0] == 9:  # Blackwell's FP8 backward takes d=64
        with te.autocast(recipe=_recipe()), backend_scope(allow=["FusedAttention"]):
            with pytest.raises(NotImplementedError, match="head_dim_qk=64 with FP8 gradients on sm90"):
                dpa(*qkv)
    with te.autocast(recipe=_recipe()), torch.no_grad():
        out = run_on("FusedAttention", dpa, *qkv)
    ref, _ = _reference(qkv, dout, fmt, "causal", 64)
    to_bshd = (lambda t: t.transpose(0, 1)) if fmt == "sbhd" else (lambda t: t)
    assert rel_rmse(to_bshd(out).reshape(ref.shape), ref) < TE_TOL
    with env(NVTE_FP8_DPA_BWD="0"), te.autocast(recipe=_recipe()):
        out = run_on("FusedAttention", dpa, *qkv)
    out.backward(dout)
    _, ref_grads = _reference(qkv, dout, fmt, "causal", 64)
    assert all(rel_rmse(to_bshd(t.grad), r) < TE_TOL for t, r in zip(qkv, ref_grads))


def test_thd_forward_with_gaps():
    """THD in FP8 (ragged offsets and a padding mask; forward only on Hopper): NaN gaps set no
    scale and stay out, gap rows come out 0; TE's bar against float64, close to the emulation."""
    lengths, gaps = [300, 77, 512, 100], [5, 0, 64, 3]
    p = make_thd(lengths, gaps_q=gaps, h=H, hg=2, d=128, dtype=torch.bfloat16, device="cuda", tail=7, seed=11)
    kwargs = p.kwargs(True, 512, 512, shared=True)
    outs = {}
    for label in ("FusedAttention", "unfused"):
        dpa = te.DotProductAttention(H, 128, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal")
        for _ in range(2):
            with te.autocast(recipe=_recipe()), torch.no_grad():
                outs[label] = run_on(label, dpa, p.q, p.k, p.v, **kwargs)
    out, emu = outs["FusedAttention"], outs["unfused"]
    assert (out[~p.valid_q] == 0).all() and torch.isfinite(out).all()
    ref = reference_thd(*(t.detach().double().cpu() for t in (p.q, p.k, p.v)), *(x.cpu() for x in (p.cu_q, p.cu_q, p.off_q, p.off_q)),
                        ["padding_causal"] * 4, [None] * 4, 1 / math.sqrt(128))
    valid = p.valid_q.cpu()
    numbers = dict(out_vs_f16=rel_rmse(out.cpu()[valid], ref.reshape(out.shape)[valid]),
                   out_vs_emulation=rel_rmse(out[p.valid_q], emu[p.valid_q]))
    _record("fp8-fwd thd gaps padding_causal 4:2 d128", **numbers)
    assert numbers["out_vs_f16"] < TE_TOL and numbers["out_vs_emulation"] < OUT_TOL, numbers


PACKINGS = [("bshd", -3), ("bshd", -2), ("sbhd", -3)]


@pytest.mark.parametrize("fmt,dim", PACKINGS)
def test_declared_qkv_layer_equals_separate_tensors(fmt, dim):
    """qkv_layer (one cast, zero-copy FP8 views, dQKV packed) against the separate-tensor path
    on the same views passed as three tensors (three casts, the same FP8 bytes and strides, so
    the same graph): the same output bit for bit, and gradients within the spread of cuDNN's
    backward (it accumulates dQ in a run-dependent order); against contiguous copies: close."""
    (q, k, v), dout = _inputs(21, fmt, H, 128)
    layer = torch.stack([t.detach() for t in (q, k, v)], dim=dim).requires_grad_()
    twin = layer.detach().clone().requires_grad_()
    copies = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    results = []
    for kwargs in (dict(qkv_layer=layer, qkv_interleave_dim=dim), dict(zip(("query_layer", "key_layer", "value_layer"),
                                                                           twin.unbind(dim))),
                   dict(zip(("query_layer", "key_layer", "value_layer"), copies))):
        dpa = te.DotProductAttention(H, 128, qkv_format=fmt, attn_mask_type="causal")
        with warnings.catch_warnings(), te.autocast(recipe=_recipe()):
            warnings.simplefilter("ignore", DeprecationWarning)  # the views found by pointers
            out = run_on("FusedAttention", dpa, **kwargs)
        out.backward(dout)
        results.append(out)
    assert torch.equal(results[0], results[1]) and rel_rmse(twin.grad, layer.grad) < 1e-3
    assert rel_rmse(results[2], results[0]) < 1e-3
    assert rel_rmse(torch.stack([t.grad for t in copies], dim=dim), layer.grad) < 1e-2


def _cast_both(x, dtype, valid):
    """(Triton's cast, PyTorch's cast), each with its own amax buffer."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import fp8_cast
    from transformer_engine.pytorch.attention.dot_product_attention.fp8.quantize import Quantizer

    fp8_max = 448.0 if dtype == E4M3 else 57344.0
    quantizers = [Quantizer(dtype, fp8_max, torch.tensor(7.3, device="cuda"), torch.zeros(4, device="cuda"), 1) for _ in range(2)]
    got = fp8_cast.fp8_like(x, dtype)
    assert fp8_cast._triton_fits(x, got, valid)
    fp8_cast._launch(x, got, quantizers[0], valid)
    want = fp8_cast.fp8_like(x, dtype)
    fp8_cast._cast_torch(x, want, quantizers[1], valid)
    return (got, quantizers[0].amax_buffer), (want, quantizers[1].amax_buffer)


@pytest.mark.parametrize("dtype", [E4M3, torch.float8_e5m2])
def test_one_pass_cast_bits(dtype):
    """The Triton cast writes the bytes of the PyTorch cast (the emulation's) and the same amax:
    a dense permuted 5-D layout (a packed sbh3d buffer seen as bshd) keeps its strides; a
    [T, H, D] tensor with valid rows zeroes the others and leaves them out of the amax."""
    packed = (torch.randn(257, 2, 4, 3, 128, device="cuda") * 30).to(torch.bfloat16).permute(1, 0, 3, 2, 4)
    thd = (torch.randn(4099, 8, 128, device="cuda") * 30).to(torch.bfloat16)
    for x, valid in ((packed, None), (thd, torch.rand(4099, device="cuda") > 0.3)):
        (got, amax), (want, want_amax) = _cast_both(x, dtype, valid)
        assert got.stride() == x.stride()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and torch.equal(amax, want_amax)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_pass_dequantize_bits(dtype):
    """The Triton dequantization writes PyTorch's bits (float32(x8) * descale, rounded once) in
    the FP8 tensor's strides."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.fp8_cast import _flat_dense, dequantize
    from transformer_engine.pytorch.attention.dot_product_attention.fp8.state import triton_available

    x8 = (torch.randn(3, 1025, 8, 128, device="cuda") * 100).clamp(-448, 448).to(E4M3).transpose(1, 2)  # no NaN bytes
    assert _flat_dense(x8) and triton_available()  # the kernel runs (else this compares PyTorch with itself)
    descale = torch.tensor([0.0123], device="cuda")[0]
    got = dequantize(x8, descale, dtype)
    assert got.stride() == x8.stride() and torch.equal(got, (x8.float() * descale).to(dtype))


@pytest.mark.parametrize("length", [1, 2, 16, 1024])  # 1 and 2: the roll's edges; 1024: TE's default, eight tiles
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_one_launch_update_bits(algo, length):
    """The Triton delayed-scaling update equals the PyTorch one on the GPU, bit for bit."""
    from transformer_engine.pytorch.attention.dot_product_attention.fp8 import state as state_mod

    history = torch.rand(length, 9, device="cuda") * 4
    history[length - 1, 1] = float("nan")  # in the window (a row the roll moves) when length > 1
    reduced = torch.tensor([0.0, 3.0, 0.5, float("inf"), float("nan"), 1e-45, 0.0, 2.0, 7.0], device="cuda")
    r = recipe.DelayedScaling(amax_history_len=length, amax_compute_algo=algo, margin=1)
    got = state_mod.ScalingState(torch.rand(9, device="cuda") + 0.5, history.clone())
    want = state_mod.ScalingState(got.scale.clone().cpu(), history.clone().cpu())
    assert state_mod._one_launch(got.amax_history, r)
    state_mod.delayed_update(got, reduced.clone(), r, 448.0)
    state_mod.delayed_update(want, reduced.cpu(), r, 448.0)  # the CPU: PyTorch's formulation
    assert torch.equal(got.scale.cpu(), want.scale)
    assert torch.equal(got.amax_history.cpu().nan_to_num(-1.0), want.amax_history.nan_to_num(-1.0))


def test_a_training_step_is_sync_free():
    """FP8 forward (its casts, tables, amaxes), the region's update, the FP8 backward and its
    update: no host sync (after a warm-up that builds the graphs)."""
    dpa = te.DotProductAttention(H, 128, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    for i in range(2):
        qkv, dout = _inputs(30 + i, "bshd", 2, 128)
        torch.cuda.synchronize()
        with sync_errors() if i else contextlib.nullcontext():
            with te.autocast(recipe=_recipe()):
                out = run_on("FusedAttention", dpa, *qkv)
            out.backward(dout)
    torch.cuda.synchronize()


def _count_cast_kernels(**kwargs) -> int:
    from torch.profiler import ProfilerActivity, profile

    dpa = te.DotProductAttention(H, 128, qkv_format="bshd", attn_mask_type="causal")
    with te.autocast(recipe=_recipe()), torch.no_grad():
        run_on("FusedAttention", dpa, **kwargs)  # warm-up: graphs, Triton compile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_on("FusedAttention", dpa, **kwargs)
            torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "cast_fp8" in e.key)


def test_the_packed_buffer_is_quantized_by_one_kernel():
    (q, k, v), _ = _inputs(40, "bshd", H, 128)
    layer = torch.stack([t.detach() for t in (q, k, v)], dim=-3)
    packed = _count_cast_kernels(qkv_layer=layer)
    separate = _count_cast_kernels(query_layer=q.detach(), key_layer=k.detach(), value_layer=v.detach())
    _record("cast kernels per FP8 forward", qkv_layer=packed, separate=separate)
    assert (packed, separate) == (1, 3)


def test_megatron_fp8_dot_product_attention_runs_on_cudnn():
    """megatron-core's --fp8-format hybrid --fp8-dot-product-attention (its TEDotProductAttention
    in its fp8 context) reaches cuDNN's FP8 path on the GPU."""
    pytest.importorskip("megatron.core")
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.fp8_utils import get_fp8_context
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=H * 128, num_attention_heads=H, num_query_groups=2, kv_channels=128,
                               attention_dropout=0.0, params_dtype=torch.bfloat16, fp8="hybrid", fp8_recipe="delayed",
                               fp8_dot_product_attention=True)
    attn = TEDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    qkv, dout = _inputs(50, "sbhd", 2, 128)
    with get_fp8_context(config):
        out = attn(*qkv, None, AttnMaskType.causal)
    out.backward(dout)
    assert attn.last_selection.label == "FusedAttention"
    assert attn._fp8_state.fwd.scale[QKV] != 1 and all(torch.isfinite(t.grad).all() for t in qkv)
