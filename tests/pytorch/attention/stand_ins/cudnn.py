"""cuDNN (nvidia-cudnn-frontend 1.32): the SDPA graphs ``backends/cudnn/graphs.py`` builds and
runs, emulated. The package's ops (``ops.py``: variant packs, ragged offsets, stats, the max
logit) and its mask-band translation (``graphs.band_kwargs``, through a stand-in ``cudnn``
module's ``diagonal_alignment``) run for real; ``build_fwd`` / ``build_bwd`` record the
configuration and return an emulated graph whose ``execute(pack)`` reads and writes the
variant pack by uid, as the real graph does.

Semantics: q/k/v/o are [B, H, S, D] over the tensors' strides, a varlen call's ragged offsets
are ELEMENT offsets (token offset x token stride) and its per-sequence lengths INT32; the band
is sdpa's (alignment TOP_LEFT / BOTTOM_RIGHT, a left bound that counts the diagonal itself:
window_left + 1, a right bound); a post-scale bias [B|1, H|1, SQ, SKV] or [1, 1, 1, SKV];
ALiBi with the standard slopes, placed on the band's diagonal; ``sink_token`` [1, H, 1, 1]
and its gradient; stats [B, H, SQ, 1] (each row's log-sum-exp) or, for the max logit, the row
max and sum of exponents, the row max of a row past a sequence's length left as GARBAGE.
A query row that sees no key is left unwritten in the output (as cuDNN leaves it); a sequence
with an empty side writes nothing at all (stricter than cuDNN, which writes zero gradients
there), so the package must not hand such rows an empty buffer. Dropout is recorded (its seed
and offset in the pack) but not applied: its values are checked on the GPU."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch

from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import graphs
from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.graphs import UID

from ..reference import alibi_bias, band, standard_slopes
from . import stand_in_module
from .rows import backward, forward, max_and_sum_exp

GARBAGE = 1e30
ALIGNMENT = types.SimpleNamespace(TOP_LEFT="TOP_LEFT", BOTTOM_RIGHT="BOTTOM_RIGHT")


@dataclass
class Graph:
    """One built graph: its configuration as build_fwd / build_bwd received it."""

    direction: str  # "fwd" | "bwd"
    b: int
    sq: int
    skv: int
    scale: float
    band: dict
    varlen: bool
    padded: bool
    features: tuple  # (bias, alibi, dropout_p, sink) as the op passed them
    with_max: bool = False
    grads: tuple = (None, None)  # the backward's (dbias, dsink) outputs, None where not asked for
    deterministic: bool = False

    @property
    def bottom_right(self) -> bool:
        return self.band["diagonal_alignment"] == ALIGNMENT.BOTTOM_RIGHT

    @property
    def window(self) -> Tuple[int, int]:
        """(left, right) in TE's terms (-1 unbounded), from sdpa's band bounds."""
        left, right = self.band["diagonal_band_left_bound"], self.band["diagonal_band_right_bound"]
        return (-1 if left is None else left - 1), (-1 if right is None else right)

    def _sequences(self, pack: dict) -> Iterator[Tuple[int, slice, slice, int, int]]:
        """(index, the q rows' index, the kv rows' index, n, m) per sequence."""
        q, k = pack[UID["q"]], pack[UID["k"]]
        lens = [pack[UID[n]].view(-1) if UID[n] in pack else None for n in ("len_q", "len_kv")]
        for i in range(self.b):
            if self.varlen:  # ragged element offsets back to rows
                qa, ka = int(pack[UID["rq"]].view(-1)[i]) // q.stride(0), int(pack[UID["rk"]].view(-1)[i]) // k.stride(0)
                n, m = int(lens[0][i]), int(lens[1][i])
                yield i, slice(qa, qa + n), slice(ka, ka + m), n, m
            else:
                n = q.shape[1] if lens[0] is None else int(lens[0][i])
                m = k.shape[1] if lens[1] is None else int(lens[1][i])
                yield i, (i, slice(0, n)), (i, slice(0, m)), n, m

    def _scores_args(self, pack: dict, i: int, n: int, m: int, h: int):
        """(allowed [n, m], bias [h, n, m] or None, sink [h] or None) of sequence i."""
        left, right = self.window
        shift = m - n if self.bottom_right else 0
        bias = None
        if UID["bias"] in pack:
            full = pack[UID["bias"]]
            bias = full[i if full.shape[0] > 1 else 0].expand(h, full.shape[2], full.shape[3])[:, :n, :m]
        elif self.features[1]:  # ALiBi, on the band's diagonal
            bias = alibi_bias(n, m, "causal_bottom_right" if self.bottom_right else "causal", standard_slopes(h))
        sink = pack[UID["sink"]].view(-1) if UID["sink"] in pack else None
        return band(n, m, left, right, shift), bias, sink

    def execute(self, pack: dict) -> None:
        (self._forward if self.direction == "fwd" else self._backward)(pack)

    def _forward(self, pack: dict) -> None:
        q, k, v, out = (pack[UID[n]] for n in ("q", "k", "v", "o"))
        h = q.shape[-2]
        for i, rq, rk, n, m in self._sequences(pack):
            if self.with_max:
                pack[UID["max"]][i, :, n:, 0] = GARBAGE
            if not (n and m):
                continue
            ok, bias, sink = self._scores_args(pack, i, n, m, h)
            o, lse = forward(q[rq], k[rk], v[rk], ok, self.scale, bias, sink)
            seen = ok.any(dim=1)  # a row that sees no key is left unwritten
            out[rq][seen] = o[seen].to(out.dtype)
            if not self.with_max:
                pack[UID["stats"]][i, :, :n, 0] = lse.float()
                continue
            row_max, sum_exp = max_and_sum_exp(q[rq], k[rk], ok, self.scale, bias, sink)
            pack[UID["max"]][i, :, :n, 0][:, seen] = row_max[:, seen].float()
            pack[UID["sum_exp"]][i, :, :n, 0][:, seen] = sum_exp[:, seen].float()

    def _backward(self, pack: dict) -> None:
        q, k, v, out, dout, stats = (pack[UID[n]] for n in ("q", "k", "v", "o", "do", "stats"))
        dq, dk, dv = (pack[UID[n]] for n in ("dq", "dk", "dv"))
        dbias, dsink = pack.get(UID["dbias"]), pack.get(UID["dsink"])
        for i, rq, rk, n, m in self._sequences(pack):
            if not (n and m):
                continue
            ok, bias, sink = self._scores_args(pack, i, n, m, q.shape[-2])
            gq, gk, gv, ds, gsink = backward(dout[rq], q[rq], k[rk], v[rk], out[rq], stats[i, :, :n, 0], ok, self.scale,
                                             bias, sink)
            dq[rq], dk[rk], dv[rk] = gq.to(dq.dtype), gk.to(dk.dtype), gv.to(dv.dtype)
            if dbias is not None:
                _add_bias_grad(dbias[i if dbias.shape[0] > 1 else 0], ds, n, m)
            if dsink is not None:
                dsink.view(-1).add_(gsink.float())


def _add_bias_grad(target: torch.Tensor, ds: torch.Tensor, n: int, m: int) -> None:
    """Add dS [h, n, m] into one entry's dbias [h|1, sq|1, skv], summed over broadcast dims."""
    if target.shape[0] == 1:
        ds = ds.sum(0, keepdim=True)
    if target.shape[1] == 1:
        target[:, :, :m] += ds.sum(1, keepdim=True).to(target.dtype)
    else:
        target[:, :n, :m] += ds.to(target.dtype)


