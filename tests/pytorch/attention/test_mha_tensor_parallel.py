"""MultiheadAttention in TE's argument order (TransformerLayer's positional call), and tensor
parallelism: a TP=2 module on gloo, given the TP=1 module's weights split column/row-wise,
reproduces the TP=1 output and gradients (with and without sequence parallelism)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from transformer_engine.pytorch import MultiheadAttention

from .dist_helpers import run_distributed

HID, H, D, S, B = 32, 4, 8, 6, 2


def test_transformer_layer_positional_call():
    """TE's TransformerLayer passes the first seven arguments positionally."""
    init = lambda w: torch.nn.init.constant_(w, 0.01)  # noqa: E731
    out_init = lambda w: torch.nn.init.constant_(w, -0.02)  # noqa: E731
    mha = MultiheadAttention(HID, H, D, 0.0, 1e-3, init, out_init, layer_number=3, input_layernorm=True,
                             params_dtype=torch.float64, device="cpu")
    qkv = mha.layernorm_qkv
    assert qkv.eps == 1e-3 and mha.layer_number == 3
    assert (qkv.query_weight == 0.01).all() and (qkv.value_weight == 0.01).all() and (mha.proj.weight == -0.02).all()
    assert (qkv.query_bias == 0).all() and (mha.proj.bias == 0).all() and (qkv.layer_norm_weight == 1).all()
    x = torch.randn(S, B, HID, dtype=torch.float64)
    # All keys get the same score, so each query averages the value rows it may see (causal).
    normed = torch.nn.functional.layer_norm(x, (HID,), eps=1e-3)
    v = normed @ qkv.value_weight.T
    avg = v.cumsum(0) / torch.arange(1, S + 1, dtype=torch.float64).view(S, 1, 1)
    torch.testing.assert_close(mha(x), mha.proj(avg))


