"""Context parallelism on gloo (CPU): worlds of 2 and 4 processes, one spawn per world running
every case; each rank's output rows and dq/dk/dv rows must equal the independent float64
reference on the global batch, and padding rows must be exactly 0."""

from __future__ import annotations

import re

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention, gather_context_parallel, get_cp_partition_indices, partition_for_context_parallel
from transformer_engine.pytorch.attention.dot_product_attention.cp.support import cp_support_markdown
from transformer_engine.pytorch.attention.dot_product_attention.cp.comm import CPComm

from .cp_cases import CAUSAL_WINDOW, Case, check_case, spawn

WINDOWS_A2A = (("padding", (2, 3)), ("padding_causal", (4, 0)), ("padding", None))

WORLD2 = [
    Case("p2p-causal-gaps", "p2p"),
    Case("p2p-full-cross", "p2p", mask="padding", cross=True),
    Case("p2p-causal-nogaps-mha", "p2p", gaps=False, h=4, hg=4),
    Case("p2p-is-causal", "p2p", policy="is_causal", mask="padding"),
    Case("p2p-bshd-causal", "p2p", fmt="bshd", mask="causal"),
    Case("p2p-sbhd-full", "p2p", fmt="sbhd", mask="no_mask"),
    Case("p2p-float32", "p2p", dtype="float32"),
    Case("p2p-qkv-layer", "p2p", h=4, hg=4, packed="qkv:-3"),
    Case("p2p-th3d-layer", "p2p", h=4, hg=4, packed="qkv:-2"),
    Case("p2p-kv-layer-gqa", "p2p", packed="kv:-3"),
    Case("p2p-kv-layer-cross", "p2p", mask="padding", cross=True, packed="kv:-2"),
    Case("p2p-bshd-kv-layer", "p2p", fmt="bshd", mask="causal", packed="kv:-2"),
    Case("ag-causal-gaps", "all_gather"),
    Case("ag-window-policies", "all_gather", policy="dict", policy_windows=CAUSAL_WINDOW, mask="padding"),
    Case("ag-bshd-window", "all_gather", fmt="bshd", mask="causal", window=(5, 0)),
    Case("ag-full-cross", "all_gather", mask="padding", cross=True),
    Case("ag-th3d-layer", "all_gather", h=4, hg=4, packed="qkv:-2"),
    Case("ag-kv-layer-policies", "all_gather", policy="is_causal", mask="padding", packed="kv:-2"),
    Case("a2a-causal-gaps", "a2a"),
    Case("a2a-windows-policies", "a2a", policy="dict", policy_windows=WINDOWS_A2A, mask="padding"),
    Case("a2a-sbhd-window", "a2a", fmt="sbhd", mask="no_mask", window=(3, 2)),
    Case("a2a-is-causal", "a2a", policy="is_causal", mask="padding"),
    Case("a2a-full-cross", "a2a", mask="padding", cross=True),
    Case("a2a-qkv-layer", "a2a", h=4, hg=4, packed="qkv:-3"),
    Case("a2a-kv-layer-gqa", "a2a", packed="kv:-3"),
    Case("a2a-sbhd-th3d-layer", "a2a", fmt="sbhd", mask="causal", h=4, hg=4, packed="qkv:-2"),
    Case("a2a-dropout", "a2a", dropout=0.5),
    Case("a2a-dropout-policies", "a2a", policy="is_causal", mask="padding", dropout=0.5),
    Case("err-p2p-dropout", "p2p", dropout=0.1, error=("NotImplementedError", "attention_dropout=> 0 with cp_comm_type='p2p'")),
    Case("err-ag-dropout", "all_gather", dropout=0.1, error=("NotImplementedError", "attention_dropout=> 0 with cp_comm_type='all_gather'")),
    Case("err-p2p-window", "p2p", window=(3, 0), error=("NotImplementedError", "window_size=(3, 0)")),
    Case("err-ag-two-sided", "all_gather", mask="padding", window=(2, 2), error=("NotImplementedError", "window_size=(2, 2)")),
    Case("err-a2a-heads", "a2a", h=3, hg=3, error=("NotImplementedError", "num_attention_heads=3")),
    Case("err-causal-cross", "p2p", mask="padding_causal", cross=True, error=("NotImplementedError", "self-attention sharing")),
    Case("p2p-thd-attention-mask-ignored", "p2p", thd_attention_mask=True),
    Case("p2p-checkpoint", "p2p", checkpoint=True),
    Case("a2a-bshd-checkpoint", "a2a", fmt="bshd", mask="causal", checkpoint=True),
    Case("err-bad-slot", "p2p", bad_slots=True, error=("ValueError", "divisible by 2 x cp size = 4")),
    Case("err-dense-length", "p2p", fmt="bshd", mask="causal", dense_len=3, error=("ValueError", "divisible by 2 x cp size = 4")),
]

