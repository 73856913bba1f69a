"""megatron-core 0.16's TEDotProductAttention, unchanged, on this package (CPU, gloo): sbhd and
THD (PackedSeqParams with and without padded offsets), GQA, TP=1 and TP=2, and a small GPT of
megatron's local layers with TEDotProductAttention as core attention that trains."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from .dist_helpers import check_body, run_bodies
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


def test_tensor_parallel_2_ranks_each_get_their_head_slice(world2):
    check_body(world2, "tp2")


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


def test_small_gpt_with_te_core_attention_trains(world1):
    check_body(world1, "gpt")


# ---------------------------------------------------------------------------------- megatron's dynamic CP switch


def _cp_thd(world: int):
    """Three sequences with gaps, every slot divisible by 2 x world (4, 8, 4 rows)."""
    return make_thd([3, 5, 2], gaps_q=[1, 3, 2], h=H, hg=G, d=D, seed=11)


def _thd_reference(p, dout):
    """The global output and dq/dk/dv of the float64 reference (megatron makes THD causal
    'padding_causal')."""
    leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]
    out = reference_thd(*leaves, p.cu_q, p.cu_kv, p.off_q, p.off_kv, ["padding_causal"] * 3, [None] * 3, 1 / math.sqrt(D))
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def _thd_call(attn, p, dout, params, share):
    """One megatron call on this rank's rows (``share(x)``); its output and dq/dk/dv."""
    leaves = [share(t.detach()).requires_grad_() for t in (p.q, p.k, p.v)]
    out = attn(*leaves, None, AttnMaskType.causal, packed_seq_params=params)
    out.backward(share(dout).reshape(out.shape))
    return [out.detach().view(-1, H, D)] + [t.grad for t in leaves]


