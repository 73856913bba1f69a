"""FlashAttention v4 and FusedAttention (cuDNN) against the unfused backend on the GPU:
formats x masks x GQA x windows x THD (with and without gaps), fp16/bf16, forward and
dQ/dK/dV; gaps against the same batch packed without them; plus CUDA-graph capture and
torch.compile. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention

from .gpu_helpers import GPU_BACKENDS, check_graph_replay, grads_of, rel_err, run_on
from .packing import GAP_CASES, check_gaps_vs_dense_packing, make_thd
from .spies import spy_zeroing_ops

pytestmark = pytest.mark.gpu
H, D = 4, 128
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
LENGTHS = [100, 300, 37, 511, 1]
GAPS = [12, 0, 27, 1, 64]

THD_CASES = [
    # (mask, window, hg, gaps, dtype)
    ("padding", None, 4, False, torch.bfloat16),
    ("padding_causal", None, 4, False, torch.bfloat16),
    ("padding_causal", None, 1, False, torch.bfloat16),
    ("padding", None, 2, True, torch.bfloat16),
    ("padding_causal", None, 4, True, torch.bfloat16),
    ("padding_causal", (64, 0), 4, True, torch.bfloat16),
    ("padding", (32, 32), 4, False, torch.bfloat16),
    ("padding_causal", None, 4, True, torch.float16),
]


def _compare(label, dpa, inputs, kwargs, dtype, valid_rows=None, expect_refusal=None):
    out = run_on(label, dpa, *inputs, expect_refusal=expect_refusal, **kwargs)
    assert dpa.last_selection.label == label
    g = torch.randn_like(out)
    got = grads_of(out, inputs, g)
    ref_in = [t.detach().clone().requires_grad_() for t in inputs]
    ref = run_on("unfused", dpa, *ref_in, **kwargs)
    want = grads_of(ref, ref_in, g)
    tol = TOL[dtype]
    assert rel_err(out, ref) < tol, f"out: {rel_err(out, ref):.2e}"
    for name, a, b in zip("qkv", got, want):
        assert torch.isfinite(a).all(), f"d{name} has non-finite values"
        assert rel_err(a, b) < 4 * tol, f"d{name}: {rel_err(a, b):.2e}"
    if valid_rows is not None:
        rows_q, rows_kv = valid_rows
        assert torch.all(out.view(out.shape[0], -1)[~rows_q] == 0)
        for a, rows in zip(got, (rows_q, rows_kv, rows_kv)):
            assert torch.all(a[~rows] == 0)


@pytest.mark.parametrize("label", list(GPU_BACKENDS))
@pytest.mark.parametrize("mask,window,hg,gaps,dtype", THD_CASES)
def test_thd(label, mask, window, hg, gaps, dtype):
    p = make_thd(LENGTHS, gaps_q=GAPS if gaps else None, h=H, hg=hg, d=D, dtype=dtype, device="cuda", tail=5)
    dpa = DotProductAttention(H, D, num_gqa_groups=hg, qkv_format="thd", attn_mask_type=mask, window_size=window)
    kwargs = p.kwargs(gaps, max(LENGTHS), max(LENGTHS), shared=True)
    if not gaps:  # without gaps the tail past the last sequence holds finite garbage, not NaN
        p.fill_outside(7.0)
    _compare(label, dpa, [p.q, p.k, p.v], kwargs, dtype, (p.valid_q, p.valid_kv))


DENSE_CASES = [
    ("bshd", "no_mask", 256, 256),
    ("bshd", "causal", 256, 256),
    ("bshd", "causal_bottom_right", 128, 384),
    ("sbhd", "causal", 256, 256),
    ("bshd", "padding_causal", 256, 256),
]


@pytest.mark.parametrize("label", list(GPU_BACKENDS))
@pytest.mark.parametrize("fmt,mask,sq,skv", DENSE_CASES)
def test_dense(label, fmt, mask, sq, skv):
    b, dtype = 2, torch.bfloat16
    shape = lambda s, h: (b, s, h, D) if fmt == "bshd" else (s, b, h, D)  # noqa: E731
    inputs = [torch.randn(shape(s, h), device="cuda", dtype=dtype, requires_grad=True) for s, h in ((sq, H), (skv, 2), (skv, 2))]
    kwargs = {}
    if mask.startswith("padding"):
        lengths = torch.tensor([sq, sq // 2], device="cuda")
        pad = torch.arange(sq, device="cuda").view(1, sq) >= lengths.view(b, 1)
        kwargs["attention_mask"] = pad.view(b, 1, 1, sq)
    dpa = DotProductAttention(H, D, num_gqa_groups=2, qkv_format=fmt, attn_mask_type=mask)
    # FlashAttention takes padding only as cu_seqlens (declared; skipped with that reason).
    refusal = "attention_mask=padding mask" if label == "FlashAttention v4" and mask.startswith("padding") else None
    _compare(label, dpa, inputs, kwargs, dtype, expect_refusal=refusal)


# bf16 runs every gap case; fp16 only the plain ones (no window, self-attention), which keeps the
# number of JIT-compiled kernels down.
GAP_RUNS = [(torch.bfloat16, *case) for case in GAP_CASES] + [
    (torch.float16, *case) for case in GAP_CASES if case[1] is None and not case[3]
]


def _dtype_id(value):
    """'bfloat16' / 'float16' in the test ids; pytest's own ids for the other values."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


