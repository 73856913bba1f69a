"""Per-sequence mask policies against a per-sequence reference: mixed, all-full, all-causal,
empty groups, an empty batch, GQA, with and without gaps; validation messages; sync-free and
CUDA-graph capture on the GPU."""

from __future__ import annotations

import math

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention

from .gpu_helpers import GPU_BACKENDS, check_graph_replay, grads_of, rel_err, run_on
from .packing import make_thd
from .reference import reference_thd

H, D = 4, 8
LENGTHS = [5, 3, 7, 1, 4, 6]
GAPS = [2, 0, 1, 3, 0, 2]


def _ids(*xs, device="cpu"):
    return torch.tensor(xs, dtype=torch.int64, device=device)


def _expected(p, per_seq_types, per_seq_windows, gaps, scale):
    refs = [t.detach().double().nan_to_num(0.0).requires_grad_() for t in (p.q, p.k, p.v)]
    off_q, off_kv = (p.off_q, p.off_kv) if gaps else (p.cu_q, p.cu_kv)
    return refs, reference_thd(*refs, p.cu_q, p.cu_kv, off_q, off_kv, per_seq_types, per_seq_windows, scale)


POLICIES = {
    "mixed": ({"padding_causal": _ids(0, 2, 4), "padding": _ids(1, 3, 5)}, None),
    "all-full": ({"padding": _ids(0, 1, 2, 3, 4, 5), "padding_causal": _ids()}, None),
    "all-causal": ({"padding_causal": _ids(5, 4, 3, 2, 1, 0)}, None),
    "three-with-window": ({"padding_causal": _ids(0, 3), "padding": _ids(1), ("padding_causal", (2, 0)): _ids(2, 4, 5)}, None),
    "bottom-right-and-window": ({"padding_causal_bottom_right": _ids(1, 2), ("padding", (1, 1)): _ids(0, 3, 4, 5)}, None),
    "is-causal": (None, torch.tensor([True, False, False, True, True, False])),
}


def _policy_table(per_seq, is_causal, b):
    types, windows = [None] * b, [None] * b
    if is_causal is not None:
        for i, c in enumerate(is_causal.tolist()):
            types[i] = "padding_causal" if c else "padding"
        return types, windows
    for key, ids in per_seq.items():
        mask, window = key if isinstance(key, tuple) else (key, None)
        for i in ids.tolist():
            types[i], windows[i] = mask, window
    return types, windows


