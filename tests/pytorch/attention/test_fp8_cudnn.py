"""FusedAttention's FP8 path on the CPU: its declaration (every FP8 rule named with its reason),
and its wiring, the package's FP8 ops and graphs (``backends/cudnn/fp8_ops.py``,
``fp8_graphs.py``) running on the cuDNN stand-in's ``sdpa_fp8`` / ``sdpa_fp8_backward`` nodes
(``stand_ins/cudnn.py``, ``cudnn_fp8_nodes.py``; fixture ``cudnn_lib``): the FP8 Q/K/V bytes,
the scalars each graph reads by uid, the slots each amax lands in, the delayed-scaling state
over steps against the unfused emulation, a declared packed buffer cast once and handed over
zero-copy, THD, NVTE_FP8_DPA_BWD=0, and the FP8 casts themselves (the Triton kernel through Triton's interpreter). The GPU side is
test_gpu_fp8.py."""

from __future__ import annotations

import math

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention import AttentionParams, backends
from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import fp8 as cudnn_fp8
from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.fp8_graphs import FP8_UID
from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.graphs import UID
from transformer_engine.pytorch.attention.dot_product_attention.selection.libraries import InstalledLibraries

from .fp8_helpers import DO, DP, DQKV, QKV, delayed, fp8_clean, rel_rmse  # noqa: F401  (fp8_clean: the autouse fixture)
from .stand_ins.cudnn_fp8_nodes import PAST_LENGTH, cast_fp8
from .packing import make_thd

E4M3 = torch.float8_e4m3fn
LIBS = InstalledLibraries(cudnn_frontend="1.32.0", cudnn=91900)
FUSED = backends.FusedAttention


# ---------------------------------------------------------------------------------- the declaration


def _reasons(monkeypatch=None, bwd="1", **kw):
    if monkeypatch is not None:
        monkeypatch.setenv("NVTE_FP8_DPA_BWD", bwd)
    base = dict(fp8=True, head_dim_qk=128, head_dim_v=128, attn_mask_type="causal")
    return [str(r) for r in FUSED.not_supported_reasons(AttentionParams(**{**base, **kw}), LIBS)]


def test_fp8_configurations_fused_attention_runs(monkeypatch):
    assert _reasons(monkeypatch) == []
    assert _reasons(monkeypatch, qkv_format="sbhd", attn_mask_type="no_mask", num_gqa_groups=4) == []
    assert _reasons(monkeypatch, head_dim_qk=64, head_dim_v=64, requires_grad=False) == []
    assert _reasons(monkeypatch, qkv_format="thd", attn_mask_type="padding_causal", requires_grad=False, pad_between_seqs=True) == []
    assert _reasons(monkeypatch, attn_mask_type="padding_causal", has_padding_mask=True) == []


@pytest.mark.parametrize("kw,field,why", [
    (dict(head_dim_qk=64, head_dim_v=64), "head_dim_qk=64 with FP8 gradients on sm90", "takes head dim 128 only"),
    (dict(qkv_format="thd", attn_mask_type="padding_causal"), "qkv_format=thd with FP8 gradients", "refuses ragged offsets"),
    (dict(attn_mask_type="causal_bottom_right", max_seqlen_q=64, max_seqlen_kv=128, compute_capability=(10, 0)),
     "attn_mask_type=causal_bottom_right", "no bottom-right diagonal on Hopper, and this package has not run it on Blackwell"),
])
def test_fp8_backward_rules_name_the_f16_backward_way_out(monkeypatch, kw, field, why):
    (reason,) = _reasons(monkeypatch, **kw)
    assert reason.startswith(field) and why in reason and "NVTE_FP8_DPA_BWD=0" in reason
    assert _reasons(monkeypatch, bwd="0", **kw) == [], "an FP8 forward with the high-precision backward runs them"


