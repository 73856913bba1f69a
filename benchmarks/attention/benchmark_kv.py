"""KV-cache steps on the GPU (issue #25): DotProductAttention with ``inference_params`` against
the library called directly on the same cache.

Each case: one layer's cache holds B sequences of C cached tokens (bf16, 16 query heads over 2
KV heads, head dim 128; paged caches take their pages in random order) and one step appends
Sq tokens to every sequence (Sq = 1: decode; Sq = 256: a prefill chunk) and attends over the
cache, bottom-right causal. Three ways to run that step:

  dpa      DotProductAttention(q, k, v, inference_params=...): the append and the attention
  direct   the same append (InferenceParams.step: the package's cache manager, the same work)
           and the library called by hand on the cache it returns: FA4's ``_flash_attn_fwd``
           with ``page_table`` (or the non-paged cache) and ``seqused_k``; cuDNN's paged SDPA,
           a cudnn-frontend graph built here as the probe built it
  library  the library call alone, without the append

Times (ms per step): ``graph`` replays the step captured in a CUDA graph (GPU time only; the
ratio direct/dpa is the issue's target, >= 0.95), ``eager`` runs calls back to back, and
``host`` is the host time of one call started on an idle GPU (the eager step's Python against
the library's own). cuDNN's non-paged cache has no direct call here (its ragged graph is the
package's ordinary THD call): dpa only. Rows go to OUT/kv.json and OUT/kv.md after every
case, so a run cut short keeps what it measured; ``--budget`` seconds (default 220, with FA4's
JIT compiles included) stops starting new cases.

    python benchmarks/attention/benchmark_kv.py --out benchmarks/results/kv
    python benchmarks/attention/benchmark_kv.py --backend fa4 --budget 100 --out OUT
"""

from __future__ import annotations

import argparse
import json
import random
import time
import traceback
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from profile_small import graphed, host_us  # run as a script: this directory is on sys.path

H, HKV, D = 16, 2, 128
SCALE = D ** -0.5
BF16 = torch.bfloat16
LABELS = {"fa4": "FlashAttention v4", "cudnn": "FusedAttention"}
# (batch, context): the probe's point first, then the corners and the middle of 1-64 x 1k-32k.
SIZES = [(32, 4096), (1, 1024), (64, 32768), (1, 32768), (64, 1024), (8, 8192), (64, 8192), (8, 32768), (1, 8192)]
PREFILL = [(4, 4096), (4, 32768)]
CHUNK = 256


@dataclass(frozen=True)
class Case:
    backend: str  # fa4 or cudnn
    page: Optional[int]  # None: the non-paged cache
    batch: int
    context: int
    step: int = 1  # new tokens per sequence: 1 decodes, more prefills a chunk

    @property
    def max_len(self) -> int:
        unit = self.page or 64
        return -(-(self.context + self.step) // unit) * unit


def cases(backends: List[str]) -> List[Case]:
    out = []
    for batch, context in SIZES:
        for backend in backends:
            out += [Case(backend, page, batch, context) for page in (64, 256, None)]
    for batch, context in PREFILL:
        out += [Case(backend, 64, batch, context, CHUNK) for backend in backends]
    return out


class Setup:
    """The cache after a prefill of ``context`` random tokens per sequence (pages shuffled), the
    step announced by ``pre_step``, its inputs, and the module."""

    def __init__(self, case: Case) -> None:
        import transformer_engine.pytorch as te

        b, paged = case.batch, case.page is not None
        self.case = case
        self.params = te.InferenceParams(b, case.max_len, num_heads_kv=HKV, head_dim_k=D, dtype=BF16, is_paged=paged,
                                         total_num_pages=b * case.max_len // case.page if paged else None, page_size=case.page,
                                         max_ctx_len=max(case.context, case.step), qkv_format="bshd")
        self.params.allocate_memory(1)
        for cache in self.params.cache_manager.cache[1]:
            cache.normal_()  # what the cached tokens hold: any finite values
        if paged:
            manager = self.params.cache_manager
            manager.free_pages = deque(random.Random(0).sample(range(manager.total_num_pages), manager.total_num_pages))
        self.params.pre_step(OrderedDict((i, case.context) for i in range(b)))
        self.params.pre_step(OrderedDict((i, case.step) for i in range(b)))
        self.q = torch.randn(b, case.step, H, D, dtype=BF16, device="cuda")
        self.k, self.v = (torch.randn(b, case.step, HKV, D, dtype=BF16, device="cuda") for _ in range(2))
        self.dpa = te.DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format="bshd", attn_mask_type="padding_causal",
                                          layer_number=1)

    def dpa_step(self) -> Callable[[], None]:
        from transformer_engine.pytorch.attention import backend_scope

        def step():
            with backend_scope(allow=[self.case.backend]), torch.no_grad():
                self.dpa(self.q, self.k, self.v, inference_params=self.params)
        return step

    def append(self):
        return self.params.step(1, self.k, self.v, "bshd")


