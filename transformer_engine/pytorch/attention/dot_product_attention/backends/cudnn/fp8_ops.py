"""The registered FP8 cuDNN ops (``te_attn::cudnn_fp8_fwd``, ``cudnn_fp8_bwd``) and their
shape-only fakes: each builds (once per configuration) and runs one graph of :mod:`.fp8_graphs`,
writing into caller-provided buffers.

Arguments as the BF16 ops' (:mod:`.ops`), without windows and score features: q/k/v/out are
FP8 [T, H, D] (varlen, ``offsets_*`` the [B+1] start offsets, ``seqlens_*`` the [B] valid
lengths; forward only) or [B, S, H, D] (dense; lengths for a padded batch). ``scalars`` is the
float32 table of :data:`.fp8_graphs.FWD_SCALARS` / ``BWD_SCALARS`` rows, ``amaxes`` a float32
[N, 4] table whose column 0 the graph writes (``FWD_AMAXES`` / ``BWD_AMAXES`` order).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import kernel_ops
from . import fp8_graphs, graphs
from .graphs import UID
from .ops import stats_shape


def _key(kind: str, tensors, b: int, sq: int, skv: int, scale: float, causal: bool, bottom_right: bool, varlen: bool,
         padded: bool) -> tuple:
    return (kind, b, sq, skv, scale, causal, bottom_right, varlen, padded, tensors[0].device,
            tuple((t.dtype, tuple(t.shape), t.stride()) for t in tensors))


def cudnn_fp8_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    scalars: torch.Tensor,
    amaxes: torch.Tensor,
    offsets_q: Optional[torch.Tensor],
    offsets_kv: Optional[torch.Tensor],
    seqlens_q: Optional[torch.Tensor],
    seqlens_kv: Optional[torch.Tensor],
    batch_size: int,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    softmax_scale: float,
    causal: bool,
    bottom_right: bool,
) -> torch.Tensor:
    """Writes ``out`` (FP8, head dim of v) in the rows it runs and ``amaxes`` [2, 4] (amax_s,
    amax_o); returns the stats [B, H, SQ, 1] float32 (natural-log LSE)."""
    varlen, padded = offsets_q is not None, seqlens_q is not None
    b, sq, skv = batch_size, max(max_seqlen_q, 1), max(max_seqlen_kv, 1)
    stats = torch.empty(stats_shape(q, b, max_seqlen_q), dtype=torch.float32, device=q.device)
    key = _key("fp8_fwd", (q, k, v, out), b, sq, skv, softmax_scale, causal, bottom_right, varlen, padded)
    pack = {UID["q"]: q, UID["k"]: k, UID["v"]: v, UID["o"]: out, UID["stats"]: stats}
    pack.update(fp8_graphs.scalar_pack(scalars, fp8_graphs.FWD_READS))
    pack.update(fp8_graphs.amax_pack(amaxes, fp8_graphs.FWD_AMAXES))
    ragged = graphs.ragged_sources(offsets_q, offsets_kv, dict(q=q, k=k, v=v, o=out)) if varlen else {}
    pack.update(graphs.metadata_pack(seqlens_q, seqlens_kv, ragged))
    build = lambda h: fp8_graphs.build_fwd(h, q, k, v, out, b, sq, skv, softmax_scale, causal, bottom_right,  # noqa: E731
                                           varlen, padded)
    graphs.run_graph(key, build, pack, q.device)
    return stats


def _cudnn_fp8_fwd_fake(q, k, v, out, scalars, amaxes, offsets_q, offsets_kv, seqlens_q, seqlens_kv, batch_size, max_seqlen_q,
                        *args):
    return q.new_empty(stats_shape(q, batch_size, max_seqlen_q), dtype=torch.float32)


kernel_ops.register("cudnn_fp8_fwd", cudnn_fp8_fwd, ("out", "amaxes"), _cudnn_fp8_fwd_fake)


def cudnn_fp8_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    stats: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    scalars: torch.Tensor,
    amaxes: torch.Tensor,
    seqlens_q: Optional[torch.Tensor],
    seqlens_kv: Optional[torch.Tensor],
    batch_size: int,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    softmax_scale: float,
    causal: bool,
    bottom_right: bool,
) -> None:
    """Writes ``dq``/``dk``/``dv`` (FP8, q's/k's/v's shapes, any strides: views of one packed
    buffer included) and ``amaxes`` [4, 4] (amax_dq, amax_dk, amax_dv, amax_dp); dense only.
    ``dout`` (FP8) needs ``out``'s strides."""
    padded = seqlens_q is not None
    b, sq, skv = batch_size, max(max_seqlen_q, 1), max(max_seqlen_kv, 1)
    key = _key("fp8_bwd", (dout, q, k, v, out, dq, dk, dv), b, sq, skv, softmax_scale, causal, bottom_right, False, padded)
    pack = {UID["q"]: q, UID["k"]: k, UID["v"]: v, UID["o"]: out, UID["do"]: dout, UID["stats"]: stats, UID["dq"]: dq,
            UID["dk"]: dk, UID["dv"]: dv}
    pack.update(fp8_graphs.scalar_pack(scalars, fp8_graphs.BWD_READS))
    pack.update(fp8_graphs.amax_pack(amaxes, fp8_graphs.BWD_AMAXES))
    pack.update(graphs.metadata_pack(seqlens_q, seqlens_kv, {}))
    build = lambda h: fp8_graphs.build_bwd(h, q, k, v, out, dout, dq, dk, dv, b, sq, skv, softmax_scale, causal,  # noqa: E731
                                           bottom_right, padded)
    graphs.run_graph(key, build, pack, q.device)


def _cudnn_fp8_bwd_fake(*args) -> None:
    return None


kernel_ops.register("cudnn_fp8_bwd", cudnn_fp8_bwd, ("dq", "dk", "dv", "amaxes"), _cudnn_fp8_bwd_fake)
