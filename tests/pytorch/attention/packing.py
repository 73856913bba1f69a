"""Test helpers that build packed (THD) batches, with NaN poured into every gap row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class Packed:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_kv: torch.Tensor
    off_q: torch.Tensor
    off_kv: torch.Tensor
    valid_q: torch.Tensor
    valid_kv: torch.Tensor

    def fill_outside(self, value: float) -> "Packed":
        """Put ``value`` in every row outside the sequences (a finite one: a batch that declares
        no gaps promises readable rows past its last sequence, which whole-tile kernels read)."""
        with torch.no_grad():
            self.q[~self.valid_q] = value
            self.k[~self.valid_kv] = value
            self.v[~self.valid_kv] = value
        return self

    def kwargs(self, gaps: bool, max_q: int, max_kv: int, shared: bool = False) -> dict:
        kw = dict(cu_seqlens_q=self.cu_q, cu_seqlens_kv=self.cu_q if shared else self.cu_kv, max_seqlen_q=max_q, max_seqlen_kv=max_kv)
        if gaps:
            kw.update(cu_seqlens_q_padded=self.off_q, cu_seqlens_kv_padded=self.off_q if shared else self.off_kv)
        return kw


def _offsets(lengths: List[int], gaps: Optional[List[int]]):
    cu, off, valid = [0], [0], []
    for i, n in enumerate(lengths):
        g = gaps[i] if gaps else 0
        cu.append(cu[-1] + n)
        off.append(off[-1] + n + g)
        valid += [True] * n + [False] * g
    return cu, off, valid


def make_thd(lengths_q, lengths_kv=None, gaps_q=None, gaps_kv=None, h=4, hg=4, d=8, dv=None, dtype=torch.float64,
             device="cpu", tail=0, seed=0) -> Packed:
    """Packed q/k/v with each sequence followed by its gap; gap and tail rows are NaN."""
    lengths_kv = lengths_q if lengths_kv is None else lengths_kv
    gaps_kv = gaps_q if gaps_kv is None and lengths_kv is lengths_q else gaps_kv
    cu_q, off_q, valid_q = _offsets(lengths_q, gaps_q)
    cu_kv, off_kv, valid_kv = _offsets(lengths_kv, gaps_kv)
    valid_q += [False] * tail
    valid_kv += [False] * tail
    g = torch.Generator().manual_seed(seed)
    def rand(n, heads, dim, valid):
        t = torch.randn(n, heads, dim, generator=g, dtype=torch.float64)
        t[~torch.tensor(valid, dtype=torch.bool)] = float("nan")
        return t.to(dtype=dtype, device=device).requires_grad_()
    q = rand(len(valid_q), h, d, valid_q)
    k = rand(len(valid_kv), hg, d, valid_kv)
    v = rand(len(valid_kv), hg, dv or d, valid_kv)
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return Packed(q, k, v, as_i32(cu_q), as_i32(cu_kv), as_i32(off_q), as_i32(off_kv),
                  torch.tensor(valid_q, device=device), torch.tensor(valid_kv, device=device))


# ------------------------------------------------------------------ gaps against the same batch packed without them

GAP_CASES = [
    # (mask, window, hg, cross)
    ("padding", None, 4, False),
    ("padding_causal", None, 2, False),
    ("padding_causal", (3, 0), 1, False),
    ("padding_causal_bottom_right", None, 4, True),
    ("padding", (2, 1), 2, True),
    ("padding_causal", None, 4, True),  # top-left cross: distinct q and kv offsets
]


def check_gaps_vs_dense_packing(label, p: Packed, lengths_q, lengths_kv, mask, window, hg, d, tol, shared, heads=4):
    """Run ``p`` (NaN in every gap) on backend ``label`` and the same sequences packed without
    gaps: output and gradient rows in the gaps exactly 0 and finite, valid rows equal."""
    from transformer_engine.pytorch import DotProductAttention

    from .gpu_helpers import grads_of, rel_err, run_on

    dpa = DotProductAttention(heads, d, num_gqa_groups=hg, qkv_format="thd", attn_mask_type=mask, window_size=window)
    kwargs = p.kwargs(True, max(lengths_q), max(lengths_kv), shared=shared)
    # FlashAttention aligns causal masks bottom-right only: top-left causal cross-attention is
    # refused by selection (its reason), and the test skips with that reason.
    top_left_cross = mask in ("padding_causal", "causal") and not shared and label.startswith("FlashAttention")
    out = run_on(label, dpa, p.q, p.k, p.v, expect_refusal="with sq != skv possible" if top_left_cross else None, **kwargs)
    g = torch.randn_like(out)
    grads = grads_of(out, [p.q, p.k, p.v], g)
    packed = [t.detach()[m].clone().requires_grad_() for t, m in ((p.q, p.valid_q), (p.k, p.valid_kv), (p.v, p.valid_kv))]
    plain = dict(cu_seqlens_q=p.cu_q, cu_seqlens_kv=p.cu_q if shared else p.cu_kv,
                 max_seqlen_q=max(lengths_q), max_seqlen_kv=max(lengths_kv))
    ref = run_on(label, dpa, *packed, **plain)
    ref_grads = grads_of(ref, packed, g[p.valid_q])
    assert torch.all(out[~p.valid_q] == 0) and torch.isfinite(out).all()
    assert rel_err(out[p.valid_q], ref) <= tol
    for got, want, valid in zip(grads, ref_grads, (p.valid_q, p.valid_kv, p.valid_kv)):
        assert torch.isfinite(got).all() and torch.all(got[~valid] == 0)
        assert rel_err(got[valid], want) <= tol * 4
