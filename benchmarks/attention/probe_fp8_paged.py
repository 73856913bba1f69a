"""One GPU probe for issues #24 (FP8 attention on cuDNN) and #25 (KV cache): seven questions,
each a list of cases checked against a float32 reference, printed as they finish and written as
JSON lines to OUT.

    python benchmarks/attention/probe_fp8_paged.py OUT.jsonl [--only Q1,Q6]

Q1  cuDNN ``sdpa_fp8`` forward, E4M3 Q/K/V/O, bshd and sbhd, causal or not, GQA 16:4, d 64/128
Q2  cuDNN ``sdpa_fp8_backward``: HYBRID (E5M2 dO and gradients) and all-E4M3
Q3  the same on THD (ragged offsets + padding mask): accepted on sm90, or the exact refusal
Q4  O declared BF16 in the FP8 graph; Q/K/V as views of one packed E4M3 buffer (bs3hd, bsh3d)
Q5  cuDNN paged KV (``paged_attention_k_table``/``v_table``), bf16, pages 64/128/256, decode
    and prefill chunks, pools stored [pages, HKV, page, D] or FA4's [pages, page, HKV, D]
Q6  FA4 ``_flash_attn_fwd`` with ``page_table`` (pages 16/64/128/256) and with a dense
    [B, S, HKV, D] cache + ``seqused_k``, q packed THD
Q7  one decode step (B 32, context 4096, GQA 16:2, d 128) timed on both, CUDA events, eager

Records: ``q``, ``case``, ``status`` (ok, mismatch, refused = the library declined while
building, error, skipped, timeout, crashed, not run), ``error`` (the exception text) and the
numbers: ``max_abs_err``, ``rmse_over_range`` (against the reference from the dequantized FP8
inputs, ``vs_fp8_inputs_*``, and from the unquantized inputs, ``vs_orig_*``), the amax outputs
next to the reference's, ``unused_pages_nan_safe``, ``ms_per_call``. One ``env`` record gives
the versions.

The questions run in a worker process (this file with ``--worker``); the driver reads its lines.
A question past its time cap, or a worker that dies (a crash that poisons the CUDA context),
ends that worker, and a fresh one goes on with the next question. The whole run stops at
TOTAL_CAP_S whatever happens; what was not reached is recorded as not run.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque

RESULT_TAG = "RESULT "
TITLES = {"Q1": "cuDNN FP8 forward (bshd, sbhd)", "Q2": "cuDNN FP8 backward", "Q3": "cuDNN FP8 on THD (sm90)",
          "Q4": "FP8: BF16 O, packed QKV", "Q5": "cuDNN paged KV (bf16)", "Q6": "FA4 page_table / dense cache",
          "Q7": "decode timing FA4 vs cuDNN"}
# Per question: the cap after which the driver kills the worker, and the time kept free for each
# later question (so a slow one cannot starve the rest); the worker stops starting cases
# earlier (its soft deadline) and records the rest as skipped.
CAPS_S = {"Q1": 35, "Q2": 45, "Q3": 20, "Q4": 35, "Q5": 35, "Q6": 95, "Q7": 40}
KEEP_FOR_S = {"Q1": 10, "Q2": 10, "Q3": 5, "Q4": 10, "Q5": 20, "Q6": 55, "Q7": 20}
TOTAL_CAP_S = 220
STARTUP_CAP_S = 60
GRACE_S = 8


# ------------------------------------------------------------------ worker


def _soft_deadline(q: str, order: list, stop_at: float, cap: float) -> float:
    later = sum(KEEP_FOR_S[x] for x in order[order.index(q) + 1:])
    return min(time.time() + cap - GRACE_S, stop_at - GRACE_S - later)


def _question(q: str):
    if q in ("Q1", "Q2", "Q3", "Q4"):
        import probe_fp8_paged_fp8 as module
    else:
        import probe_fp8_paged_kv as module
    return getattr(module, q.lower())


def worker(questions: list, stop_at: float, order: list, resume: str) -> None:
    """Run ``questions`` in order; ``resume`` ("Q2:3:31.5") continues a question after its first
    3 cases with 31.5 s of its cap left (a worker restarted after a crash)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is float32, not TF32
    torch.backends.cudnn.allow_tf32 = False
    import probe_fp8_paged_common as common

    try:
        common.emit("env", "versions", status="info", **common.environment())
    except Exception as e:  # noqa: BLE001
        common.emit("env", "versions", status="error", error=f"{type(e).__name__}: {e}")
    caps = dict(CAPS_S)
    if resume:
        q, skip, left = resume.split(":")
        common.SKIP_CASES[q], caps[q] = int(skip), float(left)
    for q in questions:
        print(f"BEGIN {q}", flush=True)
        if q == "Q6":
            _emit_fa4_version(common.emit)
        try:
            _question(q)(_soft_deadline(q, order, stop_at, caps[q]))
        except Exception as e:  # noqa: BLE001 - a question that cannot even start is a record too
            common.emit(q, "(question)", status="error", error=f"{type(e).__name__}: {e}"[:2500])
        print(f"END {q}", flush=True)


