"""cudnn-frontend's FP8 SDPA graphs (``sdpa_fp8``, ``sdpa_fp8_backward``) for the ops of
:mod:`.fp8_ops`, built on the BF16 graphs' helpers (:mod:`.graphs`: tensor declarations, ragged
offsets, the cache and execution).

What the graphs compute (cudnn-frontend 1.32's FP8 nodes; Q, K, V, O, dO are FP8 tensors, every
scale and descale a float32 [1, 1, 1, 1] device scalar)::

    forward : S = softmax(Q K^T * attn_scale * descale_q * descale_k)      amax_s = max |S|
              O = (S * scale_s in E4M3) V * descale_s * descale_v           amax_o = max |O|
              O8 = O * scale_o in O's FP8 type; stats = natural-log LSE [B, H, SQ, 1]
    backward: dP = P * (dO V^T - rowsum(dO * O)) * attn_scale              amax_dp = max |dP|
              dP8 = dP * scale_dp in dO's FP8 type (the gradient of Q K^T, attn_scale included)
              dQ8 = dP8 K * ... * scale_dq, dK8 = dP8^T Q * ... * scale_dk, dV8 = S^T dO * ... * scale_dv

On the H200 (cuDNN 9.19) O and dQ/dK/dV are written in FP8 only (BF16 outputs are Blackwell
features), which is why the callers dequantize them.

Each op passes its scalars as one float32 table [N, 4] with a value per 16-byte row (column 0),
so every scalar the library reads starts on a 16-byte boundary; ``*_SCALARS`` name the rows and
``*_READS`` say which row each graph scalar reads (the three Q/K/V descales share one scale).
"""

from __future__ import annotations

from typing import Dict, Iterable, Tuple

import torch

from . import graphs
from .graphs import UID

FP8_UID = {name: 40 + i for i, name in enumerate((
    "descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o", "amax_s", "amax_o", "descale_o",
    "descale_do", "descale_dp", "scale_dq", "scale_dk", "scale_dv", "scale_dp", "amax_dq", "amax_dk", "amax_dv", "amax_dp"))}

FWD_SCALARS = ("descale_qkv", "descale_s", "scale_s", "scale_o", "descale_o")  # descale_o: for the caller's dequantization
FWD_READS = {"descale_q": 0, "descale_k": 0, "descale_v": 0, "descale_s": 1, "scale_s": 2, "scale_o": 3}
FWD_AMAXES = ("amax_s", "amax_o")
BWD_SCALARS = ("descale_qkv", "descale_o", "descale_s", "scale_s", "descale_do", "descale_dp", "scale_dqkv", "scale_dp",
               "descale_dqkv")
BWD_READS = {"descale_q": 0, "descale_k": 0, "descale_v": 0, "descale_o": 1, "descale_s": 2, "scale_s": 3, "descale_do": 4,
             "descale_dp": 5, "scale_dq": 6, "scale_dk": 6, "scale_dv": 6, "scale_dp": 7}
BWD_AMAXES = ("amax_dq", "amax_dk", "amax_dv", "amax_dp")
# sdpa_fp8_backward's keyword for each backward scalar (the library capitalizes the gradients).
_BWD_KWARGS = {"descale_do": "descale_dO", "descale_dp": "descale_dP", "scale_dq": "scale_dQ", "scale_dk": "scale_dK",
               "scale_dv": "scale_dV", "scale_dp": "scale_dP"}


def scalar_pack(scalars: torch.Tensor, reads: Dict[str, int]) -> dict:
    """{uid: [1, 1, 1, 1] view of the table row} for every graph scalar in ``reads``."""
    return {FP8_UID[name]: scalars[row, :1].view(1, 1, 1, 1) for name, row in reads.items()}


def amax_pack(amaxes: torch.Tensor, names: Tuple[str, ...]) -> dict:
    """{uid: [1, 1, 1, 1] view of row i} for the amax outputs, written by the graph."""
    return {FP8_UID[name]: amaxes[i, :1].view(1, 1, 1, 1) for i, name in enumerate(names)}