@pytest.mark.parametrize("label", list(GPU_BACKENDS))
@pytest.mark.parametrize("dtype,mask,window,hg,cross", GAP_RUNS, ids=_dtype_id)
def test_gaps_equal_the_batch_packed_without_them(label, dtype, mask, window, hg, cross):
    lengths_q = [200, 17, 333, 64]
    lengths_kv = [150, 220, 40, 64] if cross else lengths_q
    p = make_thd(lengths_q, lengths_kv, [8, 31, 0, 100], [3, 0, 77, 5] if cross else None, h=H, hg=hg, d=D,
                 dtype=dtype, device="cuda", tail=9)
    window = None if window is None else tuple(16 * w for w in window)
    check_gaps_vs_dense_packing(label, p, lengths_q, lengths_kv, mask, window, hg, D, 2e-2, shared=not cross, heads=H)


@pytest.mark.parametrize("label", list(GPU_BACKENDS))
def test_cuda_graph_capture(label):
    p = make_thd(LENGTHS, gaps_q=GAPS, h=H, hg=H, d=D, dtype=torch.bfloat16, device="cuda")
    dpa = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal")
    g = torch.randn(p.q.shape[0], H * D, device="cuda", dtype=torch.bfloat16)
    check_graph_replay(label, dpa, [p.q, p.k, p.v], p.kwargs(True, max(LENGTHS), max(LENGTHS), shared=True), g)


@pytest.mark.parametrize("label", list(GPU_BACKENDS))
def test_torch_compile_fullgraph(label):
    p = make_thd(LENGTHS, gaps_q=GAPS, h=H, hg=H, d=D, dtype=torch.bfloat16, device="cuda")
    dpa = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal")
    kwargs = p.kwargs(True, max(LENGTHS), max(LENGTHS), shared=True)
    qkv = torch.stack([p.q.detach(), p.k.detach(), p.v.detach()], dim=1).requires_grad_()

    def f(qkv):
        if label == "FusedAttention":  # cuDNN refuses a packed q with gradients: q apart, kv packed
            return dpa(query_layer=qkv[:, 0], kv_layer=qkv[:, 1:], qkv_interleave_dim=-3, **kwargs)
        return dpa(qkv_layer=qkv, qkv_interleave_dim=-3, **kwargs)

    compiled = torch.compile(f, fullgraph=True)
    switches = dict(GPU_BACKENDS[label], NVTE_UNFUSED_ATTN="0")
    from .gpu_helpers import env

    with env(**switches):
        out = compiled(qkv)
        out.float().sum().backward()
        eager = f(qkv.detach())
    assert rel_err(out, eager) < 1e-3
    assert torch.all(qkv.grad[~p.valid_q] == 0) and torch.isfinite(qkv.grad).all()


