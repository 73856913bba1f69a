"""Host time of DotProductAttention against FA4 called by hand, phase by phase (issue #26, H200).

One THD batch, bf16, padding_causal: 110 sequences with lengths drawn uniformly from 64..512
(seed 0), d64 with 16:16 heads (``--shape d64``) or d128 with 16:2 (``--shape gqa``); the module
forced onto FA4. The batch and both calls are ``benchmark_host.py``'s (``Batch``, ``dpa_call``,
``fa4_call``: the direct call is ``flash_attn_varlen_func``). Each turn runs, for
DotProductAttention and then for the direct call on the same tensors, every call from an idle
GPU:

  fwd host            the training forward's host time (returned, not synchronized)
  bwd host            backward()'s host time, and ``bwd synced`` to its last kernel
  nograd fwd host     the forward under no_grad, and ``nograd fwd synced``
  fwd+bwd synced      forward and backward, synchronized once at the end

and prints the medians over ``--turns`` turns, their difference and ratio. Host times are what
the package adds to the library's own Python; the synced rows are what ``benchmark_host.py``
times. The H200's host moves these by 20-40% between processes: compare runs of one process,
or medians over processes.

  python benchmarks/attention/host_phases.py --shape d64
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Callable, Dict, List

import torch

from benchmark_host import Batch, dpa_call, fa4_call  # run as a script: this directory is on sys.path
from benchmark_mixed import Shape

PHASES = ("fwd host", "bwd host", "bwd synced", "nograd fwd host", "nograd fwd synced", "fwd+bwd synced")


def batch(shape: str) -> Batch:
    rng = random.Random(0)
    lengths = [rng.randint(64, 512) for _ in range(110)]
    heads, groups, dim = (16, 16, 64) if shape == "d64" else (16, 2, 128)
    return Batch(Shape(shape, lengths, heads, groups, dim))


def turn(call: Callable[[], torch.Tensor], leaves: List[torch.Tensor], grad: torch.Tensor) -> List[float]:
    """One sample of each phase (seconds), in PHASES' order."""
    sync, clock = torch.cuda.synchronize, time.perf_counter

    def clear() -> None:
        for t in leaves:
            t.grad = None
        sync()

    clear()
    t0 = clock(); out = call(); t1 = clock(); sync()  # noqa: E702
    t2 = clock(); out.backward(grad.view(out.shape)); t3 = clock(); sync(); t4 = clock()  # noqa: E702
    with torch.no_grad():
        t5 = clock(); call(); t6 = clock(); sync(); t7 = clock()  # noqa: E702
    clear()
    t8 = clock(); out = call(); out.backward(grad.view(out.shape)); sync(); t9 = clock()  # noqa: E702
    return [t1 - t0, t3 - t2, t4 - t2, t6 - t5, t7 - t5, t9 - t8]


def main() -> None:
    from transformer_engine.pytorch.attention import backend_scope

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("d64", "gqa"), default="d64")
    ap.add_argument("--turns", type=int, default=300)
    args = ap.parse_args()
    b = batch(args.shape)
    leaves = b.leaves()  # both paths on the same tensors
    paths = {"dpa": dpa_call(b, leaves), "direct": fa4_call(b, leaves)}
    samples: Dict[str, List[List[float]]] = {name: [] for name in paths}
    with backend_scope(force="FlashAttention v4"):
        for _ in range(30):  # warm-up: FA4 compiles, the fast path and bound calls settle
            for call in paths.values():
                turn(call, leaves, b.grad)
        for _ in range(args.turns):
            for name, call in paths.items():
                samples[name].append(turn(call, leaves, b.grad))
    for i, phase in enumerate(PHASES):
        a, d = (statistics.median(s[i] for s in samples[name]) * 1e6 for name in ("dpa", "direct"))
        print(f"{args.shape} {phase:18s} dpa {a:8.1f}  direct {d:8.1f}  diff {a - d:7.1f}  ratio {a / d:.3f} (us)")


if __name__ == "__main__":
    main()