@pytest.mark.parametrize("kw,start,why", [
    (dict(fp8_recipe="Float8CurrentScaling"), "fp8_recipe=Float8CurrentScaling", "scales must exist before it runs"),
    (dict(compute_capability=(8, 9)), "compute_capability=sm89 with FP8", "Hopper or newer"),
    (dict(compute_capability=(12, 0)), "compute_capability=sm120 with FP8", "TE refuses"),
    (dict(head_dim_qk=72, head_dim_v=72, requires_grad=False), "head_dim_qk=72 in FP8", "multiples of 16 up to 128"),
    (dict(head_dim_v=64, requires_grad=False), "head_dim_v=64 with head_dim_qk=128 in FP8", "equal head dims"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1 in FP8", "not probed"),
    (dict(core_attention_bias_type="alibi"), "core_attention_bias_type=alibi in FP8", "no_bias"),
    (dict(softmax_type="learnable"), "softmax_type='learnable' in FP8", "vanilla"),
    (dict(return_max_logit=True), "return_max_logit=True in FP8", "False"),
    (dict(window_size=(8, 0)), "window_size=(8, 0) in FP8", "sliding windows"),
    (dict(attn_mask_type="causal_bottom_right", max_seqlen_q=64, max_seqlen_kv=128, requires_grad=False,
          compute_capability=(9, 0)), "attn_mask_type=causal_bottom_right with sq != skv possible in FP8 on sm90",
     "only supported on Blackwell"),
    (dict(qkv_format="thd", attn_mask_type="padding_causal", requires_grad=False,
          per_seq_policies=()), "attn_mask_type_per_seq=given in FP8", "one mask policy"),
])
def test_fp8_rules_name_what_they_refuse(monkeypatch, kw, start, why):
    if "per_seq_policies" in kw:
        from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType, MaskSpec

        kw["per_seq_policies"] = (MaskSpec(AttnMaskType.PADDING_CAUSAL, (-1, 0)), MaskSpec(AttnMaskType.PADDING, (-1, -1)))
    reasons = _reasons(monkeypatch, **kw)
    assert any(r.startswith(start) and why in r for r in reasons), reasons


def test_library_versions(monkeypatch):
    params = AttentionParams(fp8=True, head_dim_qk=128, head_dim_v=128)
    old = [str(r) for r in FUSED.not_supported_reasons(params, InstalledLibraries(cudnn_frontend="1.20.0", cudnn=91900))]
    assert any(r.startswith("cudnn_frontend=1.20.0 with FP8") for r in old)
    buggy = [str(r) for r in FUSED.not_supported_reasons(params, InstalledLibraries(cudnn_frontend="1.32.0", cudnn=91000))]
    assert any(r.startswith("cudnn=9.10.0 with FP8 gradients") for r in buggy)


def test_the_recipe_is_a_selection_fact():
    assert AttentionParams(fp8=True).fp8_recipe == "DelayedScaling"
    assert AttentionParams(fp8=False, fp8_recipe="Float8CurrentScaling").fp8_recipe is None
    meta = {"recipe": recipe.Float8CurrentScaling(fp8_dpa=True)}
    assert AttentionParams(fp8=True, fp8_meta=meta).fp8_recipe == "Float8CurrentScaling"


# ---------------------------------------------------------------------------------- the wiring


@pytest.fixture
def standin(cudnn_lib):
    """The cuDNN stand-in with the package's FP8 ops and graphs running on it."""
    return cudnn_lib


def _scalar(pack: dict, name: str) -> torch.Tensor:
    """The float32 [1, 1, 1, 1] scalar a graph reads for ``name`` (fp8_graphs' FP8_UID)."""
    return pack[FP8_UID[name]]


def _inputs(seed, b=2, s=32, h=4, hg=2, d=128, fmt="bshd"):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda n: (s, b, n, d)) if fmt == "sbhd" else (lambda n: (b, s, n, d))
    return [torch.randn(shape(n), generator=g).to(torch.bfloat16).requires_grad_() for n in (h, hg, hg)]


def _steps(backend, fmt="bshd", mask="causal", hg=2, d=128, steps=3, history=1, fp8_format=recipe.Format.HYBRID, dpa=None,
           first=0, **kw):
    """``steps`` training steps (inputs of seeds ``first``...) of one module (``dpa``, or a new
    one) on ``backend`` (forced); the last output and gradients, and the module's FP8 state."""
    dpa = dpa or te.DotProductAttention(4, d, num_gqa_groups=hg, qkv_format=fmt, attn_mask_type=mask)
    for i in range(first, first + steps):
        q, k, v = _inputs(i, hg=hg, d=d, fmt=fmt)
        dout = torch.randn(*q.shape[:2], 4 * d, generator=torch.Generator().manual_seed(50 + i)).to(torch.bfloat16)
        with backend_scope(force=backend):
            with te.autocast(recipe=delayed(amax_history_len=history, amax_compute_algo="max", fp8_format=fp8_format)):
                out = dpa(q, k, v, **kw)
            out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad], dpa._fp8_state


