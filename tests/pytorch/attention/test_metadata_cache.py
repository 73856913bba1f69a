"""THD metadata remembered across calls (prepare/metadata_cache.py).

Its teeth: a repeated call on the same unchanged cu_seqlens derives nothing (the same bounded
offsets, lengths and cuDNN offsets, forward and backward), and every change the contract names
derives again with the new values: an in-place write (the module's outputs then follow the new
sequences, which a cache keyed by identity alone would get wrong), another bound, the switch,
inference tensors, a full cache. The module runs with the CUDA path's host work on the CPU (no
value reads, offsets bounded on the device) and the library stand-ins."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention.backends import varlen
from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import graphs
from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import kernel as cudnn_kernel
from transformer_engine.pytorch.attention.dot_product_attention.prepare import fast_path, metadata_cache, packed_seqs
from transformer_engine.pytorch.attention.dot_product_attention.prepare.packed_seqs import PackedSeqs, made_safe

from .stand_ins.cudnn import lengths_of, offsets_of, pack_of

H, HG, D = 4, 2, 8


@pytest.fixture(autouse=True)
def empty_cache():
    metadata_cache.clear()
    yield
    metadata_cache.clear()


def _cu(*values):
    return torch.tensor(values, dtype=torch.int32)


def _bounded(cu, max_len=4, total=10, offsets=None):
    side = PackedSeqs(cu, cu if offsets is None else offsets, max_len, total)
    return made_safe(side, side)[0]


def test_unchanged_tensor_is_derived_once():
    cu = _cu(0, 3, 7, 9)
    a, b = _bounded(cu), _bounded(cu)
    assert b.cu_seqlens is a.cu_seqlens and b.seqlens() is a.seqlens()
    assert a.cu_seqlens.tolist() == [0, 3, 7, 9] and a.seqlens().tolist() == [3, 4, 2]


def test_gapped_lengths_are_remembered_with_both_offsets():
    cu, offsets = _cu(0, 3, 5), _cu(0, 4, 9)
    a, b = _bounded(cu, offsets=offsets), _bounded(cu, offsets=offsets)
    assert b.offsets is a.offsets and b.seqlens() is a.seqlens() and a.seqlens().tolist() == [3, 2]
    offsets[2] = 6  # the second slot shrinks to 2 rows: still holds its 2 tokens
    c = _bounded(cu, offsets=offsets)
    assert c.offsets is not a.offsets and c.offsets.tolist() == [0, 4, 6]


@pytest.mark.parametrize("write", ["copy_", "setitem", "no_grad add_"])
def test_an_in_place_write_derives_again(write):
    cu = _cu(0, 3, 7, 9)
    a = _bounded(cu)
    new = _cu(0, 1, 2, 12)  # 12 is past the 10 rows: bounded to 10
    if write == "copy_":
        cu.copy_(new)
    elif write == "setitem":
        cu[:] = new
    else:
        with torch.no_grad():
            cu.add_(new - cu)
    b = _bounded(cu)
    assert b.cu_seqlens is not a.cu_seqlens
    assert b.cu_seqlens.tolist() == [0, 1, 2, 10] and b.seqlens().tolist() == [1, 1, 4]  # 8 rows capped at max_seqlen 4


def test_each_bound_has_its_own_entry():
    cu = _cu(0, 6, 9)
    a, b = _bounded(cu, max_len=6, total=10), _bounded(cu, max_len=6, total=8)
    assert a.cu_seqlens.tolist() == [0, 6, 9] and b.cu_seqlens.tolist() == [0, 6, 8]
    c = _bounded(cu, max_len=4, total=10)
    assert c.cu_seqlens is a.cu_seqlens and c.seqlens().tolist() == [4, 3] and a.seqlens().tolist() == [6, 3]


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("NVTE_ATTN_METADATA_CACHE", "0")
    cu = _cu(0, 3, 7)
    a, b = _bounded(cu), _bounded(cu)
    assert b.cu_seqlens is not a.cu_seqlens and b.seqlens() is not a.seqlens()
    assert not metadata_cache.owns(a.cu_seqlens)


def test_inference_tensors_are_not_remembered():
    with torch.inference_mode():
        cu = _cu(0, 3, 7)
        a, b = _bounded(cu), _bounded(cu)
    assert b.cu_seqlens is not a.cu_seqlens and a.cu_seqlens.tolist() == [0, 3, 7]


def test_a_full_cache_is_emptied(monkeypatch):
    monkeypatch.setattr(metadata_cache, "MAX_ENTRIES", 2)
    tensors = [_cu(0, i + 1) for i in range(3)]
    first = _bounded(tensors[0]).cu_seqlens
    for t in tensors[1:]:
        _bounded(t)
    assert not metadata_cache.owns(first)
    assert _bounded(tensors[0]).cu_seqlens is not first


def test_values_kept_with_one_tensor_are_bounded(monkeypatch):
    monkeypatch.setattr(metadata_cache, "MAX_DERIVED", 3)
    cu = _cu(0, 3, 7)
    lengths = [_bounded(cu, max_len=m).seqlens() for m in (4, 5, 6)]
    assert _bounded(cu, max_len=4).seqlens() is lengths[0]
    _bounded(cu, max_len=7).seqlens()  # a fourth value: the three kept are dropped
    assert _bounded(cu, max_len=4).seqlens() is not lengths[0]


def test_derivations_from_caller_tensors_are_not_remembered():
    """Only the bounding reads the caller's tensors; lengths, int64 and element offsets are
    remembered only from remembered (bounded) offsets."""
    cu = _cu(0, 3, 7)
    plain = PackedSeqs(cu, cu, 4, 10)
    assert plain.seqlens() is not plain.seqlens()
    assert cudnn_kernel._int64(cu) is not cudnn_kernel._int64(cu)
    bounded = _bounded(cu).cu_seqlens
    wide = cudnn_kernel._int64(bounded)
    assert cudnn_kernel._int64(bounded) is wide and wide.dtype == torch.int64
    assert graphs._element_offsets(wide, 32) is graphs._element_offsets(wide, 32)
    assert graphs._element_offsets(wide, 32).view(-1).tolist() == [0, 96, 224]
    assert graphs._element_offsets(wide, 16) is not graphs._element_offsets(wide, 32)


# ------------------------------------------------------------------ the module, as on CUDA


@pytest.fixture
def as_on_cuda(monkeypatch):
    """The CUDA path's host work on the CPU: no value reads, offsets bounded by made_safe."""
    monkeypatch.setattr(packed_seqs, "value_checks_on", lambda device: False)
    bounded = lambda pq, pk: made_safe(pq, pk)  # noqa: E731
    monkeypatch.setattr(packed_seqs, "checked_or_safe", bounded)
    monkeypatch.setattr(fast_path, "checked_or_safe", bounded)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(12, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(12, HG, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    return q, k, v


def _run(dpa, backend, qkv, cu, max_len):
    for t in qkv:
        t.grad = None
    with backend_scope(force=backend):
        out = dpa(*qkv, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len)
    out.backward(torch.ones_like(out))
    return [out.detach()] + [t.grad.clone() for t in qkv]


def _unfused(qkv, lengths):
    """The unfused backend on fresh cu_seqlens of ``lengths`` (its own values)."""
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal")
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    return _run(dpa, "unfused", leaves, cu, max(lengths))


def _assert_close(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a.nan_to_num(), b.nan_to_num(), rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("backend", ["FlashAttention v4", "FusedAttention"])
def test_module_reuses_metadata_and_follows_in_place_writes(as_on_cuda, fa4_lib, cudnn_lib, backend):
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal")
    qkv = _batch()
    cu = _cu(0, 5, 8, 12)
    first = _run(dpa, backend, qkv, cu, 5)
    _assert_close(first, _unfused(qkv, [5, 3, 4]))
    derived = []

    def counting(real):
        def counted(*args):
            *head, derive = args

            def counting_derive():
                derived.append(head[-1] if real is metadata_cache.derived_from else head[0])
                return derive()

            return real(*head, counting_derive)

        return counted

    with pytest.MonkeyPatch.context() as mp:
        for module in (packed_seqs, varlen, cudnn_kernel, graphs):
            for name in ("remembered", "derived_from"):
                if hasattr(module, name):
                    mp.setattr(module, name, counting(getattr(metadata_cache, name)))
        again = _run(dpa, backend, qkv, cu, 5)
        assert derived == []  # forward and backward: every derivation was remembered
        cu.copy_(_cu(0, 2, 9, 12))  # other sequences, same rows: a cache keyed by identity alone would miss it
        moved = _run(dpa, backend, qkv, cu, 7)
        assert "sides" in derived and "bounded" in derived
    _assert_close(again, first)
    _assert_close(moved, _unfused(qkv, [2, 7, 3]))
    if backend == "FusedAttention":  # what cuDNN was handed on the last call: the new offsets and lengths
        node, pack = cudnn_lib.of("fwd")[-1]
        assert offsets_of(pack, "q").tolist() == [0, 2, 9, 12] and lengths_of(pack, "q").tolist() == [2, 7, 3]
        assert pack_of(pack, "rq") is not None
    else:
        calls = fa4_lib.of("fwd")
        assert calls[1]["cu_seqlens_q"] is calls[0]["cu_seqlens_q"]  # the remembered bounded offsets
        assert calls[-1]["cu_seqlens_q"].tolist() == [0, 2, 9, 12]


def test_a_remembered_plan_keeps_its_kernel_call(as_on_cuda, fa4_lib, monkeypatch):
    """The problem and KernelCall of a remembered plan are made once per set of flags: a repeat
    makes none, a call without gradients (no statistics) makes its own."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends import kernel_autograd

    made = []
    real = kernel_autograd.module_problem
    monkeypatch.setattr(kernel_autograd, "module_problem", lambda *args: made.append(1) or real(*args))
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal")
    qkv, cu = _batch(), _cu(0, 5, 8, 12)
    first = _run(dpa, "FlashAttention v4", qkv, cu, 5)
    again = _run(dpa, "FlashAttention v4", qkv, cu, 5)
    assert len(made) == 1
    _assert_close(again, first)
    with torch.no_grad(), backend_scope(force="FlashAttention v4"):
        out = dpa(*qkv, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    assert len(made) == 2 and fa4_lib.of("fwd")[-1]["lse"] is None
    torch.testing.assert_close(out, first[0])
