"""Bad input gets a clear error that names the argument, what it got and what it accepts
(randomized bad THD metadata: test_thd_packings.py; bad per-sequence policies:
test_per_seq_policy.py; bad repeats on the fast path: test_fast_path.py)."""

from __future__ import annotations

import math

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention

from .packing import make_thd

H, D = 4, 8


def dense(b=2, s=5, h=H, d=D):
    return [torch.randn(b, s, h, d) for _ in range(3)]


CONSTRUCTOR_CASES = [
    (dict(qkv_format="bhsd"), ValueError, "qkv_format"),
    (dict(attn_mask_type="diagonal"), ValueError, "attn_mask_type"),
    (dict(num_gqa_groups=3), ValueError, "num_gqa_groups"),
    (dict(kv_channels=0), ValueError, "kv_channels"),
    (dict(attn_mask_type="causal", window_size=(-1, 4)), ValueError, "window_size"),
    (dict(window_size=(2,)), TypeError, "window_size"),
    (dict(tp_size=0), ValueError, "tp_size must be a positive int; got 0"),
    (dict(tp_size=3), ValueError, "num_attention_heads=4 must be divisible by the tensor-parallel size 3"),
    (dict(tp_size=4, num_gqa_groups=2), ValueError, "num_gqa_groups=2 must be divisible by the tensor-parallel size 4"),
    (dict(cp_group=object()), ValueError, "cp_group was given but torch.distributed is not initialized"),
    (dict(cp_comm_type="ring"), ValueError, "cp_comm_type must be one of p2p, all_gather, a2a, a2a\\+p2p; got 'ring'"),
    (dict(attention_type="both"), ValueError, "attention_type"),
    (dict(attention_dropout=1.5), ValueError, "attention_dropout"),
]


@pytest.mark.parametrize("kwargs,exc,name", CONSTRUCTOR_CASES, ids=[c[2] + str(i) for i, c in enumerate(CONSTRUCTOR_CASES)])
def test_constructor_errors(kwargs, exc, name):
    args = dict(num_attention_heads=H, kv_channels=D)
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        DotProductAttention(**args)


def test_head_count_mismatch():
    q, k, v = dense(h=3)
    with pytest.raises(ValueError, match="query_layer has 3 heads; num_attention_heads is 4"):
        DotProductAttention(H, D, qkv_format="bshd")(q, k, v)


def test_head_dim_mismatch():
    q, k, v = dense(d=16)
    with pytest.raises(ValueError, match="kv_channels"):
        DotProductAttention(H, D, qkv_format="bshd")(q, k, v)


def test_gqa_head_count_mismatch():
    q, _, _ = dense()
    k, v = torch.randn(2, 5, 2, D), torch.randn(2, 5, 2, D)
    with pytest.raises(ValueError, match="key_layer has 2 heads; num_gqa_groups is 4"):
        DotProductAttention(H, D, qkv_format="bshd")(q, k, v)


def test_rank_mismatch():
    q, k, v = dense()
    with pytest.raises(ValueError, match="query_layer must have rank 3"):
        DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")(q, k, v)


def test_thd_without_cu_seqlens():
    p = make_thd([3, 2])
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_kv"):
        DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")(p.q, p.k, p.v)


@pytest.mark.parametrize("bad,msg", [
    (torch.tensor([0, 3, 5], dtype=torch.int64), "dtype torch.int64"),
    (torch.tensor([[0, 3, 5]], dtype=torch.int32), r"shape \(1, 3\)"),
])
def test_cu_seqlens_type(bad, msg):
    p = make_thd([3, 2])
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32 tensor.*" + msg):
        DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")(p.q, p.k, p.v, cu_seqlens_q=bad, cu_seqlens_kv=p.cu_kv)


def test_cu_seqlens_length_mismatch():
    p = make_thd([3, 2])
    with pytest.raises(ValueError, match="cu_seqlens_kv must have length batch_size\\+1 = 3"):
        DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")(
            p.q, p.k, p.v, cu_seqlens_q=p.cu_q, cu_seqlens_kv=torch.tensor([0, 5], dtype=torch.int32))


def test_max_seqlen_tensor_rejected():
    p = make_thd([3, 2])
    with pytest.raises(TypeError, match="max_seqlen for cu_seqlens_q must be a non-negative Python int"):
        DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")(
            p.q, p.k, p.v, cu_seqlens_q=p.cu_q, cu_seqlens_kv=p.cu_kv, max_seqlen_q=torch.tensor(3))


def test_pad_between_true_without_padded_offsets():
    p = make_thd([3, 2])
    with pytest.raises(ValueError, match="pad_between_seqs=True needs cu_seqlens_q_padded"):
        DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")(
            p.q, p.k, p.v, cu_seqlens_q=p.cu_q, cu_seqlens_kv=p.cu_kv, pad_between_seqs=True)