def _scalars(g, names: Iterable[str]) -> dict:
    import cudnn

    return {name: g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT, uid=FP8_UID[name])
            for name in names}


def _declare_amaxes(outputs: Iterable[Tuple[str, object]]) -> None:
    import cudnn

    for name, gt in outputs:
        gt.set_uid(FP8_UID[name]).set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)


def _mask_kwargs(t: dict, causal: bool, bottom_right: bool, padded: bool) -> dict:
    """Causal flags and per-sequence lengths as sdpa_fp8 and sdpa_fp8_backward take them (the
    flags rather than band bounds: the FP8 bindings of cudnn-frontend 1.x all take these)."""
    kwargs = dict(use_padding_mask=padded, seq_len_q=t.get("len_q"), seq_len_kv=t.get("len_kv"))
    if causal and bottom_right:
        kwargs["use_causal_mask_bottom_right"] = True
    elif causal:
        kwargs["use_causal_mask"] = True
    return kwargs


def build_fwd(handle, q, k, v, o, b: int, sq: int, skv: int, scale: float, causal: bool, bottom_right: bool, varlen: bool,
              padded: bool):
    """The forward graph: O (in ``o``'s FP8 type), the stats, amax_s and amax_o."""
    import cudnn

    g = graphs._new_graph(q.dtype, handle)
    t = graphs._graph_tensors(g, dict(q=(q, sq), k=(k, skv), v=(v, skv)), b, varlen, padded)
    if varlen:
        graphs._set_ragged(g, t, ("q", "k", "v"), b)
    o_t, stats_t, amax_s, amax_o = g.sdpa_fp8(q=t["q"], k=t["k"], v=t["v"], **_scalars(g, FWD_READS), attn_scale=scale,
                                              generate_stats=True, **_mask_kwargs(t, causal, bottom_right, varlen or padded))
    graphs._declare_output(g, o_t, "o", o, sq, b, varlen)
    o_t.set_data_type(graphs._dtype(o.dtype))
    dims, strides = graphs._stats_layout(b, q.shape[-2], sq)
    stats_t.set_uid(UID["stats"]).set_output(True).set_dim(dims).set_stride(strides).set_data_type(cudnn.data_type.FLOAT)
    _declare_amaxes(zip(FWD_AMAXES, (amax_s, amax_o)))
    return graphs._finish(g)


def build_bwd(handle, q, k, v, o, do, dq, dk, dv, b: int, sq: int, skv: int, scale: float, causal: bool, bottom_right: bool,
              padded: bool):
    """The backward graph (dense layouts: cuDNN's FP8 backward takes no ragged offsets on
    Hopper): dQ, dK, dV in their buffers' FP8 type, and the four amaxes."""
    g = graphs._new_graph(q.dtype, handle)
    t = graphs._graph_tensors(g, dict(q=(q, sq), k=(k, skv), v=(v, skv), o=(o, sq), do=(do, sq)), b, False, padded)
    stats = graphs._row_tensor(g, "stats", b, q.shape[-2], sq)
    scalars = {_BWD_KWARGS.get(name, name): gt for name, gt in _scalars(g, BWD_READS).items()}
    outs = g.sdpa_fp8_backward(q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"], stats=stats, attn_scale=scale, **scalars,
                               **_mask_kwargs(t, causal, bottom_right, padded))
    for name, gt, ref, s_max in (("dq", outs[0], dq, sq), ("dk", outs[1], dk, skv), ("dv", outs[2], dv, skv)):
        graphs._declare_output(g, gt, name, ref, s_max, b, False)
        gt.set_data_type(graphs._dtype(ref.dtype))
    _declare_amaxes(zip(BWD_AMAXES, outs[3:7]))
    return graphs._finish(g)
