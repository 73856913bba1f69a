"""flash-attn-4 (4.0.0b36), ``flash_attn.cute.interface``: the private ``_flash_attn_fwd`` and
``_flash_attn_bwd`` the package calls, keyword-only, with b36's keyword names.

Semantics (the library's, as the package relies on them): varlen calls take physical offsets as
``cu_seqlens_*`` and valid lengths as ``seqused_*``; dense calls [B, S, H, D]; a KV cache comes
dense [B, S, H, D] with ``cu_seqlens_k`` None, or paged (pools [P, page, H, D] and
``page_table``); causal is bottom-right; windows ``window_size_left/right`` (None: unbounded);
the output, the LSE ([H, T] varlen, [B, H, S] dense) and dQ/dK/dV (allocated where not given) are written only in the rows
of the sequences run; K/V are read in whole tiles past each sequence end; the backward works from the LSE it is handed
and, with ``learnable_sink``, returns the sink's gradient fourth. An entry with query rows but no
keys gets output 0 (probed on the H200: benchmarks/attention/probe_kv_zeroing.py). A sequence with keys but no
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


def _q_rows(kw: dict, name: str, b: int, start: int, n: int) -> torch.Tensor:
    """A view of sequence b's query-side rows [start, start + n) of ``kw[name]``: of entry b
    (dense, ``cu_seqlens_q`` None) or of the packed rows."""
    t = kw[name]
    return t[b, start : start + n] if kw.get("cu_seqlens_q") is None else t[start : start + n]


def _lse_rows(kw: dict, b: int, start: int, n: int) -> torch.Tensor:
    return kw["lse"][b, :, :n] if kw.get("cu_seqlens_q") is None else kw["lse"][:, start : start + n]


def _kv_rows(kw: dict, name: str, b: int, start: int, m: int) -> torch.Tensor:
    """Sequence b's key-side rows of ``kw[name]`` as FA4 reads them: its m rows and then on to
    the end of the last tile (weight 0 in the products, read all the same). Packed rows from
    ``start``; entry b of a dense batch or KV cache (``cu_seqlens_k`` None); or a paged cache's
    pools [P, page, H, D] through ``page_table[b]``."""
    t, table = kw[name], kw.get("page_table")
    if table is not None:
        page = t.shape[1]
        end = tile_end(0, m, table.shape[1] * page)  # capped at the pages' rows
        return t[table[b, : -(-end // page)].long()].flatten(0, 1)[:end]
    if kw.get("cu_seqlens_k") is None:
        return t[b, : tile_end(0, m, t.shape[1])]
    return t[start : tile_end(start, m, t.shape[0])]


def _allocated_fwd(kw: dict) -> dict:
    """The forward's keywords with the buffers FA4 allocates where none is given: the output
    (empty, the q rows by v's head dim) and the LSE ([H, T] varlen, [B, H, S] dense) where
    return_lse or an input requires grad (FA4 4.0.0b36's rule)."""
    q, v = kw["q"], kw["v"]
    kw = dict(kw)
    if kw.get("out") is None:
        kw["out"] = q.new_empty(*q.shape[:-1], v.shape[-1])
    grads = any(t is not None and t.requires_grad for t in (q, kw["k"], v, kw.get("learnable_sink")))
    if kw.get("lse") is None and (kw["return_lse"] or grads):
        shape = (q.shape[-2], q.shape[0]) if kw.get("cu_seqlens_q") is not None else (q.shape[0], q.shape[2], q.shape[1])
        kw["lse"] = q.new_empty(shape, dtype=torch.float32)
    return kw


class FA4Library:
    """The stand-in; ``calls`` holds ("fwd" | "bwd", the keyword arguments) per call."""

    def __init__(self) -> None:
        self.calls: List[Tuple[str, dict]] = []
        self.lse_allocated: List[bool] = []  # per forward: whether the stand-in allocated an LSE (FA4's rule)

    def of(self, direction: str) -> List[dict]:
        return [kw for d, kw in self.calls if d == direction]

    @staticmethod
    def _sequences(kw: dict) -> Iterator[Seq]:
        q, k = kw["q"], kw["k"]
        cu_q, cu_k = kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k")
        used_q, used_k = kw.get("seqused_q"), kw.get("seqused_k")
        for b in range(q.shape[0] if cu_q is None else cu_q.numel() - 1):
            qa, ka = (0 if cu_q is None else int(cu_q[b])), (0 if cu_k is None else int(cu_k[b]))
            n = int(used_q[b]) if used_q is not None else (q.shape[1] if cu_q is None else int(cu_q[b + 1]) - qa)
            m = int(used_k[b]) if used_k is not None else (k.shape[1] if cu_k is None else int(cu_k[b + 1]) - ka)
            if cu_q is not None:
                assert n <= kw["max_seqlen_q"] and m <= kw["max_seqlen_k"], "max_seqlen below a sequence's length"
            yield b, qa, ka, n, m

    @staticmethod
    def _mask(kw: dict, n: int, m: int, width: int) -> torch.Tensor:
        """Bottom-right band over the first m of ``width`` keys read; a causal call has right bound 0."""
        left = -1 if kw["window_size_left"] is None else kw["window_size_left"]
        right = 0 if kw["causal"] else (-1 if kw["window_size_right"] is None else kw["window_size_right"])
        return widen(band(n, m, left, right, m - n), width)

    @torch.no_grad()  # a kernel: its writes carry no autograd history (a caller must give the output its own)
    def _flash_attn_fwd(self, *args, **kw):
        _check("_flash_attn_fwd", args, kw, FWD_KEYWORDS)
        self.calls.append(("fwd", kw))  # the keywords as passed (None buffers: allocated below, as FA4 does)
        passed_lse = kw["lse"]
        kw = _allocated_fwd(kw)
        self.lse_allocated.append(passed_lse is None and kw["lse"] is not None)
        for b, qa, ka, n, m in self._sequences(kw):
            if n == 0:
                continue  # skipped: its rows stay as they were
            k, v = _kv_rows(kw, "k", b, ka, m), _kv_rows(kw, "v", b, ka, m)
            out, lse = forward(_q_rows(kw, "q", b, qa, n), k, v, self._mask(kw, n, m, k.shape[0]), kw["softmax_scale"],
                               sink=kw.get("learnable_sink"))
            _q_rows(kw, "out", b, qa, n).copy_(out)
            if kw["lse"] is not None:
                _lse_rows(kw, b, qa, n).copy_(lse)
        return kw["out"], kw["lse"], None, None, None

    @torch.no_grad()
    def _flash_attn_bwd(self, *args, **kw):
        _check("_flash_attn_bwd", args, kw, BWD_KEYWORDS)
        self.calls.append(("bwd", kw))
        kw = dict(kw, **{g: torch.empty_like(kw[t]) for g, t in (("dq", "q"), ("dk", "k"), ("dv", "v")) if kw.get(g) is None})
        sink = kw.get("learnable_sink")
        dsink = None if sink is None else torch.zeros(sink.shape, dtype=torch.float32, device=sink.device)
        for b, qa, ka, n, m in self._sequences(kw):
            dk, dv = _kv_rows(kw, "dk", b, ka, m)[:m], _kv_rows(kw, "dv", b, ka, m)[:m]
            if n == 0:
                dk.zero_()
                dv.zero_()
                continue
            k, v = _kv_rows(kw, "k", b, ka, m), _kv_rows(kw, "v", b, ka, m)
            grads = backward(_q_rows(kw, "dout", b, qa, n), _q_rows(kw, "q", b, qa, n), k, v, _q_rows(kw, "out", b, qa, n),
                             _lse_rows(kw, b, qa, n), self._mask(kw, n, m, k.shape[0]), kw["softmax_scale"], sink=sink)
            _q_rows(kw, "dq", b, qa, n).copy_(grads[0])
            dk.copy_(grads[1][:m])
            dv.copy_(grads[2][:m])
            if dsink is not None:
                dsink += grads[4].float()
        return (kw["dq"], kw["dk"], kw["dv"]) if dsink is None else (kw["dq"], kw["dk"], kw["dv"], dsink)


def install(monkeypatch) -> FA4Library:
    lib = FA4Library()
    stand_in_module(monkeypatch, "flash_attn")
    stand_in_module(monkeypatch, "flash_attn.cute")
    interface = stand_in_module(monkeypatch, "flash_attn.cute.interface")
    monkeypatch.setattr(interface, "_flash_attn_fwd", lib._flash_attn_fwd, raising=False)
    monkeypatch.setattr(interface, "_flash_attn_bwd", lib._flash_attn_bwd, raising=False)
    return lib
