"""Where DotProductAttention's host time goes, stage by stage, forward and backward (issue #26).

For each batch (THD, bf16, padding_causal) and each backend (FA4, cuDNN), the median host time
of one training call, forward and backward apart, split into the stages below (microseconds
per call; each stage's time excludes the stages it calls, see ``stage_clock.py``), next to the
same call uninstrumented and the library called by hand on the same tensors:

  module            nn.Module's call, forward's own body, the output's reshape (what no stage claims)
  fast-path key     the fast path's key of host facts and its lookup
  bound call        the fast path's bound kernel call found (prepare/fast_path.bound_call); a call
                    that runs one skips the three stages below it
  preparation       the cached recipe turned into this call's AttentionInputs
  metadata kernels  THD bounds (made_safe, safe_sides), valid lengths (seqlens), cuDNN's ragged offsets
  plan + problem    the varlen plan and the KernelProblem
  run_kernel        NaN-guard mode, bias and sink, the KernelCall record
  autograd Function torch's autograd.Function.apply and the ctx (forward); the Function's backward body
  kernel fwd/bwd    the kernel class: features, runs, arguments (buffers excluded)
  buffers           output / gradient / statistics allocations outside the library
  op dispatch       kernel_ops.ops.<name>: the eager-or-compiled lookup (cuDNN; FA4's eager calls
                    of the module's problems skip it: their keyword dicts are in "kernel fwd/bwd")
  op body           the registered op's plain function: the library's arguments (cuDNN: graph key, pack)
  gap rows          the launches zeroing rows no sequence owns (Triton on CUDA)
  library call      the library's own entry (FA4's _flash_attn_fwd/_bwd; cuDNN's cached graph execute)
  autograd engine   backward(): torch's engine around the Function's backward, the reshape's backward

Batches: 110 sequences of 64-512 tokens with d128 and GQA 16:2, the same with d64 and 16:16
heads, and the 32k batch (14 sequences of 512-4096, d128, 16 heads).

  python benchmarks/attention/profile_stages.py                     # GPU: real kernels (FA4, cuDNN)
  python benchmarks/attention/profile_stages.py --cpu-noop          # CPU: stand-in libraries that do nothing
  python benchmarks/attention/profile_stages.py --json OUT.json --shapes short-gqa --backends fa4
  python benchmarks/attention/profile_stages.py --compare before1.json,before2.json after1.json,after2.json

With ``--cpu-noop`` the libraries are stand-ins (cuDNN's graph execution returns at once; FA4's
interface, ``noop_fa4.py``, only allocates the buffers FA4 allocates; the gap-row launches are
no-ops: the libraries' own Python, FA4's buffer validation included, is excluded), the
value checks that only run on the CPU are swapped for the CUDA path's work (as
``profile_mixed_host.py`` does), and the package's own Python runs in full: the numbers estimate
the CUDA host path on a CPU core. glibc's malloc is told to keep freed memory (the script re-runs
itself with MALLOC_MMAP_THRESHOLD_ set), so a large allocation costs about what CUDA's caching
allocator charges; there is no direct library call to compare with. On the GPU every call starts
from an idle GPU (synchronized after each call, outside the timed span).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import types
from typing import Callable, Dict, List, Optional

import torch

import noop_fa4  # run as a script: this directory is on sys.path
from benchmark_mixed import Shape
from stage_clock import StageClock, corrected, median

NOTES_LENGTHS = [4096, 3584, 3072, 2560, 2048, 4096, 1536, 1024, 512, 3072, 2048, 2560, 1024, 1536]
FWD_STAGES = ("module", "fast-path key", "bound call", "preparation", "metadata kernels", "plan + problem", "run_kernel",
              "autograd Function", "kernel fwd/bwd", "buffers", "op dispatch", "op body", "gap rows", "library call")
BWD_STAGES = ("autograd engine", "autograd Function", "kernel fwd/bwd", "buffers", "op dispatch", "op body",
              "metadata kernels", "gap rows", "library call")
LABELS = {"fa4": "FA4", "cudnn": "cuDNN"}


def describe(shape: Shape) -> str:
    return (f"{len(shape.lengths)} sequences of {min(shape.lengths)}-{max(shape.lengths)} tokens ({sum(shape.lengths)} rows), "
            f"d{shape.head_dim}, {shape.heads}:{shape.groups} heads, padding_causal")


def shapes() -> Dict[str, Shape]:
    rng = random.Random(0)  # the 110 lengths of benchmark_mixed.py's short batches
    short = [rng.choice(range(64, 513, 64)) for _ in range(110)]
    return {"short-gqa": Shape("short-gqa", short, 16, 2, 128), "short-d64": Shape("short-d64", short, 16, 16, 64),
            "32k": Shape("32k", NOTES_LENGTHS, 16, 16, 128)}


# ---------------------------------------------------------------------------------- CPU stand-ins


def install_stand_ins() -> None:
    """Libraries that do nothing, and the CUDA path's host work on the CPU (see the docstring)."""
    from profile_mixed_host import _as_on_cuda
    from transformer_engine.pytorch.attention.dot_product_attention.backends import kernel_ops
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import graphs

    _as_on_cuda()
    sys.modules["flash_attn.cute.interface"] = noop_fa4.interface()
    cudnn = types.ModuleType("cudnn")
    cudnn.diagonal_alignment = types.SimpleNamespace(TOP_LEFT="top_left", BOTTOM_RIGHT="bottom_right")
    sys.modules["cudnn"] = cudnn
    graphs.run_graph = lambda key, build, pack, device: None
    for name in ("zero_gap_rows", "zero_gap_rows_qkv"):
        kernel_ops._EAGER[name] = lambda *args: None


