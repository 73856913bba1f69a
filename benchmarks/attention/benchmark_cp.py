"""Context-parallel attention benchmark (bf16, 16 heads, head dim 128, causal).

Two modes:

  scaling   (torchrun --nproc-per-node=N benchmarks/attention/benchmark_cp.py scaling)
            A 128k-token THD batch (8 sequences of 8k-32k tokens, slots padded to 2 x 8) run
            forward+backward with cp = 1, 2, 4, 8 (as many as N allows) over NCCL; reports
            tokens/s and scaling efficiency = tokens/s(cp) / (cp x tokens/s(1)).
            Keep NVLink multicast off: NCCL_NVLS_ENABLE=0 (set here when unset).
  one-gpu   (python benchmarks/attention/benchmark_cp.py one-gpu)
            On one GPU, the ring steps of one rank at cp = 2, 4, 8 without communication:
            per step, the kernel time and the bytes the ring moves beside it (the kv block
            forward; kv block + fp32 dk/dv backward), and the link bandwidth needed to hide
            the transfer behind the kernel (bytes / kernel time).

``--backend fa4|cudnn`` picks the kernel (default fa4).
"""

from __future__ import annotations

import argparse
import os
import time
from types import SimpleNamespace

import torch

LENGTHS = [32768, 8192, 16384, 12288, 24576, 8192, 16384, 12800]  # 131,072 tokens
H, D = 16, 128
ENV = {"fa4": {"NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"}, "cudnn": {"NVTE_FLASH_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"}}


def _batch(cp_max: int, device):
    m = 2 * cp_max
    cu, off = [0], [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
        off.append(off[-1] + -(-n // m) * m)
    it = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return it(cu), it(off), off[-1]


def _time(fn, iters: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def scaling(args) -> None:
    import torch.distributed as dist

    from transformer_engine.pytorch import DotProductAttention, partition_for_context_parallel

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda")
    cu, off, total = _batch(8, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (torch.randn(total, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
    results = {}
    for cp in [c for c in (1, 2, 4, 8) if c <= world]:
        group = dist.new_group(list(range(cp)))  # every rank takes part in creating it
        if rank < cp:
            dpa = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal",
                                      cp_group=group if cp > 1 else None, cp_comm_type=args.comm, cp_stream=torch.cuda.Stream())
            local = [partition_for_context_parallel(t, cp, rank, "thd", off).requires_grad_() for t in (q, k, v)]
            g_out = partition_for_context_parallel(dout, cp, rank, "thd", off).reshape(-1, H * D)
            kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=off, cu_seqlens_kv_padded=off,
                      max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS))
            step = lambda: dpa(*local, **kw).backward(g_out)  # noqa: E731
            seconds = _time(step)
            results[cp] = sum(LENGTHS) / seconds
        dist.barrier()
    if rank == 0:
        base = results[1]
        print(f"| cp | comm | tokens/s (fwd+bwd) | scaling efficiency |\n| --- | --- | --- | --- |")
        for cp, tps in results.items():
            print(f"| {cp} | {args.comm} | {tps:,.0f} | {tps / (cp * base):.0%} |")
    dist.destroy_process_group()


def one_gpu(args) -> None:
    from transformer_engine.pytorch.attention.dot_product_attention.cp.algorithms import CPProblem, ring_plan
    from transformer_engine.pytorch.attention.dot_product_attention.backends import FlashAttentionV4, FusedAttention
    from transformer_engine.pytorch.attention.dot_product_attention.cp.spans import span_kernel
    from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType, MaskSpec
    from transformer_engine.pytorch.attention.dot_product_attention.cp.partition import get_cp_partition_indices

    dev = torch.device("cuda")
    kernel = span_kernel(FlashAttentionV4 if args.backend == "fa4" else FusedAttention, "p2p")
    cu, off, total = _batch(8, dev)
    spec = MaskSpec(AttnMaskType.PADDING_CAUSAL, (-1, 0))
    lengths = torch.diff(cu).long()
    print("| cp | rank | step | kernel fwd ms | kernel bwd ms | bytes fwd | bytes bwd | GB/s to hide fwd / bwd |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for cp in (2, 4, 8):
        t_loc = total // cp
        rank = cp // 2  # a middle rank sees both step kinds
        idx = get_cp_partition_indices(off, total, cp, rank)
        q, k, v, dout = (torch.randn(total, H, D, device=dev, dtype=torch.bfloat16)[idx] for _ in range(4))
        prob = CPProblem(off.long(), off.long(), lengths, lengths, max(LENGTHS), max(LENGTHS), (spec,), (True,),
                         torch.zeros(len(LENGTHS), dtype=torch.int64, device=dev), D ** -0.5)
        plan = ring_plan(prob, SimpleNamespace(size=cp, rank=rank), kernel, t_loc, t_loc)
        out, lse = kernel.forward(q, k, v, *plan.steps[0][0], prob.scale)
        kv_bytes = 2 * t_loc * H * D * 2
        for t, calls in enumerate(plan.steps):
            fwd = _time(lambda: [kernel.forward(q, k, v, qs, ks, m, prob.scale) for qs, ks, m in calls])
            bwd = _time(lambda: [kernel.backward(dout, q, k, v, out, lse, qs, ks, m, prob.scale) for qs, ks, m in calls])
            bytes_bwd = kv_bytes + 2 * t_loc * H * D * 4  # kv block + fp32 dk/dv accumulator
            print(f"| {cp} | {rank} | {t} | {fwd * 1e3:.3f} | {bwd * 1e3:.3f} | {kv_bytes / 2**20:.1f} MiB | "
                  f"{bytes_bwd / 2**20:.1f} MiB | {kv_bytes / fwd / 1e9:.0f} / {bytes_bwd / bwd / 1e9:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("scaling", "one-gpu"))
    parser.add_argument("--backend", choices=tuple(ENV), default="fa4")
    parser.add_argument("--comm", choices=("p2p", "all_gather", "a2a"), default="p2p")
    args = parser.parse_args()
    os.environ.update(ENV[args.backend])
    scaling(args) if args.mode == "scaling" else one_gpu(args)


if __name__ == "__main__":
    main()
