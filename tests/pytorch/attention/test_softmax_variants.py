"""softmax_type ("vanilla", "off-by-one", "learnable": a sink logit per head) on the unfused
backend against the float64 reference (outputs and gradients, the sink's included), dense and
THD (per-sequence loop and the gathered path, with gaps and GQA), with the max logit alongside;
the FA4 wiring on FA4's stand-in; the declarations and errors. (return_max_logit itself:
test_max_logit.py.)"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention.dot_product_attention import AttentionParams, get_attention_backend
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention import backends
from transformer_engine.pytorch.attention.dot_product_attention.selection.libraries import InstalledLibraries
from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType

from .gpu_helpers import env
from .packing import make_thd
from .reference import allowed_matrix, attend_one, max_logit_one, reference_thd

H, HG, D = 4, 2, 8
SINK = torch.tensor([0.7, -1.3, 2.0, 0.1], dtype=torch.float64)


def _reference_thd(p, lengths_q, lengths_kv, mask, scale, sink):
    """(output, max logit over the sequences) of the float64 reference."""
    cu = lambda ls: [0] + [sum(ls[: i + 1]) for i in range(len(ls))]  # noqa: E731
    out = reference_thd(p.q, p.k, p.v, cu(lengths_q), cu(lengths_kv), p.off_q, p.off_kv, mask, None, scale, sink=sink)
    maxes = [max_logit_one(p.q[a : a + n], p.k[c : c + m], allowed_matrix(n, m, mask), scale)
             for a, c, n, m in zip(p.off_q.tolist(), p.off_kv.tolist(), lengths_q, lengths_kv) if n]
    return out, torch.stack(maxes).amax(dim=0)


def _dpa(softmax_type, fmt="thd", mask="padding_causal", **kw):
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format=fmt, attn_mask_type=mask, softmax_type=softmax_type, **kw)
    dpa = dpa.double()
    if softmax_type == "learnable":
        with torch.no_grad():
            dpa.softmax_offset.copy_(SINK)
    return dpa


def _leaf_sink(softmax_type):
    if softmax_type == "vanilla":
        return None
    if softmax_type == "off-by-one":
        return torch.zeros(H, dtype=torch.float64)
    return SINK.clone().requires_grad_()


def _grads(out, leaves, g):
    valid = [t for t in leaves if t is not None and t.requires_grad]
    return torch.autograd.grad(out, valid, g, allow_unused=False)


def _close(a, b, tol=1e-10):
    a, b = torch.nan_to_num(a.detach(), nan=0.0), torch.nan_to_num(b.detach(), nan=0.0)
    assert (a - b).abs().max() <= tol, f"max abs err {(a - b).abs().max():.3e}"


# ------------------------------------------------------------------------- unfused: THD

# Sequence 2 has no keys at all: its queries have nothing to attend (their rows must be 0).
LENGTHS_Q, LENGTHS_KV = [5, 1, 3, 7], [5, 4, 0, 9]
GAPS_Q, GAPS_KV = [2, 0, 3, 1], [1, 2, 0, 4]


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable", "vanilla"])
@pytest.mark.parametrize("gather", ["0", "1"])
@pytest.mark.parametrize("mask", ["padding_causal_bottom_right", "padding"])
def test_thd_outputs_and_gradients_match_reference(softmax_type, gather, mask):
    p = make_thd(LENGTHS_Q, LENGTHS_KV, gaps_q=GAPS_Q, gaps_kv=GAPS_KV, h=H, hg=HG, d=D, tail=2)
    dpa = _dpa(softmax_type, mask=mask, return_max_logit=True)
    kwargs = p.kwargs(True, max(LENGTHS_Q), max(LENGTHS_KV))
    with env(NVTE_UNFUSED_THD_GATHER=gather):
        out, max_logit = dpa(p.q, p.k, p.v, **kwargs)
    assert dpa.last_selection.label == "UnfusedDotProductAttention"
    sink = _leaf_sink(softmax_type)
    leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]
    ref_p = replace(p, q=leaves[0], k=leaves[1], v=leaves[2])
    ref, ref_max = _reference_thd(ref_p, LENGTHS_Q, LENGTHS_KV, mask, 1 / math.sqrt(D), sink)
    ref = ref.view(out.shape)
    _close(out, ref)
    assert torch.equal(out[~p.valid_q], torch.zeros_like(out[~p.valid_q]))
    a, b = int(p.off_q[2]), int(p.off_q[2]) + LENGTHS_Q[2]
    assert torch.equal(out[a:b], torch.zeros_like(out[a:b])), "queries with no key must give 0"
    _close(max_logit, ref_max)
    g = torch.randn_like(out)
    params = [p.q, p.k, p.v] + ([dpa.softmax_offset] if softmax_type == "learnable" else [])
    got = torch.autograd.grad(out, params, g)
    want = _grads(ref, leaves + [sink], g)
    for x, y in zip(got, want):
        _close(x, y)
    if softmax_type == "learnable":
        assert got[3].abs().max() > 1e-3, "the sink gradient must not vanish"


def test_thd_sink_gradcheck():
    """The sink parameter's gradient by finite differences (float64), gathered path."""
    p = make_thd([3, 2], gaps_q=[1, 2], h=H, hg=HG, d=D)
    dpa = _dpa("learnable")
    kwargs = p.kwargs(True, 3, 3, shared=True)
    q, k, v = (torch.nan_to_num(t.detach(), nan=0.0) for t in (p.q, p.k, p.v))

    def f(sink):
        with torch.no_grad():
            dpa.softmax_offset.copy_(sink)
        dpa.softmax_offset.grad = None
        return dpa(q, k, v, **kwargs)

    sink = SINK.clone()
    out = f(sink)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    analytic = dpa.softmax_offset.grad.clone()
    eps = 1e-6
    for head in range(H):
        bump = torch.zeros(H, dtype=torch.float64)
        bump[head] = eps
        with torch.no_grad(), env(NVTE_UNFUSED_THD_GATHER="1"):
            numeric = ((f(sink + bump) * g).sum() - (f(sink - bump) * g).sum()) / (2 * eps)
        assert abs(float(numeric) - float(analytic[head])) < 1e-6


