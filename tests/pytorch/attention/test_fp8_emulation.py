"""What the emulated FP8 attention computes (the unfused backend under
NVTE_UnfusedDPA_Emulate_FP8=1): TE's fp8_vs_f16 criterion against the float64 reference on TE's
FP8 test configurations (small sizes), an FP8 pipeline written independently here (where each
quantization point sits), packed batches with NaN gaps, NVTE_FP8_DPA_BWD=0, recomputation, the
causality of the two recipes, and megatron-core's fp8_dot_product_attention configuration."""

from __future__ import annotations

import math

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.attention.dot_product_attention.selection.backend_selection import NoBackendError
from transformer_engine.pytorch.distributed import activation_recompute_forward

from .fp8_helpers import E4M3_MAX, E5M2_MAX, QKV, bshd, delayed, fp8_clean, module, rmse_within, step  # noqa: F401
from .packing import make_thd
from .reference import reference_dense, reference_thd

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ---------------------------------------------------------------------------------- TE's fp8_vs_f16


def _lengths(mask: str, b: int, s: int):
    if "padding" not in mask:
        return None
    return torch.tensor([s - 5, s][:b], dtype=torch.int32)


def _reference(q, k, v, mask, lengths, dout):
    """float64 attention on the bf16 inputs, and its gradients (the BF16-style reference)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = reference_dense(*leaves, mask, None, 1 / math.sqrt(q.shape[-1]), lengths, lengths)
    out = out.reshape(*out.shape[:2], -1)
    out.backward(dout.double())
    return out, [t.grad for t in leaves]


CONFIGS = [(fmt, mask, hg, d) for fmt in ("bshd", "sbhd") for mask in ("no_mask", "causal", "padding", "padding_causal")
           for hg, d in ((4, 64), (2, 128))]


@pytest.mark.parametrize("fp8_dpa_bwd", [True, False], ids=["fp8-bwd", "f16-bwd"])
@pytest.mark.parametrize("fmt,mask,hg,d", CONFIGS, ids=[f"{f}-{m}-hg{g}-d{d}" for f, m, g, d in CONFIGS])
def test_fp8_vs_f16_within_tes_tolerance(fmt, mask, hg, d, fp8_dpa_bwd, monkeypatch):
    """TE's test_dpa_fp8_vs_f16 on its configurations at CPU size (b=2, s=32, 4 heads, GQA 4:2):
    RMSE < 0.11 x range for the output and dQ, dK, dV, with TE's recipe (first step: scales 1)."""
    monkeypatch.setenv("NVTE_FP8_DPA_BWD", "1" if fp8_dpa_bwd else "0")
    b, s, h = 2, 32, 4
    q, k, v = bshd(CONFIGS.index((fmt, mask, hg, d)), b=b, s=s, h=h, hg=hg, d=d)
    dout = torch.randn(b, s, h * d, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    lengths = _lengths(mask, b, s)
    kwargs = {}
    if lengths is not None:
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
    dpa = module(h=h, hg=hg, d=d, fmt=fmt, mask=mask)
    inputs = [t.detach().transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)] if fmt == "sbhd" else [q, k, v]
    out = step(dpa, *inputs, delayed(), dout.transpose(0, 1) if fmt == "sbhd" else dout, **kwargs)
    grads = [t.grad.transpose(0, 1) if fmt == "sbhd" else t.grad for t in inputs]
    ref, ref_grads = _reference(q, k, v, mask, lengths, dout)
    rmse_within(out.transpose(0, 1) if fmt == "sbhd" else out, ref)
    for grad, ref_grad in zip(grads, ref_grads):
        rmse_within(grad, ref_grad)


# ---------------------------------------------------------------------------------- the pipeline, written out


def _fq(x, scale, dtype, fp8_max):
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype).float() / scale


def _amax(*ts):
    return torch.stack([t.detach().abs().max().float() for t in ts]).max()


class _Forward(torch.autograd.Function):
    """Quantized (E4M3) in the forward only."""

    @staticmethod
    def forward(ctx, x, scale):
        return _fq(x, scale, E4M3, E4M3_MAX)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Backward(torch.autograd.Function):
    """Quantized (E5M2) in the backward only; ``current``: the scale from the gradient itself."""

    @staticmethod
    def forward(ctx, x, current):
        ctx.current = current
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return _fq(g, E5M2_MAX / _amax(g) if ctx.current else 1.0, E5M2, E5M2_MAX), None


