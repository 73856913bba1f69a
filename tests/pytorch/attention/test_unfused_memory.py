"""Memory of the unfused backend, checked by counting (no timing): the live bytes of every
tensor an op produces (forward and backward) peak near the chunk budget, one long sequence's
training peak stays under 1.5 score matrices, a packed batch's follows its longest sequence,
autograd saves no score-sized tensor once chunks are checkpointed, the gathered THD path sizes
its slots by the tensor's rows rather than a huge declared max_seqlen, and chunked results equal
unchunked ones. test_gpu_unfused_memory.py measures the same with torch.cuda's allocator
statistics."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention

from .gpu_helpers import env
from .packing import make_thd
from .spies import LargestTensor, PeakMemory

H, HG, D = 4, 2, 8


def _peak(fn, existing):
    with PeakMemory(existing) as mode:
        fn()
    return mode.peak


def _fwd_bwd(dpa, q, k, v, **kw):
    out = dpa(q, k, v, **kw)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out))
    return out


def _largest(fn):
    with LargestTensor() as mode:
        fn()
    return mode.numel


def _dense_inputs(b=1, s=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, D, generator=g, dtype=torch.float64, requires_grad=True) for h in (H, HG, HG)]


@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_largest_tensor_stays_within_the_chunk_budget(softmax_type):
    q, k, v = _dense_inputs()
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="bshd", attn_mask_type="causal", softmax_type=softmax_type)
    full = H * 256 * 256
    assert _largest(lambda: _fwd_bwd(dpa, q, k, v)) >= full  # the counter sees the score matrix
    budget = full // 8
    with env(NVTE_UNFUSED_ATTN_MAX_SCORES=str(budget)):
        assert _largest(lambda: _fwd_bwd(dpa, q, k, v)) <= budget


def test_thd_per_sequence_and_gathered_stay_within_the_budget():
    p = make_thd([200, 3, 120], gaps_q=[5, 0, 2], h=H, hg=HG, d=D)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal")
    kwargs = p.kwargs(True, 200, 200, shared=True)
    budget = H * 25 * 200
    for gather in ("0", "1"):
        with env(NVTE_UNFUSED_ATTN_MAX_SCORES=str(budget), NVTE_UNFUSED_THD_GATHER=gather):
            largest = _largest(lambda: _fwd_bwd(dpa, p.q, p.k, p.v, **kwargs))
        # the gathered path's score chunk spans all 3 slots: B * H * rows * SKV <= budget
        assert largest <= budget, (gather, largest)


def test_autograd_saves_no_score_sized_tensor_once_checkpointed():
    q, k, v = _dense_inputs()
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="bshd", attn_mask_type="causal")
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    for budget, bound in ((str(1 << 26), H * 256 * 256), (str(H * 32 * 256), q.numel())):
        saved.clear()
        with env(NVTE_UNFUSED_ATTN_MAX_SCORES=budget), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = dpa(q, k, v)
        out.sum().backward()
        if bound == q.numel():
            assert max(saved) <= bound, "a checkpointed forward must keep only inputs/outputs for the backward"
        else:
            # A small call (at most budget/8 scores) is not checkpointed: autograd keeps its P (the teeth)
            assert max(saved) >= bound


def test_huge_declared_max_seqlen_with_few_tokens_allocates_little():
    p = make_thd([4, 4], h=H, hg=HG, d=D)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal")
    kwargs = p.kwargs(False, 100000, 100000, shared=True)
    with env(NVTE_UNFUSED_THD_GATHER="1"):
        largest = _largest(lambda: _fwd_bwd(dpa, p.q, p.k, p.v, **kwargs))
        out = dpa(p.q, p.k, p.v, **kwargs)
    assert largest <= 2 * H * 8 * 8 * 4, largest
    with env(NVTE_UNFUSED_THD_GATHER="0"):
        _close(out, dpa(p.q, p.k, p.v, **p.kwargs(False, 4, 4, shared=True)))


def _close(a, b, tol=1e-12):
    assert (a.detach() - b.detach()).abs().max() <= tol, f"{(a.detach() - b.detach()).abs().max():.3e}"


CASES = [
    # (format, mask, extra forward kwargs builder, softmax_type)
    ("bshd", "causal", "post_scale_bias", "vanilla"),
    ("bshd", "no_mask", "alibi", "learnable"),
    ("bshd", "arbitrary", "arbitrary", "off-by-one"),
    ("thd", "padding_causal", None, "learnable"),
    ("thd", "padding", "alibi", "vanilla"),
]
# NVTE_UNFUSED_THD_GATHER switches THD's path only: dense cases run once.
GATHER_CASES = [(*case, gather) for case in CASES for gather in (("0", "1") if case[0] == "thd" else ("0",))]


@pytest.mark.parametrize("fmt,mask,extra,softmax_type,gather", GATHER_CASES)
def test_chunked_results_equal_unchunked(fmt, mask, extra, softmax_type, gather):
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format=fmt, attn_mask_type=mask, softmax_type=softmax_type,
                              return_max_logit=True).double()
    g = torch.Generator().manual_seed(3)
    kw = {}
    if fmt == "thd":
        p = make_thd([40, 7, 23], gaps_q=[3, 0, 5], h=H, hg=HG, d=D)
        inputs = [p.q, p.k, p.v]
        kw = p.kwargs(True, 40, 40, shared=True)
    else:
        inputs = _dense_inputs(b=2, s=48, seed=4)
    if extra == "post_scale_bias":
        kw.update(core_attention_bias_type="post_scale_bias",
                  core_attention_bias=torch.randn(1, H, 48, 48, generator=g, dtype=torch.float64, requires_grad=True))
    elif extra == "alibi":
        kw.update(core_attention_bias_type="alibi")
    elif extra == "arbitrary":
        kw.update(attention_mask=torch.rand(2, 1, 48, 48, generator=g) < 0.3)
    leaves = inputs + ([kw["core_attention_bias"]] if "core_attention_bias" in kw else [])
    if softmax_type == "learnable":
        leaves.append(dpa.softmax_offset)
    results = []
    for budget in (str(1 << 26), str(H * 5 * 48)):  # one chunk, then chunks of 5-ish rows
        with env(NVTE_UNFUSED_ATTN_MAX_SCORES=budget, NVTE_UNFUSED_THD_GATHER=gather):
            out, max_logit = dpa(*inputs, **kw)
            grads = torch.autograd.grad(out, leaves, torch.ones_like(out).cumsum(0))
        results.append((out, max_logit, grads))
    (o1, m1, g1), (o2, m2, g2) = results
    _close(o1, o2)
    _close(m1, m2)  # a max of sums: the chunks' sums may round differently (not bit-exact)
    for a, b in zip(g1, g2):
        _close(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))


def test_chunked_dropout_backward_recomputes_the_forward_mask():
    """out is linear in v for a fixed dropout mask: <g, f(v + dv) - f(v)> must equal
    <grad_v, dv> when the backward's recomputed chunks drop what the forward dropped."""
    q, k, v = _dense_inputs(b=1, s=64)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="bshd", attn_mask_type="causal", attention_dropout=0.5).double()
    dv = torch.randn_like(v)
    with env(NVTE_UNFUSED_ATTN_MAX_SCORES=str(H * 8 * 64)):
        torch.manual_seed(7)
        out = dpa(q, k, v)
        g = torch.randn_like(out)
        (grad_v,) = torch.autograd.grad(out, [v], g)
        torch.manual_seed(7)
        shifted = dpa(q, k, v + dv)
    assert abs(float((g * (shifted - out)).sum().detach()) - float((grad_v * dv).sum())) < 1e-9


