"""Every execution plan cuDNN offers for the FP8 and the BF16 forward of issue #24's shapes, each
timed (issue #24: is the plan the heuristic picks first the fastest one?).

For bshd, 1 sequence, GQA 64:8, d128, 8k/16k tokens, causal and no mask: the package's own graph
builders (``backends/cudnn/fp8_graphs.py``, ``graphs.py``) with plans from heuristics A, B and
the fallback list, all built; each plan run alone (``execute_plan_at_index``) and timed with
triton's do_bench. Prints one line per plan: index, median ms, and the plan's name.

    python benchmarks/attention/probe_cudnn_plans.py [--tokens 8192,16384]
"""

from __future__ import annotations

import argparse

import torch

H, HKV, D = 64, 8, 128


def _finish_all(g):
    import cudnn

    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans(cudnn.build_plan_policy.ALL)
    return g, g.get_workspace_size()


def _pack_fp8(s: int):
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import fp8_graphs
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.graphs import UID

    f8 = torch.float8_e4m3fn
    q = (torch.randn(1, s, H, D, device="cuda") * 0.5).to(f8)
    k, v = ((torch.randn(1, s, HKV, D, device="cuda") * 0.5).to(f8) for _ in range(2))
    o = torch.empty(1, s, H, D, dtype=f8, device="cuda")
    stats = torch.empty(1, H, s, 1, dtype=torch.float32, device="cuda")
    table = torch.zeros(5, 4, device="cuda")
    table[:, 0] = torch.tensor([1.0, 1.0 / 448, 448.0, 1.0, 1.0])
    amaxes = torch.zeros(2, 4, device="cuda")
    pack = {UID["q"]: q, UID["k"]: k, UID["v"]: v, UID["o"]: o, UID["stats"]: stats}
    pack.update(fp8_graphs.scalar_pack(table, fp8_graphs.FWD_READS))
    pack.update(fp8_graphs.amax_pack(amaxes, fp8_graphs.FWD_AMAXES))
    return (q, k, v, o), pack


def _pack_bf16(s: int):
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.graphs import UID

    q = torch.randn(1, s, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, s, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    o = torch.empty_like(q)
    stats = torch.empty(1, H, s, 1, dtype=torch.float32, device="cuda")
    return (q, k, v, o), {UID["q"]: q, UID["k"]: k, UID["v"]: v, UID["o"]: o, UID["stats"]: stats}


def plans(kind: str, s: int, causal: bool) -> None:
    from triton.testing import do_bench

    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import fp8_graphs, graphs

    real = graphs._finish
    graphs._finish = _finish_all
    try:
        handle = graphs._handle(torch.device("cuda"))
        if kind == "fp8":
            (q, k, v, o), pack = _pack_fp8(s)
            g, ws = fp8_graphs.build_fwd(handle, q, k, v, o, 1, s, s, D ** -0.5, causal, False, False, False)
        else:
            (q, k, v, o), pack = _pack_bf16(s)
            band = graphs.band_kwargs(causal, -1, 0 if causal else -1, False)
            g, ws = graphs.build_fwd(handle, q, k, v, o, 1, s, s, D ** -0.5, band, False, False, (None, False, 0.0, None), False)
    finally:
        graphs._finish = real
    space = torch.empty(max(ws, 1), dtype=torch.uint8, device="cuda")
    n = g.get_execution_plan_count()
    flops = 4 * s * s * H * D * (0.5 if causal else 1.0)
    for i in range(n):
        name = g.get_plan_name_at_index(i) if hasattr(g, "get_plan_name_at_index") else "?"
        try:
            ms = do_bench(lambda: g.execute_plan_at_index(pack, space, i, handle=handle), warmup=10, rep=60, return_mode="median")
            print(f"[plans] {kind} s={s} causal={causal} plan {i}/{n}: {ms:.4f} ms ({flops / ms / 1e9:.0f} TFLOP/s) {name}",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"[plans] {kind} s={s} causal={causal} plan {i}/{n}: failed {type(e).__name__}: {str(e)[:120]} {name}", flush=True)
    ms = do_bench(lambda: g.execute(pack, space, handle=handle), warmup=10, rep=60, return_mode="median")
    print(f"[plans] {kind} s={s} causal={causal} execute(): {ms:.4f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,16384")
    args = ap.parse_args()
    for s in (int(x) for x in args.tokens.split(",")):
        for causal in (True, False):
            for kind in ("bf16", "fp8"):
                try:
                    plans(kind, s, causal)
                except Exception as e:  # noqa: BLE001
                    print(f"[plans] {kind} s={s} causal={causal}: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