class _JointQKV(torch.autograd.Function):
    """Q, K, V with one scale forward; dQ, dK, dV with one scale backward, back in bf16."""

    @staticmethod
    def forward(ctx, q, k, v, current):
        ctx.current = current
        scale = E4M3_MAX / _amax(q, k, v) if current else 1.0
        return tuple(_fq(t, scale, E4M3, E4M3_MAX) for t in (q, k, v))

    @staticmethod
    def backward(ctx, *grads):
        scale = E5M2_MAX / _amax(*grads) if ctx.current else 1.0
        return (*(_fq(g, scale, E5M2, E5M2_MAX).to(torch.bfloat16) for g in grads), None)


def _written_out(q, k, v, causal: bool, current: bool):
    """HYBRID FP8 attention at a first step (every delayed scale 1), bshd, GQA by repetition."""
    b, s, h, d = q.shape
    qf, kf, vf = _JointQKV.apply(q, k, v, current)
    kf, vf = (t.repeat_interleave(h // k.shape[2], dim=2) for t in (kf, vf))
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    probs = torch.softmax(_Backward.apply(scores, False), dim=-1)  # dP: delayed
    row_max = probs.detach().amax(-1, keepdim=True)  # S: each row over its largest entry, as the kernels quantize
    probs = _Forward.apply(probs / row_max, 1.0) * row_max
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
    out = _Backward.apply(_Forward.apply(out, E4M3_MAX / _amax(out) if current else 1.0), current)
    return out.to(torch.bfloat16).reshape(b, s, h * d)


def _share_unequal(a, b) -> float:
    """The share of values that differ; the differing ones must be one FP8 step apart at most
    (E4M3 steps are 1/8 of a value's binade: well under 30% of it; near zero, where a step is
    the whole value, the smallest nonzero magnitude present bounds it), so a wrong row cannot hide."""
    a, b = a.detach().float(), b.detach().float()
    differ = a != b
    nonzero = b.abs()[b != 0]
    near_zero = nonzero.min() if nonzero.numel() else torch.zeros(())
    assert ((a - b).abs()[differ] <= 0.3 * b.abs()[differ] + near_zero).all(), "values differ by more than an FP8 step"
    return differ.float().mean().item()


@pytest.mark.parametrize("current", [False, True], ids=["delayed", "current"])
@pytest.mark.parametrize("causal", [False, True], ids=["no_mask", "causal"])
def test_each_quantization_point_matches_a_pipeline_written_out(causal, current):
    """Every value of the output and of dQ, dK, dV lies on an FP8 grid here, so two computations
    with the same quantization points agree exactly except where fp32 rounding (which differs
    between CPUs and op orders) moves a value across a grid boundary: rare. A missing or misplaced
    point changes most values (checked by hand: one point removed leaves well over 10% unequal)."""
    q, k, v = bshd(30, s=48, h=4, hg=2, d=32)
    dout = torch.randn(2, 48, 4 * 32, generator=torch.Generator().manual_seed(31)).to(torch.bfloat16)
    r = recipe.Float8CurrentScaling(fp8_dpa=True) if current else delayed()
    out = step(module(h=4, hg=2, d=32, mask="causal" if causal else "no_mask"), q, k, v, r, dout)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    expected = _written_out(*leaves, causal, current)
    expected.backward(dout)
    assert _share_unequal(out, expected) < 0.01
    for got, want in zip((q.grad, k.grad, v.grad), (t.grad for t in leaves)):
        assert _share_unequal(got, want) < 0.01


# ---------------------------------------------------------------------------------- packed batches


@pytest.mark.parametrize("per_seq", [False, True], ids=["one-policy", "per-seq-policies"])
def test_thd_with_nan_gaps(per_seq):
    """THD in FP8 is emulated (cuDNN dropped FP8 THD on Hopper; its declaration will refuse it):
    amaxes over the rows sequences own, so NaN in gaps and the tail sets no scale and never leaks."""
    p = make_thd([5, 9, 3], gaps_q=[2, 0, 3], h=4, hg=2, d=32, dtype=torch.bfloat16, tail=3, seed=3)
    dpa = module(h=4, hg=2, d=32, fmt="thd", mask="padding_causal")
    kwargs = p.kwargs(gaps=True, max_q=9, max_kv=9, shared=True)
    if per_seq:
        kwargs["attn_mask_type_per_seq"] = {"padding_causal": torch.tensor([0, 2]), "padding": torch.tensor([1])}
    dout = torch.randn(p.q.shape[0], 4 * 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out = step(dpa, p.q, p.k, p.v, delayed(), dout, **kwargs)
    st = dpa._fp8_state
    assert torch.isfinite(st.fwd.scale).all() and torch.isfinite(st.bwd.scale).all() and st.fwd.scale[QKV] != 1
    assert (out[~p.valid_q] == 0).all() and torch.isfinite(out).all()
    masks = ["padding_causal", "padding" if per_seq else "padding_causal", "padding_causal"]
    ref = reference_thd(p.q.detach(), p.k.detach(), p.v.detach(), p.cu_q, p.cu_q, p.off_q, p.off_q, masks, [None] * 3,
                        1 / math.sqrt(32))
    rmse_within(out[p.valid_q], ref.reshape(out.shape)[p.valid_q])
    for t in (p.q, p.k, p.v):
        assert torch.isfinite(t.grad[p.valid_q]).all() and (t.grad[~p.valid_q] == 0).all()


# ---------------------------------------------------------------------------------- NVTE_FP8_DPA_BWD=0


def test_fp8_forward_high_precision_backward(monkeypatch):
    """The values of the FP8 forward; the gradients of the high-precision attention at the same
    inputs (TE's F16 backward from the saved high-precision inputs)."""
    q, k, v = bshd(40)
    dout = torch.randn(2, 32, 256, generator=torch.Generator().manual_seed(41)).to(torch.bfloat16)
    fp8_out = step(module(), q, k, v, delayed(), dout).detach()
    monkeypatch.setenv("NVTE_FP8_DPA_BWD", "0")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = step(module(), *leaves, delayed(), dout)
    assert torch.equal(out, fp8_out)
    plain = [t.detach().requires_grad_() for t in (q, k, v)]
    module()(*plain).backward(dout)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, plain))


def test_dropout_draws_one_mask_for_both_passes(monkeypatch):
    q, k, v = bshd(42)
    torch.manual_seed(7)
    expected = step(module(attention_dropout=0.25), q, k, v, delayed())
    monkeypatch.setenv("NVTE_FP8_DPA_BWD", "0")
    torch.manual_seed(7)
    assert torch.equal(step(module(attention_dropout=0.25), q, k, v, delayed()), expected)


# ---------------------------------------------------------------------------------- recomputation


@pytest.mark.parametrize("how", ["checkpoint_core_attention", "chunked"])
def test_recomputed_forwards_record_their_amaxes_once(how, monkeypatch):
    """A forward recomputed in the backward (DotProductAttention's checkpointing, or the unfused
    backend's chunks under torch.utils.checkpoint) runs after the region updated the scales: it
    must quantize with the first run's scales and record nothing into the next step's row."""
    r = delayed(amax_history_len=2)
    dout = torch.randn(2, 32, 256, generator=torch.Generator().manual_seed(51)).to(torch.bfloat16)
    runs = []
    for recompute in (False, True):
        q, k, v = bshd(50)
        dpa = module()
        step(dpa, *(t.detach() * 3 for t in (q, k, v)), r)  # scales != 1 from here on
        kwargs = {}
        if recompute and how == "chunked":
            monkeypatch.setenv("NVTE_UNFUSED_ATTN_MAX_SCORES", str(2 * 4 * 32 * 8))  # 4 chunks of 8 query rows
        elif recompute:
            kwargs["checkpoint_core_attention"] = True
        out = step(dpa, q, k, v, r, dout, **kwargs)
        runs.append((out, [t.grad for t in (q, k, v)], dpa._fp8_state.fwd.amax_history.clone()))
    (out_a, grads_a, hist_a), (out_b, grads_b, hist_b) = runs
    assert torch.equal(hist_b[0], torch.zeros(9))  # nothing recorded after the region's exit
    if how == "checkpoint_core_attention":  # the same operations: identical
        assert torch.equal(out_a, out_b) and torch.equal(hist_a, hist_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    else:  # chunks multiply other blocks: fp32 rounding may move a rare value across an FP8 grid boundary
        torch.testing.assert_close(hist_a, hist_b, rtol=1e-5, atol=0)
        assert _share_unequal(out_a, out_b) < 0.01 and all(_share_unequal(a, b) < 0.01 for a, b in zip(grads_a, grads_b))


def test_activation_recompute_reuses_the_first_runs_scales():
    """megatron's recompute: the rerun (recompute phase) takes the scales the first run stashed
    (the region's exit has changed them since) and records no amax, as TE's modules do."""
    dpa, r = module(), delayed()
    q, k, v = bshd(52)
    step(dpa, q, k, v, r)
    inputs = [t.detach() * 4 for t in (q, k, v)]  # the first run's exit moves the scales
    with te.autocast(recipe=r), activation_recompute_forward(activation_recompute=True, recompute_phase=False):
        first = dpa(*inputs)
    state = dpa._fp8_state
    assert len(state.recompute_scales) == 1
    history = state.fwd.amax_history.clone()
    with te.autocast(recipe=r), activation_recompute_forward(activation_recompute=True, recompute_phase=True):
        rerun = dpa(*inputs)
    assert torch.equal(rerun, first) and not state.recompute_scales
    assert torch.equal(state.fwd.amax_history, history)  # the rerun recorded nothing: no roll at its exit


# ---------------------------------------------------------------------------------- causality (TE issue #3248)


def _prefix_pair(fp8_recipe):
    """Outputs of two batches equal up to token 19 and different after it (V scaled by 50)."""
    q, k, v = (t.detach() for t in bshd(60))
    v_future = v.clone()
    v_future[:, 20:] *= 50
    return [step(module(), q, k, vv, fp8_recipe)[:, :20] for vv in (v, v_future)]


def test_delayed_scaling_keeps_causal_outputs_independent_of_future_tokens():
    a, b = _prefix_pair(delayed())
    assert torch.equal(a, b)  # the scales come from earlier steps


def test_current_scaling_lets_future_tokens_round_earlier_outputs():
    """Kept as TE defines it (one amax over all of Q, K, V and over O), and documented: a later
    token's magnitude changes the scale, hence the rounding, of earlier tokens."""
    a, b = _prefix_pair(recipe.Float8CurrentScaling(fp8_dpa=True))
    assert not torch.equal(a, b)
    rmse_within(a, b)  # a rounding-sized difference, not a wrong result


# ---------------------------------------------------------------------------------- callers


def test_multihead_attention_runs_fp8_attention():
    mha = te.MultiheadAttention(128, 4, attention_dropout=0.0, attn_mask_type="causal", params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(16, 2, 128, generator=torch.Generator().manual_seed(70)).to(torch.bfloat16).requires_grad_()
    with te.autocast(recipe=delayed()):
        out = mha(x)
    out.float().sum().backward()
    high = mha(x)
    assert mha.core_attention._fp8_state.fwd.scale[QKV] != 1 and torch.isfinite(x.grad).all()
    rmse_within(out, high)


def _megatron(**overrides):
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=4 * 64, num_attention_heads=4, num_query_groups=2, kv_channels=64,
                               attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.bfloat16, fp8="hybrid",
                               fp8_recipe="delayed", fp8_dot_product_attention=True, fp8_amax_history_len=1,
                               fp8_amax_compute_algo="most_recent", **overrides)
    return config, TEDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"), AttnMaskType


def _sbhd(seed):
    return [t.detach().transpose(0, 1).contiguous() for t in bshd(seed, h=4, hg=2)]


def test_megatron_fp8_dot_product_attention_reaches_the_fp8_path():
    """megatron-core 0.16's --fp8-format hybrid --fp8-dot-product-attention: its fp8 context
    (fp8_autocast with TEDelayedScaling(fp8_dpa=True)) around its TEDotProductAttention runs the
    FP8 path, the same numbers as this package's DotProductAttention under that recipe."""
    from megatron.core.fp8_utils import get_fp8_context

    config, attn, masks = _megatron()
    q, k, v = _sbhd(80)
    with get_fp8_context(config):
        out = attn(q, k, v, None, masks.causal)
    assert attn.last_selection.label == "UnfusedDotProductAttention" and attn._fp8_state.fwd.scale[QKV] != 1
    with te.autocast(recipe=delayed()):
        ours = module(h=4, hg=2, fmt="sbhd")(q, k, v)
    assert torch.equal(out, ours)


def test_megatron_fp8_configurations_refused_by_name(monkeypatch):
    from megatron.core.fp8_utils import get_fp8_context

    config, attn, masks = _megatron()
    q, k, v = _sbhd(81)
    with get_fp8_context(config):
        monkeypatch.setenv("NVTE_UnfusedDPA_Emulate_FP8", "0")
        with pytest.raises(NoBackendError, match="UnfusedDotProductAttention: NVTE_UnfusedDPA_Emulate_FP8=0"):
            attn(q, k, v, None, masks.causal)
    monkeypatch.setenv("NVTE_UnfusedDPA_Emulate_FP8", "1")
    config, attn, masks = _megatron(fp8_multi_head_attention=True)
    with get_fp8_context(config), pytest.raises(NotImplementedError, match=r"\(fp8_mha=True\) is not implemented"):
        attn(q, k, v, None, masks.causal)