# ------------------------------------------------------------------------- unfused: dense


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_dense_padding_outputs_gradients_and_max_logit(softmax_type, fmt):
    b, sq, skv = 3, 6, 9
    len_q, len_kv = [6, 4, 2], [9, 5, 0]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, s, h, D, generator=gen, dtype=torch.float64) for s, h in ((sq, H), (skv, HG), (skv, HG)))
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32)  # noqa: E731
    dpa = _dpa(softmax_type, fmt=fmt, mask="padding_causal_bottom_right", return_max_logit=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    inputs = leaves if fmt == "bshd" else [t.transpose(0, 1) for t in leaves]
    out, max_logit = dpa(*inputs, cu_seqlens_q=cu(len_q), cu_seqlens_kv=cu(len_kv))
    out = out.view(b, sq, H, D) if fmt == "bshd" else out.view(sq, b, H, D).transpose(0, 1)
    sink = _leaf_sink(softmax_type)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.zeros(b, sq, H, D, dtype=torch.float64)
    maxes = []
    for i in range(b):
        n, m = len_q[i], len_kv[i]
        allowed = allowed_matrix(n, m, "padding_causal_bottom_right")
        ref[i, :n] = attend_one(ref_leaves[0][i, :n], ref_leaves[1][i, :m], ref_leaves[2][i, :m], allowed, 1 / math.sqrt(D), sink=sink)
        maxes.append(max_logit_one(q[i, :n], k[i, :m], allowed, 1 / math.sqrt(D)))
    # Padded query rows are not specified by TE (the unfused backend gives 0 there): compare valid rows.
    valid = torch.zeros(b, sq, dtype=torch.bool)
    for i, n in enumerate(len_q):
        valid[i, :n] = True
    _close(out[valid], ref[valid])
    _close(max_logit, torch.stack(maxes).amax(dim=0))
    g = torch.randn_like(out) * valid[:, :, None, None]
    params = leaves + ([dpa.softmax_offset] if softmax_type == "learnable" else [])
    got = torch.autograd.grad(out, params, g)
    want = _grads(ref, ref_leaves + [sink], g)
    for x, y in zip(got, want):
        _close(x, y)


def test_repeated_calls_through_the_fast_path_keep_the_softmax_variant():
    p = make_thd([4, 3], h=H, hg=HG, d=D)
    dpa = _dpa("learnable", return_max_logit=True)
    kwargs = p.kwargs(False, 4, 4, shared=True)
    first = dpa(p.q, p.k, p.v, **kwargs)
    second = dpa(p.q, p.k, p.v, **kwargs)
    assert dpa._recipes, "the second call should have taken the fast path"
    # exact: the fast path repeats the same ops on the same data
    _close(first[0], second[0], 0.0)
    _close(first[1], second[1], 0.0)


# ------------------------------------------------------------------------- module and errors


def test_softmax_offset_parameter_as_te_defines_it():
    learnable = DotProductAttention(H, D, softmax_type="learnable")
    p = learnable.softmax_offset
    assert isinstance(p, torch.nn.Parameter) and p.shape == (H,) and p.dtype == torch.float32 and p.requires_grad
    assert "softmax_offset" in learnable.state_dict()
    assert 0 < p.abs().max() < 0.2  # N(0, 0.023)
    off = DotProductAttention(H, D, softmax_type="off-by-one")
    assert torch.equal(off.softmax_offset, torch.zeros(H)) and "softmax_offset" not in off.state_dict()
    assert not off.softmax_offset.requires_grad
    assert DotProductAttention(H, D).softmax_offset is None


def test_learnable_init_draws_inside_the_rng_tracker_fork():
    class Tracker:
        forks = 0

        def fork(self):
            Tracker.forks += 1
            return torch.random.fork_rng()

    before = torch.get_rng_state()
    DotProductAttention(H, D, softmax_type="learnable", get_rng_state_tracker=Tracker)
    assert Tracker.forks == 1 and torch.equal(torch.get_rng_state(), before)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"softmax_type must be one of 'vanilla', 'off-by-one', 'learnable'; got 'sink'"):
        DotProductAttention(H, D, softmax_type="sink")
    with pytest.raises(TypeError, match=r"return_max_logit must be a bool; got 'yes'"):
        DotProductAttention(H, D, return_max_logit="yes")


