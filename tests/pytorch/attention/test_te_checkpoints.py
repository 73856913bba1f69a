"""TransformerEngine checkpoints and MultiheadAttention, both directions.

The oracle is ``te_layout``: TE's keys, shapes and QKV row order written from TE's documented
layout, and a float64 forward computed from such a state dict alone. A state dict saved here must
have exactly TE's entries; a TE-layout one must load with ``strict=True``, give the oracle's
output and come back out unchanged; ``_extra_state`` follows TE's format. Also: MultiheadAttention's
named input errors and TE's attributes.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import replace

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention, MultiheadAttention

from .te_layout import HID, H, D, Variant, te_forward, te_inputs, te_keys, te_state_dict, variants

ALL = variants()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: threads only add scheduling time (a lot of it on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _shapes(sd):
    return [(k, tuple(v.shape)) for k, v in sd.items()]


@pytest.mark.parametrize("v", ALL, ids=str)
def test_saved_state_dict_has_te_keys_and_shapes(v):
    mha = MultiheadAttention(HID, H, **v.kwargs())
    sd = mha.state_dict()
    assert _shapes(sd) == te_keys(v)
    for key, value in sd.items():
        if key.endswith("_extra_state"):  # TE's "no FP8 state": an empty uint8 tensor
            assert value.dtype == torch.uint8 and value.numel() == 0, key


@pytest.mark.parametrize("v", [replace(v, tp=2) for v in ALL if v.hg % 2 == 0], ids=str)
def test_tensor_parallel_shards_have_te_keys_and_shapes(v):
    """Each rank's state dict (built with tp_size=2; no process group needed to construct)."""
    mha = MultiheadAttention(HID, H, **v.kwargs())
    assert _shapes(mha.state_dict()) == te_keys(v)


