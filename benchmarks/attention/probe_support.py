"""What FA4 and cuDNN actually run on this GPU: head-dim pairs, layouts, forward and backward.

Every case runs through the library ops directly (not through selection), so a case that fails
here is one the support declarations must refuse. A crash that poisons the CUDA context (an
illegal memory access) only ends the worker process: the driver restarts a fresh worker at the
next case, so one crash cannot hide the rest.

    python benchmarks/attention/probe_support.py [--only fa4_hdim,cudnn_hdim,cudnn_packed] [--out probe.jsonl]

Each line of output is one case: {"case": ..., "ok": bool, "error": str}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from typing import Dict, List

import torch

HDIMS = [(32, 32), (64, 64), (96, 96), (128, 128), (160, 160), (192, 192), (224, 224), (256, 256),
         (64, 128), (128, 64), (96, 128), (128, 96), (192, 128), (128, 192), (256, 128), (128, 256), (72, 72), (200, 200)]
LENGTHS = [200, 77, 300, 5]
GAP = 11
H, HG = 8, 2
_STAGE = ["fwd"]  # which half of the case is running, for the error text


def _cases() -> List[Dict]:
    cases = []
    for dqk, dv in HDIMS:  # FA4 JIT-compiles each configuration (seconds): THD causal only, plus dense mismatches
        cases.append(dict(group="fa4_hdim", lib="fa4", fmt="thd", dqk=dqk, dv=dv, causal=True, layout="separate", dtype="bf16"))
        if dqk != dv:
            cases.append(dict(group="fa4_hdim", lib="fa4", fmt="bshd", dqk=dqk, dv=dv, causal=False, layout="separate", dtype="bf16"))
    for dqk, dv in HDIMS:
        for fmt in ("thd", "bshd"):
            for causal in (True, False):
                cases.append(dict(group="cudnn_hdim", lib="cudnn", fmt=fmt, dqk=dqk, dv=dv, causal=causal, layout="separate",
                                  dtype="bf16"))
    for lib in ("fa4", "cudnn"):
        cases.append(dict(group=f"{lib}_hdim", lib=lib, fmt="thd", dqk=128, dv=128, causal=True, layout="separate", dtype="fp16"))
    for layout in ("t3hd", "th3d", "thd_t2hd", "thd_th2d", "separate"):
        for variant in ("as_is", "contiguous_bwd", "accum_scaled"):
            for gaps in (False, True):
                cases.append(dict(group="cudnn_packed", lib="cudnn", fmt="thd", dqk=64, dv=64, causal=True, layout=layout,
                                  variant=variant, gaps=gaps, dtype="bf16"))
    return cases


def _thd_meta(gaps: bool):
    slots = [n + (GAP if gaps else 0) for n in LENGTHS]
    cu = torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)), dtype=torch.int32, device="cuda")
    off = torch.tensor([0] + list(torch.tensor(slots).cumsum(0)), dtype=torch.int32, device="cuda")
    lens = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    return int(off[-1]), cu, off, lens


def _make(case):
    dtype = torch.bfloat16 if case["dtype"] == "bf16" else torch.float16
    dqk, dv = case["dqk"], case["dv"]
    layout = case["layout"]
    if case["fmt"] == "thd":
        total, cu, off, lens = _thd_meta(case.get("gaps", False))
        lead = (total,)
    else:
        lead = (2, 257)
    if layout == "separate":
        q = torch.randn(*lead, H, dqk, dtype=dtype, device="cuda")
        k = torch.randn(*lead, HG, dqk, dtype=dtype, device="cuda")
        v = torch.randn(*lead, HG, dv, dtype=dtype, device="cuda")
    elif layout in ("t3hd", "th3d"):
        buf = torch.randn(*lead, 3, H, dqk, dtype=dtype, device="cuda") if layout == "t3hd" else \
            torch.randn(*lead, H, 3, dqk, dtype=dtype, device="cuda")
        dim = -3 if layout == "t3hd" else -2
        q, k, v = (buf.select(dim, i) for i in range(3))
    else:
        q = torch.randn(*lead, H, dqk, dtype=dtype, device="cuda")
        buf = torch.randn(*lead, 2, H, dqk, dtype=dtype, device="cuda") if layout == "thd_t2hd" else \
            torch.randn(*lead, H, 2, dqk, dtype=dtype, device="cuda")
        dim = -3 if layout == "thd_t2hd" else -2
        k, v = (buf.select(dim, i) for i in range(2))
    meta = (cu, off, lens) if case["fmt"] == "thd" else None
    return q, k, v, meta


def _run_fa4(case):
    from transformer_engine.pytorch.attention.dot_product_attention.backends import fa4

    q, k, v, meta = _make(case)
    scale = case["dqk"] ** -0.5
    if meta is None:
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device="cuda")
        args = (None, None, None, None, q.shape[1], k.shape[1])
    else:
        _, off, lens = meta
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device="cuda")
        args = (off, off, lens, lens, max(LENGTHS), max(LENGTHS))
    fa4.fa4_fwd(q, k, v, out, lse, *args, scale, case["causal"], -1, -1)
    torch.cuda.synchronize()
    _STAGE[0] = "bwd"
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    fa4.fa4_bwd(torch.randn_like(out), q, k, v, out, lse, dq, dk, dv, *args, scale, case["causal"], -1, -1, False)
    torch.cuda.synchronize()
    return bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(t).all()) for t in (dq, dk, dv))


def _run_cudnn(case):
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import graphs, ops

    q, k, v, meta = _make(case)
    variant = case.get("variant", "as_is")
    if variant == "accum_scaled":
        # Hypothesis: the dQ accumulator is sized in tokens but indexed with q's ragged (element)
        # offsets, so a packed q (token stride 3*h*d) needs a proportionally larger accumulator.
        orig = graphs._round64
        graphs._round64 = lambda n: orig(n * 3)
    scale = case["dqk"] ** -0.5
    if meta is None:
        args = (None, None, None, None, q.shape[0], q.shape[1], k.shape[1])
    else:
        _, off, lens = meta
        args = (off, off, lens, lens, len(LENGTHS), max(LENGTHS), max(LENGTHS))
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    stats = ops.cudnn_fwd(q, k, v, out, *args, scale, case["causal"], -1, -1, False)
    torch.cuda.synchronize()
    _STAGE[0] = "bwd"
    if variant == "contiguous_bwd":
        q, k, v = (t.contiguous() for t in (q, k, v))
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    ops.cudnn_bwd(torch.randn_like(out), q, k, v, out, stats, dq, dk, dv, *args, scale, case["causal"], -1, -1, False, False)
    torch.cuda.synchronize()
    return bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(t).all()) for t in (dq, dk, dv))


def worker(cases: List[Dict], start: int) -> None:
    for i in range(start, len(cases)):
        case = cases[i]
        _STAGE[0] = "fwd"
        try:
            ok = (_run_fa4 if case["lib"] == "fa4" else _run_cudnn)(case)
            err = "" if ok else "non-finite output or gradient"
        except Exception as e:  # noqa: BLE001 - the probe records every failure as data
            ok, err = False, f"{_STAGE[0]}: {type(e).__name__}: {str(e)[:300]}"
        print("RESULT " + json.dumps(dict(index=i, case=case, ok=ok, error=err)), flush=True)
        if not ok and ("illegal" in err or "CUDA error" in err or "cudaError" in err):
            sys.exit(3)  # the context may be poisoned: let the driver start a fresh process


def drive(cases: List[Dict], out_path: str) -> None:
    start, results = 0, {}
    while start < len(cases):
        proc = subprocess.run([sys.executable, __file__, "--worker", str(start), "--only", ",".join(sorted({c["group"] for c in cases}))],
                              capture_output=True, text=True, env=os.environ)
        last = start - 1
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
                results[r["index"]] = r
                last = r["index"]
        if last + 1 < len(cases) and proc.returncode not in (0, 3):
            crashed = last + 1
            results[crashed] = dict(index=crashed, case=cases[crashed], ok=False,
                                    error=f"worker died (rc {proc.returncode}): {proc.stderr[-300:]}")
            last = crashed
        start = last + 1
    with open(out_path, "w") as f:
        for i in sorted(results):
            f.write(json.dumps(results[i]) + "\n")
    for i in sorted(results):
        r = results[i]
        print(("ok   " if r["ok"] else "FAIL ") + json.dumps(r["case"]) + ("" if r["ok"] else "  -> " + r["error"][:200]))
    print(f"{sum(r['ok'] for r in results.values())} ok, {sum(not r['ok'] for r in results.values())} failed")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="fa4_hdim,cudnn_hdim,cudnn_packed")
    ap.add_argument("--worker", type=int, default=None)
    ap.add_argument("--out", default="probe_support.jsonl")
    a = ap.parse_args()
    groups = set(a.only.split(","))
    cases = [c for c in _cases() if c["group"] in groups]
    if a.worker is not None:
        worker(cases, a.worker)
    else:
        try:
            drive(cases, a.out)
        except Exception:
            traceback.print_exc()
            raise


if __name__ == "__main__":
    main()
