"""cuDNN (nvidia-cudnn-frontend): a stand-in ``cudnn`` module whose ``pygraph`` records what
``backends/cudnn/graphs.py`` declares and executes it in float64. The package's ops, graph
building and mask-band translation all run for real; ``sdpa`` and ``sdpa_backward`` take
cudnn-frontend's keyword names (an unknown one is a TypeError), and ``execute(pack)`` reads and
writes the variant pack by uid THROUGH the declarations: each tensor's dims and strides, its
ragged (element) offsets, the per-sequence lengths, a paged cache's block tables. A wrong stride,
offset or uid in graphs.py shows up as a wrong number.

Semantics (cuDNN's, as the package relies on them): q/k/v/o are [B, H, S, D]; the band is
sdpa's (``diagonal_alignment`` TOP_LEFT / BOTTOM_RIGHT, a left bound that counts the diagonal
itself, a right bound); a post-scale bias [B|1, H|1, SQ, SKV]; ALiBi with the standard slopes
on the band's diagonal; ``sink_token`` [1, H, 1, 1] and its gradient; stats [B, H, SQ, 1] (each
row's log-sum-exp) or, for the max logit, the row max and sum of exponents (the row max of a row
past a sequence's length left as GARBAGE). A query row that sees no key is left unwritten in the
output (as cuDNN leaves it); a sequence with an empty side writes nothing at all (stricter than
cuDNN, which writes zero gradients there), so the package must not hand such rows an empty
buffer. Dropout is recorded (its seed and offset in the pack) but not applied: its values are
checked on the GPU.

``sdpa_fp8`` and ``sdpa_fp8_backward`` (cudnn-frontend 1.32's FP8 nodes, their keyword names)
are recorded the same way and executed by :mod:`.cudnn_fp8_nodes`; their runs are told apart by
``Node.direction`` ("fp8_fwd", "fp8_bwd")."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import graphs
from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.graphs import UID

from ..reference import alibi_bias, band, standard_slopes
from . import stand_in_module
from .cudnn_fp8_nodes import fp8_backward, fp8_forward, fp8_modelled
from .rows import backward, forward, max_and_sum_exp

GARBAGE = 1e30


class _Names:
    """An enum of cudnn's: any member is its qualified name (``diagonal_alignment.TOP_LEFT``)."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix

    def __getattr__(self, name: str) -> str:
        return f"{self._prefix}.{name}"


class Tensor:
    """A cudnn_tensor: its declaration, as the setters leave it."""

    def __init__(self, name="", dim=None, stride=None, data_type=None, uid=None):
        self.name, self.dim, self.stride, self.data_type, self.uid = name, dim, stride, data_type, uid
        self.ragged: Optional[Tensor] = None
        self.output = False

    def set_ragged_offset(self, t: "Tensor") -> "Tensor":
        self.ragged = t
        return self

    def set_uid(self, uid: int) -> "Tensor":
        self.uid = uid
        return self

    def set_output(self, flag: bool) -> "Tensor":
        self.output = flag
        return self

    def set_dim(self, dim) -> "Tensor":
        self.dim = list(dim)
        return self

    def set_stride(self, stride) -> "Tensor":
        self.stride = list(stride)
        return self

    def set_data_type(self, data_type) -> "Tensor":
        self.data_type = data_type
        return self

    def view(self, pack: dict, b: int, rows: int) -> torch.Tensor:
        """Sequence (batch entry) b's first ``rows`` rows, [H, rows, D], a view of the pack's
        tensor through this declaration: its strides and its ragged offset, else b x stride 0."""
        base = pack[self.uid]
        _, h, s, d = self.dim
        assert rows <= s, f"{self.name}: {rows} rows past the declared {s}"
        offset = int(pack[self.ragged.uid].view(-1)[b]) if self.ragged is not None else b * self.stride[0]
        return torch.as_strided(base, (h, rows, d), self.stride[1:], base.storage_offset() + offset)