@pytest.mark.parametrize("v", ALL, ids=str)
def test_te_layout_loads_strict_gives_the_same_output_and_saves_back(v):
    sd = te_state_dict(v, seed=3)
    mha = MultiheadAttention(HID, H, **v.kwargs())
    mha.load_state_dict(sd, strict=True)
    x, enc = te_inputs(v)
    torch.testing.assert_close(mha(x, encoder_output=enc), te_forward(sd, v, x, enc), rtol=1e-10, atol=1e-10)
    back = mha.state_dict()
    assert list(back) == list(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
@pytest.mark.parametrize("v", [Variant(hg=2, fuse=True), Variant(hg=2), Variant("cross", True, hg=1, fuse=True, interleaved=False)], ids=str)
def test_te_layout_in_other_formats(v, fmt):
    sd = te_state_dict(v, seed=4)
    mask = ("padding_causal" if v.attention_type == "self" else "padding") if fmt == "thd" else None
    kwargs = {**v.kwargs(), "qkv_format": fmt, **({"attn_mask_type": mask} if mask else {})}
    mha = MultiheadAttention(HID, H, **kwargs)
    mha.load_state_dict(sd, strict=True)
    x, enc = te_inputs(v, fmt)
    call = {}
    if fmt == "thd":
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        call = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    want = te_forward(sd, v, x, enc, fmt=fmt, lengths=[4, 5])
    torch.testing.assert_close(mha(x, encoder_output=enc, **call), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("v", [Variant(input_layernorm=True, hg=2), Variant("cross", fuse=True, bias=False),
                               Variant(hg=1, fuse=True, softmax_type="learnable")], ids=str)
def test_round_trip_through_torch_save(v):
    """Saved here, serialized, loaded into a fresh module (other weights): the same outputs, and
    the same entries again."""
    torch.manual_seed(5)
    first = MultiheadAttention(HID, H, **v.kwargs())
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    torch.manual_seed(6)
    second = MultiheadAttention(HID, H, **v.kwargs())
    second.load_state_dict(torch.load(io.BytesIO(buf.getvalue())), strict=True)
    x, enc = te_inputs(v)
    # exact: the same weights (a lossless round trip) and inputs run the same ops
    torch.testing.assert_close(second(x, encoder_output=enc), first(x, encoder_output=enc), rtol=0, atol=0)
    assert _shapes(second.state_dict()) == te_keys(v)


def test_split_parameters_are_one_buffer_and_one_gemm():
    """fuse_qkv_params=False keeps TE's separate parameters as row blocks of one buffer: the
    joined weight is a view (no copy), gradients reach every block, and after .to() (which
    moves each parameter alone) the join copies and still computes the same."""
    mha = MultiheadAttention(HID, H, num_gqa_groups=2, input_layernorm=True, attention_dropout=0.0, device="cpu")
    qkv = mha.layernorm_qkv
    joined = qkv.joined_weight()
    assert joined.data_ptr() == qkv.query_weight.data_ptr() and joined.shape == (H * D + 2 * 2 * D, HID)
    x = torch.randn(3, 2, HID)
    mha(x).sum().backward()
    assert all(getattr(qkv, n).grad is not None for n in ("query_weight", "key_weight", "value_weight", "query_bias"))
    out32 = mha(x)
    mha.double()
    joined64 = qkv.joined_weight()
    assert joined64.dtype == torch.float64 and joined64.data_ptr() != qkv.query_weight.data_ptr()
    torch.testing.assert_close(mha(x.double()).float(), out32, rtol=1e-5, atol=1e-6)


def _fp8_like_state() -> torch.Tensor:
    """What TE writes after FP8 ran: pickled state as a 1-D uint8 tensor (contents are opaque here)."""
    state = {"recipe": "DelayedScaling", "scale_fwd": [1.0, 2.0], "extra_fp8_variables": {"num_gemms": 1}}
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def test_non_empty_extra_state_is_kept_and_saved_back():
    v = Variant(input_layernorm=True, fuse=True)
    sd = te_state_dict(v)
    fp8 = {k: _fp8_like_state() for k in sd if k.endswith("_extra_state")}
    sd.update(fp8)
    mha = MultiheadAttention(HID, H, **v.kwargs())
    mha.load_state_dict(sd, strict=True)
    back = mha.state_dict()
    for key, value in fp8.items():
        assert back[key].dtype == torch.uint8 and back[key].numpy().tobytes() == value.numpy().tobytes(), key


@pytest.mark.parametrize("module", ["dpa", "proj"])
def test_extra_state_accepts_none_empty_and_bytesio(module):
    mha = MultiheadAttention(HID, H, device="cpu")
    target = mha.core_attention if module == "dpa" else mha.proj
    payload = _fp8_like_state()
    target.set_extra_state(io.BytesIO(payload.numpy().tobytes()))  # TE 1.x's format
    assert torch.equal(target.get_extra_state(), payload)
    target.set_extra_state(None)
    assert target.get_extra_state().numel() == 0
    target.set_extra_state(torch.empty(0, dtype=torch.uint8))
    assert target.get_extra_state().dtype == torch.uint8 and target.get_extra_state().numel() == 0


@pytest.mark.parametrize("bad,seen", [(torch.zeros(3), r"a \(3,\) torch.float32 tensor"), ({"a": 1}, "dict"),
                                      (torch.zeros(2, 2, dtype=torch.uint8), r"a \(2, 2\) torch.uint8 tensor")])
def test_bad_extra_state_is_named(bad, seen):
    for target in (DotProductAttention(H, D), MultiheadAttention(HID, H, device="cpu").proj):
        with pytest.raises(TypeError, match=rf"_extra_state must be a 1-D uint8 tensor \(TE's serialized extra state, "
                                            rf"empty when there is none\), an io.BytesIO or None; got {seen}"):
            target.set_extra_state(bad)


def test_core_attention_extra_state_may_be_missing_or_under_te_1_6_name():
    """As TE: a checkpoint without the core attention's entry loads strictly (TE <= 1.5, and
    megatron's distributed checkpoints), and TE 1.6/1.7's ``fused_attention._extra_state`` is read
    in its place; other modules' entries stay required."""
    v = Variant(fuse=True)
    sd = te_state_dict(v)
    del sd["core_attention._extra_state"]
    mha = MultiheadAttention(HID, H, **v.kwargs())
    mha.load_state_dict(sd, strict=True)
    sd["core_attention.fused_attention._extra_state"] = _fp8_like_state()
    mha.load_state_dict(sd, strict=True)
    assert torch.equal(mha.state_dict()["core_attention._extra_state"], _fp8_like_state())
    del sd["proj._extra_state"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "proj._extra_state"'):
        mha.load_state_dict(sd, strict=True)


def test_standalone_dot_product_attention_has_te_extra_state():
    dpa = DotProductAttention(H, D, softmax_type="learnable")
    assert _shapes(dpa.state_dict()) == [("softmax_offset", (H,)), ("_extra_state", (0,))]
    DotProductAttention(H, D).load_state_dict({}, strict=True)


# ------------------------------------------------------------------ named input errors

def test_hidden_size_mismatch_is_named():
    mha = MultiheadAttention(HID, H, device="cpu")
    with pytest.raises(ValueError, match=r"hidden_states must be \[s, b, hidden=32\] \(qkv_format='sbhd', this module's "
                                         r"hidden_size\); got shape \(5, 2, 24\)"):
        mha(torch.randn(5, 2, 24))
    with pytest.raises(ValueError, match=r"hidden_states must be \[s, b, hidden=32\] .*got shape \(5, 32\)"):
        mha(torch.randn(5, HID))
    thd = MultiheadAttention(HID, H, device="cpu", qkv_format="thd", attn_mask_type="padding")
    with pytest.raises(ValueError, match=r"hidden_states must be \[t, hidden=32\] \(qkv_format='thd'.*got shape \(2, 5, 32\)"):
        thd(torch.randn(2, 5, HID))


def test_encoder_output_mismatch_is_named():
    mha = MultiheadAttention(HID, H, attention_type="cross", attn_mask_type="no_mask", device="cpu")
    with pytest.raises(ValueError, match=r"encoder_output must be \[s, b, hidden=32\] .*got shape \(7, 2, 16\)"):
        mha(torch.randn(5, 2, HID), encoder_output=torch.randn(7, 2, 16))
    with pytest.raises(TypeError, match=r"encoder_output has dtype torch.float64 but this module's parameters are "
                                        r"torch.float32"):
        mha(torch.randn(5, 2, HID), encoder_output=torch.randn(7, 2, HID, dtype=torch.float64))


def test_dtype_mismatch_is_named_unless_autocast():
    # no_mask: the unfused backend's masked scores do not run under autocast yet (not this check's business)
    mha = MultiheadAttention(HID, H, attention_dropout=0.0, device="cpu", attn_mask_type="no_mask")
    with pytest.raises(TypeError, match=r"hidden_states has dtype torch.bfloat16 but this module's parameters are "
                                        r"torch.float32; pass torch.float32 \(or convert the module with .to\(\), or run "
                                        r"under torch.autocast\)"):
        mha(torch.randn(5, 2, HID, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"hidden_states must be a torch.Tensor; got list"):
        mha([[0.0] * HID])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mha(torch.randn(5, 2, HID, dtype=torch.bfloat16)).shape == (5, 2, HID)


# ------------------------------------------------------------------ TE's attributes

def test_te_attributes_with_te_meanings():
    mha = MultiheadAttention(HID, H, kv_channels=6, num_gqa_groups=2, fuse_qkv_params=False, qkv_weight_interleaved=True,
                             params_dtype=torch.float64, device="cpu", name="attn", window_size=(3, 0))
    want = dict(hidden_size_per_attention_head=6, num_attention_heads=H, num_attention_heads_per_partition=H,
                num_gqa_groups=2, num_gqa_groups_per_partition=2, hidden_size_q=6 * H, hidden_size_kv=12,
                qkv_weight_interleaved=False,  # TE: never with separate parameters
                params_dtype=torch.float64, layer_number=1, cp_size=1, cp_rank=0, tp_size=1, sequence_parallel=False,
                input_layernorm=False, attention_type="self", qkv_format="sbhd", attn_mask_type="causal",
                window_size=(3, 0), return_bias=False, return_layernorm_output=False, softmax_type="vanilla",
                rotary_pos_interleaved=False, qk_norm_before_rope=False, q_norm=None, k_norm=None, name="attn",
                get_rng_state_tracker=None, tp_group=None)
    assert {k: getattr(mha, k) for k in want} == want
    assert mha.core_attention.layer_number == 1


def test_parallel_marks_on_parameters():
    """TE's tensor-parallel attributes: every weight is marked (dim 0 column-, dim 1
    row-parallel), column-parallel biases too; the norm and the row-parallel bias carry
    ``sequence_parallel``."""
    mha = MultiheadAttention(HID, H, input_layernorm=True, fuse_qkv_params=True, tp_size=2, set_parallel_mode=True,
                             sequence_parallel=True, device="cpu")
    qkv, proj = mha.layernorm_qkv, mha.proj
    assert (qkv.weight.tensor_model_parallel, qkv.weight.partition_dim, qkv.weight.partition_stride) == (True, 0, 1)
    assert (qkv.bias.tensor_model_parallel, qkv.bias.partition_dim) == (True, 0)
    assert (proj.weight.tensor_model_parallel, proj.weight.partition_dim) == (True, 1)
    assert proj.bias.sequence_parallel and qkv.layer_norm_weight.sequence_parallel and qkv.layer_norm_bias.sequence_parallel
    assert not hasattr(proj.bias, "tensor_model_parallel")
