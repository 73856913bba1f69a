"""The driver of TE's configuration matrix (te_matrix.py): groups of cases run in worker
processes, a fresh worker after a case that ended one (a CUDA crash can poison a process), the
results gathered and summed up. ``python -m tests.pytorch.attention.te_matrix`` runs :func:`main`."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from typing import Dict, List

import torch

from . import te_matrix
from .te_matrix import BACKENDS, FAMILIES, GPU_BACKENDS, groups
from .te_matrix_run import run_case

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FATAL = ("illegal memory access", "illegal instruction", "CUDA error", "cudaError", "unspecified launch failure", "misaligned address")


def worker(group: str, start: int, device: str) -> None:
    """Run a group's cases from ``start``, one RESULT line each; exit 3 after a CUDA error (the
    context may be poisoned: the driver continues in a fresh process)."""
    short = group.split(":")[0]
    cases = groups([short])[group]
    crash_at = os.environ.get("TE_MATRIX_CRASH_AT")  # tests of the driver: die hard at this case
    for i in range(start, len(cases)):
        if crash_at == cases[i].id:
            os._exit(134)
        t0 = time.perf_counter()
        r = run_case(cases[i], short, device)
        r.update(group=group, index=i, seconds=round(time.perf_counter() - t0, 3))
        print("RESULT " + json.dumps(r), flush=True)
        if r["status"] == "fail" and any(s in r["detail"] for s in FATAL):
            sys.exit(3)


def drive_group(group: str, device: str, n_cases: int) -> List[dict]:
    """All results of one group, restarting a worker after each case that ended one."""
    results: Dict[int, dict] = {}
    start = 0
    while start < n_cases:
        proc = subprocess.run([sys.executable, "-m", "tests.pytorch.attention.te_matrix_driver", "--worker", group, "--start", str(start),
                               "--device", device], capture_output=True, text=True, cwd=ROOT, env=os.environ.copy())
        last = start - 1
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
                results[r["index"]] = r
                last = r["index"]
        if last + 1 < n_cases and proc.returncode != 3:
            results[last + 1] = dict(index=last + 1, group=group, status="fail", id=None,
                                     detail=f"worker died (rc {proc.returncode}) in this case: {proc.stderr[-600:]}")
            last += 1
        start = last + 1
    return [results[i] for i in sorted(results)]


def drive(device: str, backends, families=None, jobs: int = 4, only_groups=None) -> List[dict]:
    todo = {g: cs for g, cs in groups(backends, families).items() if only_groups is None or g in only_groups}
    out: List[dict] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(drive_group, g, device, len(cs)): g for g, cs in todo.items()}
        for fut in concurrent.futures.as_completed(futures):
            g = futures[fut]
            res = fut.result()
            for r in res:  # a dead worker's record names its case from the list
                if r.get("id") is None:
                    c = todo[g][r["index"]]
                    r.update(id=c.id, family=c.family, backend=BACKENDS[g.split(":")[0]][0])
            out += res
    return out


def summary(results: List[dict]) -> str:
    table: Dict[tuple, Counter] = defaultdict(Counter)
    for r in results:
        table[(r["backend"], r["family"])][r["status"]] += 1
    lines = ["| backend | family | pass | refused | skip | fail |", "|---|---|---|---|---|---|"]
    for (backend, fam), n in sorted(table.items()):
        lines.append(f"| {backend} | {fam} | {n['pass']} | {n['refused']} | {n['skip']} | {n['fail']} |")
    total = Counter(r["status"] for r in results)
    lines.append(f"\ntotal: {total['pass']} pass, {total['refused']} refused, {total['skip']} skip, {total['fail']} fail")
    fails = [r for r in results if r["status"] == "fail"]
    if fails:
        lines.append("\nfailures:")
        lines += [f"  {r['backend']} {r['id']}: {r['detail'][:300]}" for r in fails]
    reasons = Counter((r["backend"], r["detail"]) for r in results if r["status"] == "refused")
    if reasons:
        lines.append("\nrefusal reasons (count):")
        lines += [f"  {n:4d}  {b}: {why[:200]}" for (b, why), n in sorted(reasons.items())]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=te_matrix.__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backends", default=None, help="comma list of fa4, cudnn, unfused (default: fa4,cudnn on cuda)")
    ap.add_argument("--families", default=None, help="comma list of " + ", ".join(FAMILIES))
    ap.add_argument("--jobs", type=int, default=8, help="worker processes at a time")
    ap.add_argument("--out", default=None, help="write every result as a JSON line here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker is not None:
        worker(a.worker, a.start, a.device)
        return 0
    backends = a.backends.split(",") if a.backends else (list(GPU_BACKENDS) if a.device == "cuda" else ["unfused"])
    families = a.families.split(",") if a.families else None
    t0 = time.perf_counter()
    results = drive(a.device, backends, families, a.jobs)
    if a.out:
        with open(a.out, "w") as f:
            for r in sorted(results, key=lambda r: (r["backend"], r["id"])):
                f.write(json.dumps(r) + "\n")
    print(summary(results))
    print(f"\n{len(results)} cases in {time.perf_counter() - t0:.0f} s on {a.device}")
    return 1 if any(r["status"] == "fail" for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
