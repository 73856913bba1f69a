"""Mixed per-sequence policies against their uniform bound, on the GPU (issue #16).

For each batch shape, half of the sequences causal (every other one), bf16, THD:

  mixed          DotProductAttention with ``attn_mask_type_per_seq``, default settings (each
                 policy's call spans the batch, the others' sequences with length 0)
  mixed-compact  the same with NVTE_THD_POLICY_COMPACT=1 (each call gets only its sequences)
  shorthand      ``thd_sequence_is_causal`` (default settings)
  causal, full   the uniform calls on the same tokens

The bound is t_causal * (causal work of the causal sequences / causal work of all) + t_full *
(full work of the full sequences / full work of all): each uniform call's time weighted by the
share of its work the mixed batch holds. Every time is a median of triton's do_bench, forward
alone and forward+backward, both as eager calls and as CUDA-graph replays (host time vs GPU
time). Writes mixed.json and mixed.md under --out; ``--plot`` merges runs and draws the ratios.

  python benchmarks/attention/benchmark_mixed.py --backend fa4 cudnn --out DIR
  python benchmarks/attention/benchmark_mixed.py --backend cudnn --shape 110short-h8-d64 --out DIR2
  python benchmarks/attention/benchmark_mixed.py --plot DIR/mixed.json DIR2/mixed.json --out MERGED
"""

from __future__ import annotations

import argparse
import json
import os
import random
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from profile_small import graphed  # run as a script: this directory is on sys.path

LABELS = {"fa4": "FlashAttention v4", "cudnn": "FusedAttention"}


@dataclass
class Shape:
    name: str
    lengths: List[int]
    heads: int
    groups: int
    head_dim: int
    gap: int = 0  # rows of padding after each sequence


def shapes() -> List[Shape]:
    rng = random.Random(0)
    notes = [4096, 3584, 3072, 2560, 2048, 4096, 1536, 1024, 512, 3072, 2048, 2560, 1024, 1536]
    short = [rng.choice(range(64, 513, 64)) for _ in range(110)]
    return [
        Shape("32k-14seq-h16-d128", notes, 16, 16, 128),
        Shape("4long-5k-12k-h16-d128", [5120, 12288, 8192, 9728], 16, 16, 128),
        Shape("110short-h16-gqa2-d128", short, 16, 2, 128),
        Shape("110short-h8-d64", short, 8, 8, 64),
        Shape("32k-14seq-gaps-h16-d128", notes, 16, 16, 128, gap=64),
    ]


def _offsets(lengths: List[int], gap: int) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n + gap)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def _work(lengths: List[int], causal: List[bool]):
    full_all = sum(n * n for n in lengths)
    causal_part = sum(n * n for n, c in zip(lengths, causal) if c)
    full_part = sum(n * n for n, c in zip(lengths, causal) if not c)
    return causal_part / full_all, full_part / full_all  # causal work scales the same way


class Case:
    """Inputs and the five calls of one shape on one backend."""

    def __init__(self, shape: Shape, backend: str):
        from transformer_engine.pytorch import DotProductAttention

        self.shape, self.label = shape, LABELS[backend]
        b = len(shape.lengths)
        cu = _offsets(shape.lengths, 0)
        total = int(cu[-1]) + b * shape.gap
        mk = lambda h: torch.randn(total, h, shape.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
        self.q, self.k, self.v = mk(shape.heads), mk(shape.groups), mk(shape.groups)
        self.causal = [i % 2 == 0 for i in range(b)]
        m = max(shape.lengths)
        self.kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m)
        if shape.gap:
            off = _offsets(shape.lengths, shape.gap)
            self.kwargs.update(cu_seqlens_q_padded=off, cu_seqlens_kv_padded=off)
        ids = torch.arange(b, device="cuda")
        flags = torch.tensor(self.causal, device="cuda")
        self.per_seq = {"padding_causal": ids[flags].clone(), "padding": ids[~flags].clone()}
        self.is_causal = flags
        self.dpa = DotProductAttention(shape.heads, shape.head_dim, num_gqa_groups=shape.groups, qkv_format="thd",
                                       attn_mask_type="padding_causal")

    def call(self, variant: str, qkv=None) -> Callable[[], torch.Tensor]:
        q, k, v = qkv or (self.q, self.k, self.v)
        kw = dict(self.kwargs)
        if variant.startswith("mixed"):
            kw["attn_mask_type_per_seq"] = self.per_seq
        elif variant == "shorthand":
            kw["thd_sequence_is_causal"] = self.is_causal
        elif variant == "full":
            kw["attn_mask_type"] = "padding"
        return lambda: self.dpa(q, k, v, **kw)


def _step(fn, inputs, with_bwd: bool):
    if not with_bwd:
        def fwd():
            with torch.no_grad():
                return fn()
        return fwd
    grad = torch.randn_like(fn())

    def both():
        out = fn()
        return torch.autograd.grad(out, inputs, grad)
    return both


def _time(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=20, rep=120, return_mode="median")


VARIANT_ENV = {"mixed-compact": {"NVTE_THD_POLICY_COMPACT": "1"}}
SWITCHES = ("NVTE_THD_POLICY_COMPACT",)