@pytest.mark.parametrize("label", list(GPU_BACKENDS))
@pytest.mark.parametrize("tail", [0, 7])
def test_zeroing_is_skipped_once_every_row_is_known_owned(label, tail, nan_buffers, monkeypatch):
    """The rows fact (backends/varlen.py ``rows_fact``) on the device: the first call copies it
    without waiting; once it has landed, a batch that fills its tensors makes no zeroing launch
    (forward or backward), and one with a tail keeps zeroing it. Buffers start NaN-filled
    (``nan_buffers``): a row left unzeroed would show. The tail holds finite values: rows past
    cu_seqlens[-1] without padded offsets are not NaN-guarded (README), FA4 reads them."""
    zeroed = spy_zeroing_ops(monkeypatch)
    p = make_thd(LENGTHS, h=H, hg=H, d=D, dtype=torch.bfloat16, device="cuda", tail=tail)
    with torch.no_grad():
        for t in (p.q, p.k, p.v):
            t[~p.valid_q] = 1.0
    kw = dict(cu_seqlens_q=p.cu_q, cu_seqlens_kv=p.cu_q, max_seqlen_q=511, max_seqlen_kv=511)
    g = torch.randn(p.q.shape[0], H * D, device="cuda", dtype=torch.bfloat16)
    dpa = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal")
    first = run_on(label, dpa, p.q, p.k, p.v, **kw)
    first = [first] + grads_of(first, [p.q, p.k, p.v], g)
    torch.cuda.synchronize()  # the copy has landed
    zeroed.clear()
    again = run_on(label, dpa, p.q, p.k, p.v, **kw)
    again = [again] + grads_of(again, [p.q, p.k, p.v], g)
    assert bool(zeroed) == bool(tail)
    valid = p.valid_q
    for a, b in zip(again, first):
        assert torch.isfinite(a[valid]).all() and rel_err(a[valid], b[valid]) < 1e-3
        assert torch.all(a[~valid] == 0)


@pytest.mark.parametrize("label", list(GPU_BACKENDS))
def test_remembered_metadata_follows_refilled_cu_seqlens(label):
    """THD metadata is remembered per cu_seqlens tensor (prepare/metadata_cache.py): eager calls
    fill it, a capture after them must record its own derivations (replays after a refill follow
    the new lengths), and an eager call after an in-place refill must derive again."""
    other = [500, 49, 300, 99, 1]  # the same 949 rows, other sequences
    p = make_thd(LENGTHS, h=H, hg=H, d=D, dtype=torch.bfloat16, device="cuda")
    dpa = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal")
    cu = p.cu_q.clone()
    kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=511, max_seqlen_kv=511)
    g = torch.randn(p.q.shape[0], H * D, device="cuda", dtype=torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]
    refill = torch.tensor([0] + list(torch.tensor(other).cumsum(0)), dtype=torch.int32, device="cuda")

    def fresh(lengths_cu):  # a new module and new tensors: nothing remembered applies
        new = [t.detach().clone().requires_grad_() for t in leaves]
        copy = lengths_cu.clone()
        out = run_on(label, DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal"), *new,
                     **dict(kw, cu_seqlens_q=copy, cu_seqlens_kv=copy))
        return [out] + grads_of(out, new, g)

    def check(got, want):
        for a, b in zip(got, want):
            assert rel_err(a, b) < 1e-3

    first_cu = cu.clone()
    out = run_on(label, dpa, *leaves, **kw)
    check([out] + grads_of(out, leaves, g), fresh(first_cu))
    side = torch.cuda.Stream()  # eager warm-ups on a side stream (remembered there), then the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run_on(label, dpa, *leaves, **kw).backward(g)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    # Fresh leaves for the capture: a leaf whose gradient was accumulated on another stream
    # (the eager calls above) cannot be captured; the capture's backward assigns the gradients.
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    graph = torch.cuda.CUDAGraph()
    # Captured on the stream the warm-ups filled the cache on: without the capture guard the
    # capture would take their remembered values, and the replays would keep the old lengths.
    with torch.cuda.graph(graph, stream=side):
        captured = run_on(label, dpa, *leaves, **kw)
        captured.backward(g)
    cu.copy_(refill)
    graph.replay()
    torch.cuda.synchronize()
    check([captured] + [t.grad.clone() for t in leaves], fresh(refill))
    final = [t.detach().clone().requires_grad_() for t in leaves]
    out = run_on(label, dpa, *final, **kw)  # eager again on the refilled tensor
    check([out] + grads_of(out, final, g), fresh(refill))