@dataclass
class Node:
    """One sdpa, sdpa_backward, sdpa_fp8 or sdpa_fp8_backward node: its tensors and arguments,
    by cudnn-frontend's names."""

    direction: str  # "fwd" | "bwd" | "fp8_fwd" | "fp8_bwd"
    tensors: dict  # q, k, v (o, dO, stats for the backward) and the tensor-valued arguments
    args: dict  # everything else, by name
    outputs: dict = field(default_factory=dict)  # o / stats, or dq / dk / dv

    @property
    def b(self) -> int:
        return self.tensors["q"].dim[0]

    @property
    def sq(self) -> int:
        return self.tensors["q"].dim[2]

    @property
    def skv(self) -> int:
        return self.tensors["k"].dim[2] if self.tensors.get("paged_attention_k_table") is None else self.args["paged_attention_max_seq_len_kv"]

    @property
    def bottom_right(self) -> bool:
        return self.args["diagonal_alignment"].endswith("BOTTOM_RIGHT")

    @property
    def window(self) -> Tuple[int, int]:
        """(left, right) in TE's terms (-1 unbounded): cuDNN's left bound counts the diagonal."""
        left, right = self.args["diagonal_band_left_bound"], self.args["diagonal_band_right_bound"]
        return (-1 if left is None else left - 1), (-1 if right is None else right)

    @property
    def varlen(self) -> bool:
        return self.tensors["q"].ragged is not None

    @property
    def padded(self) -> bool:
        return bool(self.args["use_padding_mask"])

    @property
    def alibi(self) -> bool:
        return bool(self.args["use_alibi_mask"])

    @property
    def dropout_p(self) -> float:
        return 0.0 if self.args["dropout"] is None else self.args["dropout"][0]

    @property
    def with_max(self) -> bool:
        return self.tensors.get("score_max") is not None

    def uid(self, name: str) -> Optional[int]:
        t = self.tensors.get(name)
        return None if t is None else t.uid