def _dynamic_cp_body(rank: int, world: int) -> None:
    """megatron-core's TEDotProductAttention built without CP (context_parallel_size=1), then
    given PackedSeqParams that switch CP on (cp_group) and off (local_cp_size=1, or a group of
    one rank) call by call; every call matches the reference on the rows the rank passed."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from transformer_engine.pytorch import partition_for_context_parallel

    singles = [dist.new_group([r]) for r in range(world)]  # every rank makes every group, in one order
    attn = _attention(pg_collection=ProcessGroupCollection(tp=singles[rank], cp=None, hcp=None))
    assert (attn.cp_group, attn.cp_global_ranks, attn.cp_stream, attn.cp_comm_type) == (None, None, None, "p2p")
    p = _cp_thd(world)
    dout = torch.randn(p.q.shape, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    want = _thd_reference(p, dout)
    # As megatron's get_thd_batch_on_this_cp_rank builds them: one tensor for both sides.
    meta = dict(qkv_format="thd", cu_seqlens_q=p.cu_q, cu_seqlens_kv=p.cu_q, cu_seqlens_q_padded=p.off_q,
                cu_seqlens_kv_padded=p.off_q, max_seqlen_q=5, max_seqlen_kv=5)
    mine = lambda x: partition_for_context_parallel(x, world, rank, "thd", p.off_q)  # noqa: E731
    whole = lambda x: x  # noqa: E731
    calls = [("on", PackedSeqParams(**meta, cp_group=dist.group.WORLD, local_cp_size=world), mine),
             ("off: local_cp_size=1", PackedSeqParams(**meta, local_cp_size=1), whole),
             ("on again", PackedSeqParams(**meta, cp_group=dist.group.WORLD, local_cp_size=world), mine),
             ("off: a group of one rank", PackedSeqParams(**meta, cp_group=singles[rank], local_cp_size=1), whole)]
    for what, params, share in calls:
        got = _thd_call(attn, p, dout, params, share)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, share(b), rtol=1e-10, atol=1e-10, msg=lambda m: f"CP {what}, {name}, rank {rank}: {m}")
        assert torch.all(got[0][~share(p.valid_q)] == 0), f"CP {what}: a padding row is not 0 on rank {rank}"
        assert attn.cp_group is params.cp_group and attn.cp_comm_type == "p2p"
    assert attn.cp_global_ranks == [rank] and attn.cp_config.size == 1  # the last call's group of one rank
    _dynamic_cp_sbhd(attn, rank, world)


def _dynamic_cp_sbhd(attn, rank: int, world: int) -> None:
    """sbhd, as megatron's get_batch_on_this_hybrid_cp_rank passes it: one sample, its global
    length in separate cu_seqlens tensors, the CP group and local_cp_size."""
    import torch.distributed as dist

    from transformer_engine.pytorch import partition_for_context_parallel

    q, k, v = _sbhd(13, s=8, b=1)
    want = _sbhd_reference(q, k, v)
    ends = lambda: torch.tensor([0, 8], dtype=torch.int32)  # noqa: E731
    meta = dict(qkv_format="sbhd", cu_seqlens_q=ends(), cu_seqlens_kv=ends(), cu_seqlens_q_padded=ends(),
                cu_seqlens_kv_padded=ends(), max_seqlen_q=8, max_seqlen_kv=8)
    out = attn(*(partition_for_context_parallel(t, world, rank, "sbhd") for t in (q, k, v)), None, AttnMaskType.causal,
               packed_seq_params=PackedSeqParams(**meta, cp_group=dist.group.WORLD, local_cp_size=world))
    torch.testing.assert_close(out, partition_for_context_parallel(want, world, rank, "sbhd"), rtol=1e-10, atol=1e-10)
    out = attn(q, k, v, None, AttnMaskType.causal, packed_seq_params=PackedSeqParams(**meta, local_cp_size=1))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_dynamic_context_parallel_switch_one_rank(world1):
    check_body(world1, "dynamic_cp")


def test_dynamic_context_parallel_switch_two_ranks(world2):
    check_body(world2, "dynamic_cp")


def test_cp_attributes_keep_te_meaning():
    """The four CP attributes are plain, TE-named attributes read at each call: assigning
    cp_group=None directly (as TE's forward would read it) switches CP off."""
    from transformer_engine.pytorch import DotProductAttention
    from transformer_engine.pytorch.attention.dot_product_attention.cp.comm import CPComm

    class TwoRanks(CPComm):
        def __init__(self) -> None:  # no process group behind it
            self.group, self.size, self.rank, self.backend, self.stream = None, 2, 0, "none", None

    group = TwoRanks()
    dpa = DotProductAttention(H, D, num_gqa_groups=G, cp_group=group, cp_global_ranks=[3, 5], cp_comm_type="all_gather")
    assert (dpa.cp_group, dpa.cp_global_ranks, dpa.cp_stream, dpa.cp_comm_type) == (group, [3, 5], None, "all_gather")
    assert (dpa.cp_config.size, dpa.cp_config.comm_type, dpa.cp_config.global_ranks) == (2, "all_gather", (3, 5))
    dpa.cp_group = None
    assert dpa.cp_config is None
    q, k, v = _sbhd(14)
    torch.testing.assert_close(dpa(q, k, v), _sbhd_reference(q, k, v))
    dpa.set_context_parallel_group(group, None, None, "a2a")
    assert dpa.cp_comm_type == "a2a" and dpa.cp_config.comm_type == "a2a"
    with pytest.raises(ValueError, match="cp_comm_type must be one of p2p, all_gather, a2a, a2a\\+p2p; got 'ring'"):
        dpa.set_context_parallel_group(group, None, None, "ring")


# One spawn per world size runs every body of that size (each spawn imports megatron-core again).
@pytest.fixture(scope="module")
def world1():
    return run_bodies({"dynamic_cp": _dynamic_cp_body, "gpt": _gpt_body}, 1)


@pytest.fixture(scope="module")
def world2():
    return run_bodies({"tp2": _tp2_body, "dynamic_cp": _dynamic_cp_body}, 2)
