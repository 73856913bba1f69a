"""FusedAttention's argument wiring on the CPU: the cuDNN ops are replaced by recorders, and
DotProductAttention runs the real backend code around them. What the GPU tests cannot see
directly is checked here: one dropout seed per forward, handed unchanged to the backward; no
dropout in eval mode; the bias cast to the inputs' dtype and its gradient routed back; the
bottom-right band sent top-left where both alignments are the same mask; the sink logits sent as
float32 [H] and their gradient (asked for only when wanted) routed back."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention import backends
from transformer_engine.pytorch.attention.dot_product_attention.backends import gap_rows
from transformer_engine.pytorch.attention.dot_product_attention.backends import kernel_ops

FWD_NAMES = ("offsets_q", "offsets_kv", "seqlens_q", "seqlens_kv", "batch_size", "max_seqlen_q", "max_seqlen_kv",
             "softmax_scale", "causal", "window_left", "window_right", "bottom_right", "bias", "rng", "alibi", "dropout_p", "sink")
BWD_NAMES = FWD_NAMES[:12] + ("deterministic",) + FWD_NAMES[12:] + ("need_dbias", "need_dsink")


class _RecordingOps:
    """Records the cuDNN ops' arguments; writes nothing into the buffers it is given. The
    gap-row ops are the real ones (the kernel zeroes the rows no sequence owns through them)."""

    zero_gap_rows = staticmethod(gap_rows.zero_gap_rows)
    zero_gap_rows_qkv = staticmethod(gap_rows.zero_gap_rows_qkv)

    def __init__(self):
        self.fwd, self.bwd = [], []

    def cudnn_fwd(self, q, k, v, out, *args):
        self.fwd.append(dict(zip(FWD_NAMES, args), out=out))
        return q.new_zeros(1)

    def cudnn_bwd(self, dout, q, k, v, out, stats, dq, dk, dv, *args):
        call = dict(zip(BWD_NAMES, args), grads=(dq, dk, dv))
        self.bwd.append(call)
        dbias = torch.ones_like(call["bias"]) if call["need_dbias"] else q.new_empty(0)
        dsink = torch.full_like(call["sink"], 2.0) if call["need_dsink"] else q.new_empty(0)
        return dbias, dsink


@pytest.fixture
def recorder(monkeypatch):
    ops = _RecordingOps()
    monkeypatch.setattr(kernel_ops, "ops", ops)
    with backend_scope(force=backends.FusedAttention):
        yield ops


def _qkv(b=2, sq=16, skv=16, h=4, d=8, dtype=torch.float32):
    return [torch.randn(b, s, h, d, dtype=dtype, requires_grad=True) for s in (sq, skv, skv)]


def test_dropout_seed_is_drawn_once_and_reused_by_the_backward(recorder):
    dpa = DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type="causal", attention_dropout=0.25)
    out = dpa(*_qkv())
    out.sum().backward()
    (fwd,), (bwd,) = recorder.fwd, recorder.bwd
    assert fwd["dropout_p"] == 0.25 and bwd["dropout_p"] == 0.25
    assert fwd["rng"].dtype == torch.int64 and fwd["rng"].shape == (2,)
    assert bwd["rng"] is fwd["rng"]
    dpa(*_qkv())
    assert not torch.equal(recorder.fwd[1]["rng"], fwd["rng"]), "each forward draws a new seed"


def test_eval_mode_runs_without_dropout(recorder):
    dpa = DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type="causal", attention_dropout=0.25).eval()
    dpa(*_qkv())
    assert recorder.fwd[0]["dropout_p"] == 0.0 and recorder.fwd[0]["rng"] is None


@pytest.mark.parametrize("requires_grad", [True, False])
def test_bias_is_cast_and_its_gradient_routed_back(recorder, requires_grad):
    q, k, v = _qkv(dtype=torch.bfloat16)
    bias = torch.randn(1, 4, 16, 16, dtype=torch.float32, requires_grad=requires_grad)
    dpa = DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type="no_mask")
    out = dpa(q, k, v, core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    out.float().sum().backward()
    (fwd,), (bwd,) = recorder.fwd, recorder.bwd
    assert fwd["bias"].dtype == torch.bfloat16 and fwd["bias"].is_contiguous()
    assert torch.equal(fwd["bias"], bias.detach().to(torch.bfloat16))
    assert bwd["need_dbias"] is requires_grad
    if requires_grad:
        assert bias.grad.dtype == torch.float32 and torch.equal(bias.grad, torch.ones_like(bias))


def test_alibi_flag(recorder):
    dpa = DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type="causal")
    dpa(*_qkv(), core_attention_bias_type="alibi")
    assert recorder.fwd[0]["alibi"] is True and recorder.fwd[0]["bias"] is None


@pytest.mark.parametrize("sq,skv,bottom_right", [(16, 16, False), (8, 16, True)])
def test_bottom_right_band_runs_top_left_where_lengths_match(recorder, sq, skv, bottom_right):
    dpa = DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type="causal_bottom_right")
    dpa(*_qkv(sq=sq, skv=skv))
    assert recorder.fwd[0]["causal"] is True and recorder.fwd[0]["bottom_right"] is bottom_right


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
def test_sink_logits_sent_and_their_gradient_routed_back(recorder, softmax_type):
    q, k, v = _qkv(dtype=torch.bfloat16)
    dpa = DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type="causal", softmax_type=softmax_type)
    if softmax_type == "learnable":
        with torch.no_grad():
            dpa.softmax_offset.copy_(torch.arange(4, dtype=torch.float32).view(dpa.softmax_offset.shape))
    dpa(q, k, v).float().sum().backward()
    (fwd,), (bwd,) = recorder.fwd, recorder.bwd
    expected = torch.arange(4.0) if softmax_type == "learnable" else torch.zeros(4)
    assert fwd["sink"].dtype == torch.float32 and torch.equal(fwd["sink"], expected)
    assert bwd["sink"] is fwd["sink"]
    assert bwd["need_dsink"] is (softmax_type == "learnable")
    if softmax_type == "learnable":
        assert torch.equal(dpa.softmax_offset.grad.reshape(-1), torch.full((4,), 2.0))


def test_no_sink_for_vanilla_softmax(recorder):
    DotProductAttention(4, 8, qkv_format="bshd")(*_qkv()).sum().backward()
    assert recorder.fwd[0]["sink"] is None and recorder.bwd[0]["need_dsink"] is False


def test_sink_gradient_is_the_sum_of_the_policy_calls(recorder):
    """THD with two mask policies: two cuDNN calls, each reducing the sink gradient over its own
    rows; the module's gradient is their sum (the recorder returns 2.0 per call)."""
    from .packing import make_thd

    p = make_thd([5, 3, 6], gaps_q=[2, 0, 1], h=4, hg=4, d=8, dtype=torch.bfloat16)
    for t in (p.q, p.k, p.v):
        t.requires_grad_()
    dpa = DotProductAttention(4, 8, qkv_format="thd", softmax_type="learnable")
    kwargs = dict(p.kwargs(True, 6, 6, shared=True), thd_sequence_is_causal=torch.tensor([True, False, True]))
    dpa(p.q, p.k, p.v, **kwargs).float().sum().backward()
    assert len(recorder.fwd) == 2 and [c["need_dsink"] for c in recorder.bwd] == [True, True]
    assert all(c["sink"] is recorder.fwd[0]["sink"] for c in recorder.fwd + recorder.bwd)
    assert torch.equal(dpa.softmax_offset.grad.reshape(-1), torch.full((4,), 4.0))


