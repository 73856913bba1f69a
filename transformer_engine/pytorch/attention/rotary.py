"""Rotary position embeddings for MultiheadAttention: rotate-half RoPE, with each row's
position taken from the packed (THD) metadata and, under context parallelism, from the rank's
share of the global sequence."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .dot_product_attention.cp.partition import dense_positions, positions_of_local_rows
from .dot_product_attention.prepare.packed_seqs import PackedSeqs, prepare_sides, value_checks_on


def rotate_packed(packed: dict, rope, fmt: str, cp: Tuple[int, int], cus, max_seqlens, pad_between) -> dict:
    """DotProductAttention's q/k/v keywords with q and k rotated (RoPE acts on q and k
    separately, so this is the sliced path). THD: the packed metadata built here for the
    positions is handed to DotProductAttention (``_packed_seqs``), which would otherwise build it
    again from the same arguments. Under context parallelism (``cp`` = (size, rank)) each local
    row is rotated by its GLOBAL position (the rank holds chunks r and 2cp-1-r of every
    sequence), as TE does, and nothing is handed over: DotProductAttention prepares the global
    metadata over every rank's rows."""
    q, k, v = split_packed(packed)
    q_freqs, k_freqs = rope if isinstance(rope, tuple) else (rope, rope)
    out = {}
    q_pos = k_pos = None
    if fmt == "thd" and cp[0] > 1:
        q_pos, k_pos = _thd_cp_positions(q, k, cus, pad_between, cp)
    elif fmt == "thd":
        # DotProductAttention's own preparation (checks and, on CUDA, bounds), done once.
        sides = prepare_sides(cus, max_seqlens, pad_between, (q.shape[0], k.shape[0]), q.device)
        q_pos, k_pos = _positions(sides[0]), _positions(sides[1])
        out["_packed_seqs"] = sides
    elif cp[0] > 1:
        seq_dim = 0 if fmt == "sbhd" else 1
        q_freqs = cp_dense_freqs(q_freqs, q.shape[seq_dim], cp)
        k_freqs = cp_dense_freqs(k_freqs, k.shape[seq_dim], cp)
    out.update(query_layer=apply_rotary_pos_emb(q, q_freqs, fmt, q_pos),
               key_layer=apply_rotary_pos_emb(k, k_freqs, fmt, k_pos), value_layer=v)
    return out


def rotate_cached_step(packed: dict, rope, fmt: str, inference_params) -> dict:
    """DotProductAttention's q/k/v keywords with q and k rotated for a KV-cache step: each new
    token at its position in its sequence, the sequence's cached length before the step plus
    its index in the step (TE's ``start_positions=inference_params.get_seqlens_pre_step()``),
    from the step's device lengths (no host sync; CUDA graphs replay it as lengths change)."""
    q, k, v = split_packed(packed)
    q_freqs, k_freqs = rope if isinstance(rope, tuple) else (rope, rope)
    lead = q.shape[:-2]
    positions = inference_params.step_positions(fmt, lead).pos.view(lead)  # the append reads them too
    return dict(query_layer=apply_rotary_pos_emb(q, q_freqs, fmt, positions),
                key_layer=apply_rotary_pos_emb(k, k_freqs, fmt, positions), value_layer=v)


def _thd_cp_positions(q: torch.Tensor, k: torch.Tensor, cus, pad_between, cp: Tuple[int, int]):
    """Under context parallelism: the global position within its sequence of every local q and
    k row (0 on rows outside any sequence). The same checks (and, on CUDA, bounds) as
    DotProductAttention's; a length can be no more than the global rows, which stands in for
    the max_seqlen rotary does not need."""
    size, rank = cp
    totals = (q.shape[0] * size, k.shape[0] * size)  # the offsets index global rows
    pq, pk = prepare_sides(cus, totals, pad_between, totals, q.device)
    return tuple(positions_of_local_rows(p.offsets.long(), p.seqlens().long(), size, rank, t.shape[0])
                 for p, t in ((pq, q), (pk, k)))


def cp_dense_freqs(freqs: torch.Tensor, local_len: int, cp: Tuple[int, int]) -> torch.Tensor:
    """The rows of ``freqs`` for a rank's bshd/sbhd rows under context parallelism."""
    size, rank = cp
    if freqs.shape[0] < local_len * size:
        raise ValueError(f"rotary_pos_emb must hold a row for every position: the global sequence has {local_len * size} "
                         f"positions ({local_len} local rows x cp size {size}) but rotary_pos_emb has {freqs.shape[0]} rows")
    return freqs.index_select(0, dense_positions(local_len, size, rank, freqs.device))


def split_packed(packed: dict):
    """q, k, v of DotProductAttention's keywords (views of a declared packed buffer)."""
    if "qkv_layer" in packed:
        t, dim = packed["qkv_layer"], packed["qkv_interleave_dim"]
        return tuple(t.select(dim, i) for i in range(3))
    if "kv_layer" in packed:
        t, dim = packed["kv_layer"], packed["qkv_interleave_dim"]
        return (packed["query_layer"], t.select(dim, 0), t.select(dim, 1))
    return packed["query_layer"], packed["key_layer"], packed["value_layer"]


def _positions(p: PackedSeqs) -> torch.Tensor:
    """Position of each token row within its sequence (0 on rows outside any sequence)."""
    seq = p.token_seq_ids().clamp(0, max(p.batch_size - 1, 0))
    rows = torch.arange(p.total_tokens, device=p.offsets.device)
    return torch.where(p.token_valid(), rows - p.offsets.long()[seq], 0) if p.batch_size else rows * 0


def _bounded_positions(positions: torch.Tensor, available: int) -> torch.Tensor:
    """Positions must index ``rotary_pos_emb``: checked where reading values is free (CPU, or
    NVTE_ATTN_VALIDATE=1), clamped on the device otherwise (an index past the end would be a
    device-side assert that ends the CUDA context)."""
    if value_checks_on(positions.device):
        if positions.numel() and int(positions.max()) >= available:
            raise ValueError(f"rotary_pos_emb must hold a row for every position: a sequence reaches position "
                             f"{int(positions.max())} but rotary_pos_emb has {available} rows")
        return positions
    return positions.clamp(max=max(available - 1, 0))


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, fmt: str, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotate-half RoPE on the first ``freqs.shape[-1]`` channels; ``freqs`` is [S, 1, 1, R].
    ``positions`` (``t.shape[:-2]``; required for thd): each token's position, else the
    positions of the sequence dim."""
    if positions is not None:
        f = freqs[_bounded_positions(positions, freqs.shape[0])].view(*t.shape[:-2], 1, -1)
    elif fmt == "sbhd":
        f = freqs[: t.shape[0]]
    else:
        f = freqs[: t.shape[1]].transpose(0, 1)
    rot = f.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    out = x * f.cos().to(t.dtype) + rotated * f.sin().to(t.dtype)
    return torch.cat((out, rest), dim=-1)
