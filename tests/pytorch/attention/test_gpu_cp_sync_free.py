"""A context-parallel step adds no host sync and captures in a CUDA graph (GPU).

NCCL needs one GPU per rank, and the one-GPU machine's gloo staging syncs by design, so the
transport here is an in-process stand-in (:class:`LoopbackComm`, a CPComm): rank 0 of a CP
group of 2 whose "peer" sends back tensors shaped like its own. The numbers are meaningless;
what is checked is that everything else a CP step runs (partition indices, ring steps, LSE
merges, the FA4/cuDNN kernels, the backward ring) neither syncs with the host nor breaks a
CUDA-graph capture. Correctness of CP is checked elsewhere (test_context_parallel.py on gloo,
test_gpu_context_parallel.py with the kernels).
"""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention.dot_product_attention.cp.comm import CPComm, Pending

from .gpu_helpers import env, sync_errors

pytestmark = pytest.mark.gpu
H, D = 4, 64
KERNEL_ENV = {
    "FlashAttention v4": {"NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
    "FusedAttention": {"NVTE_FLASH_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
}


class LoopbackComm(CPComm):
    """Rank 0 of ``size`` ranks; every peer answers with a copy of what this rank sends."""

    def __init__(self, size: int = 2) -> None:  # no process group behind it
        self.group, self.size, self.rank, self.backend, self.stream = None, size, 0, "loopback", None

    def exchange(self, send, dst, src):
        recv = send.clone()
        return Pending(lambda: recv)

    def all_gather(self, t):
        return t.unsqueeze(0).expand(self.size, *t.shape).clone()

    def reduce_scatter(self, t):
        return t.sum(0)

    def all_to_all(self, t):
        return t.clone()


def _batch(device="cuda", cp=2):
    # Two sequences with gaps; every slot a multiple of 2 * cp, as TE's contract requires.
    lengths, slots = [100, 37], [104, 48]
    cu = torch.tensor([0, 100, 137], dtype=torch.int32, device=device)
    cu_pad = torch.tensor([0, 104, 152], dtype=torch.int32, device=device)
    local = sum(slots) // cp
    q, k, v = (torch.randn(local, H, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad,
                  max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    return (q, k, v), kwargs


def _step(dpa, inputs, kwargs):
    out = dpa(*inputs, **kwargs)
    out.backward(torch.ones_like(out))
    return out


@pytest.mark.parametrize("label", list(KERNEL_ENV))
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
def test_cp_step_is_sync_free_and_captures(label, comm_type):
    inputs, kwargs = _batch()
    dpa = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal", cp_group=LoopbackComm(),
                              cp_comm_type=comm_type)
    with env(**KERNEL_ENV[label]):
        _step(dpa, inputs, kwargs)  # warm-up: JIT compiles, cuDNN plans
        torch.cuda.synchronize()
        with sync_errors():
            out = _step(dpa, inputs, kwargs)
        ran = dpa.last_selection.label
        assert ran == label, f"expected {label}, ran {ran}"
        assert torch.isfinite(out).all()

        _check_capture(dpa, inputs, kwargs)


def _check_capture(dpa, inputs, kwargs):
    """Capture forward+backward (fresh leaves, warmed up on a side stream, as capture needs),
    replay on new values and compare with an eager run on them."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _step(dpa, leaves, kwargs)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(dpa, leaves, kwargs)
    with torch.no_grad():
        for t in leaves:
            t.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    fresh = [t.detach().clone().requires_grad_() for t in leaves]
    eager = _step(dpa, fresh, kwargs)
    torch.testing.assert_close(captured, eager, rtol=2e-2, atol=2e-2)
    for a, b in zip(leaves, fresh):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-2)



@pytest.mark.parametrize("label", list(KERNEL_ENV))
def test_mha_rope_cp_step_is_sync_free(label):
    """MultiheadAttention with rotary embeddings under CP: the global positions of the local
    rows (zigzag, from the global slots) are computed on the device without a host sync."""
    from transformer_engine.pytorch import MultiheadAttention

    (q, _, _), kwargs = _batch()
    mha = MultiheadAttention(H * D, H, D, attention_dropout=0.0, fuse_qkv_params=True, qkv_format="thd",
                             attn_mask_type="padding_causal", params_dtype=torch.bfloat16, device="cuda")
    mha.set_context_parallel_group(LoopbackComm(), None, None, "p2p")
    x = torch.randn(q.shape[0], H * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    angles = torch.outer(torch.arange(256, device="cuda", dtype=torch.float32), inv)
    rope = torch.cat([angles, angles], dim=-1).view(256, 1, 1, D)
    with env(**KERNEL_ENV[label]):
        mha(x, rotary_pos_emb=rope, **kwargs).sum().backward()  # warm-up
        torch.cuda.synchronize()
        with sync_errors():
            out = mha(x, rotary_pos_emb=rope, **kwargs)
            out.sum().backward()
        assert mha.core_attention.last_selection.label == label
        assert torch.isfinite(out).all()