HYBRID, E4M3_FORMAT = recipe.Format.HYBRID, recipe.Format.E4M3


@pytest.mark.parametrize("fmt,mask,hg,fp8_format", [("bshd", "causal", 2, HYBRID), ("sbhd", "no_mask", 4, HYBRID),
                                                    ("bshd", "no_mask", 1, HYBRID), ("bshd", "causal", 2, E4M3_FORMAT)])
def test_three_steps_match_the_emulation(standin, fmt, mask, hg, fp8_format):
    """The stand-in computes cuDNN's FP8 graphs; so against the unfused emulation the output is
    the same computation (equal up to rounding order); the gradients differ where cuDNN's graph uses
    the FP8 O in rowsum(dO * O) (~0.5% of the range); the states agree slot by slot, except dP,
    which is softmax_scale times the emulation's (see fp8.py). The E4M3 recipe's backward runs
    dO and dQ/dK/dV in E4M3 (HYBRID's in E5M2)."""
    got, state = _steps(FUSED, fmt, mask, hg, fp8_format=fp8_format)
    (_, bwd), = standin.of("fp8_bwd")[-1:]
    grad_dtype = E4M3 if fp8_format == E4M3_FORMAT else torch.float8_e5m2
    assert bwd[UID["do"]].dtype == grad_dtype and bwd[UID["dq"]].dtype == grad_dtype
    want, ref_state = _steps(backends.UnfusedDotProductAttention, fmt, mask, hg, fp8_format=fp8_format)
    assert rel_rmse(got[0], want[0]) < 1e-3
    for grad, ref in zip(got[1:], want[1:]):  # E5M2 gradients: a tiny difference flips a value by 25%, rarely
        assert rel_rmse(grad, ref) < 0.02
    torch.testing.assert_close(state.fwd.scale, ref_state.fwd.scale, rtol=1e-5, atol=0)
    torch.testing.assert_close(state.fwd.amax_history, ref_state.fwd.amax_history, rtol=1e-5, atol=0)
    slots = [DO, DQKV]
    torch.testing.assert_close(state.bwd.amax_history[:, slots], ref_state.bwd.amax_history[:, slots], rtol=0.02, atol=0)
    ratio = state.bwd.scale[DP] / ref_state.bwd.scale[DP]
    assert abs(ratio.item() * (1 / math.sqrt(128)) - 1) < 0.05, "cuDNN's dP amax = softmax_scale x the emulation's"


