"""Times DotProductAttention per backend against the libraries called directly, on the H200.

Prints TFLOP/s (causal counted as half) and the ratio direct_time / dpa_time, and writes a
markdown table, a JSON file and a PNG plot to --out. Sections:

  uniform   THD batches (the NOTES batch: 32,768 tokens in 14 sequences of 512-4096; many short;
            few long) and a dense bshd batch, causal and full, head dim 128 and 64
  gaps      the NOTES batch with gaps between sequences vs the same tokens without gaps
  per_seq   half the sequences causal: DotProductAttention (one call per policy) vs uniform
            vs regrouping (gather per policy with host-synced sizes, 2 calls, scatter)
  features  cuDNN with dropout and ALiBi (the NOTES batch, causal) and with a post-scale bias
            (dense bshd), through DotProductAttention vs the same cuDNN graphs called directly
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path

import torch

from transformer_engine.pytorch import DotProductAttention

NOTES_LENGTHS = [4096, 3584, 3072, 2560, 2048, 4096, 1536, 1024, 512, 3072, 2048, 2560, 1024, 1536]
BATCHES = {
    "notes-32k": NOTES_LENGTHS,
    "many-short": [128] * 256,
    "few-long": [8192] * 4,
}
H = 16
ONLY = {"FA4": {"NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"}, "cuDNN": {"NVTE_FLASH_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"}}


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=150, return_mode="median")


def flops(lengths, d, causal, bwd):
    f = sum(4 * s * s * H * d for s in lengths) * (0.5 if causal else 1.0)
    return f * (3.5 if bwd else 1.0)


def cu(xs):
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def thd_inputs(total, d, grad):
    return [torch.randn(total, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3)]


def timed(fwd, inputs, with_bwd):
    """Median ms of fwd() alone, or of fwd()+backward."""
    if not with_bwd:
        with torch.no_grad():
            return bench(fwd)
    out = fwd()
    g = torch.randn_like(out)

    def step():
        for t in inputs:
            t.grad = None
        fwd().backward(g)

    return bench(step)


class Env:
    def __init__(self, values):
        self.values, self.saved = values, {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def dpa_thd(lengths, d, mask, gaps=None, per_seq=None, dropout=0.0, **extra):
    """A closure running DotProductAttention on a THD batch, with optional gaps/policies;
    ``extra`` goes to the call (e.g. core_attention_bias_type)."""
    slots = [n + (gaps[i] if gaps else 0) for i, n in enumerate(lengths)]
    inputs = thd_inputs(sum(slots), d, True)
    dpa = DotProductAttention(H, d, qkv_format="thd", attn_mask_type=mask, attention_dropout=dropout)
    kwargs = dict(cu_seqlens_q=cu(lengths), max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    kwargs["cu_seqlens_kv"] = kwargs["cu_seqlens_q"]
    if gaps:
        kwargs["cu_seqlens_q_padded"] = kwargs["cu_seqlens_kv_padded"] = cu(slots)
    if per_seq is not None:
        kwargs["attn_mask_type_per_seq"] = per_seq
    kwargs.update(extra)
    return (lambda: dpa(*inputs, **kwargs)), inputs, dpa


def fa4_direct(lengths, d, causal):
    from flash_attn.cute import flash_attn_varlen_func

    inputs = thd_inputs(sum(lengths), d, True)
    c = cu(lengths)
    m = max(lengths)

    def fwd():
        out = flash_attn_varlen_func(*inputs, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=m, max_seqlen_k=m, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    return fwd, inputs


def cudnn_direct(lengths, d, causal, alibi=False, dropout_p=0.0):
    """The cuDNN graph calls alone (the plain functions FusedAttention runs in eager mode),
    without DotProductAttention's validation, selection and planning. nvidia-cudnn-frontend's
    own torch op is not used for this: its THD backward rejected its forward's stats on this
    batch (shape mismatch)."""
    inputs = thd_inputs(sum(lengths), d, True)
    c, m, scale, b = cu(lengths), max(lengths), d ** -0.5, len(lengths)
    lens = c[1:] - c[:-1]
    return _cudnn_fn((c, c, lens, lens, b, m, m, scale, causal, -1, -1, False), inputs, None, alibi, dropout_p), inputs


def _cudnn_fn(args, inputs, bias, alibi, dropout_p):
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import ops as cudnn

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            rng = torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=q.device) if dropout_p > 0 else None
            o = q.new_empty(*q.shape[:-1], v.shape[-1])  # a direct caller's buffer (cuDNN writes every row here)
            stats = cudnn.cudnn_fwd(q, k, v, o, *args, bias, rng, alibi, dropout_p)
            ctx.save_for_backward(q, k, v, o, stats, rng)
            return o

        @staticmethod
        def backward(ctx, grad):
            q, k, v, o, stats, rng = ctx.saved_tensors
            grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
            cudnn.cudnn_bwd(grad.contiguous(), q, k, v, o, stats, *grads, *args, False, bias, rng, alibi, dropout_p)
            return grads

    return lambda: Fn.apply(*inputs)


def row(section, batch, d, mask, what, ms, f):
    r = dict(section=section, batch=batch, head_dim=d, mask=mask, what=what, ms=round(ms, 4), tflops=round(f / ms / 1e9, 1))
    print(json.dumps(r), flush=True)
    return r


REPEATS = 3  # compared paths alternate and each keeps its median: host noise moved single runs by 10%,
# and gaps vs no gaps differ by less than that


def alternate(paths: dict, with_bwd: bool) -> dict:
    """{name: (fn, inputs)} -> {name: median ms over REPEATS rounds that run every path once}."""
    times = {name: [] for name in paths}
    for _ in range(REPEATS):
        for name, (fn, inputs) in paths.items():
            times[name].append(timed(fn, inputs, with_bwd))
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def uniform_section(rows, head_dims, batches=tuple(BATCHES)):
    for batch, lengths in ((b, BATCHES[b]) for b in batches):
        for d in head_dims:
            for causal in (True, False):
                mask = "padding_causal" if causal else "padding"
                for with_bwd in (False, True):
                    f = flops(lengths, d, causal, with_bwd)
                    tag = "fwd+bwd" if with_bwd else "fwd"
                    for lib, direct in (("FA4", fa4_direct), ("cuDNN", cudnn_direct)):
                        try:
                            with Env(ONLY[lib]):
                                paths = {"direct": direct(lengths, d, causal), "via DPA": dpa_thd(lengths, d, mask)[:2]}
                                for name, ms in alternate(paths, with_bwd).items():
                                    rows.append(row("uniform", batch, d, mask, f"{lib} {name} {tag}", ms, f))
                        except Exception:
                            traceback.print_exc()


def gaps_section(rows):
    gaps = [(-n) % 256 + 64 for n in NOTES_LENGTHS]  # round each slot up, plus 64 rows (finite values)
    for lib in ("FA4", "cuDNN"):
        variants = [("no gaps", None, {}), ("gaps", gaps, {})]
        if lib == "FA4":  # the guard's other modes: copies of q/k/v, or none (finite gap rows)
            variants += [(f"gaps, SANITIZE_GAPS={m}", gaps, {"NVTE_FLASH_ATTN_SANITIZE_GAPS": m}) for m in ("copy", "0")]
        for causal in (True, False):
            mask = "padding_causal" if causal else "padding"
            for with_bwd in (False, True):
                f = flops(NOTES_LENGTHS, 128, causal, with_bwd)
                tag = "fwd+bwd" if with_bwd else "fwd"
                try:
                    times = {name: [] for name, _, _ in variants}
                    for _ in range(REPEATS):
                        for name, g, extra in variants:
                            with Env(dict(ONLY[lib], **extra)):
                                fn, inputs, _ = dpa_thd(NOTES_LENGTHS, 128, mask, gaps=g)
                                times[name].append(timed(fn, inputs, with_bwd))
                    for name, ts in times.items():
                        rows.append(row("gaps", "notes-32k", 128, mask, f"{lib} {name} {tag}", sorted(ts)[len(ts) // 2], f))
                except Exception:
                    traceback.print_exc()


def per_seq_section(rows):
    b = len(NOTES_LENGTHS)
    ids_causal = torch.arange(0, b, 2, device="cuda")
    ids_full = torch.arange(1, b, 2, device="cuda")
    per_seq = {"padding_causal": ids_causal, "padding": ids_full}
    causal_len = [NOTES_LENGTHS[i] for i in range(0, b, 2)]
    full_len = [NOTES_LENGTHS[i] for i in range(1, b, 2)]
    for lib in ("FA4", "cuDNN"):
        for with_bwd in (False, True):
            f = flops(causal_len, 128, True, with_bwd) + flops(full_len, 128, False, with_bwd)
            tag = "fwd+bwd" if with_bwd else "fwd"
            try:
                with Env(ONLY[lib]):
                    fn, inputs, _ = dpa_thd(NOTES_LENGTHS, 128, "padding", per_seq=per_seq)
                    rows.append(row("per_seq", "notes-32k", 128, "mixed", f"{lib} mixed via DPA {tag}", timed(fn, inputs, with_bwd), f))
                    for mask in ("padding_causal", "padding"):
                        fn, inputs, _ = dpa_thd(NOTES_LENGTHS, 128, mask)
                        uf = flops(NOTES_LENGTHS, 128, mask == "padding_causal", with_bwd)
                        rows.append(row("per_seq", "notes-32k", 128, mask, f"{lib} uniform {mask} {tag}", timed(fn, inputs, with_bwd), uf))
                    fn, inputs = regroup(per_seq)
                    rows.append(row("per_seq", "notes-32k", 128, "mixed", f"{lib} regroup {tag}", timed(fn, inputs, with_bwd), f))
            except Exception:
                traceback.print_exc()


def regroup(per_seq):
    """The slow baseline: gather whole sequences per policy (host-synced sizes), run each
    group as its own packed batch, scatter back."""
    inputs = thd_inputs(sum(NOTES_LENGTHS), 128, True)
    c = cu(NOTES_LENGTHS)
    dpa = DotProductAttention(H, 128, qkv_format="thd", attn_mask_type="padding")

    def fwd():
        out = torch.empty(inputs[0].shape[0], H * 128, device="cuda", dtype=torch.bfloat16)
        for mask, ids in per_seq.items():
            lengths = (c[ids + 1] - c[ids]).tolist()  # host sync, as the upstream proposal did
            rows = torch.cat([torch.arange(int(c[i]), int(c[i]) + n, device="cuda") for i, n in zip(ids.tolist(), lengths)])
            c_part = cu(lengths)
            part = dpa(*(t.index_select(0, rows) for t in inputs), cu_seqlens_q=c_part, cu_seqlens_kv=c_part,
                       max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths), attn_mask_type=mask)
            out = out.index_copy(0, rows, part)
        return out

    return fwd, inputs


def features_section(rows):
    """cuDNN with dropout / ALiBi / a bias: DotProductAttention vs the graphs called directly."""
    d = 128
    thd = [("dropout 0.1", dict(dropout_p=0.1), dict(dropout=0.1)),
           ("alibi", dict(alibi=True), dict(core_attention_bias_type="alibi"))]
    for name, direct_kw, dpa_kw in thd:
        for with_bwd in (False, True):
            f, tag = flops(NOTES_LENGTHS, d, True, with_bwd), "fwd+bwd" if with_bwd else "fwd"
            try:
                with Env(ONLY["cuDNN"]):
                    paths = {"direct": cudnn_direct(NOTES_LENGTHS, d, True, **direct_kw),
                             "via DPA": dpa_thd(NOTES_LENGTHS, d, "padding_causal", **dpa_kw)[:2]}
                    for path, ms in alternate(paths, with_bwd).items():
                        rows.append(row("features", "notes-32k", d, "padding_causal", f"cuDNN {path} {name} {tag}", ms, f))
            except Exception:
                traceback.print_exc()
    b, s = 2, 4096
    bias = torch.randn(1, H, s, s, device="cuda", dtype=torch.bfloat16)
    for with_bwd in (False, True):
        f, tag = 4 * b * s * s * H * d * 0.5 * (3.5 if with_bwd else 1.0), "fwd+bwd" if with_bwd else "fwd"
        try:
            inputs = [torch.randn(b, s, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
            args = (None, None, None, None, b, s, s, d ** -0.5, True, -1, -1, False)
            dpa = DotProductAttention(H, d, qkv_format="bshd", attn_mask_type="causal")
            with Env(ONLY["cuDNN"]):
                paths = {"direct": (_cudnn_fn(args, inputs, bias, False, 0.0), inputs),
                         "via DPA": ((lambda: dpa(*inputs, core_attention_bias_type="post_scale_bias", core_attention_bias=bias)), inputs)}
                for path, ms in alternate(paths, with_bwd).items():
                    rows.append(row("features", f"bshd b{b} s{s}", d, "causal", f"cuDNN {path} bias 1hss {tag}", ms, f))
        except Exception:
            traceback.print_exc()


def dense_section(rows):
    b, s, d = 8, 4096, 128
    for causal in (True, False):
        mask = "causal" if causal else "no_mask"
        for with_bwd in (False, True):
            f = 4 * b * s * s * H * d * (0.5 if causal else 1.0) * (3.5 if with_bwd else 1.0)
            tag = "fwd+bwd" if with_bwd else "fwd"
            try:
                from flash_attn.cute import flash_attn_func

                inputs = [torch.randn(b, s, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]

                def direct():
                    out = flash_attn_func(*inputs, causal=causal)
                    return out[0] if isinstance(out, tuple) else out

                rows.append(row("dense", f"bshd b{b} s{s}", d, mask, f"FA4 direct {tag}", timed(direct, inputs, with_bwd), f))
                dpa = DotProductAttention(H, d, qkv_format="bshd", attn_mask_type=mask)
                with Env(ONLY["FA4"]):
                    rows.append(row("dense", f"bshd b{b} s{s}", d, mask, f"FA4 via DPA {tag}", timed(lambda: dpa(*inputs), inputs, with_bwd), f))
            except Exception:
                traceback.print_exc()


def write(rows, out_dir: Path, device: str):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(dict(device=device, rows=rows), indent=1))
    lines = [f"Device: {device}. bf16, {H} heads. TFLOP/s count causal as half; fwd+bwd counts 3.5x the forward FLOPs.", "",
             "| section | batch | d | mask | what | ms | TFLOP/s |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['section']} | {r['batch']} | {r['head_dim']} | {r['mask']} | {r['what']} | {r['ms']} | {r['tflops']} |" for r in rows]
    lines += ["", f"Ratio direct_time / DPA_time (uniform: medians of {REPEATS} alternating runs; target >= 0.95):", "", "| batch | d | mask | pass | FA4 | cuDNN |", "|---|---|---|---|---|---|"]
    index = {(r["batch"], r["head_dim"], r["mask"], r["what"]): r["ms"] for r in rows}
    for (batch, d, mask, what), ms in index.items():
        if what.startswith("FA4 direct"):
            tag = what.split()[-1]
            ratios = []
            for lib in ("FA4", "cuDNN"):
                direct, dpa = index.get((batch, d, mask, f"{lib} direct {tag}")), index.get((batch, d, mask, f"{lib} via DPA {tag}"))
                ratios.append(f"{direct / dpa:.3f}" if direct and dpa else "-")
            lines.append(f"| {batch} | {d} | {mask} | {tag} | {ratios[0]} | {ratios[1]} |")
    gap_rows = [(r["mask"], r["what"], r["ms"]) for r in rows if r["section"] == "gaps"]
    if gap_rows:
        lines += ["", f"Gaps: time with gaps / without (median of {REPEATS} alternating runs; target <= 1.03):", "",
                  "| backend | mask | pass | guard | with gaps / without |", "|---|---|---|---|---|"]
        base = {(m, w.split()[0], w.split()[-1]): ms for m, w, ms in gap_rows if " no gaps " in w}
        for m, w, ms in gap_rows:
            lib, tag = w.split()[0], w.split()[-1]
            if " no gaps " not in w and (m, lib, tag) in base:
                guard = w.split(",")[1].strip().rsplit(" ", 1)[0] if "," in w else "default (in place)" if lib == "FA4" else "-"
                lines.append(f"| {lib} | {m} | {tag} | {guard} | {ms / base[(m, lib, tag)]:.3f} |")
    feature_rows = {r["what"]: r["ms"] for r in rows if r["section"] == "features"}
    if feature_rows:
        lines += ["", f"cuDNN features, ratio direct_time / DPA_time (medians of {REPEATS} alternating runs; target >= 0.95):", "", "| feature | pass | ratio |", "|---|---|---|"]
        for what, ms in feature_rows.items():
            if what.startswith("cuDNN direct "):
                via = feature_rows.get(what.replace("direct", "via DPA", 1))
                name, tag = what[len("cuDNN direct "):].rsplit(" ", 1)
                lines.append(f"| {name} | {tag} | {ms / via:.3f} |" if via else f"| {name} | {tag} | - |")
    (out_dir / "bench.md").write_text("\n".join(lines) + "\n")
    plot(rows, out_dir / "bench.png")
    print("\n".join(lines))


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r["section"] in ("uniform", "dense")]
    labels = [f"{r['batch']} d{r['head_dim']} {r['mask'].replace('padding_', '').replace('padding', 'full')}\n{r['what']}" for r in sel]
    fig, ax = plt.subplots(figsize=(10, max(4, 0.22 * len(sel))))
    # Light bars: the library called directly; dark bars: the same through DotProductAttention.
    palette = {("FA4", True): "lightsteelblue", ("FA4", False): "tab:blue", ("cuDNN", True): "lightgreen", ("cuDNN", False): "tab:green"}
    colors = [palette[(r["what"].split()[0], "direct" in r["what"])] for r in sel]
    ax.barh(range(len(sel)), [r["tflops"] for r in sel], color=colors)
    ax.set_yticks(range(len(sel)), labels, fontsize=5)
    ax.invert_yaxis()
    ax.set_xlabel("TFLOP/s (bf16, causal counted as half)")
    ax.set_title("DotProductAttention vs direct library calls (H200)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--sections", default="uniform,gaps,per_seq,dense,features")
    ap.add_argument("--head-dims", default="128,64")
    ap.add_argument("--batches", default=",".join(BATCHES), help="uniform section: which of " + ", ".join(BATCHES))
    args = ap.parse_args()
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    rows = []
    sections = args.sections.split(",")
    if "uniform" in sections:
        uniform_section(rows, [int(x) for x in args.head_dims.split(",")], args.batches.split(","))
    if "gaps" in sections:
        gaps_section(rows)
    if "per_seq" in sections:
        per_seq_section(rows)
    if "dense" in sections:
        dense_section(rows)
    if "features" in sections:
        features_section(rows)
    write(rows, Path(args.out), device)


if __name__ == "__main__":
    main()