def test_return_bias_and_layernorm_output_in_te_order():
    mha = MultiheadAttention(HID, H, attention_dropout=0.0, input_layernorm=True, return_bias=True,
                             return_layernorm_output=True, params_dtype=torch.float64, device="cpu")
    torch.nn.init.normal_(mha.proj.bias)
    torch.nn.init.normal_(mha.layernorm_qkv.layer_norm_bias)
    x = torch.randn(S, B, HID, dtype=torch.float64)
    out, bias, ln = mha(x)
    assert bias is mha.proj.bias
    qkv = mha.layernorm_qkv
    torch.testing.assert_close(ln, torch.nn.functional.layer_norm(x, (HID,), qkv.layer_norm_weight, qkv.layer_norm_bias))
    mha.return_bias, mha.return_layernorm_output = False, False
    torch.testing.assert_close(mha(x), out + bias)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(fuse_wgrad_accumulation=True), NotImplementedError, r"fuse_wgrad_accumulation=True is not implemented"),
    (dict(ub_overlap_ag=True), NotImplementedError, r"ub_overlap_ag=True is not implemented"),
    (dict(zero_centered_gamma=True), NotImplementedError, r"zero_centered_gamma=True is not implemented"),
    (dict(rotary_pos_interleaved=True), NotImplementedError, r"rotary_pos_interleaved=True"),
    (dict(qk_norm_type="RMSNorm"), NotImplementedError, r"qk_norm_type='RMSNorm' is not implemented"),
    (dict(tp_size=2), ValueError, r"tensor-parallel size of 2 \(tp_size / tp_group\) needs set_parallel_mode=True"),
    (dict(tp_size=3, set_parallel_mode=True), ValueError, r"num_attention_heads=4 must be divisible by the tensor-parallel size 3"),
    (dict(layer_number=0), ValueError, r"layer_number must be a positive int or None; got 0"),
    (dict(return_layernorm_output=True), ValueError, r"return_layernorm_output=True needs input_layernorm=True"),
])
def test_unsupported_and_bad_arguments_are_named(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        MultiheadAttention(HID, H, device="cpu", **kwargs)


def _rows(w: torch.Tensor, parts, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of a weight whose rows are the concatenation of blocks ``parts``
    (row counts), each block split evenly over the ranks."""
    out, start = [], 0
    for n in parts:
        out.append(w[start + rank * n // world : start + (rank + 1) * n // world])
        start += n
    return torch.cat(out)


def _shard_state_dict(full: dict, hg: int, interleaved: bool, rank: int, world: int) -> dict:
    """A rank's TE-layout state dict from the tp=1 one: column-parallel rows by head/group
    (fused non-interleaved QKV: each of its q/k/v blocks), ``proj.weight``'s columns by head,
    the norm, ``proj.bias`` and the extra states whole."""
    q_rows, kv_rows = H * D, hg * D
    qkv_blocks = [q_rows + 2 * kv_rows] if interleaved else [q_rows, kv_rows, kv_rows]
    fused_blocks = {"qkv.": qkv_blocks, "layernorm_qkv.": qkv_blocks,
                    "key_value.": [2 * kv_rows] if interleaved else [kv_rows, kv_rows]}
    shard = {}
    for key, value in full.items():
        prefix, name = key.rsplit(".", 1)[0] + ".", key.rsplit(".", 1)[1]
        if prefix == "proj." and name == "weight":
            value = _rows(value.T, [q_rows], rank, world).T
        elif prefix != "proj." and name in ("weight", "bias"):
            value = _rows(value, fused_blocks.get(prefix, [value.shape[0]]), rank, world)
        elif name.endswith(("_weight", "_bias")) and not name.startswith("layer_norm"):  # split query/key/value
            value = _rows(value, [value.shape[0]], rank, world)
        shard[key] = value
    return shard


def _joined_grad(projection) -> torch.Tensor:
    """The gradient of a projection's whole weight (its blocks' gradients, top to bottom)."""
    return torch.cat([getattr(projection, name).grad for name in projection.weight_names])


CASES = [  # (attention_type, fuse_qkv_params, qkv_weight_interleaved, hg, input_layernorm)
    ("self", False, True, 2, False),
    ("self", True, True, 2, True),
    ("self", True, False, 4, False),
    ("cross", True, False, 2, False),
    ("self", True, False, 2, True),
    ("cross", False, True, 2, True),
]


def _tp_case(rank, world, case, sequence_parallel):
    attention_type, fuse, interleaved, hg, ln = case
    kwargs = dict(kv_channels=D, attention_dropout=0.0, num_gqa_groups=hg, input_layernorm=ln, attention_type=attention_type,
                  fuse_qkv_params=fuse, qkv_weight_interleaved=interleaved, bias=True, params_dtype=torch.float64,
                  device="cpu", attn_mask_type="causal" if attention_type == "self" else "no_mask")
    torch.manual_seed(0)
    full = MultiheadAttention(HID, H, **kwargs)
    for p in full.parameters():
        torch.nn.init.normal_(p, std=0.3)
    part = MultiheadAttention(HID, H, set_parallel_mode=True, tp_group=dist.group.WORLD,
                              sequence_parallel=sequence_parallel, **kwargs)
    # Each rank loads its TE-layout shard strictly (every key present, every shape right).
    part.load_state_dict(_shard_state_dict(full.state_dict(), hg, interleaved and fuse, rank, world), strict=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(S, B, HID, dtype=torch.float64, generator=g)
    enc = torch.randn(S + 2, B, HID, dtype=torch.float64, generator=g) if attention_type == "cross" else None
    grad = torch.randn(S, B, HID, dtype=torch.float64, generator=g)
    x_full = x.clone().requires_grad_()
    out_full = full(x_full, encoder_output=enc)
    out_full.backward(grad)
    mine = slice(rank * S // world, (rank + 1) * S // world) if sequence_parallel else slice(None)
    x_part = x[mine].clone().requires_grad_()
    enc_part = None if enc is None else enc[slice(rank * (S + 2) // world, (rank + 1) * (S + 2) // world) if sequence_parallel else slice(None)]
    out = part(x_part, encoder_output=enc_part)
    torch.testing.assert_close(out, out_full[mine])
    out.backward(grad[mine])
    torch.testing.assert_close(x_part.grad, x_full.grad[mine])
    q_name = {("self", True): "layernorm_qkv", ("self", False): "qkv", ("cross", True): "layernorm_query",
              ("cross", False): "query_layer"}[attention_type, ln]
    got, want = _joined_grad(getattr(part, q_name)), _joined_grad(getattr(full, q_name))
    parts = [H * D, hg * D, hg * D] if attention_type == "self" and not (fuse and interleaved) else [want.shape[0]]
    torch.testing.assert_close(got, _rows(want, parts, rank, world))
    torch.testing.assert_close(part.proj.weight.grad, _rows(full.proj.weight.grad.T, [H * D], rank, world).T)
    bias_grad = part.proj.bias.grad.clone()
    if sequence_parallel:  # each rank saw its own tokens; the framework sums these grads (as for TE)
        dist.all_reduce(bias_grad)
    torch.testing.assert_close(bias_grad, full.proj.bias.grad)


def _tp_body(rank, world):
    for case in CASES:
        for sequence_parallel in (False, True):
            try:
                _tp_case(rank, world, case, sequence_parallel)
            except Exception as e:
                raise AssertionError(f"case {case}, sequence_parallel={sequence_parallel}: {e}") from e


def test_tp2_matches_tp1_with_split_weights():
    run_distributed(_tp_body, 2)


def test_tp_group_outside_an_initialized_process_group_counts_as_one_rank():
    mha = MultiheadAttention(HID, H, tp_group=object(), set_parallel_mode=False, device="cpu")
    assert mha.tp_size == 1 and mha.core_attention.tp_size == 1
