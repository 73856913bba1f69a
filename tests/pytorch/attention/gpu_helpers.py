"""Helpers for the GPU tests: run on one backend (failing if it is not the one selected),
compare it with the unfused one."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from transformer_engine.pytorch.attention import backend_scope

GPU_BACKENDS = {
    # label -> the switches that leave only that backend (and the unfused fallback) on
    "FlashAttention v4": {"NVTE_FUSED_ATTN": "0"},
    "FusedAttention": {"NVTE_FLASH_ATTN": "0"},
}


@contextlib.contextmanager
def env(**values):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def sync_errors():
    """Inside the block, an operation that synchronizes the host with the GPU raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def run_on(label, dpa, *args, expect_refusal=None, **kwargs):
    """Run dpa on backend ``label`` ("unfused" for the unfused one) and no other.

    The call runs under ``backend_scope(allow=[label])``. If ``label`` refuses the
    configuration the test FAILS, unless it passes ``expect_refusal`` (text that the refusal's
    reasons must contain, e.g. "attention_mask="): then it is skipped with those reasons. A call
    that runs although a refusal was expected fails too (the declaration changed; update the test)."""
    want = "UnfusedDotProductAttention" if label == "unfused" else label
    try:
        with backend_scope(allow=[label]):
            out = dpa(*args, **kwargs)
    except NotImplementedError as err:
        if expect_refusal is None:
            pytest.fail(f"{label} refused a configuration this test expects it to run:\n{err}")
        if expect_refusal not in str(err):
            pytest.fail(f"{label} refused, but not for {expect_refusal!r}:\n{err}")
        pytest.skip(f"{label} refuses this configuration, as expected ({expect_refusal}): {err}")
    if expect_refusal is not None:
        pytest.fail(f"{label} ran a configuration the test expected it to refuse ({expect_refusal!r})")
    selected = dpa.last_selection.label
    assert selected == want, f"expected {want} to run, selection chose {selected}:\n{dpa.last_selection.report()}"
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def grads_of(out, leaves, g):
    for t in leaves:
        t.grad = None
    out.backward(g)
    return [t.grad.clone() for t in leaves]


def check_graph_replay(label, dpa, inputs, kwargs, g):
    """Capture forward+backward in a CUDA graph, then put NEW values into the inputs and
    replay: the outputs and gradients must match an eager run on the new values (a kernel left
    out of the capture would keep the old values)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: JIT compiles, cuDNN plans
        for _ in range(2):
            run_on(label, dpa, *leaves, **kwargs).backward(g)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_on(label, dpa, *leaves, **kwargs)
        out.backward(g)
    with torch.no_grad():
        for t in leaves:
            t.copy_(torch.where(torch.isfinite(t), t * 0.5 + 0.25, t))
    graph.replay()
    torch.cuda.synchronize()
    fresh = [t.detach().clone().requires_grad_() for t in leaves]
    eager = run_on(label, dpa, *fresh, **kwargs)
    eager.backward(g)
    assert rel_err(out, eager) < 1e-3
    for a, b in zip(leaves, fresh):
        assert rel_err(a.grad, b.grad) < 1e-3
