"""Where the time goes on launch-bound batches (many short sequences): host time per call,
the GPU kernels each path launches, and both paths replayed from a CUDA graph (GPU time only).

    python benchmarks/attention/profile_small.py [--head-dims 64,128] [--paths direct,DPA] [--batches many-short]

``--paths DPA`` times DotProductAttention alone: the public API only, so an older checkout of
the package (``host_before_after.sh``) runs it even where the direct cuDNN harness has no
matching op there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmark_attention import BATCHES, ONLY, Env, bench, cudnn_direct, dpa_thd, fa4_direct


def host_us(step, n=50) -> float:
    """Median host microseconds of one call, each call starting on an idle GPU.

    Back-to-back calls (the earlier method, up to 2026-12-03) fill CUDA's launch queue on
    launch-heavy steps, after which a launch waits for the GPU and the "host" time includes GPU
    time; that made runs of the same code differ by up to 2.4x. Here the GPU is synchronized
    after every call, outside the timed span."""
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def graphed_ms(step) -> float:
    """Median ms of one replay of ``step`` captured in a CUDA graph (no host work at all)."""
    return bench(graphed(step))


def graphed(step):
    """``step`` captured in a CUDA graph (after a warm-up on a side stream); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def steps(fwd, inputs):
    out = fwd()
    g = torch.randn_like(out)

    def fwd_only():
        with torch.no_grad():
            fwd()

    def fwd_bwd():
        for t in inputs:
            t.grad = None
        fwd().backward(g)

    return {"fwd": fwd_only, "fwd+bwd": fwd_bwd}


def kernels(step, n=5) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--paths", default="direct,DPA", help="comma list of direct, DPA")
    ap.add_argument("--batches", default="many-short", help=f"comma list of {', '.join(BATCHES)}")
    args = ap.parse_args()
    for batch in args.batches.split(","):
        run_batch(batch, BATCHES[batch], [int(x) for x in args.head_dims.split(",")], args.paths.split(","))


def run_batch(batch, lengths, head_dims, wanted):
    for d in head_dims:
        for causal in (True, False):
            mask = "padding_causal" if causal else "padding"
            for lib, direct in (("FA4", fa4_direct), ("cuDNN", cudnn_direct)):
                with Env(ONLY[lib]):
                    build = {"direct": lambda: steps(*direct(lengths, d, causal)), "DPA": lambda: steps(*dpa_thd(lengths, d, mask)[:2])}
                    build = {name: make for name, make in build.items() if name in wanted}
                    paths = {name: make() for name, make in build.items()}
                    for tag in ("fwd", "fwd+bwd"):
                        line = []
                        for name, s in paths.items():
                            # Fresh leaves for the capture: gradient accumulators made by eager
                            # runs on the default stream would make the capture touch that stream.
                            line.append(f"{name}: host {host_us(s[tag]):.0f} us, eager {bench(s[tag]):.3f} ms, "
                                        f"graphed {graphed_ms(build[name]()[tag]):.3f} ms")
                        print(f"[small] {batch} {lib} d={d} {mask} {tag}: " + "; ".join(line), flush=True)
                    if d == 64 and causal and os.getenv("PROFILE_KERNELS", "1") == "1":
                        for name, s in paths.items():
                            print(f"[kernels] {lib} d={d} {mask} fwd+bwd {name}\n{kernels(s['fwd+bwd'])}", flush=True)


if __name__ == "__main__":
    main()
