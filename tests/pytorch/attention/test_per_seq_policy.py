"""Per-sequence mask policies (``attn_mask_type_per_seq``, ``thd_sequence_is_causal``) against
the float64 reference: mixed, all-full, all-causal, windows, empty groups, an empty batch, GQA,
with and without gaps; policy windows and ``bottom_right_diagonal``; validation messages; the
policy table of malformed ids; and the compacted kernel calls (NVTE_THD_POLICY_COMPACT=1) on
the FA4 and cuDNN stand-ins. The GPU runs are test_gpu_per_seq_policy.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention import backends

from .gpu_helpers import grads_of
from .grid import cycled
from .packing import make_thd
from .reference import reference_thd
from .stand_ins.cudnn import lengths_of, offsets_of

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
# every policy causal (its normalized window (-1, 0) was handed to all of them). Head counts and
# the module's mask are taken in turn over the policies and gaps (GQA is independent of them).
@pytest.mark.parametrize("name,gaps,hg,module_mask", cycled([list(POLICIES), [False, True]],
                                                             [(4, "padding"), (2, "padding_causal"), (2, "padding"), (4, "padding_causal")]))
def test_cpu_parity(name, gaps, hg, module_mask):
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
    (dict(thd_sequence_is_causal=torch.tensor([True, False] * 3), window_size=(-1, 4)), ValueError, "thd_sequence_is_causal"),
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


@pytest.mark.parametrize("name,flag,gaps", cycled([list(WINDOWED), [None, True]], [(False,), (True,)]))
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


# ------------------------------------------------------------------------------------ compacted calls
# Where the policy sizes are known from the id tensors' shapes, NVTE_THD_POLICY_COMPACT=1 runs each
# policy's FA4/cuDNN call over its own sequences only (gathered start offsets and lengths, in
# batch order), so its grid covers them alone (off by default, see environment.py).

HG = 2
PER_SEQ = {"padding_causal": [4, 0, 3], "padding": [5, 2, 1]}  # in no order: the calls run batch order


def _compact_inputs(gaps=True):
    p = make_thd(LENGTHS, gaps_q=GAPS if gaps else None, h=H, hg=HG, d=D, tail=3)
    if not gaps:
        p.fill_outside(7.0)  # FA4 reads the tail in whole tiles; without declared gaps it must be finite
    per_seq = {mask: torch.tensor(ids) for mask, ids in PER_SEQ.items()}
    return p, dict(p.kwargs(gaps, max(LENGTHS), max(LENGTHS), shared=True), attn_mask_type_per_seq=per_seq)


@pytest.mark.parametrize("gaps", [True, False])
def test_compacted_calls_run_only_their_sequences_in_batch_order(fa4_lib, gaps, monkeypatch):
    monkeypatch.setenv("NVTE_THD_POLICY_COMPACT", "1")
    p, kwargs = _compact_inputs(gaps)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd")
    with backend_scope(force=backends.FlashAttentionV4):
        out = dpa(p.q, p.k, p.v, **kwargs)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (p.q, p.k, p.v), g)
    offsets = (p.off_q if gaps else p.cu_q).tolist()
    assert len(fa4_lib.of("fwd")) == 2
    for kw, ids in zip(fa4_lib.of("fwd"), PER_SEQ.values()):
        ids = sorted(ids)
        assert kw["cu_seqlens_q"].tolist() == [offsets[i] for i in ids] + [offsets[-1]]
        assert torch.equal(kw["cu_seqlens_k"], kw["cu_seqlens_q"])
        assert kw["seqused_q"].tolist() == [LENGTHS[i] for i in ids] and torch.equal(kw["seqused_k"], kw["seqused_q"])
    # The numbers: the unfused backend on the same inputs.
    ref_in = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]
    with backend_scope(allow=["unfused"]):
        ref = dpa(*ref_in, **kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, torch.autograd.grad(ref, ref_in, g)):  # from FA4's float32 LSE
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.all(out[~p.valid_q] == 0) and all(torch.all(t[~p.valid_q] == 0) for t in grads)


@pytest.mark.parametrize("value", ["0", None])
def test_compaction_off_spans_the_batch_in_every_call(fa4_lib, value, monkeypatch):
    if value is not None:
        monkeypatch.setenv("NVTE_THD_POLICY_COMPACT", value)
    p, kwargs = _compact_inputs()
    with backend_scope(force=backends.FlashAttentionV4):
        DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd")(p.q, p.k, p.v, **kwargs)
    assert [kw["cu_seqlens_q"].numel() for kw in fa4_lib.of("fwd")] == [len(LENGTHS) + 1] * 2
    causal = set(PER_SEQ["padding_causal"])
    assert fa4_lib.of("fwd")[0]["seqused_q"].tolist() == [n if i in causal else 0 for i, n in enumerate(LENGTHS)]


def test_is_causal_shorthand_is_not_compacted(fa4_lib, monkeypatch):
    """Its policy sizes are values, not shapes: telling them apart would take a sync."""
    monkeypatch.setenv("NVTE_THD_POLICY_COMPACT", "1")
    p, kwargs = _compact_inputs()
    del kwargs["attn_mask_type_per_seq"]
    kwargs["thd_sequence_is_causal"] = torch.tensor([True, False, False, True, True, False])
    with backend_scope(force=backends.FlashAttentionV4):
        DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd")(p.q, p.k, p.v, **kwargs)
    assert [kw["cu_seqlens_q"].numel() for kw in fa4_lib.of("fwd")] == [len(LENGTHS) + 1] * 2


def test_spare_entries_of_malformed_ids_run_nothing_inside_the_tensor(monkeypatch):
    """Sizes larger than the sequences a policy really owns (repeated or out-of-range ids, which
    only the CUDA path lets through unchecked): the spare entries get length 0 and a start
    inside the tensor."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends.varlen import plan_varlen
    from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType, MaskSpec
    from transformer_engine.pytorch.attention.dot_product_attention.prepare.policies import SeqPolicies

    monkeypatch.setenv("NVTE_THD_POLICY_COMPACT", "1")
    p, kwargs = _compact_inputs()
    specs = (MaskSpec(AttnMaskType.PADDING_CAUSAL, (-1, 0)), MaskSpec(AttnMaskType.PADDING, (-1, -1)))
    policies = SeqPolicies(specs, torch.tensor([0, 1, 1, 0, 0, 1]), (True, True), sizes=(5, 3))  # policy 0 owns 3
    captured = {}

    def spy(inp, training):
        captured["plan"] = plan_varlen(dataclasses.replace(inp, policies=policies))
        return inp.q.new_zeros(*inp.q.shape[:-1], D)

    monkeypatch.setattr(backends.FlashAttentionV4, "run", staticmethod(spy))
    with backend_scope(force=backends.FlashAttentionV4), torch.no_grad():
        DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd")(p.q, p.k, p.v, **kwargs)
    causal, full = captured["plan"].calls
    offsets = p.off_q.tolist()
    assert causal.offsets_q.tolist() == [offsets[0], offsets[3], offsets[4], offsets[5], offsets[5], offsets[-1]]
    assert causal.seqused_q.tolist() == [LENGTHS[0], LENGTHS[3], LENGTHS[4], 0, 0]
    assert full.offsets_q.tolist() == [offsets[1], offsets[2], offsets[5], offsets[-1]]
    assert full.batch_size == 3 and causal.batch_size == 5


def test_compacted_cudnn_calls_take_the_policy_size_as_batch(cudnn_lib, monkeypatch):
    monkeypatch.setenv("NVTE_THD_POLICY_COMPACT", "1")
    p, kwargs = _compact_inputs()
    with backend_scope(force=backends.FusedAttention):
        DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd")(p.q, p.k, p.v, **kwargs)
    runs = cudnn_lib.of("fwd")
    assert [graph.b for graph, _ in runs] == [3, 3]
    assert [offsets_of(pack, "q").numel() for _, pack in runs] == [4, 4]
    assert [lengths_of(pack, "q").tolist() for _, pack in runs] == [[LENGTHS[i] for i in sorted(ids)] for ids in PER_SEQ.values()]