# The module's own mask must not leak into the policies: a causal module mask once turned
# every policy causal (its normalized window (-1, 0) was handed to all of them).
@pytest.mark.parametrize("module_mask", ["padding", "padding_causal"])
@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("hg", [4, 2])
@pytest.mark.parametrize("name", list(POLICIES))
def test_cpu_parity(name, hg, gaps, module_mask):
    per_seq, is_causal = POLICIES[name]
    p = make_thd(LENGTHS, gaps_q=GAPS if gaps else None, h=H, hg=hg, d=D, tail=2)
    dpa = DotProductAttention(H, D, num_gqa_groups=hg, qkv_format="thd", attn_mask_type=module_mask)
    out = dpa(p.q, p.k, p.v, **p.kwargs(gaps, 7, 7, shared=True), attn_mask_type_per_seq=per_seq,
              thd_sequence_is_causal=is_causal).view(-1, H, D)
    types, windows = _policy_table(per_seq, is_causal, len(LENGTHS))
    refs, ref = _expected(p, types, windows, gaps, 1 / math.sqrt(D))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(ref)
    for got, want, valid in zip(grads_of(out, [p.q, p.k, p.v], g), grads_of(ref, refs, g), (p.valid_q, p.valid_kv, p.valid_kv)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        assert torch.all(got[~valid] == 0)


def test_uniform_policy_is_exactly_the_scalar_path():
    p = make_thd(LENGTHS, gaps_q=GAPS, h=H, d=D, dtype=torch.float32)
    dpa = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")
    kw = p.kwargs(True, 7, 7, shared=True)
    scalar = dpa(p.q, p.k, p.v, attn_mask_type="padding_causal", **kw)
    policy = dpa(p.q, p.k, p.v, attn_mask_type_per_seq={"padding_causal": _ids(*range(6)), "padding": _ids()}, **kw)
    # exact: a uniform policy must run the scalar path's ops on the same data
    assert torch.equal(scalar, policy)
    assert dpa.last_selection.label == "UnfusedDotProductAttention"


def test_empty_batch():
    p = make_thd([], h=H, d=D, tail=3)
    dpa = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")
    out = dpa(p.q, p.k, p.v, cu_seqlens_q=p.cu_q, cu_seqlens_kv=p.cu_kv, max_seqlen_q=0, max_seqlen_kv=0,
              attn_mask_type_per_seq={"padding_causal": _ids(), "padding": _ids()})
    assert out.shape == (3, H * D) and torch.all(out == 0)
    out.sum().backward()
    assert torch.all(p.q.grad == 0)


ERRORS = [
    (dict(attn_mask_type_per_seq={"padding_causal": _ids(0, 1)}), ValueError, "place each of the 6 sequences in exactly one entry; its entries hold 2"),
    (dict(attn_mask_type_per_seq={"diagonal": _ids(*range(6))}), ValueError, "attn_mask_type_per_seq key must be one of"),
    (dict(attn_mask_type_per_seq={"padding": torch.arange(6.0)}), TypeError, r"attn_mask_type_per_seq\['padding'\] must be a 1-D integer tensor"),
    (dict(attn_mask_type_per_seq={("padding_causal", (-1, 2)): _ids(*range(6))}), ValueError, r"window of attn_mask_type_per_seq key 'padding_causal'=\(-1, 2\) does not fit"),
    (dict(attn_mask_type_per_seq={"arbitrary": _ids(*range(6))}), ValueError, "cannot use 'arbitrary'"),
    (dict(attn_mask_type_per_seq=[("padding", _ids(*range(6)))]), TypeError, "attn_mask_type_per_seq must be a non-empty dict"),
    (dict(thd_sequence_is_causal=torch.tensor([1, 0, 1, 0, 1, 0])), TypeError, "thd_sequence_is_causal must be a 1-D bool tensor"),
    (dict(thd_sequence_is_causal=torch.tensor([True, False])), ValueError, "thd_sequence_is_causal must hold one value per sequence"),
    (dict(thd_sequence_is_causal=torch.ones(6, dtype=torch.bool), attn_mask_type_per_seq={"padding": _ids(*range(6))}), ValueError, "not both"),
    (dict(thd_sequence_is_causal=torch.ones(6, dtype=torch.bool), core_attention_bias_type="alibi"), NotImplementedError, "core_attention_bias_type='alibi' cannot be combined with per-sequence"),
]


@pytest.mark.parametrize("kwargs,exc,msg", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_validation(kwargs, exc, msg):
    p = make_thd(LENGTHS, h=H, d=D)
    dpa = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")
    with pytest.raises(exc, match=msg):
        dpa(p.q, p.k, p.v, **p.kwargs(False, 7, 7, shared=True), **kwargs)


def test_dense_format_rejected():
    q = torch.randn(2, 5, H, D)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask")
    with pytest.raises(NotImplementedError, match="thd_sequence_is_causal needs qkv_format='thd'"):
        dpa(q, q, q, thd_sequence_is_causal=torch.ones(2, dtype=torch.bool))


# bottom_right_diagonal with per-sequence policies: a window that comes from a policy (a
# ("padding", window) key, or the call's window handed to thd_sequence_is_causal's 'padding'
# policy) is aligned like the call's own window: bottom-right by default; False (top-left) is
# refused by name, as for the call's own window, never run bottom-right silently. Cross
# attention with sq != skv (1 query / 2 keys among them), where the two alignments differ.
CROSS_Q, CROSS_KV = [1, 3, 2, 4], [2, 5, 2, 6]
WINDOWED = {
    "window-key": (dict(attn_mask_type_per_seq={("padding", (0, 0)): _ids(0, 2), "padding_causal": _ids(1),
                                                 "padding_causal_bottom_right": _ids(3)}),
                   ["padding", "padding_causal", "padding", "padding_causal_bottom_right"], [(0, 0), None, (0, 0), None]),
    "call-window-to-is-causal": (dict(thd_sequence_is_causal=torch.tensor([False, True, False, True]), window_size=(1, 0)),
                                 ["padding", "padding_causal", "padding", "padding_causal"], [(1, 0)] * 4),
    "uniform-window-key": (dict(attn_mask_type_per_seq={("padding", (0, 0)): _ids(0, 1, 2, 3)}), ["padding"] * 4, [(0, 0)] * 4),
}


def _cross_call(kwargs, flag, gaps=False):
    p = make_thd(CROSS_Q, CROSS_KV, gaps_q=[1, 0, 2, 1] if gaps else None, gaps_kv=[0, 2, 1, 1] if gaps else None, h=H, d=D)
    dpa = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal")
    out = dpa(p.q, p.k, p.v, **p.kwargs(gaps, max(CROSS_Q), max(CROSS_KV)), bottom_right_diagonal=flag, **kwargs)
    return p, out.view(-1, H, D)


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("flag", [None, True])
@pytest.mark.parametrize("name", list(WINDOWED))
def test_policy_windows_align_bottom_right_by_default(name, flag, gaps):
    kwargs, types, windows = WINDOWED[name]
    p, out = _cross_call(kwargs, flag, gaps)
    refs, ref = _expected(p, types, windows, gaps, 1 / math.sqrt(D))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(ref)
    for got, want in zip(grads_of(out, [p.q, p.k, p.v], g), grads_of(ref, refs, g)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    if name != "call-window-to-is-causal":  # the 1-query/2-key sequence with window (0, 0) sees its last key only
        key = p.off_kv[0] + 1 if gaps else p.cu_kv[0] + 1
        torch.testing.assert_close(out[int(p.off_q[0] if gaps else 0)], p.v[int(key)], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(WINDOWED))
def test_top_left_policy_windows_are_refused_by_name(name):
    kwargs, _, _ = WINDOWED[name]
    arg = "thd_sequence_is_causal" if "thd_sequence_is_causal" in kwargs else "attn_mask_type_per_seq"
    window = (1, 0) if "window_size" in kwargs else (0, 0)
    with pytest.raises(NotImplementedError) as err:
        _cross_call(kwargs, False)
    assert (f"bottom_right_diagonal=False with the 'padding' policy of {arg} (window {window}): windows and ALiBi on "
            f"non-causal masks are aligned bottom-right here; use None or True (a top-left band that ends at the "
            f"diagonal is a causal mask: 'padding_causal' with window (left, 0))") == str(err.value)


def test_top_left_flag_leaves_causal_and_unwindowed_policies_to_their_mask_type():
    """As for the call's own mask: the mask type decides causal alignment, and a policy without
    a window has nothing to align, so False runs (and matches the reference)."""
    kwargs = dict(attn_mask_type_per_seq={"padding": _ids(0), "padding_causal": _ids(1, 2),
                                          ("padding_causal_bottom_right", (1, 0)): _ids(3)})
    p, out = _cross_call(kwargs, False)
    types = ["padding", "padding_causal", "padding_causal", "padding_causal_bottom_right"]
    _, ref = _expected(p, types, [None, None, None, (1, 0)], False, 1 / math.sqrt(D))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_debug_switch_catches_duplicate_ids(monkeypatch):
    monkeypatch.setenv("NVTE_ATTN_VALIDATE", "1")
    p = make_thd(LENGTHS, h=H, d=D)
    dpa = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")
    with pytest.raises(ValueError, match=r"must name each sequence once; ids \[4\] are repeated and \[5\] missing"):
        dpa(p.q, p.k, p.v, **p.kwargs(False, 7, 7, shared=True), attn_mask_type_per_seq={"padding": _ids(0, 1, 2), "padding_causal": _ids(3, 4, 4)})


def _policy_of_ids_reference(id_lists, b):
    """Plain Python: each policy in order claims its ids in [0, b); a later claim wins; an
    unclaimed sequence has -1."""
    table = [-1] * b
    for p, ids in enumerate(id_lists):
        for i in ids:
            if 0 <= i < b:
                table[i] = p
    return table


# Well-formed and malformed ids (unchecked on CUDA): negatives (the clamp's -1 and below),
# ids at and past b, an id repeated within a policy and across policies, unclaimed sequences.
ID_CASES = {
    "well-formed": [[4, 0, 3], [5, 2, 1]],
    "negative": [[-1, 0, 1], [-7, 2, 3, 4, 5]],  # unclamped, -7 would wrap onto sequence 1
    "past the end": [[6, 0, 100], [1, 2, 3, 4, 5]],
    "repeated across policies": [[0, 1, 2, 3], [3, 4, 5, 0]],
    "repeated within a policy, one unclaimed": [[0, 0, 2], [3, 4, 5]],
    "three policies, one empty": [[1, 5], [], [0, 2, 3, 4, 1]],
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("name", list(ID_CASES))
def test_policy_of_ids_matches_the_plain_reference(name, dtype):
    from transformer_engine.pytorch.attention.dot_product_attention.prepare.policies import policy_of_ids

    lists = ID_CASES[name]
    got = policy_of_ids([torch.tensor(ids, dtype=dtype) for ids in lists], 6, torch.device("cpu"))
    assert got.dtype == torch.int64 and got.tolist() == _policy_of_ids_reference(lists, 6)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ID_CASES))
def test_gpu_policy_of_ids_matches_the_plain_reference(name):
    """index_fill on CUDA must wrap the clamped -1 to the last spare slot, as on the CPU."""
    from transformer_engine.pytorch.attention.dot_product_attention.prepare.policies import policy_of_ids

    lists = ID_CASES[name]
    got = policy_of_ids([torch.tensor(ids, dtype=torch.int64, device="cuda") for ids in lists], 6, torch.device("cuda"))
    torch.cuda.synchronize()
    assert got.tolist() == _policy_of_ids_reference(lists, 6)


# ------------------------------------------------------------------------------------ GPU

GPU_LENGTHS = [300, 17, 512, 1, 200, 64]
GPU_GAPS = [5, 0, 33, 2, 0, 100]


def _gpu_policies(device):
    return {
        "mixed": {"padding_causal": _ids(0, 2, 4, device=device), "padding": _ids(1, 3, 5, device=device)},
        "empty-group": {"padding_causal": _ids(*range(6), device=device), "padding": _ids(device=device)},
        "three": {"padding_causal": _ids(0, 5, device=device), "padding": _ids(1, 2, device=device),
                  ("padding_causal", (64, 0)): _ids(3, 4, device=device)},
    }


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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
