"""Host time of one eager DotProductAttention forward with per-sequence policies (issue #16).

FA4 is forced; by default its kernels (and the gap-row zeroing, another launch on CUDA) are
replaced by no-ops that only count their calls, so what is timed is the Python around them and
the small torch ops the call launches itself. Cases, each with and without gaps between the
sequences (110 sequences of 64-512 tokens, h8 d64, bf16, forward under no_grad):

  uniform    attn_mask_type="padding_causal" (the fast path's case)
  is_causal  half the sequences causal through thd_sequence_is_causal
  per_seq    the same through attn_mask_type_per_seq (a dict of id tensors)

Printed per case: the median host time of a call (us), the aten ops it dispatches (each one
is a launch on CUDA unless it only makes a view or allocates) and the kernel-op calls.

  python benchmarks/attention/profile_mixed_host.py                 # CPU (or CUDA if present)
  python benchmarks/attention/profile_mixed_host.py --device cuda --real   # real FA4 kernels
  python benchmarks/attention/profile_mixed_host.py --profile per_seq+gaps # cProfile one case

On the CPU the value checks that only run there (they read values; on CUDA the values are
bounded on the device instead) are swapped for the CUDA path's work unless --cpu-checks is
given, so the numbers estimate the CUDA host path. CPU numbers are not GPU numbers.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import sys
import time
from collections import Counter
from typing import Callable, Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import noop_fa4  # run as a script: this directory is on sys.path
from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention import backends
from transformer_engine.pytorch.attention.dot_product_attention.prepare import policies as per_seq_policy
from transformer_engine.pytorch.attention.dot_product_attention.prepare import packed_seqs as thd
from transformer_engine.pytorch.attention.dot_product_attention.backends import kernel_ops

CASES = ("uniform", "is_causal", "per_seq")


class _NoOpKernels:
    """Stands in for ``kernel_ops.ops``: every op returns at once and is counted. FA4's eager
    calls of the module's problems skip ``ops`` (their keyword dicts are built once per
    problem), so :meth:`install` also stands in for flash-attn-4's interface module."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()

    def __getattr__(self, name: str) -> Callable:
        def op(*args, **kwargs) -> None:
            self.calls[name] += 1
        return op

    def install(self) -> None:
        kernel_ops.ops = self
        sys.modules["flash_attn.cute.interface"] = noop_fa4.interface(lambda name: self.calls.update((name,)))


class _AtenCount(TorchDispatchMode):
    """Counts the aten ops dispatched: all of them, and those that launch work on CUDA (not
    views, not bare allocations, not the host-side wrapping of a Python scalar)."""

    _NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "scalar_tensor"}

    def __init__(self) -> None:
        super().__init__()
        self.all = 0
        self.launching = 0
        self.names: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.all += 1
        name = func.overloadpacket.__name__
        if not func.is_view and name not in self._NO_LAUNCH:
            self.launching += 1
            self.names[name] += 1
        return func(*args, **(kwargs or {}))


def _as_on_cuda() -> None:
    """On the CPU, do the CUDA path's host work: no value reads, offsets bounded on the device."""
    for module in (thd, per_seq_policy):
        module.value_checks_on = lambda device: False
    thd.bounded_on_device = lambda device: True


def _batch(device: str, gap: int):
    rng = random.Random(0)
    lengths = [rng.choice(range(64, 513, 64)) for _ in range(110)]
    cu, off = [0], [0]
    for n in lengths:
        cu.append(cu[-1] + n)
        off.append(off[-1] + n + gap)
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    q, k, v = (torch.randn(off[-1], 8, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
    kw = dict(cu_seqlens_q=as_i32(cu), max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    kw["cu_seqlens_kv"] = kw["cu_seqlens_q"]
    if gap:
        kw["cu_seqlens_q_padded"] = kw["cu_seqlens_kv_padded"] = as_i32(off)
    causal = torch.tensor([i % 2 == 0 for i in range(len(lengths))], device=device)
    ids = torch.arange(len(lengths), device=device)
    policy_kw = {
        "uniform": {},
        "is_causal": dict(thd_sequence_is_causal=causal),
        "per_seq": dict(attn_mask_type_per_seq={"padding_causal": ids[causal].clone(), "padding": ids[~causal].clone()}),
    }
    return (q, k, v), kw, policy_kw


def _calls(device: str) -> Dict[str, Callable[[], torch.Tensor]]:
    dpa = DotProductAttention(8, 64, qkv_format="thd", attn_mask_type="padding_causal")
    out = {}
    for gap in (0, 64):
        qkv, kw, policy_kw = _batch(device, gap)
        for case in CASES:
            call_kw = dict(kw, **policy_kw[case])
            out[case + ("+gaps" if gap else "")] = lambda qkv=qkv, call_kw=call_kw: dpa(*qkv, **call_kw)
    return out


def _host_us(fn: Callable, iters: int, device: str) -> float:
    """Median host time of one call, each from an idle GPU on CUDA (as profile_small.host_us:
    with queued work a launch can wait for the GPU, and "host" time would include GPU time)."""
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if device == "cuda":
            torch.cuda.synchronize()  # outside the timed span
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--real", action="store_true", help="run the real FA4 kernels (CUDA only)")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--cpu-checks", action="store_true", help="on the CPU, keep the CPU-only value checks")
    ap.add_argument("--profile", default=None, help="print cProfile's top functions for this case")
    ap.add_argument("--ops", action="store_true", help="list the launching aten ops of each case")
    args = ap.parse_args()
    if args.real and args.device != "cuda":
        ap.error("--real needs --device cuda")
    if args.device == "cpu" and not args.cpu_checks:
        _as_on_cuda()
    kernels = None if args.real else _NoOpKernels()
    if kernels is not None:
        kernels.install()
    torch.set_num_threads(1)
    with torch.no_grad(), backend_scope(force=backends.FlashAttentionV4):
        calls = _calls(args.device)
        print(f"device {args.device}, kernels {'real' if args.real else 'no-op'}, "
              f"{'CPU value checks' if args.device == 'cpu' and args.cpu_checks else 'CUDA host path'}")
        print(f"{'case':<16} {'host us':>8} {'aten ops':>9} {'launching':>10} {'kernel ops':>11}")
        for name, fn in calls.items():
            for _ in range(5):
                fn()  # warm: the fast path's recipe, allocator, lazy imports
            us = _host_us(fn, args.iters, args.device)
            before = sum(kernels.calls.values()) if kernels else 0
            with _AtenCount() as count:
                fn()
            launched = (sum(kernels.calls.values()) - before) if kernels else "-"
            print(f"{name:<16} {us:8.1f} {count.all:9d} {count.launching:10d} {launched!s:>11}")
            if args.ops:
                print("    " + ", ".join(f"{n} x{c}" for n, c in count.names.most_common()))
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.iters):
                calls[args.profile]()
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumtime").print_stats(40)
            print(buf.getvalue())


if __name__ == "__main__":
    main()