def test_a_restored_module_computes_the_same_fp8_result_on_cudnn(standin):
    """A module restored from another's state_dict (TE's extra state) then trains exactly as
    the original on the cuDNN path: same outputs, gradients and histories."""
    trained = te.DotProductAttention(4, 128, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    _steps(FUSED, dpa=trained, history=3)
    restored = te.DotProductAttention(4, 128, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    restored.load_state_dict(trained.state_dict())
    got, got_state = _steps(FUSED, dpa=restored, history=3, steps=2, first=3)
    want, want_state = _steps(FUSED, dpa=trained, history=3, steps=2, first=3)
    # Exact by construction: the same ops on the same inputs in one process (one thread count),
    # so the only way the two runs differ is a state the checkpoint failed to restore.
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(got_state.fwd.amax_history, want_state.fwd.amax_history)
    assert torch.equal(got_state.bwd.amax_history, want_state.bwd.amax_history)


def _one_call(backend, mask, q, k, v, grad, **kw):
    dpa = te.DotProductAttention(4, 128, num_gqa_groups=k.shape[2], qkv_format="bshd", attn_mask_type=mask)
    leaves = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
    with backend_scope(force=backend), te.autocast(recipe=delayed()):
        out = dpa(*leaves, **kw)
    if grad:
        out.float().pow(2).sum().backward()
    return [out.detach()] + ([t.grad for t in leaves] if grad else [])


@pytest.mark.parametrize("case", ["dense-padding", "bottom-right-cross"])
def test_masks_against_the_emulation(standin, case):
    """Dense padding (per-sequence lengths, zero-filled FP8 buffers; FP8 backward) and a
    bottom-right causal cross-attention forward (sq < skv, no gradients) agree with the
    emulation; rows past a sequence's length come out 0."""
    q, k, v = (t.detach() for t in _inputs(9))
    if case == "dense-padding":
        cu = torch.tensor([0, 27, 59], dtype=torch.int32)
        args = dict(mask="padding_causal", grad=True, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    else:
        q = q[:, :16]
        args = dict(mask="causal_bottom_right", grad=False)
    mask, grad = args.pop("mask"), args.pop("grad")
    got = _one_call(FUSED, mask, q, k, v, grad, **args)
    (node, pack), = standin.of("fp8_fwd")
    assert node.args["use_causal_mask_bottom_right"] is (case == "bottom-right-cross")
    assert node.args["use_causal_mask"] is (case == "dense-padding") and node.padded is (case == "dense-padding")
    want = _one_call(backends.UnfusedDotProductAttention, mask, q, k, v, grad, **args)
    assert rel_rmse(got[0], want[0]) < 1e-3
    for g, w in zip(got[1:], want[1:]):
        assert rel_rmse(g, w) < 0.02
    if case == "dense-padding":
        assert (pack[UID["o"]][0, 27:].float() == PAST_LENGTH).all(), "the stand-in writes rows past the length, as the H200"
        assert (got[0][0, 27:] == 0).all() and all((g[0, 27:] == 0).all() for g in got[1:])


def test_what_the_kernels_receive(standin):
    """Q/K/V: the emulation's E4M3 bytes at the state's QKV scale (1 at the first step, then
    448 / amax); each graph scalar read from its own 16-byte row of one float32 table (the three
    Q/K/V descales one row); the forward's descale_s = 1/scale_s; the backward reads the
    forward's Q/K/V, O and S scalars, descale_o = 1 / the forward's scale_o, one scale for
    dQ/dK/dV, descale_dP = 1/scale_dP, and gets the forward's FP8 tensors and E5M2 dO (HYBRID)."""
    _steps(FUSED, steps=2)
    (_, fwd), (_, bwd) = standin.of("fp8_fwd")[-1], standin.of("fp8_bwd")[-1]
    q, k, v = _inputs(1)
    scale = 1 / _scalar(fwd, "descale_q").view(())
    for got, x in zip((fwd[UID[n]] for n in "qkv"), (q, k, v)):
        assert got.dtype == E4M3 and torch.equal(got.view(torch.uint8), cast_fp8(x.detach(), scale, E4M3).view(torch.uint8))
    for pack in (fwd, bwd):
        table = [_scalar(pack, n) for n in FP8_UID if FP8_UID[n] in pack and not n.startswith("amax")]
        rows = torch.empty(0).set_(table[0].untyped_storage()).view(-1, 4)
        assert all(t.dtype == torch.float32 and t.shape == (1, 1, 1, 1) and t.storage_offset() % 4 == 0 for t in table)
        assert all(t.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr() for t in table), "one table"
        assert torch.equal(rows[:, 1:], torch.zeros(len(rows), 3)), "one value per 16-byte row"
        assert len({_scalar(pack, f"descale_{n}").storage_offset() for n in "qkv"}) == 1, "one Q/K/V descale"
    assert _scalar(fwd, "descale_s") == 1 / _scalar(fwd, "scale_s") and _scalar(fwd, "scale_s") != 1
    for name in ("descale_q", "descale_s", "scale_s"):
        assert _scalar(bwd, name) == _scalar(fwd, name), name
    assert torch.allclose(_scalar(bwd, "descale_o"), 1 / _scalar(fwd, "scale_o")) and _scalar(fwd, "scale_o") != 1
    assert _scalar(bwd, "scale_dq") == _scalar(bwd, "scale_dk") == _scalar(bwd, "scale_dv")
    assert _scalar(bwd, "descale_dp") == 1 / _scalar(bwd, "scale_dp") and _scalar(bwd, "scale_dp") != 1
    assert bwd[UID["do"]].dtype == torch.float8_e5m2 and bwd[UID["dq"]].dtype == torch.float8_e5m2
    assert all(bwd[UID[n]] is fwd[UID[n]] for n in ("q", "k", "v", "o", "stats"))


LAYOUTS = [("bshd", -3), ("bshd", -2), ("sbhd", -3), ("sbhd", -2)]


@pytest.mark.parametrize("fmt,dim", LAYOUTS)
def test_declared_qkv_layer_is_cast_once_and_handed_over_as_views(standin, monkeypatch, fmt, dim):
    """One cast for the packed buffer (one amax, one pass), q/k/v handed to the kernel as views
    of its FP8 copy; the same output and the same (packed) gradients as separate tensors."""
    calls = []
    real = cudnn_fp8.cast_fp8
    monkeypatch.setattr(cudnn_fp8, "cast_fp8", lambda x, *a, **k: calls.append(x) or real(x, *a, **k))
    q, k, v = (t.detach() for t in _inputs(7, hg=4, fmt=fmt))
    layer = torch.stack([q, k, v], dim=dim).requires_grad_()
    sep = [t.clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(*q.shape[:2], 4 * 128, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    outs, casts = [], []
    for kwargs in (dict(qkv_layer=layer, qkv_interleave_dim=dim), dict(zip(("query_layer", "key_layer", "value_layer"), sep))):
        dpa = te.DotProductAttention(4, 128, qkv_format=fmt, attn_mask_type="causal")
        with backend_scope(force=FUSED), te.autocast(recipe=delayed()):
            out = dpa(**kwargs)
        casts.append(len(calls))
        out.backward(dout)
        calls.clear()
        outs.append(out)
    assert casts == [1, 3], "the forward casts the packed buffer once, separate tensors one by one"
    (_, packed_call), (_, packed_bwd) = standin.of("fp8_fwd")[0], standin.of("fp8_bwd")[0]
    assert len({t.untyped_storage().data_ptr() for t in (packed_call[UID[n]] for n in "qkv")}) == 1
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(layer.grad, torch.stack([t.grad for t in sep], dim=dim))
    dq8 = packed_bwd[UID["dq"]]
    assert dq8.untyped_storage().data_ptr() == packed_bwd[UID["dv"]].untyped_storage().data_ptr(), "dQKV written packed"


def test_declared_kv_layer_and_the_fast_path(standin, monkeypatch):
    """kv_layer: q cast alone, k/v as one buffer; a repeated call (the fast path) still casts the
    declared buffer of THAT call."""
    calls = []
    real = cudnn_fp8.cast_fp8
    monkeypatch.setattr(cudnn_fp8, "cast_fp8", lambda x, *a, **k: calls.append(x) or real(x, *a, **k))
    dpa = te.DotProductAttention(4, 128, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    for seed in (1, 2):
        q, k, v = (t.detach() for t in _inputs(seed))
        kv = torch.stack([k, v], dim=-3).requires_grad_()
        with backend_scope(force=FUSED), te.autocast(recipe=delayed()):
            out = dpa(q.requires_grad_(), kv_layer=kv)
        assert calls[-2] is kv and calls[-1] is q
        out.float().sum().backward()
        assert kv.grad.shape == kv.shape and torch.isfinite(kv.grad).all()
    assert len(dpa._recipes) == 1, "the second call took the fast path"


@pytest.mark.parametrize("cross", [False, True])
def test_thd_forward_with_nan_gaps(standin, cross):
    """THD forward (no gradients), self- and cross-attention (other K/V lengths and gaps): gaps
    and the tail set no amax (NaN there would make the QKV scale NaN) and come out 0; the output
    and the state match the emulation's."""
    kv = dict(lengths_kv=[7, 4, 6], gaps_kv=[1, 2, 0]) if cross else {}
    p = make_thd([5, 9, 3], gaps_q=[2, 0, 3], h=4, hg=2, d=64, dtype=torch.bfloat16, tail=3, seed=3, **kv)
    kwargs = p.kwargs(gaps=True, max_q=9, max_kv=7 if cross else 9, shared=not cross)
    results = []
    for backend in (FUSED, backends.UnfusedDotProductAttention):
        dpa = te.DotProductAttention(4, 64, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal")
        for _ in range(2):  # no gradients, but the region updates the scales (grad mode is on at its exit)
            with backend_scope(force=backend), te.autocast(recipe=delayed()), torch.no_grad():
                out = dpa(p.q, p.k, p.v, **kwargs)
        results.append((out, dpa._fp8_state.fwd.scale.clone()))
    (out, scale), (ref, ref_scale) = results
    assert torch.isfinite(scale).all() and scale[QKV] != 1 and (out[~p.valid_q] == 0).all()
    torch.testing.assert_close(scale, ref_scale, rtol=1e-5, atol=0)
    assert rel_rmse(out[p.valid_q], ref[p.valid_q]) < 1e-4
    (node, pack) = standin.of("fp8_fwd")[0]
    assert node.varlen and pack[UID["rq"]].dtype == torch.int64 and standin.of("fp8_bwd") == []


def test_fp8_forward_f16_backward(standin, monkeypatch):
    """NVTE_FP8_DPA_BWD=0: the ordinary cuDNN backward graph gets the high-precision q, k, v,
    the dequantized output and the FP8 forward's stats; no FP8 backward, no backward amaxes."""
    monkeypatch.setenv("NVTE_FP8_DPA_BWD", "0")
    q, k, v = _inputs(3)
    dpa = te.DotProductAttention(4, 128, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    with backend_scope(force=FUSED), te.autocast(recipe=delayed()):
        out = dpa(q, k, v)
    out.float().sum().backward()
    (_, fwd), = standin.of("fp8_fwd")
    (_, call), = standin.of("bwd")
    assert call[UID["q"]] is q and call[UID["k"]] is k and call[UID["v"]] is v and call[UID["stats"]] is fwd[UID["stats"]]
    assert torch.equal(call[UID["o"]].reshape(out.shape), out.detach())
    assert standin.of("fp8_bwd") == [] and (dpa._fp8_state.bwd.amax_history == 0).all()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# ---------------------------------------------------------------------------------- the casts


def _quantizer(dtype=E4M3, scale=37.5, slots=4, slot=2):
    from transformer_engine.pytorch.attention.dot_product_attention.fp8.quantize import Quantizer

    return Quantizer(dtype, 448.0 if dtype == E4M3 else 57344.0, torch.tensor(scale), torch.zeros(slots), slot)


@pytest.mark.parametrize("dtype", [E4M3, torch.float8_e5m2])
def test_cast_is_the_emulations_quantization(dtype):
    """The bytes fake_quantize rounds to (it dequantizes them afterwards), saturating, with the
    amax max-accumulated into its slot; the FP8 tensor keeps the input's strides."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.fp8_cast import cast_fp8, dequantize
    from transformer_engine.pytorch.attention.dot_product_attention.fp8.quantize import fake_quantize

    x = (torch.randn(2, 16, 4, 8, generator=torch.Generator().manual_seed(1)) * 40).to(torch.bfloat16).transpose(1, 2)
    q = _quantizer(dtype)
    q.amax_buffer[q.slot] = 1.0
    x8 = cast_fp8(x, q)
    assert x8.stride() == x.stride() and x8.dtype == dtype
    assert q.amax_buffer[q.slot] == x.float().abs().max() and q.amax_buffer[0] == 0
    expected = fake_quantize(x, q.scale, dtype, q.fp8_max)
    assert torch.equal(x8.float() * torch.reciprocal(q.scale), expected), "the same FP8 values"
    assert torch.equal(dequantize(x8, torch.reciprocal(q.scale), torch.float32), expected)


def test_cast_of_packed_rows_skips_gaps():
    """THD: the rows no sequence owns set no amax (they hold NaN here) and are written as 0."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.fp8_cast import cast_fp8

    x = torch.randn(10, 2, 8, dtype=torch.bfloat16)
    valid = torch.tensor([True] * 4 + [False] * 2 + [True] * 3 + [False])
    x[~valid] = float("nan")
    q = _quantizer()
    x8 = cast_fp8(x, q, valid)
    assert q.amax_buffer[q.slot] == x[valid].float().abs().max()
    assert (x8[~valid].float() == 0).all() and torch.isfinite(x8.float()).all()


def test_view_like_maps_a_view_into_the_fp8_copy():
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.fp8_cast import fp8_like, view_like

    layer = torch.randn(6, 2, 3, 4, 8)[1:]  # a view with a storage offset: [S, B, 3, H, D]
    buf = fp8_like(layer, E4M3)
    buf.copy_(layer.to(E4M3))
    for i in range(3):
        view = layer.select(2, i).transpose(0, 1)  # sbhd -> the bshd view the backends see
        mapped = view_like(buf, layer, view)
        assert mapped.shape == view.shape and mapped.stride() == view.stride()
        assert torch.equal(mapped.float(), view.to(E4M3).float())


def test_flat_density_decides_the_one_pass_kernel():
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.fp8_cast import _flat_dense

    t = torch.empty(2, 3, 4, 5)
    assert _flat_dense(t) and _flat_dense(t.transpose(0, 2)) and _flat_dense(t[1:])
    assert not _flat_dense(t[:, 1:]) and not _flat_dense(t.select(1, 0)) and not _flat_dense(t[:, :, :1])


@pytest.mark.parametrize("with_rows", [False, True])
def test_triton_kernel_in_the_interpreter(with_rows):
    """The one-pass kernel's indexing, amax and row mask, through Triton's CPU interpreter. Its
    numpy FP8 cast gets values that round UP to a power of two wrong (it returns half of it), so
    those may differ, in exactly that way; the GPU test checks the bits."""
    pytest.importorskip("triton")
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import fp8_cast

    x = (torch.randn(37, 3, 2, 16, generator=torch.Generator().manual_seed(2)) * 7).to(torch.bfloat16)
    valid = torch.rand(37, generator=torch.Generator().manual_seed(3)) > 0.3 if with_rows else None
    q, ref_q = _quantizer(), _quantizer()
    out = fp8_cast.fp8_like(x, E4M3)
    fp8_cast._launch(x, out, q, valid)
    expected = fp8_cast.fp8_like(x, E4M3)
    fp8_cast._cast_torch(x, expected, ref_q, valid)
    assert torch.equal(q.amax_buffer, ref_q.amax_buffer)
    got, want = out.float(), expected.float()
    wrong = got != want
    assert wrong.float().mean() < 0.05
    assert torch.equal(got[wrong] * 2, want[wrong]) and (torch.frexp(want[wrong])[0].abs() == 0.5).all()
    if with_rows:
        assert (got[~valid] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_kernel_in_the_interpreter(dtype):
    """The one-pass dequantization (float32(x8) * descale in the output dtype) against the
    PyTorch formulation on a permuted dense tensor: same strides, same values (fp16 bit for bit;
    the interpreter's bfloat16 cast truncates, so bf16 within one unit in the last place; the
    GPU test checks those bits)."""
    pytest.importorskip("triton")
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import fp8_cast
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.fp8_cast_kernel import dequantize

    x8 = (torch.randn(5, 7, 3, 16, generator=torch.Generator().manual_seed(4)) * 50).to(E4M3).transpose(1, 2)
    descale = torch.tensor([[0.0371, 0.0, 0.0, 0.0]])[0, 0]
    want = fp8_cast.dequantize(x8, descale, dtype)  # CPU: the PyTorch formulation
    got = torch.empty_strided(x8.shape, x8.stride(), dtype=dtype)
    n = x8.numel()
    dequantize[(-(-n // 128),)](fp8_cast._flat(x8), fp8_cast._flat(got), descale, n, BLOCK=128)
    assert got.stride() == want.stride()
    if dtype == torch.float16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0 ** -7, atol=0.0)


def test_benchmark_report_writes_rows_and_speedups(tmp_path):
    """benchmark_fp8.py's report (run on the H200 by the lead): partial rows, errors and the
    speedup table render without a GPU."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "attention" / "benchmark_fp8.py"
    spec = importlib.util.spec_from_file_location("benchmark_fp8", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    base = dict(tokens=8192, seqs=1, heads="16:16", mask="causal", eager_ms=1.0, queued=True, tflops=1.0)
    rows = [dict(base, path="bf16 fwd", gpu_ms=0.6), dict(base, path="fp8 fwd", gpu_ms=0.4),
            dict(base, path="fp8 fwd+bwd", error="RuntimeError: refused")]
    bench.write(rows, tmp_path, {"gpu": "none"}, "interrupted")
    text = (tmp_path / "bench_fp8.md").read_text()
    assert "Status: interrupted" in text and "| 8192 | causal | 1.50x | - | - |" in text and "error: RuntimeError" in text
