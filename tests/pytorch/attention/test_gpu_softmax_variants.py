"""Attention sinks on the GPU: FlashAttention v4 (flash-attn-4's learnable_sink) and cuDNN
(sink_token / dSink_token), forward and backward, against the unfused backend in float64, bf16
inputs, dense and THD (gaps, GQA, per-sequence policies): outputs, dQ/dK/dV and the sink's
gradient. Skipped without CUDA; a case a backend refuses fails (``run_on``), except cuDNN's THD
backward, which cuDNN runs only from 9.26 on (the test expects the refusal below that)."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.declaration import SINK_THD_BACKWARD_MIN_CUDNN
from transformer_engine.pytorch.attention.dot_product_attention.selection.libraries import installed_libraries

from .gpu_helpers import rel_err, run_on
from .packing import make_thd
from .reference import allowed_matrix, max_logit_one

pytestmark = pytest.mark.gpu
H, D = 4, 128
TOL = 2e-2
LENGTHS = [100, 300, 37, 511, 1]
GAPS = [12, 0, 27, 1, 64]


def _module(softmax_type, hg, fmt, mask):
    dpa = DotProductAttention(H, D, num_gqa_groups=hg, qkv_format=fmt, attn_mask_type=mask, softmax_type=softmax_type).cuda()
    if softmax_type == "learnable":
        with torch.no_grad():  # logits in the range of the scores, so the sink matters
            dpa.softmax_offset.copy_(torch.tensor([1.5, -0.5, 3.0, 0.0], device="cuda"))
    return dpa


def _compare(label, dpa, inputs, kwargs, valid_rows=None, grads=True, expect_refusal=None):
    leaves = list(inputs) + ([dpa.softmax_offset] if dpa.softmax_type == "learnable" else [])
    with torch.set_grad_enabled(grads):
        out = run_on(label, dpa, *inputs, expect_refusal=expect_refusal, **kwargs)
    assert dpa.last_selection.label == label
    # The reference: the unfused backend on float64 copies (the sink parameter stays float32;
    # the unfused backend computes it in the inputs' precision).
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    ref = run_on("unfused", dpa, *ref_in, **kwargs)
    assert rel_err(out, ref) < TOL, f"out: {rel_err(out, ref):.2e}"
    if valid_rows is not None:
        assert torch.all(out.view(out.shape[0], -1)[~valid_rows[0]] == 0)
    if not grads:
        return
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, g)
    want = torch.autograd.grad(ref, ref_in + leaves[3:], g.double())
    for name, a, b in zip(["dq", "dk", "dv", "dsink"], got, want):
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        assert rel_err(a, b) < 4 * TOL, f"{name}: {rel_err(a, b):.2e}"
    if valid_rows is not None:
        for name, grad, rows in (("dq", got[0], valid_rows[0]), ("dk", got[1], valid_rows[1]), ("dv", got[2], valid_rows[1])):
            assert torch.all(grad.view(grad.shape[0], -1)[~rows] == 0), f"{name}: gap rows not 0"


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
@pytest.mark.parametrize("mask,hg,gaps,policies", [
    ("padding_causal", 4, False, False),
    ("padding", 2, True, False),
    ("padding_causal", 1, True, False),
    ("padding_causal", 4, True, True),
])
@pytest.mark.parametrize("label", ["FlashAttention v4", "FusedAttention"])
def test_thd_sinks(label, softmax_type, mask, hg, gaps, policies):
    p = make_thd(LENGTHS, gaps_q=GAPS if gaps else None, h=H, hg=hg, d=D, dtype=torch.bfloat16, device="cuda", tail=5)
    dpa = _module(softmax_type, hg, "thd", mask)
    kwargs = p.kwargs(gaps, max(LENGTHS), max(LENGTHS), shared=True)
    if policies:
        kwargs["thd_sequence_is_causal"] = torch.tensor([True, False, True, False, True], device="cuda")
    if not gaps:
        for t in (p.q, p.k, p.v):
            t.data[~p.valid_q] = 7.0
    valid = (p.valid_q, p.valid_kv)
    if label == "FusedAttention" and (installed_libraries().cudnn or 0) < SINK_THD_BACKWARD_MIN_CUDNN:
        _compare(label, dpa, [p.q, p.k, p.v], kwargs, valid, grads=False)  # the forward runs
        _compare(label, dpa, [p.q, p.k, p.v], kwargs, valid, expect_refusal="sinks in the thd backward")
        return
    _compare(label, dpa, [p.q, p.k, p.v], kwargs, valid)


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
@pytest.mark.parametrize("mask,sq,skv", [("no_mask", 256, 256), ("causal_bottom_right", 128, 384)])
@pytest.mark.parametrize("label", ["FlashAttention v4", "FusedAttention"])
def test_dense_sinks(label, softmax_type, mask, sq, skv):
    inputs = [torch.randn(2, s, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s, h in ((sq, H), (skv, 2), (skv, 2))]
    _compare(label, _module(softmax_type, 2, "bshd", mask), inputs, {})


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
def test_cudnn_dense_padding_sinks(softmax_type, mask):
    """Per-sequence lengths below the tensor's S (cuDNN's seq_len_q/kv): the sink gradient must
    reduce over each sequence's own rows only, the masking a THD call of several policies
    relies on (cuDNN's THD sink backward itself needs 9.26)."""
    b, s = 3, 192
    inputs = [torch.randn(b, s, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (H, 2, 2)]
    pad = torch.arange(s, device="cuda").view(1, s) >= torch.tensor([s, 77, 130], device="cuda").view(b, 1)
    dpa = _module(softmax_type, 2, "bshd", mask)
    _compare("FusedAttention", dpa, inputs, dict(attention_mask=pad.view(b, 1, 1, s)))


def test_return_max_logit_runs_on_the_unfused_backend_on_cuda():
    q = torch.randn(2, 64, H, D, device="cuda", dtype=torch.bfloat16)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal", return_max_logit=True)
    out, max_logit = run_on("unfused", dpa, q, q, q)  # cuDNN's is test_gpu_cudnn_features'
    allowed = allowed_matrix(64, 64, "causal")
    want = torch.stack([max_logit_one(q[i], q[i], allowed, D ** -0.5) for i in range(2)]).amax(0)
    torch.testing.assert_close(max_logit, want.float(), rtol=1e-5, atol=1e-5)
