"""What zeroing a KV step's unowned output rows costs in a CUDA graph, and whether FA4 writes
zeros itself for a batch entry given query rows but no keys (issue #25: the one launch
DotProductAttention's graph-captured decode step makes beyond the append and FA4's call).

Times (graph-replayed, ms) for 1 x 1k and 64 x 1k decode steps, paged 256 and not:
  append+fa4          the direct step of benchmark_kv.py
  + triton zero       ... and the package's zero_gap_rows launch (what DPA replays today)
  + zero_()           ... and out.zero_() of the whole step output instead
  zeros+fa4           ... output from torch.zeros (fill before the call) instead of empty
Then FA4 on a batch of 2 where entry 1 has seqused_q = 1 and seqused_k = 0 (output NaN-filled
first): prints whether its row comes back all 0.

    python benchmarks/attention/probe_kv_zeroing.py
"""

from __future__ import annotations

import torch

from benchmark_kv import BF16, D, H, HKV, SCALE, Case, Setup, _bench
from profile_small import graphed


def _fa4_kwargs(s: Setup, out: torch.Tensor) -> dict:
    step, b, sq = s.append(), s.case.batch, s.case.step
    kw = dict(q=s.q.view(b * sq, H, D), k=step.k_cache, v=step.v_cache, cu_seqlens_q=torch.arange(
        0, (b + 1) * sq, sq, dtype=torch.int32, device="cuda"), seqused_q=step.seqlens_q, seqused_k=step.seqlens_kv,
        max_seqlen_q=sq, max_seqlen_k=s.case.max_len, softmax_scale=SCALE, causal=True, out=out, return_lse=False)
    if step.is_paged:
        kw["page_table"] = step.page_table
    return kw


def timings(case: Case) -> dict:
    from flash_attn.cute import interface
    from transformer_engine.pytorch.attention.dot_product_attention.backends import kernel_ops

    s = Setup(case)
    b, sq = case.batch, case.step
    out = torch.empty(b * sq, H, D, dtype=BF16, device="cuda")
    kw = _fa4_kwargs(s, out)
    step = s.append()
    rows = (step.cu_seqlens_q, step.cu_seqlens_q_padded)

    def fresh(**over):
        return {**kw, **over}

    paths = {
        "append+fa4": lambda: (s.append(), interface._flash_attn_fwd(**kw)),
        "+ triton zero": lambda: (s.append(), interface._flash_attn_fwd(**kw), kernel_ops.ops.zero_gap_rows(out, *rows, -1)),
        "+ zero_()": lambda: (s.append(), out.zero_(), interface._flash_attn_fwd(**kw)),
        "zeros+fa4": lambda: (s.append(), interface._flash_attn_fwd(**fresh(out=torch.zeros(b * sq, H, D, dtype=BF16,
                                                                                                  device="cuda")))),
    }
    res = {}
    for name, fn in paths.items():
        fn()
        torch.cuda.synchronize()
        res[name] = round(_bench(graphed(fn)), 4)
    return res


def empty_entry_writes_zeros() -> str:
    from flash_attn.cute import interface

    torch.manual_seed(0)
    q = torch.randn(2, H, D, dtype=BF16, device="cuda")
    k, v = (torch.randn(2, 256, HKV, D, dtype=BF16, device="cuda") for _ in range(2))
    out = torch.full((2, H, D), float("nan"), dtype=BF16, device="cuda")
    i32 = dict(dtype=torch.int32, device="cuda")
    interface._flash_attn_fwd(q=q, k=k, v=v, cu_seqlens_q=torch.tensor([0, 1, 2], **i32), seqused_q=torch.tensor([1, 1], **i32),
                              seqused_k=torch.tensor([100, 0], **i32), max_seqlen_q=1, max_seqlen_k=256, softmax_scale=SCALE,
                              causal=True, out=out, return_lse=False)
    torch.cuda.synchronize()
    row1 = out[1]
    return (f"entry 1 (no keys): all zero {bool((row1 == 0).all())}, nan {int(row1.isnan().sum())}, "
            f"entry 0 finite {bool(out[0].isfinite().all())}")


def main() -> None:
    for batch in (1, 64):
        for page in (256, None):
            print(f"[kvzero] batch {batch} context 1024 page {page}: {timings(Case('fa4', page, batch, 1024))}", flush=True)
    try:
        print(f"[kvzero] {empty_entry_writes_zeros()}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"[kvzero] empty entry call failed: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
