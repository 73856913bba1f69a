"""Facts about the kernels that decide the THD routing, measured on the GPU at hand.

1. Which rows each kernel writes: the output and gradient buffers handed to it are pre-filled
   with NaN, and we count the rows outside any (used) sequence that came back written, and how
   many of them hold zeros.
2. Which inputs leak NaN from gap rows into valid rows (q, k, v or dout poisoned alone), and
   whether zeroing the guard's spill rows stops it; what FA4 writes for key-less sequences.
3. What FA4's ``seqused`` costs against the same batch without it, what the extra passes
   (memset, where, clone, zero_gap_rows) cost, and FA4's public function against our op.

    python benchmarks/attention/probe_kernels.py [--steps writes,cudnn_writes_det,leaks,empty_kv,costs,direct,graph]
"""

from __future__ import annotations

import traceback

import torch

import transformer_engine.pytorch.attention.dot_product_attention.backends  # noqa: F401  (registers the torch.ops.te_attn ops)

ops = torch.ops.te_attn
H, D = 16, 128
# Lengths that end mid-tile: with tile multiples (the NOTES batch) no kernel ever loads a gap
# row, and an earlier version of this probe wrongly concluded that NaN in gaps cannot leak.
LENGTHS = [n - 37 * (i % 3) for i, n in enumerate([4096, 3584, 3072, 2560, 2048, 4096, 1536, 1024, 512, 3072, 2048, 2560, 1024, 1536])]
GAPS = [(-n) % 256 + 64 for n in LENGTHS]


def cu(xs):
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def layout(gaps):
    slots = [n + g for n, g in zip(LENGTHS, gaps)] if gaps else LENGTHS
    valid = torch.cat([torch.arange(s, device="cuda") < n for n, s in zip(LENGTHS, slots)])
    return cu(slots), valid


