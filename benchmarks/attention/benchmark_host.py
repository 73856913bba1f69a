"""DotProductAttention against the library called by hand, on the batches of issue #26 (H200).

Batches (THD, bf16, padding_causal): 110 sequences of 64-512 tokens with d128 and GQA 16:2, the
same with d64 and 16:16 heads, and the 32k batch (14 sequences of 512-4096, d128, 16 heads).
For each, forward alone and forward+backward:

  FA4 / cuDNN  the library called by hand ("direct": FA4's flash_attn_varlen_func; cuDNN's graph
               ops called as plain functions, benchmark_attention._cudnn_fn) and through
               DotProductAttention with only that backend switched on, on the same tensors
  autotune     DotProductAttention with every backend on: NVTE_ATTN_AUTOTUNE off (the fixed
               order), =1 (eager timing) and =gpu (GPU timing), with the backend it ran

Each time is the median over calls, in two modes: eager, each call synchronized (from an idle GPU
to its last kernel: host and GPU time), and graph-replayed (the call captured in a CUDA graph,
each replay synchronized: GPU time alone). Eager direct and DPA calls alternate call by call
(which goes first swaps each turn), so drift on the machine hits both alike; the H200's host
moved blocks of 40 eager calls of one path by up to 20%. The ratios DPA / direct are the
issue's targets (<= 1.10 eager; graph-replayed unchanged or better).

  python benchmarks/attention/benchmark_host.py --out benchmarks/results/DIR

Writes DIR/host_bench.json and DIR/host_bench.md after every measurement, so an interrupted run
(or one that reaches --budget seconds, 210 by default, then skips what is left) keeps what it
measured. FA4 compiles each new configuration on its first call (seconds); the warm-up calls
before each measurement absorb that.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from benchmark_attention import ONLY, Env, _cudnn_fn  # run as a script: this directory is on sys.path
from profile_small import graphed
from profile_stages import describe, shapes

ROUNDS = 4  # rounds of graph replays (eager calls: ROUNDS * CALLS turns)
CALLS = 30  # timed calls per round and mode
AUTOTUNE = {"off": "0", "autotune=1": "1", "autotune=gpu": "gpu"}


class Batch:
    """One batch's tensors; :meth:`leaves` gives fresh q/k/v (graph captures want leaves whose
    gradient accumulators never ran on another stream)."""

    def __init__(self, shape):
        self.shape = shape
        cu = [0]
        for n in shape.lengths:
            cu.append(cu[-1] + n)
        self.rows, self.max_len = cu[-1], max(shape.lengths)
        self.cu = torch.tensor(cu, dtype=torch.int32, device="cuda")
        self.grad = torch.randn(self.rows, shape.heads * shape.head_dim, device="cuda", dtype=torch.bfloat16)

    def leaves(self) -> List[torch.Tensor]:
        mk = lambda h: torch.randn(self.rows, h, self.shape.head_dim, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                   requires_grad=True)
        return [mk(self.shape.heads), mk(self.shape.groups), mk(self.shape.groups)]


def fa4_call(batch: Batch, leaves) -> Callable[[], torch.Tensor]:
    from flash_attn.cute import flash_attn_varlen_func

    c, m = batch.cu, batch.max_len

    def call():
        out = flash_attn_varlen_func(*leaves, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=m, max_seqlen_k=m, causal=True)
        return out[0] if isinstance(out, tuple) else out

    return call


def cudnn_call(batch: Batch, leaves) -> Callable[[], torch.Tensor]:
    lens = batch.cu[1:] - batch.cu[:-1]
    args = (batch.cu, batch.cu, lens, lens, lens.numel(), batch.max_len, batch.max_len, batch.shape.head_dim ** -0.5, True,
            -1, -1, False)
    return _cudnn_fn(args, leaves, None, False, 0.0)


def dpa_call(batch: Batch, leaves) -> Callable[[], torch.Tensor]:
    from transformer_engine.pytorch import DotProductAttention

    s = batch.shape
    dpa = DotProductAttention(s.heads, s.head_dim, num_gqa_groups=s.groups, qkv_format="thd", attn_mask_type="padding_causal")
    kw = dict(cu_seqlens_q=batch.cu, cu_seqlens_kv=batch.cu, max_seqlen_q=batch.max_len, max_seqlen_kv=batch.max_len)
    call = lambda: dpa(*leaves, **kw)  # noqa: E731
    call.module = dpa
    return call


def step(make: Callable, batch: Batch, with_bwd: bool, leaves=None) -> Callable[[], None]:
    """One synchronizable unit of work: the call under no_grad, or the call and its backward."""
    leaves = leaves if leaves is not None else batch.leaves()
    call = make(batch, leaves)

    def fwd():
        with torch.no_grad():
            call()

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        out = call()
        out.backward(batch.grad.view(out.shape))

    chosen = fwd_bwd if with_bwd else fwd
    chosen.module = getattr(call, "module", None)
    return chosen


def synced_ms(fn: Callable[[], None], n: int = CALLS) -> List[float]:
    """Milliseconds of each of ``n`` calls, each from an idle GPU to its completion."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


