"""Per-sequence mask policies on the GPU backends (skipped without CUDA): parity with the
unfused backend (mixed, empty, three policies; gaps, GQA, fp16, d64), CUDA-graph capture and
replay, no host sync, the policy table of malformed ids on CUDA, and a repeated call taking the
fast path."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention

from .gpu_helpers import GPU_BACKENDS, check_graph_replay, grads_of, rel_err, run_on
from .packing import make_thd
from .test_per_seq_policy import ID_CASES, _ids, _policy_of_ids_reference

pytestmark = pytest.mark.gpu
H = 4


@pytest.mark.parametrize("name", list(ID_CASES))
def test_gpu_policy_of_ids_matches_the_plain_reference(name):
    """index_fill on CUDA must wrap the clamped -1 to the last spare slot, as on the CPU."""
    from transformer_engine.pytorch.attention.dot_product_attention.prepare.policies import policy_of_ids

    lists = ID_CASES[name]
    got = policy_of_ids([torch.tensor(ids, dtype=torch.int64, device="cuda") for ids in lists], 6, torch.device("cuda"))
    torch.cuda.synchronize()
    assert got.tolist() == _policy_of_ids_reference(lists, 6)


GPU_LENGTHS = [300, 17, 512, 1, 200, 64]
GPU_GAPS = [5, 0, 33, 2, 0, 100]


def _gpu_policies(device):
    return {
        "mixed": {"padding_causal": _ids(0, 2, 4, device=device), "padding": _ids(1, 3, 5, device=device)},
        "empty-group": {"padding_causal": _ids(*range(6), device=device), "padding": _ids(device=device)},
        "three": {"padding_causal": _ids(0, 5, device=device), "padding": _ids(1, 2, device=device),
                  ("padding_causal", (64, 0)): _ids(3, 4, device=device)},
    }


@pytest.mark.parametrize("label", list(GPU_BACKENDS))
@pytest.mark.parametrize("name", ["mixed", "empty-group", "three"])
# d=64 too: the policies' calls share one buffer, which needs each kernel variant to leave the rows
# it does not run untouched (probed at d=128 only).
@pytest.mark.parametrize("gaps,hg,dtype,d", [(True, 4, torch.bfloat16, 128), (False, 2, torch.bfloat16, 128),
                                             (True, 4, torch.float16, 128), (True, 4, torch.bfloat16, 64)])
def test_gpu_parity(label, name, gaps, hg, dtype, d):
    p = make_thd(GPU_LENGTHS, gaps_q=GPU_GAPS if gaps else None, h=H, hg=hg, d=d, dtype=dtype, device="cuda", tail=7 if gaps else 0)
    dpa = DotProductAttention(H, d, num_gqa_groups=hg, qkv_format="thd", attn_mask_type="padding")
    kwargs = dict(p.kwargs(gaps, 512, 512, shared=True), attn_mask_type_per_seq=_gpu_policies("cuda")[name])
    out = run_on(label, dpa, p.q, p.k, p.v, **kwargs)
    g = torch.randn_like(out)
    got = grads_of(out, [p.q, p.k, p.v], g)
    ref_in = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]
    ref = run_on("unfused", dpa, *ref_in, **kwargs)
    want = grads_of(ref, ref_in, g)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    assert rel_err(out, ref) < tol and torch.all(out[~p.valid_q] == 0)
    for a, b, valid in zip(got, want, (p.valid_q, p.valid_kv, p.valid_kv)):
        assert torch.isfinite(a).all() and torch.all(a[~valid] == 0)
        assert rel_err(a, b) < 4 * tol


@pytest.mark.parametrize("label", list(GPU_BACKENDS))
@pytest.mark.parametrize("spelling", ["shorthand", "dict"])
def test_gpu_cuda_graph(label, spelling):
    """Mixed policies with gaps, forward+backward, captured in a CUDA graph and replayed on new
    values (both spellings: one call per policy over the whole batch)."""
    p = make_thd(GPU_LENGTHS, gaps_q=GPU_GAPS, h=H, d=128, dtype=torch.bfloat16, device="cuda")
    dpa = DotProductAttention(H, 128, qkv_format="thd", attn_mask_type="padding")
    kwargs = p.kwargs(True, 512, 512, shared=True)
    if spelling == "dict":
        kwargs["attn_mask_type_per_seq"] = _gpu_policies("cuda")["mixed"]
    else:
        kwargs["thd_sequence_is_causal"] = torch.tensor([1, 0, 1, 0, 1, 0], dtype=torch.bool, device="cuda")
    g = torch.randn(p.q.shape[0], H * 128, device="cuda", dtype=torch.bfloat16)
    check_graph_replay(label, dpa, [p.q, p.k, p.v], kwargs, g)


@pytest.mark.parametrize("label", list(GPU_BACKENDS))
def test_gpu_no_host_sync(label):
    """Mixed policies with gaps, forward+backward, under set_sync_debug_mode('error')."""
    p = make_thd(GPU_LENGTHS, gaps_q=GPU_GAPS, h=H, d=128, dtype=torch.bfloat16, device="cuda")
    dpa = DotProductAttention(H, 128, qkv_format="thd", attn_mask_type="padding")
    policies = {"padding_causal": _ids(0, 2, 4, device="cuda"), ("padding", (64, 64)): _ids(1, 3, 5, device="cuda")}
    kwargs = dict(p.kwargs(True, 512, 512, shared=True), attn_mask_type_per_seq=policies)
    g = torch.randn(p.q.shape[0], H * 128, device="cuda", dtype=torch.bfloat16)
    run_on(label, dpa, p.q, p.k, p.v, **kwargs).backward(g)  # warm-up: JIT and plans may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_on(label, dpa, p.q, p.k, p.v, **kwargs).backward(g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(p.q.grad).all()


@pytest.mark.parametrize("label", list(GPU_BACKENDS))
@pytest.mark.parametrize("spelling", ["dict", "is_causal"])
def test_gpu_policy_hit_equals_full_path(label, spelling, full_paths):
    """On each GPU backend: a repeated mixed-policy call (new lengths, ids and values; the same
    token count and id shapes, so the same key) takes the fast path and matches a fresh module's full path (the forward bit for bit; gradients
    up to the order of the backward's atomic adds)."""
    gaps = [5, 0, 33, 2, 0, 100]

    def call(lengths, causal, seed):
        p = make_thd(lengths, gaps_q=gaps, h=H, d=128, dtype=torch.bfloat16, device="cuda", tail=7, seed=seed)
        flags = torch.tensor(causal, device="cuda")
        ids = torch.arange(len(lengths), device="cuda")
        policy = (dict(thd_sequence_is_causal=flags) if spelling == "is_causal"
                  else dict(attn_mask_type_per_seq={"padding_causal": ids[flags].clone(), "padding": ids[~flags].clone()}))
        return p, dict(p.kwargs(True, 512, 512, shared=True), **policy)

    def outputs(dpa, p, kw):
        out = run_on(label, dpa, p.q, p.k, p.v, **kw)
        grads = torch.autograd.grad(out, (p.q, p.k, p.v), torch.ones_like(out))
        return [out, *grads]

    dpa = DotProductAttention(H, 128, qkv_format="thd", attn_mask_type="padding")
    outputs(dpa, *call([300, 17, 512, 1, 200, 64], [True, False, True, False, True, False], 0))
    p, kw = call([100, 512, 3, 250, 64, 165], [False, False, True, True, False, True], 1)  # 1094 tokens, as above
    got = outputs(dpa, p, kw)
    assert len(full_paths) == 1
    want = outputs(DotProductAttention(H, 128, qkv_format="thd", attn_mask_type="padding"), p, kw)
    # exact: the same backend (FA4 or cuDNN, per `label`) and configuration on the same data, and
    # both forwards are deterministic
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        assert torch.isfinite(a).all() and rel_err(a, b) < 1e-3
