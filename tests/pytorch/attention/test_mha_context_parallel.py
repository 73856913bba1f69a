"""MultiheadAttention under context parallelism on gloo (CPU, float64).

Each rank feeds its share of the hidden states (the zigzag split: chunks r and 2cp-1-r of every
sequence or slot) to a copy of one module; its output rows and input-gradient rows must equal
the single-process module on the whole batch, and the weight gradients summed over ranks must
equal the single-process weight gradients. Rotary embeddings must rotate every local row by its
GLOBAL position, so the comparison fails if a rank rotates by its local row index.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from transformer_engine.pytorch import MultiheadAttention, partition_for_context_parallel

from .dist_helpers import run_distributed

HID, H, D = 16, 4, 8


@dataclass(frozen=True)
class MHACase:
    id: str
    comm: str
    fmt: str = "thd"
    rope: bool = True
    fuse_qkv: bool = True
    hg: int = H
    interleaved: bool = True
    mask: str = "padding_causal"


CASES = [
    MHACase("thd-p2p-rope-fused", "p2p"),
    MHACase("thd-p2p-rope-gqa", "p2p", hg=2, fuse_qkv=False),
    MHACase("thd-ag-packed-no-rope", "all_gather", rope=False, interleaved=False),
    MHACase("thd-a2a-rope-gqa-fused", "a2a", hg=2),
    MHACase("sbhd-p2p-rope", "p2p", fmt="sbhd", mask="causal"),
    MHACase("sbhd-a2a-rope-fused", "a2a", fmt="sbhd", mask="causal", interleaved=False),
    MHACase("bshd-ag-rope", "all_gather", fmt="bshd", mask="causal", fuse_qkv=False),
]


def _freqs(n: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    return torch.cat([angles, angles], dim=-1).view(n, 1, 1, D)


def _thd_batch(cp: int) -> Tuple[torch.Tensor, dict, torch.Tensor]:
    """Three sequences with gaps (slots divisible by 2 x cp); hidden states finite everywhere
    (a NaN pad row would reach the weight gradients through the projections' products)."""
    m = 2 * cp
    lengths = [5, 3 * m + 1, 2]
    slots = [0]
    for n in lengths:
        slots.append(slots[-1] + (-(-n // m) + 1) * m)  # always a gap
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pad = torch.tensor(slots, dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(slots[-1], HID, generator=g, dtype=torch.float64)
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=pad, cu_seqlens_kv_padded=pad,
                  max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    return x, kwargs, pad


def _dense_batch(cp: int, fmt: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 4 * cp, HID, generator=g, dtype=torch.float64)
    return x.transpose(0, 1).contiguous() if fmt == "sbhd" else x


def _split(x: torch.Tensor, case: MHACase, cp: int, rank: int, slots: Optional[torch.Tensor]) -> torch.Tensor:
    return partition_for_context_parallel(x, cp, rank, case.fmt, slots)


def _run(mha, x, dout, kwargs, rope) -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    x = x.detach().clone().requires_grad_()
    out = mha(x, rotary_pos_emb=rope, **kwargs)
    (out * dout).sum().backward()
    return out.detach(), x.grad, [p.grad for p in mha.parameters()]


def _one_case(case: MHACase, rank: int, world: int) -> None:
    torch.manual_seed(11)
    mha = MultiheadAttention(HID, H, D, attention_dropout=0.0, num_gqa_groups=case.hg, fuse_qkv_params=case.fuse_qkv,
                             qkv_weight_interleaved=case.interleaved, qkv_format=case.fmt, attn_mask_type=case.mask,
                             params_dtype=torch.float64, device="cpu")
    with torch.no_grad():
        for p in mha.parameters():  # non-zero biases, so bias gradients and rows are compared too
            p.add_(0.01 * torch.randn_like(p))
    local_mha = copy.deepcopy(mha)
    local_mha.set_context_parallel_group(dist.group.WORLD, list(range(world)), None, case.comm)
    if case.fmt == "thd":
        x, kwargs, slots = _thd_batch(world)
    else:
        x, kwargs, slots = _dense_batch(world, case.fmt), {}, None
    dout = torch.randn(x.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    rope = _freqs(64) if case.rope else None
    out, dx, grads = _run(mha, x, dout, kwargs, rope)
    local = lambda t: _split(t, case, world, rank, slots)  # noqa: E731
    got_out, got_dx, got_grads = _run(local_mha, local(x), local(dout), kwargs, rope)
    torch.testing.assert_close(got_out, local(out), rtol=1e-10, atol=1e-10, msg=lambda m: f"{case.id} out, rank {rank}: {m}")
    torch.testing.assert_close(got_dx, local(dx), rtol=1e-10, atol=1e-10, msg=lambda m: f"{case.id} dx, rank {rank}: {m}")
    names = [n for n, _ in mha.named_parameters()]
    for name, got, want in zip(names, got_grads, grads):
        dist.all_reduce(got)  # each rank's rows contribute their part of the weight gradient
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=lambda m: f"{case.id} d{name}, rank {rank}: {m}")


def _body(rank: int, world: int, case_ids: List[str]) -> None:
    for case in CASES:
        if case.id in case_ids:
            _one_case(case, rank, world)


def test_mha_context_parallel_world2():
    """Every case in one spawn (spawning costs more than the cases)."""
    run_distributed(_body, 2, [c.id for c in CASES])


@pytest.mark.parametrize("fmt", ["thd", "sbhd"])
def test_rope_positions_are_global_under_cp(fmt):
    """Single process, by hand: the rotary rows a rank uses are its rows' global positions."""
    from transformer_engine.pytorch.attention.dot_product_attention.cp.partition import (dense_positions,
                                                                                       positions_of_local_rows)

    if fmt == "sbhd":
        assert dense_positions(4, 2, 0, "cpu").tolist() == [0, 1, 6, 7]
        assert dense_positions(4, 2, 1, "cpu").tolist() == [2, 3, 4, 5]
        return
    # slots of 8 and 4 rows (sequences of 7 and 2 tokens), cp 2: rank 0 holds global rows
    # 0 1 6 7 | 8 11, rank 1 rows 2 3 4 5 | 9 10; row 7 (position 7) and 11 (position 3) are padding.
    slots, lengths = torch.tensor([0, 8, 12]), torch.tensor([7, 2])
    assert positions_of_local_rows(slots, lengths, 2, 0, 6).tolist() == [0, 1, 6, 0, 0, 0]
    assert positions_of_local_rows(slots, lengths, 2, 1, 6).tolist() == [2, 3, 4, 5, 1, 0]


def test_rope_too_short_for_the_global_sequence():
    from transformer_engine.pytorch.attention.rotary import cp_dense_freqs

    with pytest.raises(ValueError, match=r"rotary_pos_emb must hold a row for every position: the global sequence has 8 "
                                         r"positions \(4 local rows x cp size 2\) but rotary_pos_emb has 6 rows"):
        cp_dense_freqs(_freqs(6), 4, (2, 1))


def test_cp_rank_of_a2a_p2p_groups():
    """The rank MultiheadAttention rotates for is the CP rank the data is partitioned for:
    p2p_rank * a2a_size + a2a_rank under a2a+p2p."""
    from transformer_engine.pytorch.attention.dot_product_attention.cp.context_parallel import make_cp_config
    from transformer_engine.pytorch.attention.dot_product_attention.cp.comm import CPComm

    class Fake(CPComm):
        def __init__(self, size: int, rank: int) -> None:  # no process group behind it
            self.group, self.size, self.rank, self.backend, self.stream = None, size, rank, "none", None

    cfg = make_cp_config([Fake(2, 1), Fake(3, 2)], None, None, "a2a+p2p")
    assert (cfg.size, cfg.rank) == (6, 5)
    assert make_cp_config(Fake(4, 3), None, None, "p2p").rank == 3
