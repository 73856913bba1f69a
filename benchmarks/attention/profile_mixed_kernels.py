"""The kernels one mixed-policy step launches, and their GPU time (issue #16), on the two short
batches of benchmark_mixed.py: torch.profiler over 5 steps of the uniform causal call and of the
mixed call (``attn_mask_type_per_seq``), forward and forward+backward, FA4 and cuDNN.

  python benchmarks/attention/profile_mixed_kernels.py > kernels.log
"""

import torch

from benchmark_mixed import Case, _step, shapes  # run as a script: this directory is on sys.path
from transformer_engine.pytorch.attention import backend_scope


def profile(case: Case, variant: str, with_bwd: bool, steps: int = 5) -> str:
    with backend_scope(allow=[case.label]):
        step = _step(case.call(variant), (case.q, case.k, case.v), with_bwd)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=90)


def main() -> None:
    for backend in ("fa4", "cudnn"):
        for shape in [s for s in shapes() if s.name.startswith("110short")]:
            case = Case(shape, backend)
            for variant in ("causal", "mixed"):
                for with_bwd in (False, True):
                    print(f"=== {backend} {shape.name} {variant} {'fwd+bwd' if with_bwd else 'fwd'} (5 steps)")
                    print(profile(case, variant, with_bwd), flush=True)


if __name__ == "__main__":
    main()