def fa4_library(s: Setup) -> Callable[[], None]:
    """FA4 called by hand on the step's cache (what a user of flash_attn.cute writes)."""
    from flash_attn.cute import interface

    step, b, sq = s.append(), s.case.batch, s.case.step
    out = torch.empty(b * sq, H, D, dtype=BF16, device="cuda")
    kwargs = dict(q=s.q.view(b * sq, H, D), k=step.k_cache, v=step.v_cache, cu_seqlens_q=torch.arange(
        0, (b + 1) * sq, sq, dtype=torch.int32, device="cuda"), seqused_k=step.seqlens_kv, max_seqlen_q=sq,
        max_seqlen_k=s.case.max_len, softmax_scale=SCALE, causal=True, out=out, return_lse=False)
    if step.is_paged:
        kwargs["page_table"] = step.page_table
    return lambda: interface._flash_attn_fwd(**kwargs)


def cudnn_library(s: Setup) -> Callable[[], None]:
    """cuDNN's paged SDPA built by hand with cudnn-frontend on the step's pools and page table."""
    import cudnn
    from probe_fp8_paged_common import UID, bhsd, finish, graph_input, graph_output, handle, new_graph

    step, b = s.append(), s.case.batch
    pages = step.page_table.shape[1]
    out = torch.empty_like(s.q)
    g = new_graph(BF16)
    q, k, v = (graph_input(g, name, *bhsd(t), BF16) for name, t in (("q", s.q), ("k", step.k_cache), ("v", step.v_cache)))
    tables = [graph_input(g, n, [b, 1, pages, 1], [pages, pages, 1, 1], torch.int32) for n in ("table_k", "table_v")]
    lens = [graph_input(g, n, [b, 1, 1, 1], [1, 1, 1, 1], torch.int32) for n in ("len_q", "len_kv")]
    o, _ = g.sdpa(name="paged", q=q, k=k, v=v, attn_scale=SCALE, generate_stats=False, use_padding_mask=True, seq_len_q=lens[0],
                  seq_len_kv=lens[1], paged_attention_k_table=tables[0], paged_attention_v_table=tables[1],
                  paged_attention_max_seq_len_kv=s.case.max_len, diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT,
                  diagonal_band_right_bound=0)
    graph_output(o, "o", *bhsd(out), BF16)
    built, workspace = finish(g)
    table = step.page_table.view(b, 1, pages, 1)
    pack = {UID["q"]: s.q, UID["k"]: step.k_cache, UID["v"]: step.v_cache, UID["o"]: out, UID["table_k"]: table,
            UID["table_v"]: table, UID["len_q"]: step.seqlens_q.view(b, 1, 1, 1), UID["len_kv"]: step.seqlens_kv.view(b, 1, 1, 1)}
    space = torch.empty(max(workspace, 1), dtype=torch.uint8, device="cuda")
    return lambda: built.execute(pack, space, handle=handle())  # handle() binds the current stream (graph capture too)


def _bench(fn: Callable[[], None]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def _times(fn: Callable[[], None]) -> Dict[str, float]:
    fn()
    torch.cuda.synchronize()
    return dict(eager=_bench(fn), host=host_us(fn, n=30) / 1e3, graph=_bench(graphed(fn)))


def measure(case: Case) -> Dict:
    s = Setup(case)
    steps = {"dpa": s.dpa_step()}
    if case.page is not None or case.backend == "fa4":
        library = (fa4_library if case.backend == "fa4" else cudnn_library)(s)
        steps["library"] = library
        steps["direct"] = lambda: (s.append(), library())
    row = dict(asdict(case), max_len=case.max_len)
    for name, fn in steps.items():
        for mode, ms in _times(fn).items():
            row[f"{name} {mode}"] = round(ms, 4)
    ran = s.dpa.last_selection.label
    if ran != LABELS[case.backend]:
        raise RuntimeError(f"{LABELS[case.backend]} was not selected: {ran}")
    for mode in ("graph", "eager"):
        if row.get(f"direct {mode}"):
            row[f"direct/dpa {mode}"] = round(row[f"direct {mode}"] / row[f"dpa {mode}"], 3)
    return row


def markdown(rows: List[Dict]) -> str:
    cols = ["backend", "page", "batch", "context", "step", "dpa graph", "direct graph", "library graph", "direct/dpa graph",
            "dpa eager", "direct eager", "direct/dpa eager", "dpa host", "direct host", "library host"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = ["error: " + r["error"][:80] if c == "dpa graph" and "error" in r else r.get(c) for c in cols]
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def run(backends: List[str], out: Path, budget: float) -> List[Dict]:
    start, rows = time.perf_counter(), []
    out.mkdir(parents=True, exist_ok=True)
    for case in cases(backends):
        if time.perf_counter() - start > budget:
            print(f"budget of {budget:.0f} s spent: stopping before {case}", flush=True)
            break
        try:
            row = measure(case)
        except Exception as err:  # noqa: BLE001 - one failed case must not end the run
            traceback.print_exc()
            row = dict(asdict(case), error=f"{type(err).__name__}: {err}"[:300])
        row["elapsed_s"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "kv.json").write_text(json.dumps(rows, indent=1))
        (out / "kv.md").write_text(markdown(rows))
        torch.cuda.empty_cache()
    return rows


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", nargs="+", choices=sorted(LABELS), default=["fa4", "cudnn"])
    parser.add_argument("--out", type=Path, default=Path("bench-kv"))
    parser.add_argument("--budget", type=float, default=220.0, help="seconds after which no new case starts")
    args = parser.parse_args(argv)
    run(args.backend, args.out, args.budget)


if __name__ == "__main__":
    main()
