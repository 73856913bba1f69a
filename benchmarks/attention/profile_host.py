"""Host (Python) time of one launch-bound training step, direct FA4 vs DotProductAttention:
cProfile's top functions by own time, and the host cost of single pieces.

    cd benchmarks/attention && python profile_host.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch

from benchmark_attention import BATCHES, ONLY, Env, dpa_thd, fa4_direct


def per_call_us(fn, n=200) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


def step_of(fwd, inputs):
    g = torch.randn_like(fwd())

    def step():
        for t in inputs:
            t.grad = None
        fwd().backward(g)

    return step


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


def main():
    from transformer_engine.pytorch.attention.dot_product_attention.gap_rows import zero_gap_rows

    lengths = BATCHES["many-short"]
    with Env(ONLY["FA4"]):
        direct = step_of(*fa4_direct(lengths, 64, True))
        fwd, inputs, _ = dpa_thd(lengths, 64, "padding_causal")
        dpa = step_of(fwd, inputs)
        print(f"[host] step direct {per_call_us(direct):.0f} us, DPA {per_call_us(dpa):.0f} us")
        x = inputs[0].detach()
        c = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=torch.int32, device="cuda")
        print(f"[host] zero_gap_rows {per_call_us(lambda: zero_gap_rows(x, c, c, -1)):.1f} us; "
              f"torch.empty {per_call_us(lambda: torch.empty_like(x)):.1f} us")
        for name, (f, ins) in (("direct", fa4_direct(lengths, 64, True)), ("DPA", (fwd, inputs))):
            out = f()
            g = torch.randn_like(out)
            with torch.no_grad():
                nograd = per_call_us(f)
            withgrad = per_call_us(f)
            outs = [f() for _ in range(200)]
            torch.cuda.synchronize()
            t = time.perf_counter()
            for o in outs:
                o.backward(g)
            bwd = (time.perf_counter() - t) / len(outs) * 1e6
            torch.cuda.synchronize()
            stats0 = torch.cuda.memory_stats()
            step_of(f, ins)()
            stats1 = torch.cuda.memory_stats()
            mallocs = {k: stats1.get(k, 0) - stats0.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
            print(f"[phase] {name}: fwd no-grad {nograd:.0f} us, fwd with grad {withgrad:.0f} us, backward {bwd:.0f} us; allocator {mallocs}")
        def dpa_fwd():
            with torch.no_grad():
                fwd()

        print("[profile] DPA forward, cumulative\n" + top(dpa_fwd, rows=45, sort="cumtime"))
        print("[profile] direct\n" + top(direct))
        print("[profile] DPA\n" + top(dpa))


if __name__ == "__main__":
    main()