class Results:
    """Rows measured so far, written out after each one (an interrupted run keeps them)."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.rows, self.start, self.budget = out, [], time.monotonic(), budget_s
        out.mkdir(parents=True, exist_ok=True)

    def time_left(self) -> bool:
        return time.monotonic() - self.start < self.budget

    def add(self, **row) -> None:
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.write()

    def write(self) -> None:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "?"
        (self.out / "host_bench.json").write_text(json.dumps(dict(device=device, rows=self.rows), indent=1))
        (self.out / "host_bench.md").write_text(markdown(self.rows, device))


def measure_pair(results: Results, batch: Batch, lib: str, with_bwd: bool) -> None:
    """Direct and DPA on one library, eager (alternating call by call) and graph-replayed."""
    tag = "fwd+bwd" if with_bwd else "fwd"
    direct_make = fa4_call if lib == "FA4" else cudnn_call
    with Env(ONLY[lib]):
        leaves = batch.leaves()  # the same tensors for both (graph captures below take fresh ones)
        paths = {"direct": step(direct_make, batch, with_bwd, leaves), "DPA": step(dpa_call, batch, with_bwd, leaves)}
        for fn in paths.values():
            synced_ms(fn, 3)  # warm up: JIT compiles, graph builds, the fast path's recipe
        eager: Dict[str, List[float]] = {name: [] for name in paths}
        for i in range(ROUNDS * CALLS):  # call by call, in turns: the host's drift hits both alike
            for name, fn in (list(paths.items()) if i % 2 == 0 else reversed(list(paths.items()))):
                eager[name] += synced_ms(fn, 1)
        for name, make in (("direct", direct_make), ("DPA", dpa_call)):
            replay = graphed(step(make, batch, with_bwd))
            graph = [t for _ in range(ROUNDS) for t in synced_ms(replay)]
            results.add(batch=batch.shape.name, **{'pass': tag}, lib=lib, path=name, eager_ms=statistics.median(eager[name]),
                        graph_ms=statistics.median(graph))


def measure_autotune(results: Results, batch: Batch, with_bwd: bool) -> None:
    """DotProductAttention with every backend on, autotune off / eager timing / GPU timing."""
    tag = "fwd+bwd" if with_bwd else "fwd"
    for name, value in AUTOTUNE.items():
        with Env({"NVTE_ATTN_AUTOTUNE": value}):
            fn = step(dpa_call, batch, with_bwd)
            synced_ms(fn, 3)  # warm up; the first call of a bucket times the candidates
            eager = synced_ms(fn, ROUNDS * CALLS)
            chosen = fn.module.last_selection
            replay = graphed(step(dpa_call, batch, with_bwd))
            graph = synced_ms(replay, ROUNDS * CALLS)
        results.add(batch=batch.shape.name, **{'pass': tag}, lib=chosen.label, path=name, how=chosen.how,
                    eager_ms=statistics.median(eager), graph_ms=statistics.median(graph))


# ---------------------------------------------------------------------------------- the report


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.3f}" if a and b else "-"


def markdown(rows: List[dict], device: str) -> str:
    """The DPA / direct table per library, then autotune against the best library measured."""
    index = {(r["batch"], r["pass"], r["lib"], r["path"]): r for r in rows}
    lines = [f"Device: {device}. bf16, THD padding_causal; ms per call, median of {ROUNDS * CALLS} calls; eager = each "
             "call synchronized (host + GPU), graph = each CUDA-graph replay synchronized (GPU).", "",
             "| batch | pass | library | direct eager | DPA eager | **DPA/direct eager** | direct graph | DPA graph | "
             "**DPA/direct graph** |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for (batch, tag, lib, path), r in index.items():
        if path != "DPA" or lib not in ONLY:
            continue
        d = index.get((batch, tag, lib, "direct"))
        if d is None:
            continue
        lines.append(f"| {batch} | {tag} | {lib} | {d['eager_ms']:.3f} | {r['eager_ms']:.3f} | "
                     f"**{_ratio(r['eager_ms'], d['eager_ms'])}** | {d['graph_ms']:.3f} | {r['graph_ms']:.3f} | "
                     f"**{_ratio(r['graph_ms'], d['graph_ms'])}** |")
    lines += ["", "Autotune: DPA with every backend on; 'best' is the faster of DPA-on-FA4 and DPA-on-cuDNN above "
              "(target: within 3%).", "",
              "| batch | pass | setting | ran | eager | eager / best | graph | graph / best |", "|---|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if r["path"] not in AUTOTUNE:
            continue
        forced = [index.get((r["batch"], r["pass"], lib, "DPA")) for lib in ONLY]
        best_e = min((f["eager_ms"] for f in forced if f), default=None)
        best_g = min((f["graph_ms"] for f in forced if f), default=None)
        lines.append(f"| {r['batch']} | {r['pass']} | {r['path']} | {r['lib']} | {r['eager_ms']:.3f} | "
                     f"{_ratio(r['eager_ms'], best_e)} | {r['graph_ms']:.3f} | {_ratio(r['graph_ms'], best_g)} |")
    lines += ["", "How each autotuned call chose: " + "; ".join(f"{r['batch']} {r['pass']} {r['path']}: {r['how']}"
                                                             for r in rows if "how" in r)]
    return "\n".join(lines) + "\n"


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for host_bench.json / host_bench.md")
    ap.add_argument("--shapes", default="short-gqa,short-d64,32k")
    ap.add_argument("--budget", type=float, default=210.0, help="seconds after which the rows left are skipped")
    ap.add_argument("--what", default="FA4,cuDNN,autotune", help="which comparisons (before/after runs leave out autotune)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)  # a timeout's TERM: write what was measured
    torch.manual_seed(0)
    os.environ.pop("NVTE_ATTN_AUTOTUNE", None)
    results = Results(Path(args.out), args.budget)
    plan = [(name, with_bwd, what) for name in args.shapes.split(",") for with_bwd in (False, True)
            for what in args.what.split(",")]
    try:
        for name, with_bwd, what in plan:
            if not results.time_left():
                print(f"budget reached: skipping {name} {'fwd+bwd' if with_bwd else 'fwd'} {what}", flush=True)
                continue
            batch = Batch(shapes()[name])
            print(f"# {describe(batch.shape)}, {'fwd+bwd' if with_bwd else 'fwd'}, {what}", flush=True)
            try:
                if what == "autotune":
                    measure_autotune(results, batch, with_bwd)
                else:
                    measure_pair(results, batch, what, with_bwd)
            except Exception:  # one library failing on one batch must not lose the others' rows
                traceback.print_exc()
    except KeyboardInterrupt:
        print("interrupted: writing what was measured", flush=True)
    finally:
        results.write()
        print(markdown(results.rows, torch.cuda.get_device_name()))


if __name__ == "__main__":
    main()
