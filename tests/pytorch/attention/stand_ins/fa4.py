"""flash-attn-4 (4.0.0b36), ``flash_attn.cute.interface``: the private ``_flash_attn_fwd`` and
``_flash_attn_bwd`` the package calls, keyword-only, with b36's keyword names.

Semantics (the library's, as the package relies on them): varlen calls take physical offsets as
``cu_seqlens_*`` and valid lengths as ``seqused_*``; dense calls [B, S, H, D]; causal is
bottom-right; windows ``window_size_left/right`` (None: unbounded); the output, the LSE ([H, T]
varlen, [B, H, S] dense) and dQ/dK/dV are written only in the rows of the sequences run; K/V
are read in whole tiles past each sequence end; the backward works from the LSE it is handed
and, with ``learnable_sink``, returns the sink's gradient fourth. A sequence with keys but no
query rows gets dK = dV = 0 (assumed, as kernels looping over key blocks write them; a
context-parallel step can give a sequence no query rows)."""

from __future__ import annotations

from typing import Iterator, List, Tuple

import torch

from ..reference import band
from . import stand_in_module
from .rows import backward, forward, tile_end, widen

FWD_KEYWORDS = frozenset({  # flash-attn-4 4.0.0b36, flash_attn/cute/interface.py: _flash_attn_fwd
    "q", "k", "v", "qv", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k",
    "min_seqlen_k", "page_table", "softmax_scale", "causal", "softcap", "window_size_left", "window_size_right",
    "learnable_sink", "tile_mn", "mma_pv_is_rs", "intra_wg_overlap", "num_threads", "num_splits", "pack_gqa", "_arch",
    "score_mod", "mask_mod", "block_sparse_tensors", "return_lse", "out", "lse", "aux_tensors", "aux_scalars",
    "q_descale", "k_descale", "v_descale", "gather_kv_indices", "scheduler_metadata", "seqlen_k_per_split",
    "disable_scheduler_metadata", "gather_bwd_recompute_p"})
BWD_KEYWORDS = frozenset({  # ... and _flash_attn_bwd
    "q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "softcap", "window_size_left", "window_size_right",
    "m_block_size", "n_block_size", "num_threads", "pack_gqa", "num_stages_Q", "num_stages_dO", "SdP_swapAB",
    "dKV_swapAB", "dQ_swapAB", "AtomLayoutMSdP", "AtomLayoutNdKV", "AtomLayoutMdQ", "V_in_regs", "cu_seqlens_q",
    "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k", "deterministic", "dq", "dk", "dv",
    "score_mod", "score_mod_bwd", "mask_mod", "aux_tensors", "aux_scalars", "block_sparse_tensors", "dlse",
    "learnable_sink"})

Seq = Tuple[int, int, int, int, int]  # (batch index, first q row, first kv row, q rows, kv rows)


def _check(name: str, args: tuple, kwargs: dict, accepted: frozenset) -> None:
    if args:
        raise TypeError(f"{name} is called by keyword here; got {len(args)} positional arguments")
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise TypeError(f"{name}() got unexpected keyword arguments {unknown}")


def _rows(t: torch.Tensor, dense: bool, b: int, start: int, n: int) -> torch.Tensor:
    """A view of sequence b's rows [start, start + n): of entry b (dense) or of the packed rows."""
    return t[b, start : start + n] if dense else t[start : start + n]


def _lse_rows(lse: torch.Tensor, dense: bool, b: int, start: int, n: int) -> torch.Tensor:
    return lse[b, :, :n] if dense else lse[:, start : start + n]


