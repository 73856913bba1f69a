"""The kernels one FP8 forward launches, with a declared ``qkv_layer`` against separate q/k/v
(issue 24: the packed buffer quantized once), counted with torch's profiler on the GPU.

Both calls run DotProductAttention on FusedAttention in an FP8 region (delayed scaling), no
gradients, after a warm-up (graphs built, Triton compiled). The kernels are grouped: ``cast_fp8``
(this package's one-pass amax + FP8 cast), cuDNN's attention kernel, and the rest (scalar
tables, the amax bookkeeping, O's dequantization), each with its GPU time. Expected: one cast with qkv_layer, three with
separate tensors; everything else the same. Writes fp8_kernels.json and fp8_kernels.md to --out.

  python benchmarks/attention/profile_fp8_kernels.py --out DIR [--tokens 8192 --heads 16]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch


GPU_US: dict = {}  # kernel name -> GPU microseconds in the profiled call (of the last run profiled)


def kernels_of(call) -> Counter:
    """{kernel name: launches} of one ``call()`` (after one call to warm up); their GPU time
    goes to :data:`GPU_US`."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.count]
    GPU_US.clear()
    GPU_US.update({e.key: e.self_device_time_total for e in events})
    return Counter({e.key: e.count for e in events})


def group(name: str) -> str:
    if "cast_fp8" in name:
        return "cast_fp8 (amax + FP8 cast)"
    if any(tag in name.lower() for tag in ("cudnn", "fmha", "sdpa", "flash", "attention")):
        return "cuDNN attention"
    return "other"


def forward_call(dpa, **inputs):
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe
    from transformer_engine.pytorch.attention import backend_scope

    fp8_recipe = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, fp8_dpa=True)

    def call():
        with backend_scope(allow=["FusedAttention"]), te.autocast(recipe=fp8_recipe), torch.no_grad():
            dpa(**inputs)

    return call


def main() -> None:
    import transformer_engine.pytorch as te

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--out", default="benchmarks/results/fp8")
    args = ap.parse_args()
    h, d = args.heads, 128
    layer = torch.randn(1, args.tokens, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = (layer[:, :, i].contiguous() for i in range(3))
    dpa = te.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal")
    runs, times = {}, {}
    for name, inputs in (("qkv_layer", dict(qkv_layer=layer)), ("separate q/k/v", dict(query_layer=q, key_layer=k, value_layer=v))):
        runs[name] = kernels_of(forward_call(dpa, **inputs))
        times[name] = dict(GPU_US)
    assert dpa.last_selection.label == "FusedAttention", dpa.last_selection.report()
    summary = {name: dict(total=sum(c.values()), **{g: sum(n for k_, n in c.items() if group(k_) == g)
                                                    for g in ("cast_fp8 (amax + FP8 cast)", "cuDNN attention", "other")})
               for name, c in runs.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, t in times.items():
        summary[name]["other_us"] = round(sum(us for k_, us in t.items() if group(k_) == "other"), 1)
    (out / "fp8_kernels.json").write_text(json.dumps(dict(summary=summary, kernels={n: dict(c) for n, c in runs.items()},
                                                           gpu_us=times), indent=1))
    lines = [f"Kernels of one FP8 forward (bshd, 1 x {args.tokens} tokens, {h} heads, d{d}, causal, no gradients):", "",
             "| inputs | total | cast_fp8 | cuDNN attention | other | other's GPU us |", "|---|---|---|---|---|---|"]
    lines += [f"| {n} | {s['total']} | {s['cast_fp8 (amax + FP8 cast)']} | {s['cuDNN attention']} | {s['other']} | {s['other_us']} |"
              for n, s in summary.items()]
    for name, c in runs.items():
        lines += ["", f"{name}:", ""] + [f"- {n} x {k_[:150]} ({times[name][k_]:.1f} us)" for k_, n in sorted(c.items())]
    (out / "fp8_kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
