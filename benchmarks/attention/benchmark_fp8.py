"""FP8 attention on cuDNN against BF16 attention on cuDNN, both through DotProductAttention, on
the GPU (issue 24): one or a few sequences of 8k/16k/32k tokens, head dim 128, causal and not.

For each shape and mask it times, as this package runs them (FusedAttention forced, bshd):

  bf16 fwd          the BF16 forward (no gradients)
  fp8 fwd           the FP8 forward: Q/K/V cast (one pass), sdpa_fp8, O dequantized
  bf16 fwd+bwd      a BF16 training step
  fp8 fwd+bwd       FP8 forward and FP8 backward (NVTE_FP8_DPA_BWD=1)
  fp8 fwd+bf16 bwd  FP8 forward, BF16 backward (NVTE_FP8_DPA_BWD=0)

Each is timed three ways: ``eager_ms``, the median of triton's do_bench over eager calls (what a
training loop sees, host work included); ``gpu_ms``, the same calls queued behind a GPU sleep
so they run back to back (the GPU's own time; valid when ``queued`` says the host enqueued them
all before the sleep ended); and ``graph_ms`` (forward paths), the call (FP8 region entry and exit with
the scale update included) captured in a CUDA graph and replayed. The speedups (bf16 / fp8) use
``graph_ms`` where the capture worked, else ``gpu_ms``; the target for the forward is >= 1.35x. Rows are written to bench_fp8.json and bench_fp8.md under --out after each
measurement, so an interrupted run leaves what it measured.

  python benchmarks/attention/benchmark_fp8.py --out DIR                  # 1 sequence, 16 heads
  python benchmarks/attention/benchmark_fp8.py --groups 4 --out DIR       # GQA 16:4
  python benchmarks/attention/benchmark_fp8.py --seqs 4 --tokens 32768 --out DIR
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path
from typing import Callable, Dict, List

import torch

PATHS = ("bf16 fwd", "fp8 fwd", "bf16 fwd+bwd", "fp8 fwd+bwd", "fp8 fwd+bf16 bwd")
QUEUED_REPS = 20


def _recipe():
    from transformer_engine.common import recipe

    return recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max", fp8_dpa=True)


def eager_ms(fn: Callable[[], None]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def gpu_ms(fn: Callable[[], None]) -> Dict[str, object]:
    """Per-call GPU time of calls enqueued behind a GPU sleep (the probe's timing)."""
    from probe_fp8_paged_common import _queued_time  # run as a script: this directory is on sys.path

    timing = _queued_time(fn, QUEUED_REPS)
    return dict(gpu_ms=timing["kernel_ms_per_call"], queued=timing["kernel_timing_queued"])


def _call(path: str, dpa, qkv, grad: torch.Tensor) -> Callable[[], None]:
    """The timed call of ``path``: entering the FP8 region (and leaving it, with its scale
    update) is part of an FP8 call, as in a training loop."""
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.attention import backend_scope

    fp8, train = path.startswith("fp8"), "bwd" in path

    def fn():
        with backend_scope(allow=["FusedAttention"]):
            with te.autocast(enabled=fp8, recipe=_recipe()):
                if not train:
                    with torch.no_grad():
                        dpa(*qkv)
                    return
                out = dpa(*qkv)
            for t in qkv:
                t.grad = None
            out.backward(grad)

    return fn


def flops(b: int, s: int, h: int, d: int, causal: bool, train: bool) -> float:
    f = 4 * b * s * s * h * d * (0.5 if causal else 1.0)
    return f * (3.5 if train else 1.0)


def measure(args, tokens: int, mask: str, path: str) -> dict:
    import transformer_engine.pytorch as te

    b, s = args.seqs, tokens // args.seqs
    dpa = te.DotProductAttention(args.heads, 128, num_gqa_groups=args.groups, qkv_format="bshd", attn_mask_type=mask)
    qkv = [torch.randn(b, s, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for n in (args.heads, args.groups, args.groups)]
    grad = torch.randn(b, s, args.heads * 128, device="cuda", dtype=torch.bfloat16)
    from benchmark_attention import Env  # run as a script: this directory is on sys.path

    with Env({"NVTE_FP8_DPA_BWD": "0" if path == "fp8 fwd+bf16 bwd" else "1"}):
        fn = _call(path, dpa, qkv, grad)
        fn()
        assert dpa.last_selection.label == "FusedAttention", dpa.last_selection.report()
        row = dict(tokens=tokens, seqs=b, heads=f"{args.heads}:{args.groups}", mask=mask, path=path, eager_ms=round(eager_ms(fn), 4))
        row.update(gpu_ms(fn))
        if "bwd" not in path:  # a failed capture of a training step leaves CUDA's RNG mid-capture (seen on the H200)
            row.update(graph_ms(fn))
    best = row.get("graph_ms", row["gpu_ms"])
    row["tflops"] = round(flops(b, s, args.heads, 128, mask == "causal", "bwd" in path) / best / 1e9, 1)
    return row


def graph_ms(fn: Callable[[], None]) -> Dict[str, object]:
    """Median ms of ``fn`` (the FP8 region's entry and exit with its scale update included)
    captured in one CUDA graph and replayed: the GPU time with no host work between kernels,
    which the queued timing only approaches when the host keeps ahead (``queued``)."""
    from profile_small import graphed  # run as a script: this directory is on sys.path

    try:
        return dict(graph_ms=round(eager_ms(graphed(fn)), 4))
    except Exception as e:  # noqa: BLE001  (recorded; the eager numbers stand)
        return dict(graph_error=f"{type(e).__name__}: {e}"[:200])


def _speedups(rows: List[dict]) -> List[str]:
    index = {(r["tokens"], r["mask"], r["path"]): r.get("graph_ms", r["gpu_ms"]) for r in rows}
    lines = ["", "Speedup over BF16 (GPU time: graph-replayed where captured, else queued; forward target >= 1.35x):", "",
             "| tokens | mask | fp8 fwd | fp8 fwd+bwd | fp8 fwd+bf16 bwd |", "|---|---|---|---|---|"]
    for tokens, mask in dict.fromkeys((r["tokens"], r["mask"]) for r in rows):
        ratio = lambda a, b: f"{index[(tokens, mask, a)] / index[(tokens, mask, b)]:.2f}x" if (tokens, mask, a) in index and (tokens, mask, b) in index else "-"  # noqa: E731
        lines.append(f"| {tokens} | {mask} | {ratio('bf16 fwd', 'fp8 fwd')} | {ratio('bf16 fwd+bwd', 'fp8 fwd+bwd')} | "
                     f"{ratio('bf16 fwd+bwd', 'fp8 fwd+bf16 bwd')} |")
    return lines


def write(rows: List[dict], out: Path, device: dict, status: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_fp8.json").write_text(json.dumps(dict(device=device, status=status, rows=rows), indent=1))
    lines = [f"Device: {device}. Status: {status}. bshd, d128, through DotProductAttention on FusedAttention. "
             "TFLOP/s from graph ms (gpu ms where no graph), causal counted as half, fwd+bwd as 3.5x the forward.", "",
             "| tokens | seqs | heads | mask | path | eager ms | gpu ms | queued | graph ms | TFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['seqs']} | {r['heads']} | {r['mask']} | {r['path']} | {r['eager_ms']} | {r['gpu_ms']} | "
              f"{r['queued']} | {r.get('graph_ms', r.get('graph_error', '-'))} | {r['tflops']} |" for r in rows if "error" not in r]
    lines += [f"| {r['tokens']} | {r['seqs']} | {r['heads']} | {r['mask']} | {r['path']} | error: {r['error']} |||| "
              for r in rows if "error" in r]
    (out / "bench_fp8.md").write_text("\n".join(lines + _speedups([r for r in rows if "error" not in r])) + "\n")


def device_info() -> dict:
    import cudnn

    props = torch.cuda.get_device_properties(0)
    return dict(gpu=props.name, torch=torch.__version__, cudnn=cudnn.backend_version(), cudnn_frontend=cudnn.__version__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="8192,16384,32768")
    ap.add_argument("--masks", default="causal,no_mask")
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--out", default="benchmarks/results/fp8")
    args = ap.parse_args()
    rows, device, out = [], device_info(), Path(args.out)
    try:
        for tokens in (int(t) for t in args.tokens.split(",")):
            for mask in args.masks.split(","):
                for path in args.paths.split(","):
                    try:
                        rows.append(measure(args, tokens, mask, path))
                    except Exception as e:  # noqa: BLE001  (recorded; the others still run)
                        traceback.print_exc()
                        rows.append(dict(tokens=tokens, seqs=args.seqs, heads=f"{args.heads}:{args.groups}", mask=mask, path=path,
                                         error=f"{type(e).__name__}: {e}"[:300]))
                    write(rows, out, device, "running")
                    print(json.dumps(rows[-1]), flush=True)
    except KeyboardInterrupt:
        write(rows, out, device, "interrupted")
        raise
    write(rows, out, device, "complete")
    print((out / "bench_fp8.md").read_text())


if __name__ == "__main__":
    main()
