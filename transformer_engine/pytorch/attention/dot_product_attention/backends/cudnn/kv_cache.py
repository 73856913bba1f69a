"""cuDNN over a KV cache (TE's ``inference_params``), forward only.

- Non-paged: the ordinary ragged (THD) graph of :mod:`.ops`: the step's query rows at their
  padded offsets, the cache as [B*S, Hkv, D] rows at offsets ``b*S``, per-sequence lengths.
- Paged: a graph of its own (``te_attn::cudnn_paged_fwd``): cudnn-frontend's paged SDPA
  (``paged_attention_k_table``/``v_table``, ``paged_attention_max_seq_len_kv``), the pools in
  the cache's own [P, page_size, Hkv, D] layout declared to cuDNN as [P, Hkv, page_size, D]
  through strides (probed on the H200, cuDNN 9.19 / frontend 1.32, page sizes 64-256, decode
  and prefill chunks: correct in both pool layouts), the block table [B, 1, max_pages, 1] int32
  as a view of the page table, the queries dense [B, Sq, H, D] (bshd/sbhd steps) or ragged
  (thd steps). NaN in an unused page leaked into the output once in that probe, so the pools
  must stay finite: the cache starts zeroed and holds only appended tokens.

cuDNN leaves query rows it does not run unwritten; those are zeroed afterwards (every valid row
sees at least its own key, so every valid row is written).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import kernel_ops
from ..kv_rows import kv_output_rows, zero_unowned_rows
from ...prepare.inputs import AttentionInputs
from . import graphs
from .graphs import UID

# Graph uids of the two block tables, apart from graphs.UID's (which the other graphs use).
TABLE_UID = {"table_k": 101, "table_v": 102}


def _build_paged(handle, q, k, v, out, table, b: int, sq: int, skv: int, scale: float, band: dict, ragged: bool):
    """The paged forward graph: O only (no stats: nothing differentiates it)."""
    import cudnn

    g = graphs._new_graph(q.dtype, handle)
    q_dims, q_strides = graphs._dims(q, ragged, sq, b)
    q_t = g.tensor(name="q", dim=q_dims, stride=q_strides, data_type=graphs._dtype(q.dtype), uid=UID["q"])
    if ragged:
        q_t.set_ragged_offset(graphs._ragged(g, "rq", b))
    pools = []
    for name, pool in (("k", k), ("v", v)):
        dims, strides = graphs._desc(pool, False, 0)  # [P, page, Hkv, D] -> cuDNN's [P, Hkv, page, D]
        pools.append(g.tensor(name=name, dim=dims, stride=strides, data_type=graphs._dtype(pool.dtype), uid=UID[name]))
    pages = table.shape[1]
    tables = [g.tensor(name=n, dim=[b, 1, pages, 1], stride=[pages, pages, 1, 1], data_type=cudnn.data_type.INT32, uid=uid)
              for n, uid in TABLE_UID.items()]
    lens = [g.tensor(name=n, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32, uid=UID[n])
            for n in ("len_q", "len_kv")]
    o_t, _ = g.sdpa(name="sdpa_paged", q=q_t, k=pools[0], v=pools[1], attn_scale=scale, generate_stats=False,
                    use_padding_mask=True, seq_len_q=lens[0], seq_len_kv=lens[1], paged_attention_k_table=tables[0],
                    paged_attention_v_table=tables[1], paged_attention_max_seq_len_kv=skv, **band)
    graphs._declare_output(g, o_t, "o", out, sq, b, ragged)
    return graphs._finish(g)


def cudnn_paged_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    page_table: torch.Tensor,
    offsets_q: Optional[torch.Tensor],
    seqlens_q: torch.Tensor,
    seqlens_kv: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    bottom_right: bool,
) -> None:
    """Writes ``out`` (like q, head dim of v) in the valid query rows. ``q``/``out``: [B, Sq, H, D]
    dense, or [T, H, D] with ``offsets_q`` [B+1] (ragged); ``k``/``v``: page pools
    [P, page_size, Hkv, D]; ``page_table`` [B, S // page_size] int32 (contiguous rows)."""
    ragged = offsets_q is not None
    b, sq, skv = page_table.shape[0], max(max_seqlen_q, 1), max_seqlen_kv
    band, band_key = graphs.band(causal, window_left, window_right, bottom_right)  # cached per mask (decode is host-bound)
    key = ("paged", q.dtype, b, sq, skv, q.shape[1:], k.shape, v.shape, q.stride(), k.stride(), v.stride(), out.stride(),
           page_table.shape, softmax_scale, band_key, ragged, q.device)
    table = page_table.view(b, 1, page_table.shape[1], 1)
    pack = {UID["q"]: q, UID["k"]: k, UID["v"]: v, UID["o"]: out, TABLE_UID["table_k"]: table, TABLE_UID["table_v"]: table}
    ragged_of = graphs.ragged_sources(offsets_q, None, dict(q=q, o=out)) if ragged else {}
    pack.update(graphs.metadata_pack(seqlens_q, seqlens_kv, ragged_of))
    build = lambda h: _build_paged(h, q, k, v, out, page_table, b, sq, skv, softmax_scale, band, ragged)  # noqa: E731
    graphs.run_graph(key, build, pack, q.device)


def _cudnn_paged_fwd_fake(q, k, v, out, *args) -> None:
    return None


kernel_ops.register("cudnn_paged_fwd", cudnn_paged_fwd, ("out",), _cudnn_paged_fwd_fake)


def run_cudnn_kv_cache(inp: AttentionInputs) -> torch.Tensor:
    """The KV call's output rows [rows, H, Dv] (rows no sequence owns 0)."""
    step, q, spec = inp.kv_cache, inp.q, inp.mask
    out = kv_output_rows(inp)
    causal = spec.mask_type.is_causal
    left, right = spec.window
    bottom_right = spec.mask_type.bottom_right and spec.has_band
    b, sq = step.batch_size, step.max_seqlen_q
    if step.is_paged:
        dense = step.qkv_format != "thd"
        q_in, out_in = (q.view(b, sq, *q.shape[1:]), out.view(b, sq, *out.shape[1:])) if dense else (q, out)
        kernel_ops.ops.cudnn_paged_fwd(q_in, step.k_cache, step.v_cache, out_in, step.page_table,
                                       None if dense else step.cu_seqlens_q_padded, step.seqlens_q, step.seqlens_kv, sq,
                                       step.max_seqlen_kv, inp.softmax_scale, causal, left, right, bottom_right)
    else:
        kernel_ops.ops.cudnn_fwd(q, inp.k, inp.v, out, step.cu_seqlens_q_padded, step.cu_seqlens_kv_padded, step.seqlens_q,
                                 step.seqlens_kv, b, sq, step.max_seqlen_kv, inp.softmax_scale, causal, left, right, bottom_right)
    zero_unowned_rows(out, inp)
    return out