class CudnnLibrary:
    """The stand-in; ``builds`` holds every built :class:`Graph`, ``runs`` every (graph, pack)."""

    def __init__(self) -> None:
        self.builds: List[Graph] = []
        self.runs: List[Tuple[Graph, dict]] = []

    def of(self, direction: str) -> List[Tuple[Graph, dict]]:
        return [(g, pack) for g, pack in self.runs if g.direction == direction]

    def build_fwd(self, handle, q, k, v, o, b, sq, skv, scale, band_, varlen, padded, features, with_max):
        self.builds.append(Graph("fwd", b, sq, skv, scale, band_, varlen, padded, features, with_max))
        return self.builds[-1]

    def build_bwd(self, handle, q, k, v, o, do, dq, dk, dv, grads, b, sq, skv, scale, band_, varlen, padded, deterministic,
                  features):
        self.builds.append(Graph("bwd", b, sq, skv, scale, band_, varlen, padded, features, grads=grads,
                                 deterministic=deterministic))
        return self.builds[-1]

    def run_graph(self, key, build, pack: dict, device) -> None:
        graph = build(None)
        self.runs.append((graph, pack))
        graph.execute(pack)


def install(monkeypatch) -> CudnnLibrary:
    lib = CudnnLibrary()
    module = stand_in_module(monkeypatch, "cudnn")
    monkeypatch.setattr(module, "diagonal_alignment", ALIGNMENT, raising=False)
    for name in ("build_fwd", "build_bwd", "run_graph"):
        monkeypatch.setattr(graphs, name, getattr(lib, name))
    return lib


def pack_of(pack: dict, name: str) -> Optional[torch.Tensor]:
    """A variant pack's tensor by uid name (None when the graph has no such input)."""
    return pack.get(UID[name])


def offsets_of(pack: dict, side: str) -> torch.Tensor:
    """A varlen run's start rows of side "q" or "k", from its ragged element offsets."""
    return pack[UID["r" + side]].view(-1) // pack[UID[side]].stride(0)


def lengths_of(pack: dict, side: str) -> Optional[torch.Tensor]:
    """A run's per-sequence lengths of side "q" or "kv" (None: no lengths in the graph)."""
    t = pack.get(UID["len_" + side])
    return None if t is None else t.view(-1)
