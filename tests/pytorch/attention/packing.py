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
