"""Bad THD metadata on CUDA (skipped without it): unchecked by default (each check would be a
host sync), it is bounded on the device, so no backend reads out of bounds and the context
stays usable; NVTE_ATTN_VALIDATE=1 names it, as the CPU always does (test_thd_packings.py).
cu_seqlens on another device is named."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention

from .gpu_helpers import GPU_BACKENDS
from .packing import make_thd

pytestmark = pytest.mark.gpu
H = 4


BAD_CUDA = {
    # what is wrong -> (kwargs changes, the argument the validation error names)
    "past_end": (dict(cu_seqlens_q_padded=[0, 45, 900]), "cu_seqlens_q_padded must end within"),
    "decreasing": (dict(cu_seqlens_kv=[0, 60, 30]), "cu_seqlens_kv must be non-decreasing"),
    "short_slot": (dict(cu_seqlens_q_padded=[0, 10, 110]), "cu_seqlens_q_padded slots must each hold their sequence"),
    "max_seqlen": (dict(max_seqlen_q=8), "max_seqlen for cu_seqlens_q must be at least"),
}


def _cuda_batch():
    p = make_thd([40, 60], gaps_q=[5, 7], h=H, d=64, dtype=torch.bfloat16, device="cuda")
    kw = dict(cu_seqlens_q=p.cu_q, cu_seqlens_kv=p.cu_q.clone(), cu_seqlens_q_padded=p.off_q, cu_seqlens_kv_padded=p.off_q.clone(),
              max_seqlen_q=60, max_seqlen_kv=60)
    return p, kw


def _apply(kw, changes):
    kw = dict(kw)
    for name, value in changes.items():
        kw[name] = torch.tensor(value, dtype=torch.int32, device="cuda") if isinstance(value, list) else value
    return kw


@pytest.mark.parametrize("backend", ["default", "FusedAttention", "FlashAttention v4", "unfused"])
@pytest.mark.parametrize("what", list(BAD_CUDA))
def test_cuda_bad_metadata_is_bounded_then_named(monkeypatch, backend, what):
    if backend == "unfused":
        monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
        monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    elif backend != "default":
        for k, val in dict(GPU_BACKENDS[backend], NVTE_UNFUSED_ATTN="0").items():
            monkeypatch.setenv(k, val)
    monkeypatch.delenv("NVTE_ATTN_VALIDATE", raising=False)
    p, kw = _cuda_batch()
    bad = _apply(kw, BAD_CUDA[what][0])
    dpa = DotProductAttention(H, 64, qkv_format="thd", attn_mask_type="padding")
    out = dpa(p.q, p.k, p.v, **bad)  # every backend runs this batch: a refusal is a failure
    if backend != "default":
        assert dpa.last_selection.label == ("UnfusedDotProductAttention" if backend == "unfused" else backend)
    out.float().sum().backward()
    torch.cuda.synchronize()  # an out-of-bounds access would surface here
    # Bounded, not right: clamped metadata may still point at in-tensor gap rows (NaN in this
    # batch) or leave rows past a too-small max_seqlen unwritten, so values are not checked.
    assert out.shape == (p.q.shape[0], H * 64)
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (p.q, p.k, p.v))
    healthy = dpa(p.q, p.k, p.v, **kw)  # the context still works
    torch.cuda.synchronize()
    assert torch.isfinite(healthy).all()
    monkeypatch.setenv("NVTE_ATTN_VALIDATE", "1")
    with pytest.raises(ValueError, match=BAD_CUDA[what][1]):
        dpa(p.q, p.k, p.v, **bad)


def test_cuda_cu_seqlens_on_another_device_is_named():
    p, kw = _cuda_batch()
    kw["cu_seqlens_kv"] = kw["cu_seqlens_kv"].cpu()
    with pytest.raises(ValueError, match=r"cu_seqlens_kv must be on the inputs' device cuda:0; got cpu"):
        DotProductAttention(H, 64, qkv_format="thd", attn_mask_type="padding")(p.q, p.k, p.v, **kw)
