"""THD metadata remembered across calls (prepare/metadata_cache.py).

Its teeth: a repeated call on the same unchanged cu_seqlens derives nothing (the same bounded
offsets, lengths and cuDNN offsets, forward and backward), and every change the contract names
derives again with the new values: an in-place write (the module's outputs then follow the new
sequences, which a cache keyed by identity alone would get wrong), a swapped storage, another
bound, another stream, the switch, inference mode and tensors, dispatch modes, a full cache. The
module runs with the CUDA path's host work on the CPU (no value reads, offsets bounded on the
device) and the library stand-ins, FP8 on cuDNN's included."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention.backends import kernel_autograd, varlen
from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import graphs
from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import kernel as cudnn_kernel
from transformer_engine.pytorch.attention.dot_product_attention.prepare import metadata_cache, packed_seqs
from transformer_engine.pytorch.attention.dot_product_attention.prepare.packed_seqs import PackedSeqs, made_safe

from .fp8_helpers import delayed, fp8_clean  # noqa: F401  (fp8_clean: autouse, every test starts with no FP8 state)
from .stand_ins.cudnn import lengths_of, offsets_of, pack_of

H, HG, D = 4, 2, 8


pytestmark = pytest.mark.usefixtures("empty_metadata_cache")


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


@pytest.mark.parametrize("write", ["copy_", "setitem", "no_grad add_", "data ="])
def test_an_in_place_write_derives_again(write):
    cu = _cu(0, 3, 7, 9)
    a = _bounded(cu)
    new = _cu(0, 1, 2, 12)  # 12 is past the 10 rows: bounded to 10
    if write == "copy_":
        cu.copy_(new)
    elif write == "setitem":
        cu[:] = new
    elif write == "data =":  # a new storage, the version unchanged: the data pointer tells
        version = cu._version
        cu.data = new
        assert cu._version == version
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


def test_an_inference_tensor_among_the_sources_is_not_remembered():
    """Only the offsets made in inference mode: their version counter does not exist."""
    cu = _cu(0, 3, 5)
    with torch.inference_mode():
        offsets = _cu(0, 4, 9)
    a, b = _bounded(cu, offsets=offsets), _bounded(cu, offsets=offsets)
    assert b.offsets is not a.offsets and a.seqlens().tolist() == [3, 2]


def test_values_made_in_inference_mode_are_not_kept_for_training_calls():
    cu = _cu(0, 3, 7)
    with torch.inference_mode():
        inside = _bounded(cu)
    outside = _bounded(cu)
    assert outside.cu_seqlens is not inside.cu_seqlens and not outside.cu_seqlens.is_inference()


def test_a_call_on_another_stream_derives_again(monkeypatch):
    """A value made on one CUDA stream may not be ready on another (stood in for on the CPU)."""
    cu = _cu(0, 3, 7)
    monkeypatch.setattr(metadata_cache, "_stream_of", lambda t: "stream A")
    a = _bounded(cu)
    assert _bounded(cu).cu_seqlens is a.cu_seqlens
    monkeypatch.setattr(metadata_cache, "_stream_of", lambda t: "stream B")
    assert _bounded(cu).cu_seqlens is not a.cu_seqlens
    monkeypatch.setattr(metadata_cache, "_stream_of", lambda t: False)  # a graph capture on the stream
    assert not metadata_cache.owns(_bounded(cu).cu_seqlens)


def test_a_dispatch_mode_sees_no_remembered_value():
    """make_fx, export and FakeTensorMode trace through a dispatch mode: a remembered tensor
    would become their graph's constant."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    cu = _cu(0, 3, 7)
    a = _bounded(cu)
    with Seen():
        b = _bounded(cu)
        lengths = a.seqlens()  # a remembered record: what is derived from it under the mode is not kept
    assert b.cu_seqlens is not a.cu_seqlens and not metadata_cache.owns(b.cu_seqlens)
    assert a.seqlens() is not lengths and a.seqlens() is a.seqlens()


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
    wide = cudnn_kernel._int64(_bounded(_cu(0, 3, 7)).cu_seqlens)
    columns = [graphs._element_offsets(wide, stride) for stride in (8, 16, 24)]
    assert graphs._element_offsets(wide, 8) is columns[0]
    held = len(metadata_cache._OUTPUTS)
    graphs._element_offsets(wide, 32)  # a fourth value: the three kept are dropped, and let go
    assert graphs._element_offsets(wide, 8) is not columns[0]
    assert len(metadata_cache._OUTPUTS) == held - 3 + 2
    assert not any(metadata_cache.owns(c) for c in columns)


