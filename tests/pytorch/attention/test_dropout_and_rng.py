"""Dropout and the random streams on the unfused backend: train vs eval against the float64
reference, the dropped probabilities scaled by 1/(1-p), draws inside the RNG tracker's fork
(megatron's), from the default generator under sequence parallelism, and recomputation
(checkpoint_core_attention) giving the same gradients."""

from __future__ import annotations

import math

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention

from .reference import reference_dense
from .spies import ForkingTracker

H, D = 4, 8
SCALE = 1.0 / math.sqrt(D)


def _dense_inputs(fmt, b, sq, skv, hg, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = lambda s, h: (b, s, h, D) if fmt == "bshd" else (s, b, h, D)  # noqa: E731
    return [torch.randn(shape(s, h), generator=g, dtype=torch.float64).requires_grad_() for s, h in ((sq, H), (skv, hg), (skv, hg))]


def _grads(out, leaves, g):
    for t in leaves:
        t.grad = None
    (out * g).sum().backward()
    return [t.grad.clone() for t in leaves]


def _close(a, b, tol):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


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


def test_dropout_draws_inside_the_rng_tracker_fork():
    tracker = ForkingTracker(7)
    q, k, v = _dense_inputs("bshd", 2, 8, 8, H)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", attention_dropout=0.5,
                              get_rng_state_tracker=lambda: tracker)
    before = torch.get_rng_state()
    first = dpa(q, k, v)
    assert tracker.forks == 1 and torch.equal(torch.get_rng_state(), before), "dropout must not use the default generator"
    again = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", attention_dropout=0.5,
                                get_rng_state_tracker=lambda: ForkingTracker(7))(q, k, v)
    # exact: the same call from the same tracker state repeats the same ops
    assert torch.equal(first, again), "the same tracker state must give the same dropout mask"
    dpa.eval()
    dpa(q, k, v)
    assert tracker.forks == 1, "no fork without dropout"


def test_rng_tracker_is_checked_and_passed_through_multihead_attention():
    from transformer_engine.pytorch import MultiheadAttention

    with pytest.raises(TypeError, match="get_rng_state_tracker"):
        DotProductAttention(H, D, get_rng_state_tracker=object())
    tracker = ForkingTracker(0)
    mha = MultiheadAttention(H * D, H, get_rng_state_tracker=lambda: tracker, device="cpu")
    assert mha.core_attention.get_rng_state_tracker() is tracker


def test_sequence_parallel_dropout_draws_from_the_default_generator_not_the_tracker():
    from transformer_engine.pytorch.distributed import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker(device="cpu")
    tracker.add("model-parallel-rng", 11)
    q, k, v = (torch.randn(5, 2, H, D, dtype=torch.float64) for _ in range(3))

    def run(**kw):
        torch.manual_seed(3)
        return DotProductAttention(H, D, attention_dropout=0.5, get_rng_state_tracker=lambda: tracker, **kw)(q, k, v)

    saved = {n: s.clone() for n, s in tracker.get_states().items()}
    plain = DotProductAttention(H, D, attention_dropout=0.5)
    torch.manual_seed(3)
    expected_default = plain(q, k, v)
    torch.testing.assert_close(run(sequence_parallel=True), expected_default)
    assert torch.equal(tracker.get_states()["model-parallel-rng"], saved["model-parallel-rng"])  # stream untouched
    with_tracker = run()
    assert not torch.equal(tracker.get_states()["model-parallel-rng"], saved["model-parallel-rng"])
    # Without sequence parallelism the mask comes from the tracker's stream: the same call on
    # the default generator, seeded with the tracker's saved state, gives the same values.
    torch.set_rng_state(saved["model-parallel-rng"])
    torch.testing.assert_close(with_tracker, plain(q, k, v))