class FA4Library:
    """The stand-in; ``calls`` holds ("fwd" | "bwd", the keyword arguments) per call."""

    def __init__(self) -> None:
        self.calls: List[Tuple[str, dict]] = []

    def of(self, direction: str) -> List[dict]:
        return [kw for d, kw in self.calls if d == direction]

    @staticmethod
    def _sequences(kw: dict) -> Iterator[Seq]:
        q, k = kw["q"], kw["k"]
        used_q, used_k = kw.get("seqused_q"), kw.get("seqused_k")
        if kw.get("cu_seqlens_q") is None:  # dense: one sequence per batch entry
            for b in range(q.shape[0]):
                yield b, 0, 0, q.shape[1], k.shape[1] if used_k is None else int(used_k[b])
            return
        cu_q, cu_k = kw["cu_seqlens_q"], kw["cu_seqlens_k"]
        for b in range(cu_q.numel() - 1):
            qa, ka = int(cu_q[b]), int(cu_k[b])
            n = int(used_q[b]) if used_q is not None else int(cu_q[b + 1]) - qa
            m = int(used_k[b]) if used_k is not None else int(cu_k[b + 1]) - ka
            assert n <= kw["max_seqlen_q"] and m <= kw["max_seqlen_k"], "max_seqlen below a sequence's length"
            yield b, qa, ka, n, m

    @staticmethod
    def _mask(kw: dict, n: int, m: int) -> torch.Tensor:
        """Bottom-right band; a causal call has right bound 0."""
        left = -1 if kw["window_size_left"] is None else kw["window_size_left"]
        right = 0 if kw["causal"] else (-1 if kw["window_size_right"] is None else kw["window_size_right"])
        return band(n, m, left, right, m - n)

    def _tiles(self, kw: dict, dense: bool, b: int, ka: int, m: int):
        """(k rows, v rows, their mask columns' count) of a whole-tile read of keys [ka, ka + m)."""
        end = tile_end(ka, m, kw["k"].shape[1] if dense else kw["k"].shape[0])
        return _rows(kw["k"], dense, b, ka, end - ka), _rows(kw["v"], dense, b, ka, end - ka), end - ka

    def _flash_attn_fwd(self, *args, **kw):
        _check("_flash_attn_fwd", args, kw, FWD_KEYWORDS)
        assert kw["return_lse"] == (kw["lse"] is not None), "return_lse must say whether an lse buffer is given"
        self.calls.append(("fwd", kw))
        dense, out, lse = kw.get("cu_seqlens_q") is None, kw["out"], kw["lse"]
        for b, qa, ka, n, m in self._sequences(kw):
            if n == 0:
                continue  # skipped: its rows stay as they were
            k, v, width = self._tiles(kw, dense, b, ka, m)
            o, row_lse = forward(_rows(kw["q"], dense, b, qa, n), k, v, widen(self._mask(kw, n, m), width),
                                 kw["softmax_scale"], sink=kw.get("learnable_sink"))
            _rows(out, dense, b, qa, n).copy_(o)
            if lse is not None:
                _lse_rows(lse, dense, b, qa, n).copy_(row_lse)
        return out, lse

    def _flash_attn_bwd(self, *args, **kw):
        _check("_flash_attn_bwd", args, kw, BWD_KEYWORDS)
        self.calls.append(("bwd", kw))
        dense, sink = kw.get("cu_seqlens_q") is None, kw.get("learnable_sink")
        dq, dk, dv = kw["dq"], kw["dk"], kw["dv"]
        dsink = None if sink is None else torch.zeros(sink.shape, dtype=torch.float32, device=sink.device)
        for b, qa, ka, n, m in self._sequences(kw):
            if n == 0:
                _rows(dk, dense, b, ka, m).zero_()
                _rows(dv, dense, b, ka, m).zero_()
                continue
            k, v, width = self._tiles(kw, dense, b, ka, m)
            rows_q = [_rows(kw[name], dense, b, qa, n) for name in ("dout", "q")]
            grads = backward(rows_q[0], rows_q[1], k, v, _rows(kw["out"], dense, b, qa, n),
                             _lse_rows(kw["lse"], dense, b, qa, n), widen(self._mask(kw, n, m), width), kw["softmax_scale"],
                             sink=sink)
            _rows(dq, dense, b, qa, n).copy_(grads[0])
            _rows(dk, dense, b, ka, m).copy_(grads[1][:m])
            _rows(dv, dense, b, ka, m).copy_(grads[2][:m])
            if dsink is not None:
                dsink += grads[4].float()
        return (dq, dk, dv) if dsink is None else (dq, dk, dv, dsink)


def install(monkeypatch) -> FA4Library:
    lib = FA4Library()
    stand_in_module(monkeypatch, "flash_attn")
    stand_in_module(monkeypatch, "flash_attn.cute")
    interface = stand_in_module(monkeypatch, "flash_attn.cute.interface")
    monkeypatch.setattr(interface, "_flash_attn_fwd", lib._flash_attn_fwd, raising=False)
    monkeypatch.setattr(interface, "_flash_attn_bwd", lib._flash_attn_bwd, raising=False)
    return lib