def _cpu_allocator_like_cuda() -> None:
    """Re-run this process with glibc's malloc keeping freed memory (no mmap/munmap per large
    buffer): a CPU allocation of an output then costs about what CUDA's caching allocator
    charges (~1 us instead of ~25 us), so the buffers stage estimates the GPU host path."""
    wanted = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}
    if all(os.environ.get(k) == v for k, v in wanted.items()):
        return
    os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, **wanted))


# ---------------------------------------------------------------------------------- the stages


def patch_stages(clock: StageClock) -> None:
    """Wrap every function the stages name (see the module docstring)."""
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa_module
    from transformer_engine.pytorch.attention.dot_product_attention.backends import fa4, kernel_autograd, kernel_ops
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import declaration, graphs, kernel
    from transformer_engine.pytorch.attention.dot_product_attention.prepare import fast_path, packed_seqs

    for name in ("call_key", "lookup"):
        clock.patch(dpa_module, name, "fast-path key")
    if hasattr(dpa_module, "bound_call"):
        clock.patch(dpa_module, "bound_call", "bound call")
    clock.patch(fast_path.CallRecipe, "inputs", "preparation")
    clock.patch(packed_seqs, "safe_sides", "metadata kernels")  # made_safe and the fast path both go through it
    clock.patch(packed_seqs.PackedSeqs, "seqlens", "metadata kernels")
    clock.patch(graphs, "metadata_pack", "metadata kernels")
    if hasattr(kernel, "_offsets64"):  # cuDNN's int64 offsets, once per forward
        clock.patch(kernel, "_offsets64", "metadata kernels")
    for owner in (fa4, declaration):
        clock.patch(owner, "plan_varlen", "plan + problem")
        clock.patch(owner, "run_kernel", "run_kernel")
    clock.patch(kernel_autograd, "module_problem", "plan + problem")
    clock.patch(kernel_autograd._KernelAttention, "apply", "autograd Function")
    if getattr(kernel_autograd, "_C_APPLY", None) is not None:  # the C entry eager calls take
        clock.patch(kernel_autograd, "_C_APPLY", "autograd Function")
    clock.patch(kernel_autograd._KernelAttention, "backward", "autograd Function")
    clock.patch(kernel_autograd.KernelCall, "forward", "kernel fwd/bwd")
    for cls in (fa4._FA4Kernel, kernel._CudnnKernel):
        clock.patch(cls, "forward", "kernel fwd/bwd")
        clock.patch(cls, "backward", "kernel fwd/bwd")
    clock.patch(kernel_ops.KernelOps, "__getattr__", "op dispatch")
    for name in list(kernel_ops._EAGER):
        clock.patch_item(kernel_ops._EAGER, name, "gap rows" if name.startswith("zero_gap_rows") else "op body")
    clock.patch(graphs, "run_graph", "library call")
    library = sys.modules.get("flash_attn.cute.interface")
    if library is not None:
        for name in ("_flash_attn_fwd", "_flash_attn_bwd"):
            clock.patch(library, name, "library call")
    for name in ("empty", "zeros", "full", "empty_like", "zeros_like"):
        clock.patch(torch, name, "buffers", passthrough=("library call",))
    for name in ("new_empty", "new_zeros"):
        clock.patch(torch.Tensor, name, "buffers", passthrough=("library call",))