def measure(case: Case, variant: str, with_bwd: bool, graph: bool) -> float:
    from transformer_engine.pytorch.attention import backend_scope

    saved = {name: os.environ.pop(name, None) for name in SWITCHES}
    os.environ.update(VARIANT_ENV.get(variant, {}))
    try:
        with backend_scope(allow=[case.label]):
            step = _step(case.call(variant), (case.q, case.k, case.v), with_bwd)
            step()
            if case.dpa.last_selection.label != case.label:
                raise RuntimeError(f"{case.label} was not selected: {case.dpa.last_selection.label}")
            if not graph:
                return _time(step)
            # Fresh leaves for the capture (as in profile_small): leaves that eager steps used on
            # the default stream make the captured backward sync that stream, which fails.
            fresh = tuple(t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v))
            return _time(graphed(_step(case.call(variant, fresh), fresh, with_bwd)))
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


VARIANTS = ("causal", "full", "mixed", "mixed-compact", "shorthand")
MIXED = VARIANTS[2:]


def run(backends: List[str], out: Path, names: Optional[List[str]] = None) -> List[Dict]:
    rows = []
    for backend in backends:
        for shape in shapes():
            if names and shape.name not in names:
                continue
            case = Case(shape, backend)
            share_c, share_f = _work(shape.lengths, case.causal)
            for with_bwd in (False, True):
                for graph in (False, True):
                    row = dict(backend=backend, shape=shape.name, pass_="fwd+bwd" if with_bwd else "fwd",
                               mode="graph" if graph else "eager")
                    for variant in VARIANTS:
                        try:
                            row[variant] = measure(case, variant, with_bwd, graph)
                        except Exception as err:  # noqa: BLE001 - one failed cell must not end the run
                            row[variant] = None
                            row.setdefault("errors", {})[variant] = f"{type(err).__name__}: {err}"[:300]
                            traceback.print_exc()
                    if row["causal"] and row["full"]:
                        row["bound"] = row["causal"] * share_c + row["full"] * share_f
                        for variant in MIXED:
                            if row[variant]:
                                row[f"{variant}/bound"] = row[variant] / row["bound"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del case
            torch.cuda.empty_cache()
    out.mkdir(parents=True, exist_ok=True)
    (out / "mixed.json").write_text(json.dumps(rows, indent=1))
    (out / "mixed.md").write_text(markdown(rows))
    return rows


def markdown(rows: List[Dict]) -> str:
    head = ("| backend | shape | pass | mode | causal ms | full ms | bound ms | mixed ms | mixed/bound | "
            "compact/bound | shorthand/bound |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    fmt = lambda x, p=3: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['backend']} | {r['shape']} | {r['pass_']} | {r['mode']} | {fmt(r['causal'])} | {fmt(r['full'])} | "
                     f"{fmt(r.get('bound'))} | {fmt(r['mixed'])} | {fmt(r.get('mixed/bound'), 2)} | "
                     f"{fmt(r.get('mixed-compact/bound'), 2)} | "
                     f"{fmt(r.get('shorthand/bound'), 2)} |")
    return "\n".join(lines) + "\n"


def plot(paths: List[Path], out: Path) -> Path:
    """Merge the rows of ``paths`` into ``out``/mixed.json and .md, and draw ``out``/mixed.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for path in paths for row in json.loads(path.read_text())]
    if any("mixed-span" in row for row in rows):
        # Files from before 5a89eb8, where "mixed" meant compacted calls: their columns differ.
        raise ValueError("--plot: these files hold the older variants (mixed-span); plot them with the script of their commit")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "mixed.json"
    path.write_text(json.dumps(rows, indent=1))
    (out / "mixed.md").write_text(markdown(rows))
    panels = sorted({(r["backend"], r["pass_"], r["mode"]) for r in rows})
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.6 * len(panels)), squeeze=False)
    for ax, (backend, pass_, mode) in zip(axes[:, 0], panels):
        sel = [r for r in rows if (r["backend"], r["pass_"], r["mode"]) == (backend, pass_, mode)]
        x = range(len(sel))
        width = 0.8 / len(MIXED)
        for i, variant in enumerate(MIXED):
            ax.bar([j + width * (i - (len(MIXED) - 1) / 2) for j in x], [r.get(f"{variant}/bound") or 0 for r in sel], width=width, label=variant)
        ax.axhline(1.15 if backend == "fa4" else 1.3, color="k", linestyle="--", linewidth=0.8)
        ax.set_xticks(list(x), [r["shape"] for r in sel], fontsize=7)
        ax.set_ylabel("time / bound")
        ax.set_title(f"{backend}, {pass_}, {mode}", fontsize=9)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    return png


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", nargs="+", choices=sorted(LABELS), default=["fa4", "cudnn"])
    parser.add_argument("--out", type=Path, default=Path("bench-mixed"))
    parser.add_argument("--shape", nargs="+", choices=[s.name for s in shapes()],
                        help="only these shapes (one process per shape keeps a failed CUDA-graph capture, which "
                             "poisons the process's RNG state, from failing the shapes after it)")
    parser.add_argument("--plot", type=Path, nargs="+", help="draw the ratios of earlier runs' mixed.json files (merged) and exit")
    args = parser.parse_args(argv)
    if args.plot:
        print(plot(args.plot, args.out))
        return
    run(args.backend, args.out, args.shape)


if __name__ == "__main__":
    main()