def test_budget_variable_is_checked():
    q, k, v = _dense_inputs(s=8)
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="bshd")
    with env(NVTE_UNFUSED_ATTN_MAX_SCORES="lots"), pytest.raises(ValueError, match="NVTE_UNFUSED_ATTN_MAX_SCORES must be a positive int"):
        dpa(q, k, v)


# ------------------------------------------------------------ peak memory of training (issue 22)

HM, DM = 4, 8  # heads and head dim of the peak tests: scores dominate, token-sized tensors are small


def _matrix_bytes(s: int) -> int:
    """One [HM, s, s] float32 score matrix."""
    return HM * s * s * 4


def _thd_peak(lengths, budget, gather="0", grad=True, dropout=0.0) -> int:
    p = make_thd(lengths, h=HM, hg=HM, d=DM, dtype=torch.float32)
    dpa = DotProductAttention(HM, DM, qkv_format="thd", attn_mask_type="padding_causal", attention_dropout=dropout)
    kw = p.kwargs(False, max(lengths), max(lengths))

    def run():
        with torch.set_grad_enabled(grad):
            out = dpa(p.q, p.k, p.v, **kw)
            if grad:
                out.backward(torch.ones_like(out))

    with env(NVTE_UNFUSED_ATTN_MAX_SCORES=str(budget), NVTE_UNFUSED_THD_GATHER=gather):
        return _peak(run, [p.q, p.k, p.v])


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("gather", ["0", "1"])
def test_one_long_sequence_trains_under_one_and_a_half_score_matrices(gather, dropout):
    """The budget equal to one [H, S, S] float32 matrix, as the default (2**26 elements) is for
    4 heads of 4096 tokens: forward+backward peaked at 3.2 matrices when one chunk kept its whole
    graph for autograd; forward alone must stay near one."""
    s = 1024
    train = _thd_peak([s], HM * s * s, gather, dropout=dropout)
    assert 0.5 * _matrix_bytes(s) < train < 1.5 * _matrix_bytes(s), train / _matrix_bytes(s)
    forward = _thd_peak([s], HM * s * s, gather, grad=False, dropout=dropout)
    assert forward < 1.5 * _matrix_bytes(s), forward / _matrix_bytes(s)


@pytest.mark.parametrize("gather", ["0", "1"])
def test_packed_batch_trains_in_far_less_than_one_sequence_of_its_tokens(gather):
    """Eight 256-token sequences against one of 2048 tokens, the budget that long sequence's
    score matrix (as the default is for 4 heads of 4096 tokens): the long one trains near the
    budget, the packed batch (a small call: at most budget/8 scores, so autograd keeps its P)
    far below. On the gathered path a packed batch is one [B, S, S] problem, S its longest
    sequence; with more scores than budget/8 it is chunked and checkpointed like any call."""
    budget = HM * 2048 * 2048
    packed = _thd_peak([256] * 8, budget, gather)
    long = _thd_peak([2048], budget, gather)
    assert packed < 0.5 * long, (packed, long)


def test_checkpointed_sequences_peak_like_one_of_them():
    """Sequence by sequence (the CPU path), once the call is not small every sequence is
    checkpointed: eight sequences peak about as one alone (when each kept its scores for
    autograd, the peak grew with the number of sequences: ~1.05 of one sequence holding all
    their tokens, issue 22)."""
    budget = HM * 1024 * 1024
    packed = _thd_peak([256] * 8, budget)
    alone = _thd_peak([256], budget)
    assert packed < 2 * alone, (packed, alone)