# ---------------------------------------------------------------------------------- one case


class Case:
    """One batch on one backend: the module call, the library called by hand, and timers."""

    def __init__(self, shape: Shape, backend: str, device: str):
        from transformer_engine.pytorch import DotProductAttention

        self.backend, self.device = backend, device
        cu = [0]
        for n in shape.lengths:
            cu.append(cu[-1] + n)
        mk = lambda h: torch.randn(cu[-1], h, shape.head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
        self.inputs = [mk(shape.heads), mk(shape.groups), mk(shape.groups)]
        self.cu = torch.tensor(cu, dtype=torch.int32, device=device)
        self.max_len = max(shape.lengths)
        self.dpa = DotProductAttention(shape.heads, shape.head_dim, num_gqa_groups=shape.groups, qkv_format="thd",
                                       attn_mask_type="padding_causal")
        self.kwargs = dict(cu_seqlens_q=self.cu, cu_seqlens_kv=self.cu, max_seqlen_q=self.max_len, max_seqlen_kv=self.max_len)
        self.grad = torch.randn(cu[-1], shape.heads * shape.head_dim, device=device, dtype=torch.bfloat16)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def forward(self) -> torch.Tensor:
        return self.dpa(*self.inputs, **self.kwargs)

    def direct(self) -> Optional[Callable[[], torch.Tensor]]:
        """The library called by hand on the same tensors (GPU only)."""
        if self.device != "cuda":
            return None
        if self.backend == "fa4":
            from flash_attn.cute import flash_attn_varlen_func

            c, m = self.cu, self.max_len

            def fa4_call():
                out = flash_attn_varlen_func(*self.inputs, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=m, max_seqlen_k=m,
                                             causal=True)
                return out[0] if isinstance(out, tuple) else out

            return fa4_call
        from benchmark_attention import _cudnn_fn

        q = self.inputs[0]
        lens = self.cu[1:] - self.cu[:-1]
        args = (self.cu, self.cu, lens, lens, lens.numel(), self.max_len, self.max_len, q.shape[-1] ** -0.5, True, -1, -1, False)
        return _cudnn_fn(args, self.inputs, None, False, 0.0)

    def host_times(self, fwd: Callable[[], torch.Tensor], n: int):
        """([forward us], [backward us]) of ``n`` training calls, each from an idle device."""
        fwd_us, bwd_us = [], []
        for _ in range(n):
            for t in self.inputs:
                t.grad = None
            self.sync()
            start = time.perf_counter()
            out = fwd()
            fwd_us.append((time.perf_counter() - start) * 1e6)
            self.sync()
            grad = self.grad if out.dim() == 2 else self.grad.view(out.shape)
            start = time.perf_counter()
            out.backward(grad)
            bwd_us.append((time.perf_counter() - start) * 1e6)
            self.sync()
        return fwd_us, bwd_us

    def staged(self, clock: StageClock, n: int):
        """([{stage: us}] forward, [{stage: us}] backward): one table per instrumented call."""
        fwd_tables, bwd_tables = [], []
        for _ in range(n):
            for t in self.inputs:
                t.grad = None
            self.sync()
            clock.reset()
            out = clock.run("module", self.forward)
            fwd_tables.append(_us(clock))
            self.sync()
            clock.reset()
            clock.run("autograd engine", out.backward, self.grad)
            bwd_tables.append(_us(clock))
            self.sync()
        return fwd_tables, bwd_tables

    def full_path_us(self, n: int) -> float:
        """Forward host time when the fast path misses (recipes dropped before each call)."""
        times = []
        for _ in range(n):
            self.dpa._recipes.clear()
            self.sync()
            start = time.perf_counter()
            self.forward()
            times.append((time.perf_counter() - start) * 1e6)
            self.sync()
        return median(times)


def _us(clock: StageClock):
    """One call's ({stage: exclusive us}, {stage: wrapped calls made inside it})."""
    return {s: t * 1e6 for s, t in clock.table.items()}, dict(clock.children)


def measure(case: Case, clock: StageClock, rounds: int, n: int) -> dict:
    """Uninstrumented and instrumented calls alternate round by round (host drift hits both)."""
    from transformer_engine.pytorch.attention import backend_scope

    result = {"fwd": {}, "bwd": {}}
    with backend_scope(force=case.backend):
        case.host_times(case.forward, 20)  # warm: recipe, allocator, JIT compiles
        direct = case.direct()
        if direct is not None:
            case.host_times(direct, 20)
        plain_f, plain_b, direct_f, direct_b = [], [], [], []
        staged: List[list] = [[], []]
        for _ in range(rounds):
            f, b = case.host_times(case.forward, n)
            plain_f += f
            plain_b += b
            if direct is not None:
                f, b = case.host_times(direct, n)
                direct_f += f
                direct_b += b
            patch_stages(clock)
            try:
                f, b = case.staged(clock, n)
            finally:
                clock.restore()
            staged[0] += f
            staged[1] += b
        result["total"] = {"fwd": median(plain_f), "bwd": median(plain_b)}
        for tables, key in zip(staged, ("fwd", "bwd")):
            # Each stage's median over the calls (robust to the odd slow call of a shared machine),
            # then the wrappers' cost taken back out (stage_clock.corrected).
            names = {s for t, _ in tables for s in t}
            raw = {s: median([t.get(s, 0.0) for t, _ in tables]) for s in names}
            children = {s: median([c.get(s, 0) for _, c in tables]) for s in names}
            result[key], result[f"wrapper_us_{key}"] = corrected(raw, children, result["total"][key])
        result["direct"] = {"fwd": median(direct_f), "bwd": median(direct_b)} if direct_f else None
        result["full_path_fwd"] = case.full_path_us(n)
    return result


# ---------------------------------------------------------------------------------- the table


def _cell(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(shape: Shape, results: Dict[str, dict]) -> str:
    cols = [(b, p) for b in results for p in ("fwd", "bwd")]
    lines = [f"**{describe(shape)}** (us per call)", "",
             "| stage | " + " | ".join(f"{LABELS[b]} {p}" for b, p in cols) + " |", "|---|" + "---:|" * len(cols)]
    order = list(FWD_STAGES) + [s for s in BWD_STAGES if s not in FWD_STAGES]
    for stage in order:
        cells = [results[b][p].get(stage) if stage in (FWD_STAGES if p == "fwd" else BWD_STAGES) else None for b, p in cols]
        if any(c is not None for c in cells):
            lines.append(f"| {stage} | " + " | ".join(_cell(c) for c in cells) + " |")
    lines.append("| **sum of stages** | " + " | ".join(_cell(sum(results[b][p].values())) for b, p in cols) + " |")
    lines.append("| **DPA, uninstrumented** | " + " | ".join(_cell(results[b]["total"][p]) for b, p in cols) + " |")
    direct = [results[b]["direct"][p] if results[b]["direct"] else None for b, p in cols]
    lines.append("| direct library call | " + " | ".join(_cell(d) for d in direct) + " |")
    extra = [results[b]["total"][p] - d if d is not None else None for (b, p), d in zip(cols, direct)]
    lines.append("| DPA - direct | " + " | ".join(_cell(e) for e in extra) + " |")
    lines.append("| wrapper cost taken out, per wrapped call | " + " | ".join(
        _cell(results[b][f"wrapper_us_{p}"]) for b, p in cols) + " |")
    lines.append("| full path (fast path missed) | " + " | ".join(
        _cell(results[b]["full_path_fwd"]) if p == "fwd" else "-" for b, p in cols) + " |")
    return "\n".join(lines)


def _merged(paths: List[str]) -> dict:
    """Several runs' JSON as one: each number the least over the runs (other processes on a
    shared machine only ever add time)."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f)["shapes"])
    merged = json.loads(json.dumps(runs[0]))
    for name, shape in merged.items():
        for backend, res in shape["results"].items():
            for key in ("fwd", "bwd", "total"):
                for stage in res[key]:
                    res[key][stage] = min(r[name]["results"][backend][key].get(stage, float("inf")) for r in runs)
    return merged


def compare(before: List[str], after: List[str]) -> str:
    """Per shape, each stage before -> after (us per call; the least over each side's runs)."""
    old, new = _merged(before), _merged(after)
    out = []
    for name, shape in new.items():
        cols = [(b, p) for b in shape["results"] for p in ("fwd", "bwd")]
        lines = [f"**{shape['shape']}**, before -> after (us per call)", "",
                 "| stage | " + " | ".join(f"{LABELS[b]} {p}" for b, p in cols) + " |", "|---|" + "---:|" * len(cols)]
        for stage in list(FWD_STAGES) + [s for s in BWD_STAGES if s not in FWD_STAGES]:
            cells = []
            for b, p in cols:
                was, now = (side[name]["results"][b][p].get(stage) for side in (old, new))
                cells.append("-" if was is None and now is None else f"{_cell(was)} -> {_cell(now)}")
            if any(c != "-" for c in cells):
                lines.append(f"| {stage} | " + " | ".join(cells) + " |")
        lines.append("| **DPA, uninstrumented** | " + " | ".join(
            f"**{_cell(old[name]['results'][b]['total'][p])} -> {_cell(shape['results'][b]['total'][p])}**" for b, p in cols) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-noop", action="store_true", help="CPU with stand-in libraries that do nothing")
    ap.add_argument("--shapes", default="short-gqa,short-d64,32k")
    ap.add_argument("--backends", default="fa4,cudnn")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=100, help="calls per round and measurement")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                    help="print before -> after tables from two sets of --json files (comma-separated), and exit")
    args = ap.parse_args()
    if args.compare:
        print(compare(args.compare[0].split(","), args.compare[1].split(",")))
        return
    if not args.cpu_noop and not torch.cuda.is_available():
        ap.error("no CUDA device: pass --cpu-noop to profile the host path with stand-in libraries")
    device = "cpu" if args.cpu_noop else "cuda"
    if args.cpu_noop:
        _cpu_allocator_like_cuda()
        install_stand_ins()
        torch.set_num_threads(1)
    clock = StageClock()
    print(f"device {device}{' (stand-in libraries)' if args.cpu_noop else ''}\n")
    out = {}
    all_shapes = shapes()
    for name in args.shapes.split(","):
        shape = all_shapes[name]
        results = {b: measure(Case(shape, b, device), clock, args.rounds, args.iters) for b in args.backends.split(",")}
        out[name] = dict(shape=describe(shape), results=results)
        print(table(shape, results) + "\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, stand_ins=args.cpu_noop, shapes=out), f, indent=1)


if __name__ == "__main__":
    main()
