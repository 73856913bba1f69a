"""The rows fact (backends/varlen.py ``rows_fact``, prepare/metadata_cache.py ``LateFact``):
whether every row of a packed batch's q/k/v tensors belongs to a sequence, copied to the host
without waiting; once it has landed, remembered plans skip the gap-row zeroing and FA4's NaN
guard.

Its teeth: the owned-row count equals what the zeroing leaves alone (``gap_rows.unowned_rows``,
the reference test_thd_gaps holds the Triton kernel to; lengths overrunning their slots and
offsets past 0 included); on both
library stand-ins, with NaN-filled buffers, the zeroing runs while the copy is in flight and
for every batch with a row to zero (a tail on either side, real gaps), is skipped once the copy
says every row is owned, and every call matches the unfused backend; an in-place refill that
leaves a tail makes a new fact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention.backends import varlen
from transformer_engine.pytorch.attention.dot_product_attention.backends.gap_rows import unowned_rows
from transformer_engine.pytorch.attention.dot_product_attention.prepare import metadata_cache
from transformer_engine.pytorch.attention.dot_product_attention.prepare.packed_seqs import PackedSeqs, made_safe

from .spies import spy_zeroing_ops

H, HG, D = 4, 2, 8


pytestmark = pytest.mark.usefixtures("empty_metadata_cache")


def _cu(values):
    return torch.tensor(list(values), dtype=torch.int32)


def _cumulative(lengths, start=0):
    out = [start]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=6), st.integers(0, 4),
       st.integers(0, 3), st.booleans())
def test_owned_rows_count_what_the_zeroing_leaves(seqs, head, tail, gaps):
    """Every row is either counted owned or written by ``zero_gap_rows``: the fact says "nothing
    to zero" exactly when the kernel writes nothing (lengths may overrun their slots, the first
    sequence may start past row 0, with or without padded offsets, the tensor may run past the
    last slot)."""
    metadata_cache.clear()
    lengths = [n for n, _ in seqs]
    if gaps:
        cu, off = _cu(_cumulative(lengths)), _cu(_cumulative([s for _, s in seqs], head))
    else:
        cu = off = _cu(_cumulative(lengths, head))
    total = int(off[-1]) + tail
    side = made_safe(*(PackedSeqs(cu, off, 6, total),) * 2)[0]
    written = int(unowned_rows(side.cu_seqlens, side.offsets, total).sum())  # the kernel's reference (test_thd_gaps)
    assert varlen._owned_rows(side).tolist() == [total - written]


class _Copy:
    """Stands in for ``LateFact``'s pinned copy, in flight until ``landed`` is set."""

    def __init__(self):
        self.landed = False
        self.made = 0

    def __call__(self, values):
        self.made += 1
        copy = self

        class Event:
            def query(self):
                return copy.landed

        return values.clone(), Event()


def _qkv(rows_q, rows_kv, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, h, D, generator=g, dtype=torch.float64, requires_grad=True)
            for rows, h in ((rows_q, H), (rows_kv, HG), (rows_kv, HG))]


def _call(dpa, backend, qkv, cus, max_len):
    for t in qkv:
        t.grad = None
    cu_q, cu_kv, pad_q, pad_kv = cus
    extra = {} if pad_q is None else dict(cu_seqlens_q_padded=pad_q, cu_seqlens_kv_padded=pad_kv)
    with backend_scope(force=backend):
        out = dpa(*qkv, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=max_len, max_seqlen_kv=max_len, **extra)
    out.backward(torch.ones_like(out))
    return [out.detach()] + [t.grad.clone() for t in qkv]


def _owned(rows, slots, lengths):
    """[rows] bool: the rows holding a token, sequences laid out in ``slots`` (None: back to back)."""
    starts = _cumulative(lengths if slots is None else slots)
    mask = torch.zeros(rows, dtype=torch.bool)
    for s, n in zip(starts, lengths):
        mask[s:s + n] = True
    return mask


def _unfused(qkv, lengths_q, lengths_kv, mask):
    """The unfused backend on the sequences alone, packed without gaps or tails."""
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type=mask)
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    cus = (_cu(_cumulative(lengths_q)), _cu(_cumulative(lengths_kv)), None, None)
    return _call(dpa, "UnfusedDotProductAttention", leaves, cus, max(lengths_q + lengths_kv))