def test_debug_validation_catches_overrun(monkeypatch):
    p = make_thd([3, 2])
    monkeypatch.setenv("NVTE_ATTN_VALIDATE", "1")
    bad = torch.tensor([0, 3, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q must end within the tensor's 5 rows; its last entry is 9"):
        DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")(
            p.q, p.k, p.v, cu_seqlens_q=bad, cu_seqlens_kv=bad, max_seqlen_q=6, max_seqlen_kv=6)


def test_bias_shape():
    q, k, v = dense()
    with pytest.raises(ValueError, match=r"core_attention_bias must have shape \[1\|2, 1\|4, 5, 5\] or \[1, 1, 1, 5\]; got \(2, 4, 5, 4\)"):
        DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask")(
            q, k, v, core_attention_bias_type="post_scale_bias", core_attention_bias=torch.randn(2, 4, 5, 4))


def test_bias_type_unknown():
    q, k, v = dense()
    with pytest.raises(ValueError, match="core_attention_bias_type must be one of"):
        DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask")(q, k, v, core_attention_bias_type="rel")


def test_padding_without_mask_or_lengths():
    q, k, v = dense()
    with pytest.raises(ValueError, match="needs attention_mask .* or cu_seqlens_q/cu_seqlens_kv; got neither"):
        DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding")(q, k, v)


def test_mask_given_but_ignored():
    q, k, v = dense()
    with pytest.raises(ValueError, match="attention_mask was given but attn_mask_type='causal' ignores it"):
        DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal")(q, k, v, attention_mask=torch.zeros(2, 1, 1, 5, dtype=torch.bool))


def test_padding_mask_shape():
    q, k, v = dense()
    with pytest.raises(ValueError, match=r"attention_mask \(queries\) must have shape \[b, 1, 1, s\]"):
        DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding")(q, k, v, attention_mask=torch.zeros(2, 5, dtype=torch.bool).view(2, 1, 5, 1))


def test_arbitrary_with_thd():
    p = make_thd([3, 2])
    with pytest.raises(ValueError, match="attn_mask_type='arbitrary'"):
        DotProductAttention(H, D, qkv_format="thd", attn_mask_type="arbitrary")(p.q, p.k, p.v, cu_seqlens_q=p.cu_q, cu_seqlens_kv=p.cu_kv)


def test_inference_params_must_be_an_inference_params():
    q, k, v = dense()
    with pytest.raises(TypeError, match="^inference_params must be an InferenceParams; got object"):
        DotProductAttention(H, D, qkv_format="bshd")(q, k, v, inference_params=object())


def test_policy_diagonals_are_checked_like_the_calls_own_mask():
    from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType as M, MaskSpec
    from transformer_engine.pytorch.attention.dot_product_attention.prepare.validation import check_policy_diagonals

    specs = (MaskSpec(M.PADDING_CAUSAL, (3, 0)), MaskSpec(M.PADDING, (-1, -1)), MaskSpec(M.PADDING, (2, 2)))
    for flag in (None, True):
        check_policy_diagonals(flag, specs, "attn_mask_type_per_seq")
    check_policy_diagonals(False, specs[:2], "attn_mask_type_per_seq")  # causal: the mask type decides; no window: nothing to align
    with pytest.raises(NotImplementedError, match=r"bottom_right_diagonal=False with the 'padding' policy of "
                                                  r"attn_mask_type_per_seq \(window \(2, 2\)\)"):
        check_policy_diagonals(False, specs, "attn_mask_type_per_seq")
    with pytest.raises(TypeError, match="bottom_right_diagonal must be None, True or False; got 0"):
        check_policy_diagonals(0, specs, "thd_sequence_is_causal")


@pytest.mark.parametrize("scale", ["0.1", math.inf, -math.inf, math.nan, True])
def test_softmax_scale_must_be_a_finite_number(scale):
    with pytest.raises(ValueError, match=r"softmax_scale must be a finite float \(or None for 1/sqrt\(head_dim\)\); got " + repr(scale)[:3]):
        DotProductAttention(H, D, softmax_scale=scale)


@pytest.mark.parametrize("bad", [-1, "2", 2.0, True])
def test_num_splits_bad_values_are_named(bad):
    q, k, v = dense()
    with pytest.raises(ValueError, match=r"num_splits must be None or a non-negative int .*; got " + repr(bad).replace(".", r"\.")):
        DotProductAttention(H, D, qkv_format="bshd")(q, k, v, num_splits=bad)


@pytest.mark.parametrize("cu,msg", [
    ([0, 7, 9], r"cu_seqlens_q must give each sequence a length in \[0, 5\] \(the padded length\); got lengths \[7, 2\]"),
    ([0, 3, 1], r"cu_seqlens_q must give each sequence a length in \[0, 5\] \(the padded length\); got lengths \[3, -2\]"),
])
def test_dense_cu_seqlens_outside_the_padded_length_are_rejected(cu, msg):
    q, k, v = dense()
    good = torch.tensor([0, 5, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=msg):
        DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding")(
            q, k, v, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), cu_seqlens_kv=good)