WORLD4 = [
    Case("w4-p2p-causal-gaps", "p2p"),
    Case("w4-p2p-is-causal", "p2p", policy="is_causal", mask="padding"),
    Case("w4-p2p-bshd", "p2p", fmt="bshd", mask="causal", h=4, hg=4),
    Case("w4-ag-window-policies", "all_gather", policy="dict", policy_windows=CAUSAL_WINDOW, mask="padding"),
    Case("w4-a2a-windows", "a2a", policy="dict", policy_windows=WINDOWS_A2A, mask="padding", h=4, hg=4),
    Case("w4-a2a+p2p-causal", "a2a+p2p"),
    Case("w4-a2a+p2p-is-causal", "a2a+p2p", policy="is_causal", mask="padding"),
    Case("w4-a2a+p2p-sbhd", "a2a+p2p", fmt="sbhd", mask="causal"),
    Case("w4-a2a+p2p-kv-layer", "a2a+p2p", packed="kv:-2"),
    Case("w4-p2p-qkv-layer", "p2p", h=4, hg=4, packed="qkv:-3"),
    Case("w4-a2a-dropout", "a2a", h=4, hg=4, dropout=0.5),
    Case("w4-err-a2a+p2p-dropout", "a2a+p2p", dropout=0.1, error=("NotImplementedError", "attention_dropout=> 0 with cp_comm_type='a2a+p2p'")),
]


@pytest.fixture(scope="module")
def world2():
    return spawn(2, WORLD2)


@pytest.fixture(scope="module")
def world4():
    return spawn(4, WORLD4)


@pytest.mark.parametrize("case_id", [c.id for c in WORLD2])
def test_world2(world2, case_id):
    check_case(world2, case_id, 2)


@pytest.mark.parametrize("case_id", [c.id for c in WORLD4])
def test_world4(world4, case_id):
    check_case(world4, case_id, 4)


# ---------------------------------------------------------------------------------- partition helpers