def test_a_full_cache_keeps_the_inner_values_of_the_derivation_that_filled_it(monkeypatch):
    """The cache is emptied before a derivation, not after: made_safe's bounds (remembered inside
    the sides' derivation) survive, so what is derived from them keeps being remembered."""
    monkeypatch.setattr(metadata_cache, "MAX_ENTRIES", 3)
    for i in range(2):
        _bounded(_cu(0, i + 1))
    cu, offsets = _cu(0, 3, 5), _cu(0, 4, 9)  # gaps: "sides" and two "bounded" entries
    a = _bounded(cu, offsets=offsets)
    assert metadata_cache.owns(a.cu_seqlens) and metadata_cache.owns(a.offsets)
    assert a.seqlens() is a.seqlens()


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
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)  # NaN anywhere fails (equal_nan is off)


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

    # Every module that reaches the cache, by the names it imports (setattr fails where a module
    # no longer has one: one calling metadata_cache.<name> instead would escape the count).
    users = {packed_seqs: ("remembered", "derived_from"), varlen: ("derived_from",), kernel_autograd: ("derived_from",),
             cudnn_kernel: ("derived_from",), graphs: ("derived_from",)}
    with pytest.MonkeyPatch.context() as mp:
        for module, names in users.items():
            for name in names:
                mp.setattr(module, name, counting(getattr(metadata_cache, name)))
        again = _run(dpa, backend, qkv, cu, 5)
        assert derived == []  # forward and backward: every derivation was remembered
        cu.copy_(_cu(0, 2, 9, 12))  # other sequences, same rows: a cache keyed by identity alone would miss it
        moved = _run(dpa, backend, qkv, cu, 7)
        assert "sides" in derived and "bounded" in derived
        if backend == "FusedAttention":  # cuDNN's own derivations follow the new offsets too
            assert "int64" in derived and ("elements", 32) in derived
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


def test_fp8_calls_follow_in_place_writes(as_on_cuda, cudnn_lib, fp8_clean):
    """cuDNN's FP8 forward reads the remembered plan and element offsets too: a module whose
    cu_seqlens are refilled in place gives what a module handed fresh tensors gives (the same
    delayed-scaling history on both)."""
    import transformer_engine.pytorch as te

    g = torch.Generator().manual_seed(5)
    q = torch.randn(12, H, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(12, HG, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    lengths = ([5, 3, 4], [5, 3, 4], [2, 7, 3])

    def steps(fresh_tensors: bool):
        dpa = DotProductAttention(H, 64, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal")
        cu = _cu(0, 5, 8, 12)
        outs = []
        for i, lens in enumerate(lengths):
            new = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
            if fresh_tensors:
                cu = new
            elif i:
                cu.copy_(new)
            with backend_scope(force="FusedAttention"), te.autocast(recipe=delayed()), torch.no_grad():
                outs.append(dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7))
        return outs

    refilled, fresh = steps(False), steps(True)
    for a, b in zip(refilled, fresh):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-3, atol=1e-3)  # stale offsets differ by O(1)
    assert (refilled[2].float() - refilled[1].float()).abs().max() > 0.1  # the refill changed the sequences
    assert len(cudnn_lib.of("fp8_fwd")) == 6  # the FP8 graphs ran, three calls per module