def _emit_fa4_version(emit) -> None:
    from importlib import metadata

    try:
        emit("env", "flash-attn-4", status="info", version=metadata.version("flash-attn-4"))
    except Exception as e:  # noqa: BLE001
        emit("env", "flash-attn-4", status="error", error=f"{type(e).__name__}: {e}")


# ------------------------------------------------------------------ driver


def _pump(stream, lines: "queue.Queue") -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _kill(proc: subprocess.Popen) -> None:
    """End the worker (started in its own session, so its group id is its pid) and its children."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


class Run:
    """The driver's state: records (printed and written as they come) and the worker loop."""

    def __init__(self, out_path: str, questions: list):
        self.questions, self.records = questions, []
        self.start = time.time()
        self.stop_at = self.start + TOTAL_CAP_S
        self.out = open(out_path, "w")
        self.spent: Counter = Counter()  # seconds each question has run, over all workers

    def record(self, rec: dict) -> None:
        self.records.append(rec)
        self.out.write(json.dumps(rec) + "\n")
        self.out.flush()
        print(_human(rec), flush=True)

    def drive(self) -> None:
        pending, resume = list(self.questions), None
        while pending and time.time() < self.stop_at - GRACE_S:
            done, stopped, resume = self._worker(pending, resume)
            pending = [q for q in pending if q not in done and (q != stopped or resume is not None)]
        for q in pending:
            self.record(dict(q=q, case="(question)", status="not run", error=f"the run's {TOTAL_CAP_S} s cap was reached"))
        self.out.close()
        _summary(self.records, self.questions, time.time() - self.start)

    def _worker(self, pending: list, resume):
        """One worker over ``pending`` (``resume``: (question, cases to pass over) or None);
        returns (questions finished, the question it stopped in, where to resume or None)."""
        cmd = [sys.executable, "-u", os.path.abspath(__file__), "--worker", ",".join(pending), "--order",
               ",".join(self.questions), "--stop-at", repr(self.stop_at)]
        if resume is not None:
            cmd += ["--resume", f"{resume[0]}:{resume[1]}:{CAPS_S[resume[0]] - self.spent[resume[0]]:.1f}"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines: "queue.Queue" = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        done, current, began, tail, seen = set(), None, time.time(), deque(maxlen=20), Counter()
        self.case = "(question)"
        while True:
            # between questions (and at start-up) a worker gets STARTUP_CAP_S to say BEGIN
            cap = STARTUP_CAP_S if current is None else CAPS_S[current] - self.spent[current]
            try:
                line = lines.get(timeout=max(0.05, min(self.stop_at, began + cap) - time.time()))
            except queue.Empty:
                _kill(proc)
                return done, self._lost(current, pending, done, "timeout", f"killed after {time.time() - began:.0f} s", tail), None
            if line is None:
                return self._ended(proc, done, current, began, pending, tail, seen, resume)
            if line.startswith(RESULT_TAG):
                seen[self._result(line, tail)] += 1
            elif line.startswith("CASE "):
                self.case = line[5:]
            elif line.startswith("BEGIN "):
                current, began = line[6:].strip(), time.time()
                print(f"\n=== {current}: {TITLES[current]} (cap {CAPS_S[current]} s, {time.time() - self.start:.0f} s in)",
                      flush=True)
            elif line.startswith("END "):
                done.add(current)
                self.spent[current] += time.time() - began
                current, began = None, time.time()
            else:
                tail.append(line)
                print("    | " + line[:400], flush=True)

    def _ended(self, proc, done, current, began, pending, tail, seen, resume):
        """The worker's output ended: finished, or died in ``current``; then resume after the case
        it died in (a CUDA error it reported exits with code 3; any other death left no record)."""
        rc = proc.wait()
        if current is None and all(q in done for q in pending):
            return done, None, None
        if current is None:
            return done, self._lost(None, pending, done, "crashed", f"worker exit code {rc}", tail), None
        self.spent[current] += time.time() - began
        skip = seen[current] + (resume[1] if resume is not None and resume[0] == current else 0)
        if rc != 3:
            skip += 1
            self.record(dict(q=current, case=self.case, status="crashed",
                             error=f"worker exit code {rc}; last output: " + " | ".join(tail)[-1200:]))
        print(f"    (worker ended with code {rc} in {current}; a fresh worker resumes after its case #{skip})", flush=True)
        return done, current, (current, skip)

    def _result(self, line: str, tail: deque) -> str:
        """Record a RESULT line; returns its question ("" for a broken line)."""
        try:
            rec = json.loads(line[len(RESULT_TAG):])
        except ValueError:  # a line another writer broke into: keep it as output
            tail.append(line)
            print("    | " + line[:400], flush=True)
            return ""
        self.record(rec)
        return rec.get("q", "")

    def _lost(self, current, pending, done, status, why, tail) -> str:
        q = current or next(x for x in pending if x not in done)
        case = self.case if current is not None else "(question)"
        self.record(dict(q=q, case=case, status=status, error=f"{why}; the question's remaining cases did not run; last "
                                                             f"output: " + " | ".join(tail)[-1200:]))
        return q


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _human(rec: dict) -> str:
    text = f"[{rec.get('q')}] {rec.get('case')}: {str(rec.get('status')).upper()}"
    if rec.get("error"):
        text += "\n      error: " + str(rec["error"])[:900]
    rest = [f"{k}={_fmt(v)}" for k, v in rec.items() if k not in ("q", "case", "status", "error")]
    if rest:
        text += "\n      " + " ".join(rest)
    return text


def _summary(records: list, questions: list, elapsed: float) -> None:
    print(f"\nSummary ({elapsed:.0f} s)")
    print(f"{'Q':<3} {'what':<32} {'ok':>3} {'mism':>4} {'refus':>5} {'err':>3} {'other':>5}  first problem")
    for q in questions:
        mine = [r for r in records if r.get("q") == q]
        counts = Counter(r.get("status") for r in mine)
        other = sum(n for s, n in counts.items() if s not in ("ok", "mismatch", "refused", "error"))
        bad = next((r for r in mine if r.get("status") != "ok"), None)
        first = "-" if bad is None else f"{bad.get('case')}: {bad.get('status')} {str(bad.get('error') or '')[:90]}"
        print(f"{q:<3} {TITLES[q]:<32} {counts['ok']:>3} {counts['mismatch']:>4} {counts['refused']:>5} {counts['error']:>3} "
              f"{other:>5}  {first}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="probe_fp8_paged.jsonl", help="JSON-lines file for the records")
    ap.add_argument("--only", default=",".join(TITLES), help="questions to run, e.g. Q1,Q6")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--order", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stop-at", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--resume", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        worker(a.worker.split(","), a.stop_at, a.order.split(","), a.resume)
        return
    questions = [q for q in TITLES if q in a.only.split(",")]
    Run(a.out, questions).drive()


if __name__ == "__main__":
    main()
