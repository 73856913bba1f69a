"""What one eager call does on the host and the GPU, DotProductAttention against the library
called by hand (issue #26): torch.profiler over synchronized calls, then per path the host
time from the call's start to the launch of each kernel, the host ops by self time, and the
GPU kernels.

An eager call on a short batch is host-bound until its main kernel is launched: what the host
does before that launch adds to the call's time one for one, what it does after runs while the
GPU computes. So the number that matters per path is "main launch at": microseconds from the
call's start to the library kernel's launch (forward), and to the backward kernel's launch.

    python benchmarks/attention/trace_calls.py --out DIR [--shape short-gqa] [--libs FA4,cuDNN]
    python benchmarks/attention/trace_calls.py --out DIR --analyze    # the summaries again, from DIR's traces

Writes DIR/trace_calls.md (and a Chrome trace per path, DIR/trace_<lib>_<path>.json.gz).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
from pathlib import Path
from typing import Dict, List

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmark_attention import ONLY, Env  # run as a script: this directory is on sys.path
from benchmark_host import Batch, cudnn_call, dpa_call, fa4_call
from profile_stages import shapes

CALLS = 12
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")


def _events(trace_path: Path) -> List[dict]:
    with open(trace_path) as f:
        return json.load(f)["traceEvents"]


def launch_offsets(events: List[dict]) -> Dict[str, List[List[float]]]:
    """Per marked call (the ``mark:fwd``/``mark:bwd`` record_function ranges): the offsets (us)
    from the range's start to each kernel launch inside it, with the launched kernel's name."""
    # The host's ranges only (the profiler also mirrors each range on the GPU's timeline).
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith("mark:")]
    launches = [e for e in events if e.get("ph") == "X" and e.get("name") in LAUNCHES]
    kernels = {e.get("args", {}).get("correlation"): e for e in events if e.get("cat") == "kernel"}
    out: Dict[str, List[List[float]]] = {}
    for r in ranges:
        # Every thread's launches inside the range: the backward's run on autograd's device thread.
        inside = [e for e in launches if r["ts"] <= e["ts"] <= r["ts"] + r["dur"]]
        rows = []
        for e in sorted(inside, key=lambda e: e["ts"]):
            k = kernels.get(e.get("args", {}).get("correlation"))
            name = (k or {}).get("name", "?")
            rows.append([round(e["ts"] - r["ts"], 1), round((k or {}).get("dur", 0.0), 1), name[:70]])
        out.setdefault(r["name"][5:], []).append([round(r["dur"], 1)] + rows)
    return out


def summary(lib: str, path: str, offsets: Dict[str, List[List[float]]]) -> List[str]:
    """Per mark: the median range and the median call's launches."""
    lines = [f"### {lib} {path}", ""]
    for mark, calls in offsets.items():
        median_call = sorted(calls, key=lambda c: c[0])[len(calls) // 2]
        lines.append(f"{mark}: range median {statistics.median(c[0] for c in calls):.1f} us over {len(calls)} calls; the "
                     "median call's launches (us from the range's start, kernel us, kernel):")
        lines += [f"    {t:8.1f}  {d:7.1f}  {name}" for t, d, name in median_call[1:]]
    return lines


def host_ops(prof, n: int = 18) -> str:
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=n, max_name_column_width=60)


def trace_path(lib: str, path: str, batch: Batch, out: Path, with_bwd: bool) -> str:
    make = fa4_call if path == "direct" and lib == "FA4" else cudnn_call if path == "direct" else dpa_call
    leaves = batch.leaves()
    call = make(batch, leaves)

    def one():
        for t in leaves:
            t.grad = None
        with record_function("mark:fwd"):
            out_ = call()
        torch.cuda.synchronize()
        if with_bwd:
            with record_function("mark:bwd"):
                out_.backward(batch.grad.view(out_.shape))
            torch.cuda.synchronize()

    for _ in range(5):
        one()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            one()
    raw = out / f"trace_{lib}_{path}.json"
    prof.export_chrome_trace(str(raw))
    offsets = launch_offsets(_events(raw))
    with open(raw, "rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    lines = summary(lib, path, offsets) + ["", "```", host_ops(prof), "```", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="short-gqa")
    ap.add_argument("--libs", default="FA4,cuDNN")
    ap.add_argument("--analyze", action="store_true", help="summarize the traces already in --out (no GPU needed), and exit")
    args = ap.parse_args()
    out = Path(args.out)
    if args.analyze:
        for trace in sorted(out.glob("trace_*_*.json.gz")):
            lib, path = trace.name[len("trace_"):-len(".json.gz")].split("_", 1)
            with gzip.open(trace) as f:
                print("\n".join(summary(lib, path, launch_offsets(json.load(f)["traceEvents"]))) + "\n")
        return
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    batch = Batch(shapes()[args.shape])
    report = [f"# {args.shape} on {torch.cuda.get_device_name()}", ""]
    for lib in args.libs.split(","):
        with Env(ONLY[lib]):
            for path in ("direct", "DPA"):
                report.append(trace_path(lib, path, batch, out, with_bwd=True))
                (out / "trace_calls.md").write_text("\n".join(report))
    print("\n".join(report))


if __name__ == "__main__":
    main()