def test_no_backend_error_names_softmax_type_not_return_max_logit():
    q = torch.randn(4, 2, H, D)
    dpa = DotProductAttention(H, D, softmax_type="learnable")
    with env(NVTE_UNFUSED_ATTN="0"), pytest.raises(NotImplementedError) as err:
        dpa(q, q, q)
    assert "softmax_type='learnable'" in str(err.value) and "return_max_logit" not in str(err.value)


# ------------------------------------------------------------------------- declarations

ALL_LIBS = InstalledLibraries("2", "3", "4", "1.32.0")
THD = AttentionParams(qkv_format="thd", qkv_layout="thd_thd_thd", attn_mask_type=AttnMaskType.PADDING_CAUSAL,
                      head_dim_qk=128, head_dim_v=128)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_selection_sinks_go_to_fa4_and_others_say_why(softmax_type):
    sel = get_attention_backend(replace(THD, softmax_type=softmax_type), ALL_LIBS)
    assert sel.label == "FlashAttention v4"
    text = "; ".join(map(str, sel.reasons_for("FlashAttention v3")))
    assert f"softmax_type='{softmax_type}' (supported: vanilla" in text and "takes no attention-sink logits" in text
    text = "; ".join(map(str, sel.reasons_for("FusedAttention")))
    assert f"softmax_type='{softmax_type}' with cuDNN of unknown version (supported: vanilla, or cuDNN >= 9.26" in text
    sel = get_attention_backend(replace(THD, softmax_type=softmax_type, compute_capability=(8, 0)), ALL_LIBS)
    assert sel.label == "UnfusedDotProductAttention"


@pytest.mark.parametrize("cudnn,fmt,grad,need", [
    (91900, "thd", True, "9.26 (sinks in the thd backward)"),  # the H200's cuDNN
    (91900, "thd", False, None),
    (91900, "bshd", True, None),
    (92600, "thd", True, None),
    (91200, "bshd", False, "9.13 (sinks)"),
    (None, "bshd", False, "9.13 (sinks)"),
])
def test_cudnn_sinks_follow_the_cudnn_version(cudnn, fmt, grad, need):
    libs = replace(ALL_LIBS, cudnn=cudnn)
    layout = "thd_thd_thd" if fmt == "thd" else "bshd_bshd_bshd"
    params = replace(THD, qkv_format=fmt, qkv_layout=layout, softmax_type="learnable", requires_grad=grad)
    text = "; ".join(map(str, get_attention_backend(params, libs).reasons_for("FusedAttention")))
    if need is None:
        assert text == ""
    else:
        assert text.startswith("softmax_type='learnable' with cuDNN ") and text.endswith(f"or cuDNN >= {need})")