class Graph:
    """cudnn.pygraph: one sdpa, sdpa_backward, sdpa_fp8 or sdpa_fp8_backward node, executed per
    sequence in float64."""

    def __init__(self, library: "CudnnLibrary", handle=None, io_data_type=None, intermediate_data_type=None,
                 compute_data_type=None):
        self.library, self.node = library, None
        library.builds.append(self)

    def tensor(self, name="", dim=None, stride=None, data_type=None, uid=None) -> Tensor:
        return Tensor(name, list(dim), list(stride), data_type, uid)

    def sdpa(self, q, k, v, is_inference=None, attn_scale=None, bias=None, block_mask=None, use_alibi_mask=False,
             use_padding_mask=False, seq_len_q=None, seq_len_kv=None, use_causal_mask=False, use_causal_mask_bottom_right=False,
             sliding_window_length=None, diagonal_alignment=None, diagonal_band_left_bound=None, diagonal_band_right_bound=None,
             dropout=None, rng_dump=None, paged_attention_k_table=None, paged_attention_v_table=None,
             paged_attention_max_seq_len_kv=None, max_total_seq_len_q=None, max_total_seq_len_kv=None, compute_data_type=None,
             name="", score_mod=None, generate_stats=None, implementation=None, score_max=None, score_sum_exp=None,
             sink_token=None, unfuse_fma=False, cu_seq_len_q=None, cu_seq_len_kv=None, stats_use_log2=False):
        assert not (use_causal_mask or use_causal_mask_bottom_right or sliding_window_length), "the preferred band arguments only"
        assert (generate_stats is None) != (is_inference is None), "exactly one of generate_stats, is_inference"
        tensors = dict(q=q, k=k, v=v, bias=bias, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, score_max=score_max,
                       score_sum_exp=score_sum_exp, sink_token=sink_token, paged_attention_k_table=paged_attention_k_table,
                       paged_attention_v_table=paged_attention_v_table)
        self.node = Node("fwd", tensors, self._args(locals(), tensors))
        stats = Tensor("stats") if (generate_stats if generate_stats is not None else not is_inference) else None
        self.node.outputs = dict(o=Tensor("o"), stats=stats)
        return self.node.outputs["o"], stats

    def sdpa_backward(self, q, k, v, o, dO, stats, attn_scale=None, bias=None, dBias=None, use_alibi_mask=False,
                      use_padding_mask=False, seq_len_q=None, seq_len_kv=None, max_total_seq_len_q=None, max_total_seq_len_kv=None,
                      use_causal_mask=False, use_causal_mask_bottom_right=False, sliding_window_length=None,
                      diagonal_alignment=None, diagonal_band_left_bound=None, diagonal_band_right_bound=None, dropout=None,
                      rng_dump=None, use_deterministic_algorithm=False, compute_data_type=None, name="", score_mod=None,
                      score_mod_bprop=None, sink_token=None, dSink_token=None):
        assert not (use_causal_mask or use_causal_mask_bottom_right or sliding_window_length), "the preferred band arguments only"
        tensors = dict(q=q, k=k, v=v, o=o, dO=dO, stats=stats, bias=bias, dBias=dBias, seq_len_q=seq_len_q,
                       seq_len_kv=seq_len_kv, sink_token=sink_token, dSink_token=dSink_token)
        self.node = Node("bwd", tensors, self._args(locals(), tensors))
        self.node.outputs = dict(dq=Tensor("dq"), dk=Tensor("dk"), dv=Tensor("dv"))
        return self.node.outputs["dq"], self.node.outputs["dk"], self.node.outputs["dv"]

    def sdpa_fp8(self, q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o, is_inference=None, attn_scale=None,
                 bias=None, use_alibi_mask=False, use_padding_mask=False, seq_len_q=None, seq_len_kv=None, use_causal_mask=False,
                 use_causal_mask_bottom_right=False, sliding_window=None, diagonal_alignment=None, left_bound=None,
                 right_bound=None, dropout=None, rng_dump=None, paged_attention_k_table=None, paged_attention_v_table=None,
                 paged_attention_max_seq_len_kv=None, max_total_seq_len_q=None, max_total_seq_len_kv=None, compute_data_type=None,
                 name="", fn=None, generate_stats=None, score_max=None, score_sum_exp=None, sink_token=None, unfuse_fma=False,
                 implementation=None, cu_seq_len_q=None, cu_seq_len_kv=None, stats_use_log2=False):
        fp8_modelled(locals())
        assert (generate_stats is None) != (is_inference is None), "exactly one of generate_stats, is_inference"
        tensors = dict(q=q, k=k, v=v, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, descale_q=descale_q, descale_k=descale_k,
                       descale_v=descale_v, descale_s=descale_s, scale_s=scale_s, scale_o=scale_o)
        self.node = Node("fp8_fwd", tensors, self._args(locals(), tensors))
        stats = Tensor("stats") if (generate_stats if generate_stats is not None else not is_inference) else None
        self.node.outputs = dict(o=Tensor("o"), stats=stats, amax_s=Tensor("amax_s"), amax_o=Tensor("amax_o"))
        return tuple(self.node.outputs.values())

    def sdpa_fp8_backward(self, q, k, v, o, dO, stats, descale_q, descale_k, descale_v, descale_o, descale_dO, descale_s,
                          descale_dP, scale_s, scale_dQ, scale_dK, scale_dV, scale_dP, attn_scale=None, use_padding_mask=False,
                          seq_len_q=None, seq_len_kv=None, use_causal_mask=False, use_causal_mask_bottom_right=False,
                          diagonal_alignment=None, left_bound=None, right_bound=None, use_deterministic_algorithm=False,
                          dropout=None, compute_data_type=None, name="", sink_token=None, dSink_token=None,
                          max_total_seq_len_q=None, max_total_seq_len_kv=None):
        fp8_modelled(locals())
        tensors = {n: x for n, x in locals().items() if isinstance(x, Tensor)}
        self.node = Node("fp8_bwd", tensors, self._args(locals(), tensors))
        self.node.outputs = {n: Tensor(n) for n in ("dq", "dk", "dv", "amax_dQ", "amax_dK", "amax_dV", "amax_dP")}
        return tuple(self.node.outputs.values())

    @staticmethod
    def _args(given: dict, tensors: dict) -> dict:
        return {n: v for n, v in given.items() if n not in tensors and n != "self"}

    def validate(self):
        pass

    build_operation_graph = check_support = build_plans = validate

    def create_execution_plans(self, modes):
        pass

    def get_workspace_size(self) -> int:
        return 0

    @torch.no_grad()  # a kernel: its writes carry no autograd history (a caller must give the output its own)
    def execute(self, pack: dict, workspace=None, handle=None) -> None:
        self.library.runs.append((self.node, pack))
        _RUN[self.node.direction](self.node, pack)


