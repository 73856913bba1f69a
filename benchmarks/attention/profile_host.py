"""Host (Python) time of one launch-bound training step, the library called directly vs
DotProductAttention: cProfile's top functions by own time, and the host cost of single pieces.

    cd benchmarks/attention && python profile_host.py [--lib FA4|cuDNN]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch

from benchmark_attention import BATCHES, ONLY, Env, cu, cudnn_direct, dpa_thd, fa4_direct
from profile_small import host_us, steps


def top(step, n=100, rows=25, sort="tottime") -> str:
    step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(rows)
    return buf.getvalue()


def phases(name, fwd, inputs) -> None:
    """Host time of the forward (with and without grad) and of the backward alone."""
    g = torch.randn_like(fwd())
    nograd = host_us(steps(fwd, inputs)["fwd"], n=200)
    withgrad = host_us(fwd, n=200)
    outs = [fwd() for _ in range(200)]
    torch.cuda.synchronize()
    t = time.perf_counter()
    for o in outs:
        o.backward(g)
    bwd = (time.perf_counter() - t) / len(outs) * 1e6
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    steps(fwd, inputs)["fwd+bwd"]()
    after = torch.cuda.memory_stats()
    mallocs = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
    print(f"[phase] {name}: fwd no-grad {nograd:.0f} us, fwd with grad {withgrad:.0f} us, backward {bwd:.0f} us; allocator {mallocs}")


def main():
    import argparse

    from transformer_engine.pytorch.attention.dot_product_attention.backends.gap_rows import zero_gap_rows, zero_gap_rows_qkv

    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="FA4", choices=("FA4", "cuDNN"))
    lib = ap.parse_args().lib
    lengths = BATCHES["many-short"]
    with Env(ONLY[lib]):
        direct_fwd, direct_inputs = (fa4_direct if lib == "FA4" else cudnn_direct)(lengths, 64, True)
        fwd, inputs, _ = dpa_thd(lengths, 64, "padding_causal")
        direct, dpa = steps(direct_fwd, direct_inputs), steps(fwd, inputs)
        print(f"[host] step direct {host_us(direct['fwd+bwd'], n=200):.0f} us, DPA {host_us(dpa['fwd+bwd'], n=200):.0f} us")
        x, c = inputs[0].detach(), cu(lengths)
        y, z = (t.detach() for t in inputs[1:])
        print(f"[host] zero_gap_rows {host_us(lambda: zero_gap_rows(x, c, c, -1), n=200):.1f} us; "
              f"zero_gap_rows_qkv {host_us(lambda: zero_gap_rows_qkv(x, y, z, c, c, c, c, -1), n=200):.1f} us; "
              f"torch.empty {host_us(lambda: torch.empty_like(x), n=200):.1f} us")
        phases("direct", direct_fwd, direct_inputs)
        phases("DPA", fwd, inputs)
        print("[profile] DPA forward, cumulative\n" + top(dpa["fwd"], rows=45, sort="cumtime"))
        print("[profile] direct\n" + top(direct["fwd+bwd"]))
        print("[profile] DPA\n" + top(dpa["fwd+bwd"]))


if __name__ == "__main__":
    main()