@pytest.mark.parametrize("frontend,refused", [("1.31.0", True), ("1.32.0", False), ("1.33.1", False), ("dev", True)])
def test_cudnn_sinks_need_the_frontend_they_were_run_with(frontend, refused):
    params = replace(THD, qkv_format="bshd", qkv_layout="bshd_bshd_bshd", softmax_type="learnable")
    libs = replace(ALL_LIBS, cudnn_frontend=frontend, cudnn=92600)
    text = "; ".join(map(str, get_attention_backend(params, libs).reasons_for("FusedAttention")))
    assert (f"softmax_type='learnable' with cudnn-frontend {frontend}" in text) is refused


def test_cudnn_sinks_need_more_than_one_query_row():
    params = replace(THD, qkv_format="bshd", qkv_layout="bshd_bshd_bshd", softmax_type="off-by-one", max_seqlen_q=1,
                     max_seqlen_kv=64, requires_grad=False)
    text = "; ".join(map(str, get_attention_backend(params, replace(ALL_LIBS, cudnn=92600)).reasons_for("FusedAttention")))
    assert "softmax_type='off-by-one' with max_seqlen_q=1" in text and "decode-only" in text


def test_fa4_sm100_hd256_sink_needs_no_gradient():
    base = replace(THD, compute_capability=(10, 0), head_dim_qk=256, head_dim_v=256, softmax_type="learnable")
    sel = get_attention_backend(base, ALL_LIBS)
    assert "dedicated hd256 backward has no sink" in "; ".join(map(str, sel.reasons_for("FlashAttention v4")))
    assert get_attention_backend(replace(base, requires_grad=False), ALL_LIBS).label == "FlashAttention v4"


# ------------------------------------------------------------------------- FA4 wiring, on its stand-in


@pytest.fixture
def fa4(fa4_lib):
    with backend_scope(force=backends.FlashAttentionV4):
        yield fa4_lib


@pytest.mark.parametrize("policies", [False, True])
def test_fa4_path_passes_the_sink_and_returns_its_gradient(fa4, policies):
    lengths = [5, 3, 6]
    p = make_thd(lengths, gaps_q=[2, 0, 1], h=H, hg=HG, d=D)
    dpa = _dpa("learnable")
    kwargs = p.kwargs(True, 6, 6, shared=True)
    masks = "padding_causal"
    if policies:
        kwargs["thd_sequence_is_causal"] = torch.tensor([True, False, True])
        masks = ["padding_causal", "padding", "padding_causal"]
    out = dpa(p.q, p.k, p.v, **kwargs)
    calls = 2 if policies else 1
    assert len(fa4.of("fwd")) == calls
    assert all(kw["learnable_sink"].dtype == torch.float32 for kw in fa4.of("fwd"))
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [dpa.softmax_offset, p.q], g)
    assert len(fa4.of("bwd")) == calls and all("learnable_sink" in kw for kw in fa4.of("bwd"))
    sink = SINK.clone().requires_grad_()
    leaves_q = p.q.detach().clone().requires_grad_()
    ref = reference_thd(leaves_q, p.k.detach(), p.v.detach(), p.cu_q, p.cu_q, p.off_q, p.off_q, masks, None, 1 / math.sqrt(D),
                        sink=sink).view(out.shape)
    _close(out, ref, 1e-6)  # the sink passes through float32
    want = torch.autograd.grad(ref, [sink, leaves_q], g)
    _close(got[0], want[0], 1e-5)  # summed over both policies' calls
    _close(got[1], want[1], 1e-5)


def test_fa4_path_off_by_one_passes_zeros_and_no_sink_gradient(fa4):
    p = make_thd([4, 2], h=H, hg=HG, d=D)
    dpa = _dpa("off-by-one")
    out = dpa(p.q, p.k, p.v, **p.kwargs(False, 4, 4, shared=True))
    assert torch.equal(fa4.of("fwd")[0]["learnable_sink"], torch.zeros(H))
    out.sum().backward()
    assert p.q.grad is not None and dpa.softmax_offset.grad is None