def test_partition_indices_by_hand():
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    assert get_cp_partition_indices(cu, 12, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert get_cp_partition_indices(cu, 12, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


def test_thd_get_partitioned_indices_like_megatron():
    import transformer_engine_torch as tex

    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    idx = tex.thd_get_partitioned_indices(cu, cu[-1], 4, 3)  # a 0-d tensor total, as megatron passes
    assert idx.dtype == torch.int32 and idx.tolist() == [3, 4, 11, 12]


@pytest.mark.parametrize("cp", [2, 4])
def test_partition_round_trip(cp):
    cu = torch.tensor([0, 8, 24, 32], dtype=torch.int32)
    x = torch.randn(32 + 8, 3)  # a tail of 8 rows past the last slot
    parts = [partition_for_context_parallel(x, cp, r, "thd", cu) for r in range(cp)]
    assert torch.equal(gather_context_parallel(parts, "thd", cu), x)
    d = torch.randn(2, 16, 3, 4)
    parts = [partition_for_context_parallel(d, cp, r, "bshd") for r in range(cp)]
    assert torch.equal(gather_context_parallel(parts, "bshd"), d)
    s = d.transpose(0, 1)
    parts = [partition_for_context_parallel(s, cp, r, "sbhd") for r in range(cp)]
    assert torch.equal(gather_context_parallel(parts, "sbhd"), s)


def test_partition_errors():
    with pytest.raises(ValueError, match="every slot length must be divisible by 2 x cp size = 4 under context parallelism; got slot lengths \\[6, 6\\]"):
        get_cp_partition_indices(torch.tensor([0, 6, 12], dtype=torch.int32), 12, 2, 0)
    with pytest.raises(ValueError, match="cp_rank must be an int in \\[0, 2\\); got 2"):
        get_cp_partition_indices(torch.tensor([0, 8], dtype=torch.int32), 8, 2, 2)


def test_support_table_names_every_comm_type():
    table = cp_support_markdown()
    for name in ("p2p", "all_gather", "a2a", "a2a+p2p"):
        assert f"| {name} |" in table


# ---------------------------------------------------------------------------------- refusals before communication


class _NoWireComm(CPComm):
    """Rank 0 of a two-rank group with no transport: any collective fails the test, so a
    refusal raised through it was raised before communicating."""

    def __init__(self) -> None:  # no process group behind it
        self.group, self.size, self.rank, self.backend, self.stream = None, 2, 0, "none", None

    def _fail(self, *args, **kwargs):
        raise AssertionError("communicated before refusing")

    exchange = all_gather = reduce_scatter = all_to_all = _fail


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a+p2p"])
def test_dropout_refused_by_name_before_communication(comm):
    group = [_NoWireComm(), _NoWireComm()] if comm == "a2a+p2p" else _NoWireComm()
    dpa = DotProductAttention(4, 8, qkv_format="thd", attn_mask_type="padding_causal", attention_dropout=0.1,
                              cp_group=group, cp_comm_type=comm)
    size = 4 if comm == "a2a+p2p" else 2
    cu = torch.tensor([0, 4 * size], dtype=torch.int32)
    q, k, v = (torch.randn(4, 4, 8, requires_grad=True) for _ in range(3))
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4 * size, max_seqlen_kv=4 * size)
    with pytest.raises(NotImplementedError, match=re.escape(f"attention_dropout=> 0 with cp_comm_type={comm!r} "
                                                            "(supported: 0.0, or cp_comm_type='a2a')")):
        dpa(q, k, v, **kwargs)
    dpa.eval()  # dropout is off outside training: the same call is accepted (and then communicates)
    with pytest.raises(AssertionError, match="communicated before refusing"):
        dpa(q, k, v, **kwargs)


# ---------------------------------------------------------------------------------- one entrance


class _Stop(Exception):
    pass


def _prepared(monkeypatch, dpa, *args, **kwargs):
    """The AttentionInputs DotProductAttention.forward prepares for this call; a CP call is
    stopped there (its transport is _NoWireComm)."""
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as module

    seen, original = [], module.prepare

    def spy(*a, **kw):
        seen.append(original(*a, **kw))
        if seen[-1].cp_size > 1:
            raise _Stop
        return seen[-1]

    monkeypatch.setattr(module, "prepare", spy)
    try:
        dpa(*args, **kwargs)
    except _Stop:
        pass
    (inp,) = seen
    return inp


ENTRANCE_CASES = {
    "thd-gaps-policies": ("thd", dict(thd_sequence_is_causal=torch.tensor([True, False, True]))),
    "thd-no-gaps": ("thd", {}),
    "bshd": ("bshd", {}),
    "sbhd": ("sbhd", {}),
}


def _entrance_batch(fmt, gaps):
    g = torch.Generator().manual_seed(5)
    if fmt == "thd":
        cu = torch.tensor([0, 5, 18, 19] if gaps else [0, 8, 24, 28], dtype=torch.int32)
        pad = torch.tensor([0, 8, 24, 28], dtype=torch.int32)
        q, k, v = (torch.randn(28, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=13 if gaps else 16, max_seqlen_kv=13 if gaps else 16)
        if gaps:
            kwargs.update(cu_seqlens_q_padded=pad, cu_seqlens_kv_padded=pad)
        return (q, k, v), kwargs, pad
    shape = (2, 8, 4, 8) if fmt == "bshd" else (8, 2, 4, 8)
    return tuple(torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(3)), {}, None


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("case", list(ENTRANCE_CASES))
def test_cp_and_module_calls_prepare_the_same_record(monkeypatch, case, rank):
    """One entrance: a CP call (this rank's rows, TE's global metadata) and a module call on the
    whole batch build the same AttentionInputs, field by field and fact by fact; only the rows
    (this rank's share of the module call's) and cp_size differ."""
    from dataclasses import fields, replace

    from transformer_engine.pytorch.attention.dot_product_attention.prepare.call import selection_params

    fmt, extra = ENTRANCE_CASES[case]
    (q, k, v), kwargs, slots = _entrance_batch(fmt, case != "thd-no-gaps")
    kwargs.update(extra, qkv_format=fmt, attn_mask_type="padding_causal" if fmt == "thd" else "causal")
    comm = _NoWireComm()
    comm.rank = rank
    cp_dpa = DotProductAttention(4, 8, cp_group=comm, cp_comm_type="a2a")
    local = [partition_for_context_parallel(t, 2, rank, fmt, slots if slots is not None else kwargs.get("cu_seqlens_q")) for t in (q, k, v)]
    got = _prepared(monkeypatch, cp_dpa, *local, **kwargs)
    want = _prepared(monkeypatch, DotProductAttention(4, 8), q, k, v, **kwargs)
    assert (got.cp_size, want.cp_size) == (2, 1)
    for f in fields(got):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name in ("q", "k", "v"):  # the bshd view of this rank's rows
            seq_dim = 0 if fmt == "thd" else 1
            assert torch.equal(a, partition_for_context_parallel(b, 2, rank, "thd" if fmt == "thd" else "bshd", slots, seq_dim)), f.name
        elif f.name in ("packed_q", "packed_kv") and a is not None:
            assert torch.equal(a.cu_seqlens, b.cu_seqlens) and torch.equal(a.offsets, b.offsets), f.name
            assert (a.max_seqlen, a.total_tokens, a.bounded, a.has_gaps) == (b.max_seqlen, b.total_tokens, b.bounded, b.has_gaps)
        elif f.name == "policies" and a is not None:
            assert (a.specs, a.maybe_nonempty, a.sizes) == (b.specs, b.maybe_nonempty, b.sizes)
            assert torch.equal(a.policy_of_seq, b.policy_of_seq)
        elif f.name != "cp_size":
            assert a == b if not isinstance(a, torch.Tensor) else a is b, f.name
    # The facts selection reads: the module call's, with the form of the calls CP makes (a2a:
    # the record's own form after the all-to-all; p2p: packed spans with gaps).
    layout = "_".join([fmt] * 3)
    plain = replace(selection_params(cp_dpa, want, fmt, layout), context_parallel=True)
    whole = "bshd" if fmt == "sbhd" else fmt
    assert selection_params(cp_dpa, got, fmt, layout, context_parallel=True, cp_comm_type="a2a") == replace(
        plain, cp_comm_type="a2a", qkv_format=whole, qkv_layout="_".join([whole] * 3))
    assert selection_params(cp_dpa, got, fmt, layout, context_parallel=True, cp_comm_type="p2p") == replace(
        plain, cp_comm_type="p2p", qkv_format="thd", qkv_layout="thd_thd_thd", pad_between_seqs=True, shared_cu_seqlens=True)