def _sequences(node: Node, pack: dict):
    """(b, n, m) per batch entry: the per-sequence lengths where the padding mask is on, else
    the declared lengths."""
    lens = [pack[node.uid(n)].view(-1) if node.padded else None for n in ("seq_len_q", "seq_len_kv")]
    for b in range(node.b):
        yield b, (node.sq if lens[0] is None else int(lens[0][b])), (node.skv if lens[1] is None else int(lens[1][b]))


def _keys(node: Node, name: str, pack: dict, b: int, m: int) -> torch.Tensor:
    """Sequence b's first m keys or values, [H, m, D]: dense or ragged rows, or pages through
    the block table of a paged cache ([num_pages, H, page, D] pools)."""
    t, table = node.tensors[name], node.tensors.get(f"paged_attention_{name}_table")
    if table is None:
        return t.view(pack, b, m)
    pool, pages = pack[t.uid], pack[table.uid]
    _, h, page, d = t.dim
    sp, sh, ss, sd = t.stride
    rows = [torch.as_strided(pool, (h, d), (sh, sd), pool.storage_offset() + int(pages[b, 0, j // page, 0]) * sp + (j % page) * ss)
            for j in range(m)]
    return torch.stack(rows, dim=1) if rows else pool.new_zeros(h, 0, d)


def _score_args(node: Node, pack: dict, b: int, n: int, m: int, h: int):
    """(allowed [n, m], bias [h, n, m] or None, sink [h] or None) of batch entry b."""
    left, right = node.window
    shift = m - n if node.bottom_right else 0
    bias = None
    if node.uid("bias") is not None:
        full = pack[node.uid("bias")]
        bias = full[b if full.shape[0] > 1 else 0].expand(h, full.shape[2], full.shape[3])[:, :n, :m]
    elif node.alibi:  # cuDNN's ALiBi, on the band's diagonal
        bias = alibi_bias(n, m, "causal_bottom_right" if node.bottom_right else "causal", standard_slopes(h))
    sink = pack[node.uid("sink_token")].view(-1) if node.uid("sink_token") is not None else None
    return band(n, m, left, right, shift), bias, sink


def _t(x: torch.Tensor) -> torch.Tensor:
    """[H, n, D] (a graph's view) <-> [n, H, D] (the arithmetic's rows)."""
    return x.transpose(0, 1)


def _forward(node: Node, pack: dict) -> None:
    h = node.tensors["q"].dim[1]
    o = node.outputs["o"]
    for b, n, m in _sequences(node, pack):
        if node.with_max:
            pack[node.uid("score_max")][b, :, n:, 0] = GARBAGE
        if not (n and m):
            continue
        q, k, v = _t(node.tensors["q"].view(pack, b, n)), _t(_keys(node, "k", pack, b, m)), _t(_keys(node, "v", pack, b, m))
        ok, bias, sink = _score_args(node, pack, b, n, m, h)
        out, lse = forward(q, k, v, ok, node.args["attn_scale"], bias, sink)
        seen = ok.any(dim=1)  # a row that sees no key is left unwritten
        rows = o.view(pack, b, n)
        rows[:, seen] = _t(out[seen]).to(rows.dtype)
        if node.with_max:
            row_max, sum_exp = max_and_sum_exp(q, k, ok, node.args["attn_scale"], bias, sink)
            pack[node.uid("score_max")][b, :, :n, 0][:, seen] = row_max[:, seen].float()
            pack[node.uid("score_sum_exp")][b, :, :n, 0][:, seen] = sum_exp[:, seen].float()
        elif node.outputs["stats"] is not None:
            pack[node.outputs["stats"].uid][b, :, :n, 0] = lse.float()


def _backward(node: Node, pack: dict) -> None:
    h = node.tensors["q"].dim[1]
    dbias = pack[node.uid("dBias")] if node.uid("dBias") is not None else None
    dsink = pack[node.uid("dSink_token")].view(-1) if node.uid("dSink_token") is not None else None
    stats = pack[node.uid("stats")]
    for b, n, m in _sequences(node, pack):
        if not (n and m):
            continue
        q, o, do = (_t(node.tensors[x].view(pack, b, n)) for x in ("q", "o", "dO"))
        k, v = _t(node.tensors["k"].view(pack, b, m)), _t(node.tensors["v"].view(pack, b, m))
        ok, bias, sink = _score_args(node, pack, b, n, m, h)
        grads = backward(do, q, k, v, o, stats[b, :, :n, 0], ok, node.args["attn_scale"], bias, sink)
        for name, g, rows in (("dq", grads[0], n), ("dk", grads[1], m), ("dv", grads[2], m)):
            view = node.outputs[name].view(pack, b, rows)
            view.copy_(_t(g))
        if dbias is not None:
            _add_bias_grad(dbias[b if dbias.shape[0] > 1 else 0], grads[3], n, m)
        if dsink is not None:
            dsink.add_(grads[4].float())


def _add_bias_grad(target: torch.Tensor, ds: torch.Tensor, n: int, m: int) -> None:
    """Add dS [h, n, m] into one entry's dbias [h|1, sq|1, skv], summed over broadcast dims."""
    if target.shape[0] == 1:
        ds = ds.sum(0, keepdim=True)
    if target.shape[1] == 1:
        target[:, :, :m] += ds.sum(1, keepdim=True).to(target.dtype)
    else:
        target[:, :n, :m] += ds.to(target.dtype)


_RUN = {"fwd": _forward, "bwd": _backward, "fp8_fwd": lambda node, pack: fp8_forward(node, pack, _sequences(node, pack)),
        "fp8_bwd": lambda node, pack: fp8_backward(node, pack, _sequences(node, pack))}


class CudnnLibrary:
    """The stand-in; ``builds`` holds every built :class:`Graph`, ``runs`` every executed
    (:class:`Node`, pack)."""

    def __init__(self) -> None:
        self.builds: List[Graph] = []
        self.runs: List[Tuple[Node, dict]] = []

    def of(self, direction: str) -> List[Tuple[Node, dict]]:
        return [(node, pack) for node, pack in self.runs if node.direction == direction]


def install(monkeypatch) -> CudnnLibrary:
    lib = CudnnLibrary()
    module = stand_in_module(monkeypatch, "cudnn")
    for name, value in (("pygraph", lambda *a, **kw: Graph(lib, *a, **kw)), ("data_type", _Names("data_type")),
                        ("heur_mode", _Names("heur_mode")), ("diagonal_alignment", _Names("diagonal_alignment"))):
        monkeypatch.setattr(module, name, value, raising=False)
    monkeypatch.setattr(graphs, "_handle", lambda device: None)  # no CUDA handle, no stream
    # Any dtype: the arithmetic is float64 here, so float32/float64 inputs (which real cuDNN
    # refuses, and selection keeps away from it) give tight comparisons.
    monkeypatch.setattr(graphs, "_dtype", lambda dtype: f"data_type.{dtype}")
    monkeypatch.setattr(graphs, "_graphs", OrderedDict())  # a fresh cache: this test's graphs are built here
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

