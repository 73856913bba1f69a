"""The per-shape choice (NVTE_ATTN_AUTOTUNE) on the GPU, skipped without CUDA: the real timing
(CUDA events, both modes) picks one of the accepting libraries and says so, its result agrees
with the fixed order's within bf16 noise and never touches the caller's gradients, and neither
CUDA-graph capture nor torch.compile is broken by it (nothing is timed there).

What decides the choice (accepting backends only, deterministic mode, buckets) is checked on the
CPU in test_autotune.py."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention.dot_product_attention.selection import autotune

from .gpu_helpers import env, rel_err
from .packing import make_thd

pytestmark = pytest.mark.gpu
H, HG, D = 16, 2, 64
LENGTHS = [64, 512, 192, 320, 128, 448]
CANDIDATES = {"FlashAttention v4", "FusedAttention"}


@pytest.fixture(autouse=True)
def fresh_choices():
    autotune.forget()
    yield
    autotune.forget()


def _batch(seed=0):
    p = make_thd(LENGTHS, h=H, hg=HG, d=D, dtype=torch.bfloat16, device="cuda", seed=seed)
    leaves = [t.detach().nan_to_num().requires_grad_() for t in (p.q, p.k, p.v)]
    return leaves, p.kwargs(False, max(LENGTHS), max(LENGTHS), shared=True)


def _module():
    return DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal")


@pytest.mark.parametrize("mode", ["1", "gpu"])
def test_the_measured_library_runs_and_agrees_with_the_fixed_order(mode):
    leaves, kw = _batch()
    g = torch.randn(sum(LENGTHS), H * D, device="cuda", dtype=torch.bfloat16)
    fixed = _module()
    want = fixed(*leaves, **kw)
    want_grads = torch.autograd.grad(want, leaves, g)
    tuned = _module()
    with env(NVTE_ATTN_AUTOTUNE=mode):
        got = tuned(*leaves, **kw)
        assert all(t.grad is None for t in leaves), "timing must not reach the caller's gradients"
        got_grads = torch.autograd.grad(got, leaves, g)
        again = tuned(*leaves, **kw)  # the fast path keeps the bucket's choice
    selection = tuned.last_selection
    assert selection.label in CANDIDATES and "chosen by autotune" in selection.report(), selection.report()
    assert all(label in selection.how for label in CANDIDATES), selection.how  # both libraries were timed
    assert rel_err(got, want) < 2e-2 and rel_err(again, want) < 2e-2
    for a, b in zip(got_grads, want_grads):
        assert rel_err(a, b) < 3e-2


def test_capture_after_warm_up_uses_the_recorded_choice():
    leaves, kw = _batch()
    dpa = _module()
    with env(NVTE_ATTN_AUTOTUNE="1"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                dpa(*leaves, **kw)  # the first call times the candidates (outside the capture)
        torch.cuda.current_stream().wait_stream(side)
        assert "chosen by autotune" in dpa.last_selection.how, dpa.last_selection.how  # the warm-up was timed
        chosen = dpa.last_selection.label
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            out = dpa(*leaves, **kw)
        graph.replay()
        torch.cuda.synchronize()
    assert dpa.last_selection.label == chosen and "chosen by autotune" in dpa.last_selection.how, dpa.last_selection.how
    with torch.no_grad():
        assert rel_err(out, _module()(*leaves, **kw)) < 2e-2


def test_a_first_call_under_capture_is_not_timed_and_not_kept():
    leaves, kw = _batch(seed=1)
    with torch.no_grad():
        _module()(*leaves, **kw)  # another module, eager: libraries loaded and FA4 compiled before the capture
    torch.cuda.synchronize()
    dpa = _module()  # its first call is the captured one
    with env(NVTE_ATTN_AUTOTUNE="1"):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            out = dpa(*leaves, **kw)  # capture must not fail: nothing synchronizes or times here
        assert dpa.last_selection.provisional and "not timed" in dpa.last_selection.how
        assert not dpa._recipes, "a provisional choice is not kept by the fast path"
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            assert rel_err(out, _module()(*leaves, **kw)) < 2e-2
            dpa(*leaves, **kw)  # eager again: now it is timed
    assert "chosen by autotune" in dpa.last_selection.how


def test_torch_compile_does_not_consult_it():
    torch._dynamo.reset()
    leaves, kw = _batch()
    dpa = _module()
    with torch.no_grad():
        want = _module()(*leaves, **kw)  # autotune off: times nothing
    with env(NVTE_ATTN_AUTOTUNE="1"), torch.no_grad():
        compiled = torch.compile(lambda *a: dpa(*a, **kw), fullgraph=True)
        out = compiled(*leaves)
    assert autotune._choices == {}, "the compiled call timed candidates"
    assert rel_err(out, want) < 2e-2
