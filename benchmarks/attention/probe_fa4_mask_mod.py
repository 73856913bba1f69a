"""Probe for issue #16: one FA4 launch for a mixed-policy batch, through flash_attn.cute's
``mask_mod`` with a per-sequence aux tensor (1 = full context, 0 = bottom-right causal), against
the per-policy split (one causal and one full call, each with the other policy's sequences at
length 0), both as direct library calls on benchmark_mixed.py's shapes (bf16, half causal).

Prints, per shape, the largest difference of out/LSE/dq/dk/dv between the two (valid rows), and
the median time of each (forward, forward+backward; eager and CUDA-graph replayed) against the
bound of benchmark_mixed.py. Needs a GPU with flash-attn-4 (4.0.0b36 measured).

  python benchmarks/attention/probe_fa4_mask_mod.py OUT.json
"""
import json
import sys
import time
import traceback

import torch

from benchmark_mixed import shapes, _offsets  # noqa: E402  (run as a script: this directory is on sys.path)
from profile_small import graphed  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from flash_attn.cute import utils as fa_utils  # noqa: E402
from flash_attn.cute.interface import _flash_attn_fwd, _flash_attn_bwd  # noqa: E402


@cute.jit
def per_seq_mask(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
    full = aux_tensors[0]
    is_full = fa_utils.scalar_to_ssa(full[batch[0]], cutlass.Int32)
    offset = fa_utils.scalar_to_ssa(seqlen_info.seqlen_k - seqlen_info.seqlen_q, cutlass.Int32)
    zero = fa_utils.scalar_to_ssa(0, cutlass.Int32)
    return (n_idx <= m_idx + offset) | (is_full != zero)


def bench(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=20, rep=120, return_mode="median")


def main():
    rows = []
    for shape in shapes():
        try:
            rows.append(one(shape))
        except Exception:
            traceback.print_exc()
        print(json.dumps(rows[-1] if rows else {}), flush=True)
    json.dump(rows, open(sys.argv[1], "w"), indent=1)


def one(shape):
    b = len(shape.lengths)
    lens = torch.tensor(shape.lengths, dtype=torch.int32, device="cuda")
    off = _offsets(shape.lengths, shape.gap)
    total = int(off[-1])
    torch.manual_seed(0)
    mk = lambda h: torch.randn(total, h, shape.head_dim, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = mk(shape.heads), mk(shape.groups), mk(shape.groups)
    causal = torch.tensor([i % 2 == 0 for i in range(b)], device="cuda")
    full_flag = (~causal).to(torch.int32)
    m = max(shape.lengths)
    scale = shape.head_dim ** -0.5
    used_c = torch.where(causal, lens, 0)
    used_f = torch.where(causal, 0, lens)
    common = dict(cu_seqlens_q=off, cu_seqlens_k=off, max_seqlen_q=m, max_seqlen_k=m, softmax_scale=scale)
    out = torch.zeros(total, shape.heads, shape.head_dim, device="cuda", dtype=torch.bfloat16)
    lse = torch.zeros(shape.heads, total, device="cuda", dtype=torch.float32)

    def fwd(kind, o=out, l=lse):
        if kind == "mask_mod":
            _flash_attn_fwd(q, k, v, out=o, lse=l, return_lse=True, seqused_q=lens, seqused_k=lens, causal=False,
                            mask_mod=per_seq_mask, aux_tensors=[full_flag], **common)
        elif kind == "split":
            _flash_attn_fwd(q, k, v, out=o, lse=l, return_lse=True, seqused_q=used_c, seqused_k=used_c, causal=True, **common)
            _flash_attn_fwd(q, k, v, out=o, lse=l, return_lse=True, seqused_q=used_f, seqused_k=used_f, causal=False, **common)
        else:
            _flash_attn_fwd(q, k, v, out=o, lse=l, return_lse=True, seqused_q=lens, seqused_k=lens, causal=kind == "causal", **common)

    dout = torch.randn_like(out)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def bwd(kind):
        kw = dict(common, dq=dq, dk=dk, dv=dv, deterministic=False, softcap=0.0)
        if kind == "mask_mod":
            _flash_attn_bwd(q, k, v, out, dout, lse, seqused_q=lens, seqused_k=lens, causal=False, mask_mod=per_seq_mask,
                            aux_tensors=[full_flag], **kw)
        elif kind == "split":
            _flash_attn_bwd(q, k, v, out, dout, lse, seqused_q=used_c, seqused_k=used_c, causal=True, **kw)
            _flash_attn_bwd(q, k, v, out, dout, lse, seqused_q=used_f, seqused_k=used_f, causal=False, **kw)
        else:
            _flash_attn_bwd(q, k, v, out, dout, lse, seqused_q=lens, seqused_k=lens, causal=kind == "causal", **kw)

    row = {"shape": shape.name}
    # correctness: mask_mod against the split
    t0 = time.time()
    fwd("split"); ref_o, ref_l = out.clone(), lse.clone()
    bwd("split"); ref_g = [t.clone() for t in (dq, dk, dv)]
    for t in (out, lse, dq, dk, dv):  # the mask_mod calls must write every valid row themselves
        t.fill_(float("nan"))
    fwd("mask_mod")
    row["compile_fwd_s"] = round(time.time() - t0, 1)
    valid = torch.zeros(total, dtype=torch.bool, device="cuda")
    for i, n in enumerate(shape.lengths):
        s = int(off[i]); valid[s:s + n] = True
    row["fwd_maxdiff"] = (out[valid].float() - ref_o[valid].float()).abs().max().item()
    row["lse_maxdiff"] = (lse[:, valid] - ref_l[:, valid]).abs().max().item()
    t0 = time.time()
    bwd("mask_mod")
    row["compile_bwd_s"] = round(time.time() - t0, 1)
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_g):
        row[f"{name}_maxdiff"] = (g[valid].float() - r[valid].float()).abs().max().item()
        row[f"{name}_refmax"] = r[valid].float().abs().max().item()
    for kind in ("causal", "full", "split", "mask_mod"):
        fwd(kind); bwd(kind)
        row[f"{kind}_fwd_eager"] = bench(lambda: fwd(kind))
        row[f"{kind}_fwd_graph"] = bench(graphed(lambda: fwd(kind)))
        row[f"{kind}_fb_eager"] = bench(lambda: (fwd(kind), bwd(kind)))
        row[f"{kind}_fb_graph"] = bench(graphed(lambda: (fwd(kind), bwd(kind))))
    share_c = sum(n * n for n, c in zip(shape.lengths, causal.tolist()) if c) / sum(n * n for n in shape.lengths)
    for p in ("fwd_eager", "fwd_graph", "fb_eager", "fb_graph"):
        bound = row[f"causal_{p}"] * share_c + row[f"full_{p}"] * (1 - share_c)
        row[f"bound_{p}"] = bound
        row[f"split/bound_{p}"] = round(row[f"split_{p}"] / bound, 3)
        row[f"mask_mod/bound_{p}"] = round(row[f"mask_mod_{p}"] / bound, 3)
    return row


if __name__ == "__main__":
    main()
