"""MultiheadAttention against a plain PyTorch computation from the same weights (THD
included), and proof that its fused projection goes through as a declared packed buffer."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from transformer_engine.pytorch import MultiheadAttention

from .te_layout import HID, H, D, Variant, te_forward

CASES = [
    # (attention_type, fuse, interleaved, hg, layernorm, norm)
    ("self", True, True, H, True, "LayerNorm"),
    ("self", True, False, H, False, "LayerNorm"),
    ("self", True, True, 2, True, "RMSNorm"),
    ("self", True, False, 2, False, "LayerNorm"),
    ("self", False, True, 2, False, "LayerNorm"),
    ("cross", True, True, 2, False, "LayerNorm"),
    ("cross", True, False, H, True, "LayerNorm"),
    ("cross", False, False, H, False, "LayerNorm"),
]


@pytest.mark.parametrize("attention_type,fuse,interleaved,hg,ln,norm", CASES)
def test_sbhd_matches_plain_pytorch(attention_type, fuse, interleaved, hg, ln, norm):
    """Against attention written from the module's state dict alone, read in TE's layout."""
    torch.manual_seed(0)
    v = Variant(attention_type, ln, norm, True, hg, fuse, interleaved)
    mha = MultiheadAttention(HID, H, **v.kwargs())
    x = torch.randn(6, 2, HID, dtype=torch.float64)
    enc = torch.randn(9, 2, HID, dtype=torch.float64) if attention_type == "cross" else None
    out = mha(x, encoder_output=enc)
    torch.testing.assert_close(out, te_forward(mha.state_dict(), v, x, enc))


@pytest.mark.parametrize("interleaved", [True, False])
def test_thd_matches_plain_pytorch(interleaved):
    torch.manual_seed(1)
    lengths = [3, 5, 2]
    mha = MultiheadAttention(HID, H, attention_dropout=0.0, attn_mask_type="padding_causal", fuse_qkv_params=True,
                             qkv_weight_interleaved=interleaved, params_dtype=torch.float64, device="cpu", qkv_format="thd")
    x = torch.randn(sum(lengths), HID, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    out = mha(x, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    ref = te_forward(mha.state_dict(), Variant(fuse=True, interleaved=interleaved), x.detach(), fmt="thd", lengths=lengths)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert torch.isfinite(mha.qkv.weight.grad).all()


@pytest.mark.parametrize("attention_type,fuse,hg,packed,dim", [
    ("self", True, H, "qkv_layer", -2), ("self", False, H, "qkv_layer", -3), ("self", False, 2, "kv_layer", -3),
    ("cross", True, 2, "kv_layer", -2), ("cross", False, H, "kv_layer", -3)])
def test_projection_goes_through_packed(monkeypatch, attention_type, fuse, hg, packed, dim):
    """The QKV projection output reaches DotProductAttention as a declared packed buffer, fused
    parameters or TE's separate ones (row blocks of one weight: still one GEMM)."""
    mha = MultiheadAttention(HID, H, attention_dropout=0.0, fuse_qkv_params=fuse, num_gqa_groups=hg, device="cpu",
                             attention_type=attention_type, attn_mask_type="causal" if attention_type == "self" else "no_mask")
    seen = {}
    real = mha.core_attention.forward

    def spy(*args, **kwargs):
        seen.update({k: v for k, v in kwargs.items() if k in ("qkv_layer", "kv_layer", "query_layer", "key_layer", "qkv_interleave_dim")})
        return real(*args, **kwargs)

    monkeypatch.setattr(mha.core_attention, "forward", spy)
    mha(torch.randn(4, 2, HID), encoder_output=torch.randn(5, 2, HID) if attention_type == "cross" else None)
    assert packed in seen and seen["qkv_interleave_dim"] == dim and "key_layer" not in seen
    assert ("query_layer" in seen) == (packed == "kv_layer")


