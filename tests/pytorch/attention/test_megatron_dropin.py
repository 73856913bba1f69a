"""megatron-core 0.16's TEDotProductAttention, unchanged, on this package (CPU, gloo): sbhd and
THD (PackedSeqParams with and without padded offsets), GQA, TP=1 and TP=2, and a small GPT of
megatron's local layers with TEDotProductAttention as core attention that trains."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from .dist_helpers import run_distributed
from .packing import make_thd
from .reference import reference_dense, reference_thd

warnings.filterwarnings("ignore", message=".*Apex.*")
from megatron.core.extensions.transformer_engine import TEDotProductAttention  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

H, G, D = 4, 2, 8


def _config(tp: int = 1, heads: int = H, groups: int = G) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=heads * D, num_attention_heads=heads, num_query_groups=groups,
                             kv_channels=D, attention_dropout=0.0, tensor_model_parallel_size=tp,
                             use_cpu_initialization=True, params_dtype=torch.float64)


def _attention(tp: int = 1, groups: int = G, pg_collection=None) -> TEDotProductAttention:
    return TEDotProductAttention(_config(tp, groups=groups), layer_number=1, attn_mask_type=AttnMaskType.causal,
                                 attention_type="self", pg_collection=pg_collection)


def _sbhd(seed: int, s: int = 6, b: int = 2, groups: int = G):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, b, n, D, generator=g, dtype=torch.float64) for n in (H, groups, groups)]


def _sbhd_reference(q, k, v):
    ref = reference_dense(*(t.transpose(0, 1) for t in (q, k, v)), "causal", None, 1 / math.sqrt(D))
    return ref.transpose(0, 1).reshape(q.shape[0], q.shape[1], -1)


@pytest.mark.parametrize("groups", [G, H], ids=["gqa", "mha"])
def test_sbhd_matches_reference(groups):
    q, k, v = _sbhd(0, groups=groups)
    attn = _attention(groups=groups)
    assert attn.tp_size == 1 and attn.num_gqa_groups == groups
    out = attn(q, k, v, None, AttnMaskType.causal)
    torch.testing.assert_close(out, _sbhd_reference(q, k, v))


@pytest.mark.parametrize("padded", [False, True], ids=["no_padded_offsets", "padded_offsets"])
def test_thd_packed_seq_params_match_reference(padded):
    p = make_thd([3, 5, 2], gaps_q=[1, 0, 2] if padded else None, h=H, hg=G, d=D)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=p.cu_q, cu_seqlens_kv=p.cu_kv,
                             cu_seqlens_q_padded=p.off_q if padded else None,
                             cu_seqlens_kv_padded=p.off_kv if padded else None, max_seqlen_q=5, max_seqlen_kv=5)
    # megatron turns 'causal' into 'padding_causal' for THD before calling TE.
    out = _attention()(p.q, p.k, p.v, None, AttnMaskType.causal, packed_seq_params=params)
    ref = reference_thd(p.q.detach(), p.k.detach(), p.v.detach(), p.cu_q, p.cu_kv, p.off_q, p.off_kv,
                        ["padding_causal"] * 3, [None] * 3, 1 / math.sqrt(D))
    torch.testing.assert_close(out, ref.reshape(out.shape))
    out.sum().backward()
    assert torch.isfinite(p.q.grad[p.valid_q]).all() and (p.q.grad[~p.valid_q] == 0).all()


def _tp2_body(rank: int, world: int) -> None:
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection(tp=dist.group.WORLD, cp=None, hcp=None)
    attn = _attention(tp=world, pg_collection=pgs)
    assert (attn.tp_size, attn.num_attention_heads_per_partition, attn.num_gqa_groups_per_partition) == (2, H // 2, G // 2)
    hs, gs = slice(rank * H // 2, (rank + 1) * H // 2), slice(rank * G // 2, (rank + 1) * G // 2)
    cols = slice(rank * H // 2 * D, (rank + 1) * H // 2 * D)
    # sbhd: every rank passes its own heads and gets the same columns of the full result.
    q, k, v = _sbhd(1)
    full = _attention()(q, k, v, None, AttnMaskType.causal)
    mine = attn(q[:, :, hs], k[:, :, gs], v[:, :, gs], None, AttnMaskType.causal)
    torch.testing.assert_close(mine, full[..., cols])
    torch.testing.assert_close(mine, _sbhd_reference(q, k, v)[..., cols])
    # THD with padded offsets.
    p = make_thd([4, 2], gaps_q=[2, 1], h=H, hg=G, d=D, seed=3)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=p.cu_q, cu_seqlens_kv=p.cu_kv, cu_seqlens_q_padded=p.off_q,
                             cu_seqlens_kv_padded=p.off_kv, max_seqlen_q=4, max_seqlen_kv=4)
    q, k, v = (t.detach() for t in (p.q, p.k, p.v))
    full = _attention()(q, k, v, None, AttnMaskType.causal, packed_seq_params=params)
    mine = attn(q[:, hs], k[:, gs], v[:, gs], None, AttnMaskType.causal, packed_seq_params=params)
    torch.testing.assert_close(mine, full[:, cols])


def test_tensor_parallel_2_ranks_each_get_their_head_slice():
    run_distributed(_tp2_body, 2)


def test_tp_group_world_size_must_divide_the_groups():
    with pytest.raises(ValueError, match="num_gqa_groups=2 must be divisible by the tensor-parallel size 4"):
        _attention(tp=4)


def _gpt_body(rank: int, world: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.extensions.transformer_engine import TEDotProductAttention as TEDPA
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, hidden_dropout=0.0,
                            attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32)
    layer = get_gpt_layer_local_spec()
    layer.submodules.self_attention.submodules.core_attention = TEDPA
    # The final norm defaults to TE's LayerNorm, a stand-in here: use megatron's torch norm.
    spec = TransformerBlockSubmodules(layer_specs=[layer] * 2, layer_norm=WrappedTorchNorm)
    model = GPTModel(cfg, spec, vocab_size=64, max_sequence_length=16, position_embedding_type="learned_absolute")
    assert all(isinstance(m.self_attention.core_attention, TEDPA) for m in model.decoder.layers)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 64, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    losses = []
    for _ in range(5):
        loss = model(tokens, positions, None, labels=torch.roll(tokens, -1, 1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses), losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    parallel_state.destroy_model_parallel()


def test_small_gpt_with_te_core_attention_trains():
    run_distributed(_gpt_body, 1)