class _RowWritingOps(_RecordingOps):
    """Like a cuDNN call: rows of the sequences it runs (length > 0) get the call's number, all
    other rows are left as they are; a buffer seen for the first time is NaN-filled first, so a
    row that no call writes and nothing zeroes afterwards stays NaN."""

    def __init__(self):
        super().__init__()
        self._seen = []

    def _fill(self, t, offsets, lengths, value):
        if not any(t is seen for seen in self._seen):
            self._seen.append(t)
            t.fill_(float("nan"))
        for b in range(lengths.numel()):
            start = int(offsets[b])
            t[start:start + int(lengths[b])] = value

    def cudnn_fwd(self, q, k, v, out, *args):
        stats = super().cudnn_fwd(q, k, v, out, *args)
        call = self.fwd[-1]
        self._fill(out, call["offsets_q"], call["seqlens_q"], len(self.fwd))
        return stats

    def cudnn_bwd(self, dout, q, k, v, out, stats, dq, dk, dv, *args):
        dbias, dsink = super().cudnn_bwd(dout, q, k, v, out, stats, dq, dk, dv, *args)
        call, n = self.bwd[-1], len(self.bwd)
        for t, s in ((dq, "q"), (dk, "kv"), (dv, "kv")):
            self._fill(t, call[f"offsets_{s}"], call[f"seqlens_{s}"], n)
        return dbias, dsink


