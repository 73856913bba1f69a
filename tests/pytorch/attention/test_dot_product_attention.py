"""DotProductAttention on the unfused backend against the independent float64 reference:
every format x mask type x GQA x window x (THD with and without gaps), forward and all input
gradients."""

from __future__ import annotations

import math

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention

from .packing import make_thd
from .reference import reference_dense, reference_thd

H, D = 4, 8
SCALE = 1.0 / math.sqrt(D)
DENSE_MASKS = ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right", "arbitrary"]
THD_MASKS = ["padding", "padding_causal", "padding_causal_bottom_right"]


def _window(mask: str, windowed: bool):
    if not windowed:
        return None
    return (2, 0) if "causal" in mask else (2, 1)


def _grads(out, leaves, g):
    for t in leaves:
        t.grad = None
    (out * g).sum().backward()
    return [t.grad.clone() for t in leaves]


def _leaf64(t):
    return t.detach().double().nan_to_num(0.0).requires_grad_()


def _close(a, b, tol):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("gaps,cross", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("hg", [4, 2, 1])
@pytest.mark.parametrize("mask", THD_MASKS + ["causal"])
def test_thd_matches_reference(mask, hg, windowed, gaps, cross):
    lengths_q = [3, 5, 1, 4, 0]
    lengths_kv = [4, 2, 3, 6, 2] if cross else lengths_q
    gq = [1, 0, 2, 1, 1] if gaps else None
    gkv = ([0, 2, 1, 1, 0] if cross else gq) if gaps else None
    p = make_thd(lengths_q, lengths_kv, gq, gkv, h=H, hg=hg, d=D, tail=2)
    window = _window(mask, windowed)
    dpa = DotProductAttention(H, D, num_gqa_groups=hg, qkv_format="thd", attn_mask_type=mask, window_size=window)
    out = dpa(p.q, p.k, p.v, **p.kwargs(gaps, max(lengths_q), max(lengths_kv), shared=not cross)).view(-1, H, D)
    refs = [_leaf64(t) for t in (p.q, p.k, p.v)]
    thd_mask = mask if mask.startswith("padding") else "padding_" + mask
    off_q, off_kv = (p.off_q, p.off_kv) if gaps else (p.cu_q, p.cu_kv)
    ref = reference_thd(*refs, p.cu_q, p.cu_kv, off_q, off_kv, [thd_mask] * len(lengths_q), [window] * len(lengths_q), SCALE)
    _close(out, ref, 1e-10)
    assert torch.all(out[~p.valid_q] == 0)
    g = torch.randn_like(ref)
    for got, want, valid in zip(_grads(out, [p.q, p.k, p.v], g), _grads(ref, refs, g), [p.valid_q, p.valid_kv, p.valid_kv]):
        _close(got, want, 1e-10)
        assert torch.all(got[~valid] == 0) and torch.isfinite(got).all()


def _dense_inputs(fmt, b, sq, skv, hg, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = lambda s, h: (b, s, h, D) if fmt == "bshd" else (s, b, h, D)  # noqa: E731
    return [torch.randn(shape(s, h), generator=g, dtype=torch.float64).requires_grad_() for s, h in ((sq, H), (skv, hg), (skv, hg))]


def _to_bshd(t, fmt):
    return t if fmt == "bshd" else t.transpose(0, 1)


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("hg", [4, 1])
@pytest.mark.parametrize("mask", DENSE_MASKS)
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_dense_matches_reference(fmt, mask, hg, windowed, cross):
    b, sq = 3, 5
    skv = 7 if cross else sq
    q, k, v = _dense_inputs(fmt, b, sq, skv, hg)
    window = _window(mask, windowed)
    len_q, len_kv = torch.tensor([5, 3, 1]), torch.tensor([skv, skv - 2, 2])
    kwargs, arbitrary = {}, None
    if mask.startswith("padding"):
        pad_q = torch.arange(sq).view(1, sq) >= len_q.view(b, 1)
        pad_kv = torch.arange(skv).view(1, skv) >= len_kv.view(b, 1)
        kwargs["attention_mask"] = (pad_q.view(b, 1, 1, sq), pad_kv.view(b, 1, 1, skv))
    else:
        len_q = len_kv = None
    if mask == "arbitrary":
        arbitrary = torch.rand(b, 1, sq, skv, generator=torch.Generator().manual_seed(1)) > 0.6
        kwargs["attention_mask"] = arbitrary
    dpa = DotProductAttention(H, D, num_gqa_groups=hg, qkv_format=fmt, attn_mask_type=mask, window_size=window,
                              attention_type="cross" if cross else "self")
    out = dpa(q, k, v, **kwargs)
    out = _to_bshd(out.view(*out.shape[:2], H, D), fmt)
    refs = [_leaf64(_to_bshd(t, fmt)) for t in (q, k, v)]
    ref = reference_dense(*refs, mask, window, SCALE, len_q, len_kv, arbitrary)
    _close(out, ref, 1e-10)
    g = torch.randn_like(ref)
    got = [_to_bshd(t, fmt) for t in _grads(out, [q, k, v], g)]
    for a, w in zip(got, _grads(ref, refs, g)):
        _close(a, w, 1e-10)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_low_precision_thd(dtype, tol):
    p = make_thd([6, 3, 7], gaps_q=[2, 0, 1], h=H, hg=2, d=D, dtype=dtype)
    dpa = DotProductAttention(H, D, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal")
    out = dpa(p.q, p.k, p.v, **p.kwargs(True, 7, 7, shared=True)).view(-1, H, D)
    refs = [_leaf64(t) for t in (p.q, p.k, p.v)]
    ref = reference_thd(*refs, p.cu_q, p.cu_kv, p.off_q, p.off_kv, ["padding_causal"] * 3, [None] * 3, SCALE)
    assert out.dtype == dtype
    _close(out, ref, tol)
    assert torch.all(out[~p.valid_q] == 0)


def test_gathered_thd_path_matches_per_sequence(monkeypatch):
    """The sync-free GPU path for THD, run on the CPU, equals the per-sequence CPU path."""
    p = make_thd([3, 5, 1, 4], [4, 2, 3, 6], [1, 0, 2, 1], [0, 2, 1, 1], h=H, hg=2, d=D, tail=1)
    dpa = DotProductAttention(H, D, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal_bottom_right", window_size=(1, 0))
    kw = p.kwargs(True, 5, 6)
    g = torch.randn(p.q.shape[0], H * D, dtype=torch.float64)
    out_a = dpa(p.q, p.k, p.v, **kw)
    grads_a = _grads(out_a, [p.q, p.k, p.v], g)
    monkeypatch.setenv("NVTE_UNFUSED_THD_GATHER", "1")
    out_b = dpa(p.q, p.k, p.v, **kw)
    grads_b = _grads(out_b, [p.q, p.k, p.v], g)
    _close(out_a, out_b, 1e-12)
    for a, b in zip(grads_a, grads_b):
        _close(a, b, 1e-12)


@pytest.mark.parametrize("bias_type", ["pre_scale_bias", "post_scale_bias", "alibi"])
def test_bias_types(bias_type):
    b, s = 2, 5
    q, k, v = _dense_inputs("bshd", b, s, s, H)
    bias = torch.randn(1, H, s, s, dtype=torch.float64)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask")
    kwargs = dict(core_attention_bias_type=bias_type)
    slopes = torch.rand(H, dtype=torch.float32)
    if bias_type == "alibi":
        kwargs["alibi_slopes"] = slopes
        pos = torch.arange(s)
        want_bias = -slopes.double().view(1, H, 1, 1) * (pos.view(1, s) - pos.view(s, 1)).abs().double()
    else:
        kwargs["core_attention_bias"] = bias
        # pre-scale: (qk + bias) * scale, i.e. a post-scale bias of bias * scale.
        want_bias = bias * SCALE if bias_type == "pre_scale_bias" else bias
    out = dpa(q, k, v, **kwargs).view(b, s, H, D)
    ref = reference_dense(q.detach(), k.detach(), v.detach(), "no_mask", None, SCALE, bias=want_bias)
    _close(out, ref, 1e-10)


def test_dropout_train_vs_eval():
    q, k, v = _dense_inputs("bshd", 2, 6, 6, H)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask", attention_dropout=0.5)
    dpa.eval()
    ref = reference_dense(q.detach(), k.detach(), v.detach(), "no_mask", None, SCALE)
    _close(dpa(q, k, v).view(2, 6, H, D), ref, 1e-10)
    # With V = the identity over keys (key j is the unit vector e_j), the output row is the
    # dropped probability row itself: each entry is 0 or P / (1 - p), about half of them 0.
    eye = torch.eye(6, D, dtype=v.dtype).view(1, 6, 1, D).expand(2, 6, H, D).contiguous()
    probs = reference_dense(q.detach(), k.detach(), eye, "no_mask", None, SCALE)[..., :6]
    dpa.train()
    torch.manual_seed(0)
    dropped = dpa(q, k, eye).view(2, 6, H, D).double()[..., :6]
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept], probs[kept] / 0.5, rtol=1e-10, atol=1e-12)
    assert torch.all(dropped[~kept] == 0) and 0.3 < kept.double().mean() < 0.7


def test_checkpoint_core_attention_same_gradients():
    q, k, v = _dense_inputs("sbhd", 2, 5, 5, H)
    dpa = DotProductAttention(H, D)
    g = torch.randn(5, 2, H * D, dtype=torch.float64)
    plain = _grads(dpa(q, k, v), [q, k, v], g)
    ckpt = _grads(dpa(q, k, v, checkpoint_core_attention=True), [q, k, v], g)
    for a, b in zip(plain, ckpt):
        _close(a, b, 1e-12)


def test_output_shapes():
    for fmt, shape in (("sbhd", (5, 2, H * D)), ("bshd", (2, 5, H * D))):
        q, k, v = _dense_inputs(fmt, 2, 5, 5, H)
        assert DotProductAttention(H, D, qkv_format=fmt)(q, k, v).shape == shape
    p = make_thd([3, 2])
    out = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")(p.q, p.k, p.v, **p.kwargs(False, 3, 3))
    assert out.shape == (5, H * D)


def test_large_thd_batch_of_short_sequences_runs_on_cpu():
    """32k tokens of short sequences: memory follows sum(s_i^2), not b * max_s^2."""
    lengths = [64] * 500 + [768]
    p = make_thd(lengths, h=2, hg=2, d=16, dtype=torch.float32)
    dpa = DotProductAttention(2, 16, qkv_format="thd", attn_mask_type="padding_causal")
    out = dpa(p.q, p.k, p.v, **p.kwargs(False, 768, 768))
    assert out.shape == (sum(lengths), 32) and torch.isfinite(out).all()


def test_mixed_head_dims():
    p = make_thd([3, 4], h=H, hg=H, d=D, dv=16)
    dpa = DotProductAttention(H, (D, 16), qkv_format="thd", attn_mask_type="padding_causal")
    out = dpa(p.q, p.k, p.v, **p.kwargs(False, 4, 4)).view(-1, H, 16)
    refs = [_leaf64(t) for t in (p.q, p.k, p.v)]
    ref = reference_thd(*refs, p.cu_q, p.cu_kv, p.cu_q, p.cu_kv, ["padding_causal"] * 2, [None] * 2, SCALE)
    _close(out, ref, 1e-10)



class _ForkingTracker:
    """Megatron-style RNG tracker: fork() swaps in its own CPU generator state."""

    def __init__(self, seed: int):
        self.state = torch.Generator().manual_seed(seed).get_state()
        self.forks = 0

    def fork(self):
        import contextlib

        @contextlib.contextmanager
        def forked():
            self.forks += 1
            saved = torch.get_rng_state()
            torch.set_rng_state(self.state)
            try:
                yield
            finally:
                self.state = torch.get_rng_state()
                torch.set_rng_state(saved)

        return forked()


def test_dropout_draws_inside_the_rng_tracker_fork():
    tracker = _ForkingTracker(7)
    q, k, v = _dense_inputs("bshd", 2, 8, 8, H)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", attention_dropout=0.5,
                              get_rng_state_tracker=lambda: tracker)
    before = torch.get_rng_state()
    first = dpa(q, k, v)
    assert tracker.forks == 1 and torch.equal(torch.get_rng_state(), before), "dropout must not use the default generator"
    again = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", attention_dropout=0.5,
                                get_rng_state_tracker=lambda: _ForkingTracker(7))(q, k, v)
    # exact: the same call from the same tracker state repeats the same ops
    assert torch.equal(first, again), "the same tracker state must give the same dropout mask"
    dpa.eval()
    dpa(q, k, v)
    assert tracker.forks == 1, "no fork without dropout"


def test_rng_tracker_is_checked_and_passed_through_multihead_attention():
    from transformer_engine.pytorch import MultiheadAttention

    with pytest.raises(TypeError, match="get_rng_state_tracker"):
        DotProductAttention(H, D, get_rng_state_tracker=object())
    tracker = _ForkingTracker(0)
    mha = MultiheadAttention(H * D, H, get_rng_state_tracker=lambda: tracker, device="cpu")
    assert mha.core_attention.get_rng_state_tracker() is tracker


def test_unfused_inside_torch_autocast_computes_in_float32():
    """Inside torch.autocast the unfused reference still computes in float32 (its matmuls would
    otherwise run in bf16 and the masked fill overflow): same result as outside, in the inputs'
    dtype."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 5, 4, 8, dtype=torch.bfloat16) for _ in range(3))
    dpa = DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type="causal")
    want = dpa(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dpa(q, k, v)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same float32 ops on the same data