def inputs(total, poison_rows=None, which="qkv"):
    ts = [torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    if poison_rows is not None:
        for name, t in zip("qkv", ts):
            if name in which:
                t[poison_rows] = float("nan")
    return ts


def fa4_pair(q, k, v, offsets, used_q, used_k, causal, out=None):
    total = q.shape[0]
    out = torch.full_like(q, float("nan")) if out is None else out
    lse = torch.full((H, total), float("nan"), device="cuda")
    m = max(LENGTHS)
    ops.fa4_fwd(q, k, v, out, lse, offsets, offsets, used_q, used_k, m, m, D ** -0.5, causal, -1, -1)
    return out, lse


def fa4_grads(q, k, v, out, lse, dout, offsets, used_q, used_k, causal):
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    m = max(LENGTHS)
    ops.fa4_bwd(dout, q, k, v, out, lse, dq, dk, dv, offsets, offsets, used_q, used_k, m, m, D ** -0.5, causal, -1, -1, False)
    return dq, dk, dv


def written(t, rows):
    """How many of ``rows`` hold no NaN (i.e. were written)."""
    return int(torch.isfinite(t[rows].float()).all(dim=(1, 2)).sum())


def probe_writes():
    lens = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    offsets, valid = layout(GAPS)
    q, k, v = inputs(offsets[-1].item())
    gap_rows = ~valid
    print(f"[writes] gap rows: {int(gap_rows.sum())}")
    for causal in (True, False):
        out, lse = fa4_pair(q, k, v, offsets, lens, lens, causal)
        dq, dk, dv = fa4_grads(q, k, v, out.nan_to_num(0), lse, torch.randn_like(out), offsets, lens, lens, causal)
        print(f"[writes] FA4 gaps causal={causal}: out gap rows written {written(out, gap_rows)}; dq {written(dq, gap_rows)} "
              f"dk {written(dk, gap_rows)} dv {written(dv, gap_rows)}; valid out rows finite {written(out, valid)}/{int(valid.sum())}")
        half = torch.arange(len(LENGTHS), device="cuda") % 2 == 0
        used = torch.where(half, lens, 0)
        skipped = ~torch.repeat_interleave(half, torch.tensor([n + g for n, g in zip(LENGTHS, GAPS)], device="cuda"))
        out, lse = fa4_pair(q, k, v, offsets, used, used, causal)
        dq, dk, dv = fa4_grads(q, k, v, out.nan_to_num(0), lse, torch.randn_like(out), offsets, used, used, causal)
        print(f"[writes] FA4 seqused=0 for half causal={causal}: skipped rows {int(skipped.sum())}: out written "
              f"{written(out, skipped)}; dq {written(dq, skipped)} dk {written(dk, skipped)} dv {written(dv, skipped)}")
        probe_cudnn_writes(q, k, v, offsets, lens, used, causal, gap_rows, skipped)


def probe_cudnn_writes(q, k, v, offsets, lens, used, causal, gap_rows, skipped, deterministic=False):
    """Whether cuDNN leaves rows outside its sequences untouched (then several policies' calls
    can share one buffer, with no zero-fill per call and no sum) or writes them (zeros); also
    for sequences with one side empty (cross attention), and in the deterministic backward."""
    rows_run = skipped & ~gap_rows  # the valid rows of the sequences run with a side empty
    cases = (("gaps", lens, lens, gap_rows), ("seq_len=0 for half", used, used, skipped),
             ("no queries for half", used, lens, rows_run), ("no keys for half", lens, used, rows_run))
    for name, len_q, len_kv, rows in cases:
        out, dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, q, k, v))
        m, b = max(LENGTHS), len(LENGTHS)
        stats = ops.cudnn_fwd(q, k, v, out, offsets, offsets, len_q, len_kv, b, m, m, D ** -0.5, causal, -1, -1, False)
        ops.cudnn_bwd(torch.randn_like(out).nan_to_num(0), q, k, v, out.nan_to_num(0), stats, dq, dk, dv, offsets, offsets,
                      len_q, len_kv, b, m, m, D ** -0.5, causal, -1, -1, False, deterministic)
        zero = lambda t: int((t[rows] == 0).all(dim=2).all(dim=1).sum())  # noqa: E731
        print(f"[writes] cuDNN{' deterministic' if deterministic else ''} {name} causal={causal}: rows {int(rows.sum())}: "
              f"written (not NaN) out {written(out, rows)} dq {written(dq, rows)} dk {written(dk, rows)} "
              f"dv {written(dv, rows)}; of them zero: out {zero(out)} dq {zero(dq)} dk {zero(dk)} dv {zero(dv)}")


def probe_cudnn_writes_deterministic():
    """:func:`probe_cudnn_writes` with cuDNN's deterministic backward (what
    torch.use_deterministic_algorithms(True) selects), cuDNN alone."""
    lens = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    offsets, valid = layout(GAPS)
    q, k, v = inputs(offsets[-1].item())
    half = torch.arange(len(LENGTHS), device="cuda") % 2 == 0
    skipped = ~torch.repeat_interleave(half, torch.tensor([n + g for n, g in zip(LENGTHS, GAPS)], device="cuda"))
    for causal in (True, False):
        probe_cudnn_writes(q, k, v, offsets, lens, torch.where(half, lens, 0), causal, ~valid, skipped, deterministic=True)


