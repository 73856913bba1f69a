"""Memory of the unfused backend on CUDA (skipped without it), by torch.cuda's allocator
statistics: one long sequence's training peak under 1.5 score matrices, a packed batch's far
below one sequence of its tokens; checkpointed chunks sync-free and captured in a CUDA graph;
dropout inside a captured graph drawing anew each replay. (The same counted on the CPU:
test_unfused_memory.py.)"""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention

from .gpu_helpers import check_graph_replay, env, run_on
from .packing import make_thd
from .test_unfused_memory import HM, _matrix_bytes

pytestmark = pytest.mark.gpu


def _gpu_train_peak(lengths, d=32) -> int:
    """Bytes allocated above the inputs at the peak of one unfused forward+backward on CUDA."""
    p = make_thd(lengths, h=HM, hg=HM, d=d, dtype=torch.float32, device="cuda")
    dpa = DotProductAttention(HM, d, qkv_format="thd", attn_mask_type="padding_causal")
    kw = p.kwargs(False, max(lengths), max(lengths))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run_on("unfused", dpa, p.q, p.k, p.v, **kw)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_gpu_one_long_sequence_trains_under_one_and_a_half_score_matrices():
    """Issue 22's case at the default budget (2**26 elements = one [4, 4096, 4096] float32 matrix)."""
    peak = _gpu_train_peak([4096])
    assert peak < 1.5 * _matrix_bytes(4096), peak / _matrix_bytes(4096)


def test_gpu_packed_batch_trains_in_far_less_than_one_sequence_of_its_tokens():
    packed, long = _gpu_train_peak([256] * 16), _gpu_train_peak([4096])
    assert packed < 0.5 * long, (packed, long)


def test_gpu_checkpointed_chunks_are_sync_free_and_capture():
    """The gathered path with every chunk checkpointed (a small budget): no host sync in
    forward+backward, and a CUDA graph of both replays on new values."""
    p = make_thd([100, 37, 300], gaps_q=[3, 0, 9], h=HM, hg=2, d=32, dtype=torch.float32, device="cuda")
    dpa = DotProductAttention(HM, 32, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal",
                              softmax_type="learnable").cuda()
    kw = p.kwargs(True, 300, 300, shared=True)
    g = torch.randn(p.q.shape[0], HM * 32, device="cuda")
    with env(NVTE_UNFUSED_ATTN_MAX_SCORES=str(3 * HM * 64 * 300)):
        run_on("unfused", dpa, p.q, p.k, p.v, **kw).backward(g)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run_on("unfused", dpa, p.q, p.k, p.v, **kw).backward(g)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        check_graph_replay("unfused", dpa, [p.q, p.k, p.v], kw, g)


def test_gpu_dropout_trains_inside_a_cuda_graph():
    """Checkpointed chunks cannot restore a CUDA generator's state during capture, so a captured
    call with dropout keeps P for autograd instead: it captures, and each replay draws anew."""
    p = make_thd([200, 300], h=HM, hg=HM, d=32, dtype=torch.float32, device="cuda")
    dpa = DotProductAttention(HM, 32, qkv_format="thd", attn_mask_type="padding_causal", attention_dropout=0.3)
    kw = p.kwargs(False, 300, 300)
    g = torch.randn(p.q.shape[0], HM * 32, device="cuda")
    with env(NVTE_UNFUSED_ATTN_MAX_SCORES=str(2 * HM * 300 * 300)):  # not a small call
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run_on("unfused", dpa, p.q, p.k, p.v, **kw).backward(g)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for t in (p.q, p.k, p.v):
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run_on("unfused", dpa, p.q, p.k, p.v, **kw)
            out.backward(g)
    graph.replay()
    first, first_dv = out.clone(), p.v.grad.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(first).all() and torch.isfinite(first_dv).all()
    assert not torch.equal(first, out), "each replay must draw a new dropout mask"