# batch: (q slots or None, kv slots or None, rows of q, rows of kv, cross attention); lengths 5, 3, 4
# on the query side (and 4, 5, 2 on the key side of the cross-attention batches)
BATCHES = {
    "filled": (None, None, 12, 12, False),
    "empty gaps": ([5, 3, 4], [5, 3, 4], 12, 12, False),
    "q tail": (None, None, 14, 14, False),
    "gaps": ([6, 3, 5], [6, 3, 5], 14, 14, False),
    "cross, filled": (None, None, 12, 11, True),
    "cross, kv tail": (None, None, 12, 14, True),
}
ZEROED = {"q tail", "gaps", "cross, kv tail"}


@pytest.mark.parametrize("backend", ["FlashAttention v4", "FusedAttention"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_the_zeroing_is_skipped_once_every_row_is_known_owned(as_on_cuda, fa4_lib, cudnn_lib, monkeypatch, backend, batch):
    """No gap-row zeroing (nor FA4's NaN guard) once the copied fact says every row of q and
    of k/v belongs to a sequence; every call before the copy lands, and every call of a batch
    with a row to zero on either side, zeroes as before. Buffers are NaN-filled (``nan_buffers``
    through the stand-ins): a row a skipped zeroing should have written would show; every call
    matches the unfused backend, and rows no sequence owns are exactly 0."""
    copy = _Copy()
    monkeypatch.setattr(metadata_cache, "copy_to_host", copy)
    made = spy_zeroing_ops(monkeypatch)
    slots_q, slots_kv, rows_q, rows_kv, cross = BATCHES[batch]
    lengths_q, lengths_kv = [5, 3, 4], ([4, 5, 2] if cross else [5, 3, 4])
    mask = "padding_causal_bottom_right" if cross else "padding_causal"
    qkv = _qkv(rows_q, rows_kv)
    cu_q = _cu(_cumulative(lengths_q))
    cu_kv = _cu(_cumulative(lengths_kv)) if cross else cu_q
    pad_q = None if slots_q is None else _cu(_cumulative(slots_q))
    pad_kv = pad_q if slots_kv == slots_q else _cu(_cumulative(slots_kv))  # one tensor: self-attention
    cus = (cu_q, cu_kv, pad_q, pad_kv)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type=mask)
    # cuDNN starts cross-attention buffers zero-filled (a query row may see no key there):
    # no zeroing launch, with or without the fact.
    launches = not (cross and backend == "FusedAttention")
    before = _call(dpa, backend, qkv, cus, 5)
    assert bool(made) == launches and copy.made == 1  # in flight: zeroed as before (one fact for the pair of sides)
    copy.landed = True
    made.clear()
    after = _call(dpa, backend, qkv, cus, 5)
    assert bool(made) == (launches and batch in ZEROED) and copy.made == 1
    owned_q, owned_kv = _owned(rows_q, slots_q, lengths_q), _owned(rows_kv, slots_kv, lengths_kv)
    owned = (owned_q, owned_q, owned_kv, owned_kv)  # out, dq, dk, dv
    want = _unfused([t.detach()[rows] for rows, t in zip(owned[1:], qkv)], lengths_q, lengths_kv, mask)
    for got in (before, after):
        for rows, a, b in zip(owned, got, want):
            torch.testing.assert_close(a[rows], b, rtol=1e-7, atol=1e-7)
            assert torch.all(a[~rows] == 0)  # rows no sequence owns: exactly 0 (a NaN row fails too)


def test_the_fact_follows_an_in_place_write(as_on_cuda, fa4_lib, monkeypatch):
    """Refilled cu_seqlens that stop short of the tensor's end: the plan is made again, with a
    new fact, and the tail is zeroed (a fact kept by identity would skip it: NaN rows)."""
    made = spy_zeroing_ops(monkeypatch)
    qkv = _qkv(12, 12)
    cu = _cu([0, 5, 8, 12])
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal")
    _call(dpa, "FlashAttention v4", qkv, (cu, cu, None, None), 5)
    assert made == []  # known at once on the CPU: the batch fills its 12 rows
    cu.copy_(_cu([0, 5, 8, 10]))
    got = _call(dpa, "FlashAttention v4", qkv, (cu, cu, None, None), 5)
    assert made == ["zero_gap_rows", "zero_gap_rows_qkv"]
    assert all((t[10:] == 0).all() for t in got)
    want = _unfused([t.detach()[:10] for t in qkv], [5, 3, 2], [5, 3, 2], "padding_causal")
    for a, b in zip(got, want):
        torch.testing.assert_close(a[:10], b, rtol=1e-7, atol=1e-7)