def probe_leaks():
    """NaN in the gap rows of one tensor at a time (dout too), FA4 with zero-filled outputs;
    then all of q/k/v poisoned with the guard's spill rows zeroed (what DotProductAttention does)."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends.gap_rows import FA4_MAX_TILE_ROWS, zero_gap_rows

    lens = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    offsets, valid = layout(GAPS)
    cu_valid = cu(LENGTHS)
    total = int(offsets[-1])
    m = max(LENGTHS)
    for which in ("q", "k", "v", "dout", "qkv+guard"):
        q, k, v = inputs(total, ~valid, which if which != "dout" else "")
        if which == "qkv+guard":
            for t in (q, k, v):
                zero_gap_rows(t, cu_valid, offsets, FA4_MAX_TILE_ROWS)
        for causal in (True, False):
            out, lse = fa4_pair(q, k, v, offsets, lens, lens, causal, out=torch.zeros(total, H, D, device="cuda", dtype=torch.bfloat16))
            dout = torch.randn_like(out)
            if which == "dout":
                dout[~valid] = float("nan")
            dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
            ops.fa4_bwd(dout, q, k, v, out, lse, dq, dk, dv, offsets, offsets, lens, lens, m, m, D ** -0.5, causal, -1, -1, False)
            fin = lambda t: bool(torch.isfinite(t[valid].float()).all())  # noqa: E731
            print(f"[leak] FA4 NaN in gap rows of {which} causal={causal}: valid out finite {fin(out)}, dq {fin(dq)}, "
                  f"dk {fin(dk)}, dv {fin(dv)}")


def probe_empty_kv():
    """Sequences with queries but no keys (seqused_k = 0): does FA4 write their output rows?"""
    lens = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    offsets = cu(LENGTHS)
    used_k = torch.where(torch.arange(len(LENGTHS), device="cuda") % 3 == 0, 0, lens)
    rows = torch.repeat_interleave(used_k == 0, lens)
    q, k, v = inputs(sum(LENGTHS))
    for causal in (True, False):
        out, lse = fa4_pair(q, k, v, offsets, lens, used_k, causal)
        n_written = written(out, rows)
        zeros = int((out[rows] == 0).all(dim=2).all(dim=1).sum())
        print(f"[empty kv] FA4 causal={causal}: rows of key-less sequences {int(rows.sum())}: written {n_written}, all-zero {zeros}")


def bench(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def probe_costs():
    lens = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    m = max(LENGTHS)
    plain = cu(LENGTHS)
    offsets, valid = layout(GAPS)
    for causal in (True, False):
        for name, offs, used_q, total in (("cu_seqlens only", plain, None, sum(LENGTHS)),
                                          ("cu_seqlens + seqused (no gaps)", plain, lens, sum(LENGTHS)),
                                          ("gaps + seqused", offsets, lens, int(offsets[-1]))):
            q, k, v = inputs(total)
            out = torch.zeros_like(q)
            lse = torch.empty(H, total, device="cuda")
            fwd = lambda: ops.fa4_fwd(q, k, v, out, lse, offs, offs, used_q, used_q, m, m, D ** -0.5, causal, -1, -1)  # noqa: E731
            dout = torch.randn_like(q)
            dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
            bwd = lambda: ops.fa4_bwd(dout, q, k, v, out, lse, dq, dk, dv, offs, offs, used_q, used_q, m, m, D ** -0.5, causal, -1, -1, False)  # noqa: E731
            print(f"[cost] FA4 causal={causal} {name}: fwd {bench(fwd):.3f} ms, bwd {bench(bwd):.3f} ms")
        half = torch.arange(len(LENGTHS), device="cuda") % 2 == 0
        q, k, v = inputs(sum(LENGTHS))
        out = torch.zeros_like(q)
        lse = torch.empty(H, q.shape[0], device="cuda")
        for name, used in (("seqused even seqs", torch.where(half, lens, 0)), ("seqused odd seqs", torch.where(half, 0, lens))):
            fwd = lambda: ops.fa4_fwd(q, k, v, out, lse, plain, plain, used, used, m, m, D ** -0.5, causal, -1, -1)  # noqa: E731
            print(f"[cost] FA4 causal={causal} {name}: fwd {bench(fwd):.3f} ms")
    q = torch.randn(int(offsets[-1]), H, D, device="cuda", dtype=torch.bfloat16)
    keep = valid.view(-1, 1, 1)
    print(f"[cost] memset of one [T,H,D] bf16: {bench(lambda: q.zero_()):.3f} ms; where: {bench(lambda: torch.where(keep, q, 0)):.3f} ms; "
          f"clone: {bench(lambda: q.clone()):.3f} ms")
    from transformer_engine.pytorch.attention.dot_product_attention.backends.gap_rows import FA4_MAX_TILE_ROWS, zero_gap_rows

    c_valid = cu(LENGTHS)
    print(f"[cost] zero_gap_rows, all unowned rows ({int((~valid).sum())}): {bench(lambda: zero_gap_rows(q, c_valid, offsets, -1)):.4f} ms; "
          f"guard reach ({FA4_MAX_TILE_ROWS} rows/seq): {bench(lambda: zero_gap_rows(q, c_valid, offsets, FA4_MAX_TILE_ROWS)):.4f} ms; "
          f"tail only (no gaps): {bench(lambda: zero_gap_rows(q, plain, plain, -1)):.4f} ms")


def probe_direct_vs_op():
    """FA4 called as the public function vs through our op, same batch, same process."""
    from flash_attn.cute import flash_attn_varlen_func

    plain, m = cu(LENGTHS), max(LENGTHS)
    q, k, v = inputs(sum(LENGTHS))
    for causal in (True, False):
        with torch.no_grad():
            direct = bench(lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=plain, cu_seqlens_k=plain, max_seqlen_q=m, max_seqlen_k=m, causal=causal))
        out = torch.empty_like(q)
        lse = torch.empty(H, q.shape[0], device="cuda")
        with_lse = bench(lambda: ops.fa4_fwd(q, k, v, out, lse, plain, plain, None, None, m, m, D ** -0.5, causal, -1, -1))
        no_lse = bench(lambda: ops.fa4_fwd(q, k, v, out, None, plain, plain, None, None, m, m, D ** -0.5, causal, -1, -1))
        print(f"[direct] FA4 causal={causal}: public function {direct:.3f} ms; op with lse {with_lse:.3f} ms, without {no_lse:.3f} ms")


def probe_graph():
    """Which part of a two-policy FA4 step breaks CUDA-graph capture."""
    import os

    from transformer_engine.pytorch import DotProductAttention

    os.environ.update(NVTE_FUSED_ATTN="0", NVTE_UNFUSED_ATTN="0")
    lengths = [300, 17, 512, 1, 200, 64]
    c = cu(lengths)
    q, k, v = (torch.randn(sum(lengths), 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dpa = DotProductAttention(4, 128, qkv_format="thd", attn_mask_type="padding")
    kw = dict(cu_seqlens_q=c, cu_seqlens_kv=c, max_seqlen_q=512, max_seqlen_kv=512,
              thd_sequence_is_causal=torch.tensor([1, 0, 1, 0, 1, 0], dtype=torch.bool, device="cuda"))
    g = torch.randn(sum(lengths), 512, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            dpa(q, k, v, **kw).backward(g)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for name, mode, with_bwd in (("fwd only", "global", False), ("fwd+bwd", "thread_local", True), ("fwd+bwd", "global", True)):
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode=mode):
                out = dpa(q, k, v, **kw)
                if with_bwd:
                    out.backward(g)
            graph.replay()
            torch.cuda.synchronize()
            print(f"[graph] {name} ({mode}): captured and replayed")
        except Exception as err:
            print(f"[graph] {name} ({mode}): FAILED {type(err).__name__}: {str(err).splitlines()[0]}")
            return


STEPS = {"writes": lambda: probe_writes(), "cudnn_writes_det": lambda: probe_cudnn_writes_deterministic(), "leaks": lambda: probe_leaks(), "empty_kv": lambda: probe_empty_kv(),
         "costs": lambda: probe_costs(), "direct": lambda: probe_direct_vs_op(), "graph": lambda: probe_graph()}


def main():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default=",".join(STEPS))
    torch.manual_seed(0)
    for name in ap.parse_args().steps.split(","):
        try:
            STEPS[name]()
        except Exception:
            traceback.print_exc()


if __name__ == "__main__":
    main()