def _rotate_pairs(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """RoPE written as complex rotation: channel i pairs with channel i + D/2, and the pair
    turns by angle[pos, i] (the rotate-half convention), [S, B, H, D] with angles [S, D/2]."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angles), angles).view(x.shape[0], 1, 1, half)
    return torch.cat([z.real, z.imag], dim=-1)


def test_rope_uses_sliced_path_and_rotates(monkeypatch):
    torch.manual_seed(2)
    mha = MultiheadAttention(HID, H, attention_dropout=0.0, fuse_qkv_params=True, device="cpu", params_dtype=torch.float64)
    x = torch.randn(6, 1, HID, dtype=torch.float64)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.outer(torch.arange(6, dtype=torch.float64), inv)
    freqs = torch.cat([angles, angles], dim=-1).view(6, 1, 1, D)
    seen = []
    real = mha.core_attention.forward

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(mha.core_attention, "forward", spy)
    plain = mha(x)
    assert "qkv_layer" in seen[0]  # no RoPE: the packed layer goes through whole
    torch.testing.assert_close(mha(x, rotary_pos_emb=torch.zeros_like(freqs)), plain)  # angle 0 is the identity
    mha(x, rotary_pos_emb=freqs)
    q, k, v = seen[0]["qkv_layer"].unbind(-2 if seen[0]["qkv_interleave_dim"] == -2 else -3)
    rotated = seen[-1]
    assert "qkv_layer" not in rotated  # RoPE acts on q and k separately: the sliced path
    torch.testing.assert_close(rotated["query_layer"], _rotate_pairs(q, angles), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rotated["key_layer"], _rotate_pairs(k, angles), rtol=1e-12, atol=1e-12)
    # exact: V is passed through untouched
    torch.testing.assert_close(rotated["value_layer"], v, rtol=0, atol=0)


def test_bad_normalization():
    with pytest.raises(ValueError, match="normalization must be 'LayerNorm' or 'RMSNorm'; got 'BatchNorm'"):
        MultiheadAttention(HID, H, normalization="BatchNorm", device="cpu")


def test_scale_default():
    mha = MultiheadAttention(HID, H, device="cpu")
    assert math.isclose(mha.core_attention.softmax_scale, 1 / math.sqrt(D))


def test_thd_rotary_prepares_the_packed_metadata_once(monkeypatch):
    """The THD rotary path builds the packed metadata for its positions and hands it to
    DotProductAttention: one prepare_sides per call, on the full path and on a fast-path repeat
    (which then checks nothing again); the output is each sequence run alone through a bshd twin
    of the module, and the gap rows' NaN never reaches a valid row."""
    from transformer_engine.pytorch.attention import rotary
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa_module
    from transformer_engine.pytorch.attention.dot_product_attention.prepare import fast_path
    from transformer_engine.pytorch.attention.dot_product_attention.prepare import call as prepare
    from transformer_engine.pytorch.attention.dot_product_attention.prepare import packed_seqs as thd

    counts = {"prepare_sides": 0, "sides_of": 0, "full path": 0}

    def counted(name, fn):
        def spy(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return spy

    for module in (rotary, prepare):
        monkeypatch.setattr(module, "prepare_sides", counted("prepare_sides", thd.prepare_sides))
    monkeypatch.setattr(fast_path, "sides_of", counted("sides_of", thd.sides_of))
    monkeypatch.setattr(dpa_module, "prepare", counted("full path", prepare.prepare))
    torch.manual_seed(3)
    kw = dict(attention_dropout=0.0, fuse_qkv_params=True, params_dtype=torch.float64, device="cpu")
    mha = MultiheadAttention(HID, H, attn_mask_type="padding_causal", qkv_format="thd", **kw)
    twin = MultiheadAttention(HID, H, attn_mask_type="causal", qkv_format="bshd", **kw)
    twin.load_state_dict(mha.state_dict())
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.outer(torch.arange(8, dtype=torch.float64), inv)
    freqs = torch.cat([angles, angles], dim=-1).view(8, 1, 1, D)
    for step, (lengths, gaps) in enumerate((([3, 5, 2], [1, 0, 2]), ([6, 1, 4], [0, 1, 1]))):
        cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
        off = torch.tensor([0] + list(itertools.accumulate(n + g for n, g in zip(lengths, gaps))), dtype=torch.int32)
        x = torch.randn(int(off[-1]), HID, dtype=torch.float64)
        valid = torch.cat([torch.tensor([True] * n + [False] * g) for n, g in zip(lengths, gaps)])
        x[~valid] = float("nan")
        before = dict(counts)
        out = mha(x, rotary_pos_emb=freqs, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=off,
                  cu_seqlens_kv_padded=off, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        # The second batch (same token count) repeats the first one's decisions: the fast path.
        assert {name: counts[name] - before[name] for name in counts} == {"prepare_sides": 1, "sides_of": 0,
                                                                          "full path": 1 - step}
        want = torch.cat([twin(x[int(o): int(o) + n].unsqueeze(0), rotary_pos_emb=freqs)[0] for o, n in zip(off[:-1], lengths)])
        torch.testing.assert_close(out[valid], want, rtol=1e-12, atol=1e-12)


def test_multihead_thd_rotary_without_cu_seqlens_is_named():
    from transformer_engine.pytorch import MultiheadAttention

    mha = MultiheadAttention(32, 4, qkv_format="thd", attn_mask_type="padding")
    with pytest.raises(ValueError, match="qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv"):
        mha(torch.randn(10, 32), rotary_pos_emb=torch.randn(16, 1, 1, 8))


def test_rotary_table_shorter_than_a_sequence_is_named():
    """MultiheadAttention's THD rotary positions index rotary_pos_emb: a table shorter than the
    longest sequence is named on the CPU (on CUDA it is clamped, never an out-of-range index)."""
    from transformer_engine.pytorch import MultiheadAttention

    mha = MultiheadAttention(32, 4, qkv_format="thd", attn_mask_type="padding")
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    with pytest.raises(ValueError, match="rotary_pos_emb must hold a row for every position: a sequence reaches position 5"):
        mha(torch.randn(10, 32), rotary_pos_emb=torch.randn(4, 1, 1, 8), **kw)
    assert mha(torch.randn(10, 32), rotary_pos_emb=torch.randn(6, 1, 1, 8), **kw).shape == (10, 32)
