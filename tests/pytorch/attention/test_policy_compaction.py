"""Per-policy compacted kernel calls (THD, ``attn_mask_type_per_seq``): where the policy sizes
are known from the id tensors' shapes, each policy's FA4/cuDNN call runs only its own sequences
(gathered start offsets and lengths, in batch order), so its grid covers them alone. Checked on
the CPU with FA4 emulated per sequence in float64 (the arguments each call receives, and the
numbers against the unfused backend), the cuDNN batch size, the spare entries that malformed ids
leave, and the switch (NVTE_THD_POLICY_COMPACT=1; off by default, see environment.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention import backends
from transformer_engine.pytorch.attention.dot_product_attention.backends import kernel_ops
from transformer_engine.pytorch.attention.dot_product_attention.backends.varlen import plan_varlen
from transformer_engine.pytorch.attention.dot_product_attention.prepare.policies import SeqPolicies

from .packing import make_thd
from .test_softmax_variants import _SinkFA4

H, HG, D = 4, 2, 8
LENGTHS = [5, 3, 6, 1, 4, 2]
GAPS = [2, 0, 1, 3, 0, 2]
# Ids in no particular order: the calls must still run their sequences in batch order.
PER_SEQ = {"padding_causal": [4, 0, 3], "padding": [5, 2, 1]}


@pytest.fixture(autouse=True)
def compact(monkeypatch):
    monkeypatch.setenv("NVTE_THD_POLICY_COMPACT", "1")


@pytest.fixture
def fa4(monkeypatch):
    from transformer_engine.pytorch.attention.dot_product_attention.backends import gap_rows

    _SinkFA4.calls = []
    seen = []
    fake = _SinkFA4()
    fwd = fake.fa4_fwd

    def recording_fwd(q, k, v, out, lse, cu_q, cu_kv, used_q, used_kv, *args, **kwargs):
        seen.append((cu_q.clone(), cu_kv.clone(), used_q.clone(), used_kv.clone()))
        return fwd(q, k, v, out, lse, cu_q, cu_kv, used_q, used_kv, *args, **kwargs)

    fake.fa4_fwd = recording_fwd
    fake.zero_gap_rows = gap_rows.zero_gap_rows
    fake.zero_gap_rows_qkv = gap_rows.zero_gap_rows_qkv
    monkeypatch.setattr(kernel_ops, "ops", fake)
    with backend_scope(force=backends.FlashAttentionV4):
        yield seen


def _inputs(gaps=True):
    p = make_thd(LENGTHS, gaps_q=GAPS if gaps else None, h=H, hg=HG, d=D, tail=3)
    for t in (p.q, p.k, p.v):
        t.requires_grad_()
    per_seq = {mask: torch.tensor(ids) for mask, ids in PER_SEQ.items()}
    return p, dict(p.kwargs(gaps, max(LENGTHS), max(LENGTHS), shared=True), attn_mask_type_per_seq=per_seq)


def _run(dpa, p, kwargs):
    out = dpa(p.q, p.k, p.v, **kwargs)
    g = torch.randn_like(out)
    return out, torch.autograd.grad(out, (p.q, p.k, p.v), g), g


@pytest.mark.parametrize("gaps", [True, False])
def test_each_call_runs_only_its_sequences_in_batch_order(fa4, gaps):
    p, kwargs = _inputs(gaps)
    out, grads, g = _run(DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd"), p, kwargs)
    offsets = (p.off_q if gaps else p.cu_q).tolist()
    assert len(fa4) == 2
    for (cu_q, cu_kv, used_q, used_kv), ids in zip(fa4, PER_SEQ.values()):
        ids = sorted(ids)
        assert cu_q.tolist() == [offsets[i] for i in ids] + [offsets[-1]]
        assert torch.equal(cu_kv, cu_q)
        assert used_q.tolist() == [LENGTHS[i] for i in ids] and torch.equal(used_kv, used_q)
    # The numbers: the unfused backend on the same inputs.
    ref_in = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]
    with backend_scope(allow=["unfused"]):
        ref = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd")(*ref_in, **kwargs)
    ref_grads = torch.autograd.grad(ref, ref_in, g)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert torch.all(out[~p.valid_q] == 0) and all(torch.all(t[~p.valid_q] == 0) for t in grads)


@pytest.mark.parametrize("value", ["0", None])
def test_switch_off_spans_the_batch_in_every_call(fa4, value, monkeypatch):
    p, kwargs = _inputs()
    if value is None:
        monkeypatch.delenv("NVTE_THD_POLICY_COMPACT")
    else:
        monkeypatch.setenv("NVTE_THD_POLICY_COMPACT", value)
    DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd")(p.q, p.k, p.v, **kwargs)
    assert [c[0].numel() for c in fa4] == [len(LENGTHS) + 1] * 2
    causal = set(PER_SEQ["padding_causal"])
    assert fa4[0][2].tolist() == [n if i in causal else 0 for i, n in enumerate(LENGTHS)]


def test_is_causal_shorthand_is_not_compacted(fa4):
    """Its policy sizes are values, not shapes: telling them apart would take a sync."""
    p, kwargs = _inputs()
    del kwargs["attn_mask_type_per_seq"]
    kwargs["thd_sequence_is_causal"] = torch.tensor([True, False, False, True, True, False])
    DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd")(p.q, p.k, p.v, **kwargs)
    assert [c[0].numel() for c in fa4] == [len(LENGTHS) + 1] * 2


def test_spare_entries_of_malformed_ids_run_nothing_inside_the_tensor(monkeypatch):
    """Sizes larger than the sequences a policy really owns (repeated or out-of-range ids, which
    only the CUDA path lets through unchecked): the spare entries get length 0 and a start
    inside the tensor."""
    from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType, MaskSpec

    p, kwargs = _inputs()
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


def test_cudnn_calls_take_the_policy_size_as_batch(monkeypatch):
    from .test_cudnn_wiring import FWD_NAMES, _RecordingOps

    ops = _RecordingOps()
    monkeypatch.setattr(kernel_ops, "ops", ops)
    p, kwargs = _inputs()
    with backend_scope(force=backends.FusedAttention):
        DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd")(p.q, p.k, p.v, **kwargs)
    assert "batch_size" in FWD_NAMES
    assert [c["batch_size"] for c in ops.fwd] == [3, 3]
    assert [c["offsets_q"].numel() for c in ops.fwd] == [4, 4]
    assert [c["seqlens_q"].tolist() for c in ops.fwd] == [[LENGTHS[i] for i in sorted(ids)] for ids in PER_SEQ.values()]