def test_policy_calls_share_buffers_without_row_owners(monkeypatch):
    """Several policies' calls write into one output (one dQ/dK/dV): every row holds its own
    policy's call, rows no sequence owns are zeroed after the calls (gaps and the tail: 0, not
    the NaN the buffers started with), and no row owners are made."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends import varlen

    from .packing import make_thd

    ops = _RowWritingOps()
    monkeypatch.setattr(kernel_ops, "ops", ops)
    monkeypatch.setattr(varlen, "_owners", lambda inp: pytest.fail("row owners made"))
    p = make_thd([5, 3, 6], gaps_q=[2, 0, 1], h=4, hg=4, d=8, dtype=torch.bfloat16, tail=2)
    for t in (p.q, p.k, p.v):
        t.requires_grad_()
    kwargs = dict(p.kwargs(True, 6, 6, shared=True), thd_sequence_is_causal=torch.tensor([True, False, True]))
    with backend_scope(force=backends.FusedAttention):
        out = DotProductAttention(4, 8, qkv_format="thd")(p.q, p.k, p.v, **kwargs)
        out.float().sum().backward()
    assert sorted(c["causal"] for c in ops.fwd) == [False, True] and len(ops.bwd) == 2
    assert [c["causal"] for c in ops.bwd] == [c["causal"] for c in ops.fwd]
    assert ops.fwd[0]["out"] is ops.fwd[1]["out"], "the policies' calls share one output"
    assert all(a is b for a, b in zip(*(c["grads"] for c in ops.bwd))), "and one set of gradients"
    # Rows of sequences 0 and 2 come from the causal call, sequence 1 from the other; gaps are 0.
    causal_call = 1 + [c["causal"] for c in ops.fwd].index(True)
    expect = torch.zeros(p.q.shape[0])
    offsets = p.kwargs(True, 6, 6, shared=True)["cu_seqlens_q_padded"]
    for b, (n, call) in enumerate(zip([5, 3, 6], [causal_call, 3 - causal_call, causal_call])):
        expect[int(offsets[b]):int(offsets[b]) + n] = call
    assert torch.equal(out.detach().float().view(out.shape[0], -1)[:, 0], expect)
    for grad in (p.q.grad, p.k.grad, p.v.grad):
        assert torch.equal(grad.float()[:, 0, 0], expect)



@pytest.mark.parametrize("mask", ["causal_bottom_right", "padding_causal_bottom_right"])
def test_bottom_right_with_more_queries_than_keys_needs_lengths(mask):
    """cudnn-frontend refuses a bottom-right causal band with s_q > s_kv unless per-sequence
    lengths come with it (H200, frontend 1.32): a dense call without a padding mask is refused by
    name; with one, THD, s_q <= s_kv, or top-left causal it is not."""
    from dataclasses import replace

    from transformer_engine.pytorch.attention.dot_product_attention import AttentionParams, get_attention_backend
    from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType
    from transformer_engine.pytorch.attention.dot_product_attention.selection.libraries import InstalledLibraries

    libs = InstalledLibraries(cudnn_frontend="1.32.0")
    base = AttentionParams(qkv_format="bshd", qkv_layout="bshd_bshd_bshd", attn_mask_type=AttnMaskType(mask),
                           window_size=(-1, 0), max_seqlen_q=192, max_seqlen_kv=128, head_dim_qk=64, head_dim_v=64)
    why = " ".join(map(str, get_attention_backend(base, libs).reasons_for("FusedAttention")))
    assert "max_seqlen_q=192 > max_seqlen_kv=128 and no padding mask" in why
    for ok in (replace(base, has_padding_mask=True), replace(base, max_seqlen_q=128),
               replace(base, attn_mask_type=AttnMaskType.CAUSAL),
               replace(base, qkv_format="thd", qkv_layout="thd_thd_thd")):
        assert "max_seqlen_kv" not in " ".join(map(str, get_attention_backend(ok, libs).reasons_for("FusedAttention")))
