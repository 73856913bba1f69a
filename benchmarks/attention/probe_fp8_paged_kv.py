"""Q5-Q7 of probe_fp8_paged.py: paged KV caches on cuDNN (``sdpa`` with
``paged_attention_k_table``/``v_table``) and on FA4 (``_flash_attn_fwd`` with ``page_table``),
checked against a float32 reference over the gathered pages, and one decode step timed on both.

Shapes: bf16, 16 query heads over 2 KV heads (GQA 16:2), head dim 128, bottom-right causal (a
query row sees its own position in the cache and everything before). Page pools hold the pages
in a random order; a spare page is named by no table, and every unused table slot names one
"trash" page. After each clean run the trash page is filled with NaN and the call repeated:
``unused_pages_nan_safe`` says whether the output stayed finite and unchanged (a real cache's
unused pages hold garbage).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import List, Optional

import torch

from probe_fp8_paged_common import (BF16, bhsd, compare, executor, finish, graph_input, graph_output, nans, new_graph,
                                    reference, run_case, time_calls)

H, HKV, D = 16, 2, 128
SCALE = D ** -0.5
MODES = {
    # (query rows per sequence, cache lengths after this step): a page's edge, a page and one,
    # a single token, sequences of many pages, and (prefill) a chunk shorter than the others.
    "decode": ([1] * 6, [1, 63, 64, 65, 1000, 2048]),
    "prefill chunk": ([16, 16, 16, 16, 9], [16, 80, 1000, 2048, 309]),
}
BF16_TOL = 2e-2  # max |out - ref| of a bf16 output of values below ~2


@dataclass
class PagedBatch:
    lens_q: List[int]
    lens_kv: List[int]
    page: int
    q_dense: torch.Tensor  # [B, max len_q, H, D] (rows past len_q unused)
    q_thd: torch.Tensor  # [sum len_q, H, D]
    cu_q: torch.Tensor  # int32 [B + 1]
    rows: tuple  # (sequence, position) of every packed query row
    valid: torch.Tensor  # [B, max len_q] bool
    k_dense: torch.Tensor  # [B, pages per sequence * page, HKV, D]: what the pages hold, in order
    v_dense: torch.Tensor
    pool_k: torch.Tensor  # [num_pages, page, HKV, D] (FA4's layout)
    pool_v: torch.Tensor
    table: torch.Tensor  # int32 [B, pages per sequence]
    trash: int
    lens_q_t: torch.Tensor  # int32 [B]
    lens_kv_t: torch.Tensor


def paged_batch(page: int, lens_q: List[int], lens_kv: List[int], seed: int) -> PagedBatch:
    b, maxp = len(lens_kv), math.ceil(max(lens_kv) / page)
    need = [math.ceil(n / page) for n in lens_kv]
    used = sum(need)
    num_pages = used + 2  # one spare page no table names, one trash page for the unused slots
    table = torch.full((b, maxp), num_pages - 1, dtype=torch.int32)
    slots = torch.arange(maxp)[None] < torch.tensor(need)[:, None]
    table[slots] = torch.randperm(used + 1, generator=torch.Generator().manual_seed(seed))[:used].int()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").to(BF16)  # noqa: E731
    k_dense, v_dense = rnd(b, maxp * page, HKV, D), rnd(b, maxp * page, HKV, D)
    pools = []
    for dense in (k_dense, v_dense):
        pool = rnd(num_pages, page, HKV, D)
        pool[table[slots].long().cuda()] = dense.view(b, maxp, page, HKV, D)[slots.cuda()]
        pools.append(pool)
    q_dense = rnd(b, max(lens_q), H, D)
    b_idx = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lens_q)]).cuda()
    i_idx = torch.cat([torch.arange(n) for n in lens_q]).cuda()
    valid = torch.zeros(b, max(lens_q), dtype=torch.bool, device="cuda")
    valid[b_idx, i_idx] = True
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")  # noqa: E731
    return PagedBatch(lens_q, lens_kv, page, q_dense, q_dense[b_idx, i_idx].contiguous(),
                      as_int([0] + list(itertools.accumulate(lens_q))), (b_idx, i_idx), valid, k_dense, v_dense, *pools,
                      table.cuda(), num_pages - 1, as_int(lens_q), as_int(lens_kv))


def batch_reference(batch: PagedBatch):
    return reference(batch.q_dense, batch.k_dense, batch.v_dense, SCALE, True, batch.lens_q, batch.lens_kv, bottom_right=True)


def _poisoned_rerun(run, first: torch.Tensor, trash_views, valid: Optional[torch.Tensor] = None) -> dict:
    """Fill the trash page (named by every unused table slot) with NaN, run again, and say
    whether the valid rows stayed finite and bit-identical."""
    for view in trash_views:
        view.fill_(float("nan"))
    second = run()
    torch.cuda.synchronize()
    a, b = (second, first) if valid is None else (second[valid], first[valid])
    same = bool(torch.isfinite(a).all()) and bool((a.float() - b.float()).abs().max() == 0)
    return dict(unused_pages_nan_safe=same)


# ------------------------------------------------------------------ cuDNN (Q5)


def cudnn_pools(batch: PagedBatch, layout: str):
    """[num_pages, page, HKV, D]-shaped views of the pools for cuDNN: "HND" stores
    [num_pages, HKV, page, D] (cuDNN's documented pool), "NHD" is FA4's own pool, passed through
    strides."""
    if layout == "NHD":
        return batch.pool_k, batch.pool_v
    return tuple(p.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for p in (batch.pool_k, batch.pool_v))


def cudnn_paged_call(batch: PagedBatch, layout: str, out: torch.Tensor):
    """Build the paged graph; returns (a call that writes ``out``, the pool views)."""
    import cudnn

    pool_k, pool_v = cudnn_pools(batch, layout)
    b, maxp = batch.table.shape
    g = new_graph(BF16)
    q = graph_input(g, "q", *bhsd(batch.q_dense), BF16)
    k = graph_input(g, "k", *bhsd(pool_k), BF16)
    v = graph_input(g, "v", *bhsd(pool_v), BF16)
    tables = [graph_input(g, n, [b, 1, maxp, 1], [maxp, maxp, 1, 1], torch.int32) for n in ("table_k", "table_v")]
    lens = [graph_input(g, n, [b, 1, 1, 1], [1, 1, 1, 1], torch.int32) for n in ("len_q", "len_kv")]
    o, _ = g.sdpa(name="paged", q=q, k=k, v=v, attn_scale=SCALE, generate_stats=False, use_padding_mask=True,
                  seq_len_q=lens[0], seq_len_kv=lens[1], paged_attention_k_table=tables[0],
                  paged_attention_v_table=tables[1], paged_attention_max_seq_len_kv=maxp * batch.page,
                  diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0)
    graph_output(o, "o", *bhsd(out), BF16)
    built = finish(g)
    table = batch.table.view(b, 1, maxp, 1)
    pack = dict(q=batch.q_dense, k=pool_k, v=pool_v, o=out, table_k=table, table_v=table,
                len_q=batch.lens_q_t.view(b, 1, 1, 1), len_kv=batch.lens_kv_t.view(b, 1, 1, 1))
    return executor(built, pack), (pool_k, pool_v)


def cudnn_paged_case(page: int, mode: str, layout: str) -> dict:
    batch = paged_batch(page, *MODES[mode], seed=page)
    ref, _ = batch_reference(batch)
    out = nans(batch.q_dense.shape, BF16)
    call, pools = cudnn_paged_call(batch, layout, out)
    call()
    first = out.clone()
    fields = compare(first, ref, batch.valid)
    rerun = lambda: (out.fill_(float("nan")), call(), out)[2]  # noqa: E731
    fields.update(_poisoned_rerun(rerun, first, [p[batch.trash] for p in pools], batch.valid))
    return dict(page_size=page, mode=mode, pool_layout=layout, lens_q=batch.lens_q, lens_kv=batch.lens_kv,
                match=fields["finite"] and fields["max_abs_err"] < BF16_TOL, **fields)


# ------------------------------------------------------------------ FA4 (Q6)


def _fa4():
    from flash_attn.cute import interface

    return interface


def fa4_call(batch: PagedBatch, paged: bool, out: torch.Tensor, lse: Optional[torch.Tensor]):
    """The library's private forward, by keyword: q packed THD, K/V the page pools with the page
    table (``paged``) or the dense [B, S, HKV, D] cache, valid cache lengths as seqused_k."""
    kwargs = dict(q=batch.q_thd, cu_seqlens_q=batch.cu_q, cu_seqlens_k=None, seqused_k=batch.lens_kv_t,
                  max_seqlen_q=max(batch.lens_q), max_seqlen_k=max(batch.lens_kv), softmax_scale=SCALE, causal=True,
                  out=out, lse=lse, return_lse=lse is not None)
    if paged:
        kwargs.update(k=batch.pool_k, v=batch.pool_v, page_table=batch.table)
    else:
        kwargs.update(k=batch.k_dense, v=batch.v_dense)
    fa4 = _fa4()
    return lambda: fa4._flash_attn_fwd(**kwargs)


def fa4_case(page: int, mode: str, paged: bool = True, public: bool = False) -> dict:
    batch = paged_batch(page, *MODES[mode], seed=page + 1)
    ref, ref_lse = batch_reference(batch)
    b_idx, i_idx = batch.rows
    out, lse = nans(batch.q_thd.shape, BF16), nans((H, batch.q_thd.shape[0]))
    if public:  # the public entry point, same arguments (it allocates its own out / lse)
        kw = dict(cu_seqlens_q=batch.cu_q, max_seqlen_q=max(batch.lens_q), max_seqlen_k=max(batch.lens_kv),
                  seqused_k=batch.lens_kv_t, page_table=batch.table, softmax_scale=SCALE, causal=True, return_lse=True)
        call = lambda: _fa4().flash_attn_varlen_func(batch.q_thd, batch.pool_k, batch.pool_v, **kw)  # noqa: E731
        run = lambda: call()[0]  # noqa: E731
    else:
        call = fa4_call(batch, paged, out, lse)
        run = lambda: (out.fill_(float("nan")), call(), out)[2]  # noqa: E731
    t0 = time.time()
    first = run().clone()
    torch.cuda.synchronize()
    fields = dict(first_call_s=round(time.time() - t0, 1), **compare(first, ref[b_idx, i_idx]))
    if not public:
        fields["lse_max_abs_err"] = compare(lse, ref_lse.permute(0, 2, 1)[b_idx, i_idx].t())["max_abs_err"]
    if paged:
        fields.update(_poisoned_rerun(run, first, [p[batch.trash] for p in (batch.pool_k, batch.pool_v)]))
    return dict(page_size=page if paged else None, mode=mode, cache="page pool [pages, page, HKV, D]" if paged else
                "dense [B, S, HKV, D] + seqused_k", lens_q=batch.lens_q, lens_kv=batch.lens_kv,
                match=fields["finite"] and fields["max_abs_err"] < BF16_TOL, **fields)


# ------------------------------------------------------------------ timing (Q7)

T_BATCH, T_CONTEXT = 32, 4096


def _kv_bytes() -> int:
    return 2 * T_BATCH * T_CONTEXT * HKV * D * 2  # K and V, bf16


def timing_case(backend: str, page: int, layout: str = "NHD") -> dict:
    """One decode step: 32 sequences, 4096 cached tokens each, one query each."""
    batch = paged_batch(page, [1] * T_BATCH, [T_CONTEXT] * T_BATCH, seed=11)
    if backend == "cudnn":
        out = nans(batch.q_dense.shape, BF16)
        call = cudnn_paged_call(batch, layout, out)[0]
    else:  # FA4 with its LSE written, as in Q6 (the same compiled kernels)
        out, lse = nans(batch.q_thd.shape, BF16), nans((H, T_BATCH))
        call = fa4_call(batch, backend == "fa4 paged", out, lse)
    t = time_calls(call)
    t["finite"] = bool(torch.isfinite(out if backend != "cudnn" else out[:, :1]).all())
    kernel_ms = t["kernel_ms_per_call"] if t.get("kernel_timing_queued") else t["ms_per_call"]
    return dict(backend=backend, page_size=page if backend != "fa4 dense cache" else None,
                pool_layout=layout if backend == "cudnn" else None, batch=T_BATCH, context=T_CONTEXT,
                kv_read_GBps=round(_kv_bytes() / (kernel_ms * 1e-3) / 1e9, 1), **t)


# ------------------------------------------------------------------ the questions


def q5(deadline: float) -> None:
    cases = [(p, m, "HND") for p in (64, 256) for m in MODES] + [(p, m, "NHD") for p in (64, 256) for m in MODES]
    cases += [(128, m, "HND") for m in MODES]
    for page, mode, layout in cases:
        run_case("Q5", f"cuDNN paged {mode} page {page} pool {layout}", lambda: cudnn_paged_case(page, mode, layout),
                 deadline)


def q6(deadline: float) -> None:
    """Most telling first (each new kernel configuration JIT-compiles for seconds): page 64, page
    128 (= the sm90 d128 key tile: loaded by TMA), the dense cache, then the rest."""
    for page in (64, 128):
        for mode in MODES:
            run_case("Q6", f"FA4 paged {mode} page {page}", lambda: fa4_case(page, mode), deadline)
    for mode in MODES:
        run_case("Q6", f"FA4 dense cache + seqused_k {mode}", lambda: fa4_case(64, mode, paged=False), deadline)
    for page in (256, 16):
        for mode in MODES:
            run_case("Q6", f"FA4 paged {mode} page {page}", lambda: fa4_case(page, mode), deadline)
    run_case("Q6", "FA4 paged decode page 64 via public flash_attn_varlen_func",
             lambda: fa4_case(64, "decode", public=True), deadline)


def q7(deadline: float) -> None:
    for backend, page, layout in (("fa4 paged", 64, "NHD"), ("cudnn", 64, "HND"), ("cudnn", 64, "NHD"),
                                  ("fa4 paged", 128, "NHD"), ("fa4 paged", 256, "NHD"), ("cudnn", 256, "HND"),
                                  ("fa4 dense cache", 64, "NHD")):
        name = f"decode B{T_BATCH} ctx{T_CONTEXT} {backend}" + (f" page {page}" if backend != "fa4 dense cache" else "")
        run_case("Q7", name + (f" {layout}" if backend == "cudnn" else ""), lambda: timing_case(backend, page, layout),
                 deadline)
