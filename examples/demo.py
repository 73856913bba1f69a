"""Demo: a packed batch of mixed-length sequences with gaps between them, run through
DotProductAttention forward and backward on the best available backend, checked against the
float64 unfused reference, with the backend-selection report.

    python examples/demo.py
"""

from __future__ import annotations

import os

import torch

from transformer_engine.pytorch import DotProductAttention


def packed_batch(lengths, gaps, heads, head_dim, device, dtype, seed=0):
    """q/k/v [T, H, D] with each sequence followed by its gap (gap rows are NaN on purpose)."""
    cu, cu_padded, valid = [0], [0], []
    for n, g in zip(lengths, gaps):
        cu.append(cu[-1] + n)
        cu_padded.append(cu_padded[-1] + n + g)
        valid += [True] * n + [False] * g
    gen = torch.Generator().manual_seed(seed)
    valid = torch.tensor(valid)
    tensors = []
    for _ in range(3):
        t = torch.randn(len(valid), heads, head_dim, generator=gen)
        t[~valid] = float("nan")
        tensors.append(t.to(device=device, dtype=dtype).requires_grad_())
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return tensors, as_i32(cu), as_i32(cu_padded), valid.to(device)


def run(dpa, q, k, v, cu, cu_padded, max_len, per_seq=None):
    out = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
              cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max_len, max_seqlen_kv=max_len,
              attn_mask_type_per_seq=per_seq)
    grad = torch.ones_like(out) / out.shape[-1]
    out.backward(grad)
    return out, q.grad, k.grad, v.grad


def reference(tensors, cu, cu_padded, max_len, heads, head_dim, per_seq):
    """The same call in float64 on the CPU, with only the unfused backend switched on."""
    saved = {k: os.environ.get(k) for k in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN")}
    os.environ.update(NVTE_FLASH_ATTN="0", NVTE_FUSED_ATTN="0")
    try:
        q, k, v = (t.detach().cpu().double().requires_grad_() for t in tensors)
        dpa = DotProductAttention(heads, head_dim, qkv_format="thd", attn_mask_type="padding_causal")
        cpu_per_seq = {m: ids.cpu() for m, ids in per_seq.items()}
        return run(dpa, q, k, v, cu.cpu(), cu_padded.cpu(), max_len, cpu_per_seq)
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    heads, head_dim = 8, 64
    lengths, gaps = [37, 512, 5, 129, 260, 64], [3, 0, 11, 7, 0, 60]
    tensors, cu, cu_padded, valid = packed_batch(lengths, gaps, heads, head_dim, device, dtype)
    # Sequences 0, 2, 4 are causal (streaming); 1, 3, 5 see their full context (offline).
    per_seq = {"padding_causal": torch.tensor([0, 2, 4], device=device),
               "padding": torch.tensor([1, 3, 5], device=device)}
    dpa = DotProductAttention(heads, head_dim, qkv_format="thd", attn_mask_type="padding_causal").to(device)
    got = run(dpa, *tensors, cu, cu_padded, max(lengths), per_seq)
    want = reference(tensors, cu, cu_padded, max(lengths), heads, head_dim, per_seq)
    print(f"device={device} dtype={dtype} tokens={len(valid)} sequences={len(lengths)} (gaps between them)")
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        a = a.detach().cpu().double().view(b.shape)
        rel = (a - b).norm() / b.norm()
        pad_rows = a[~valid.cpu()]
        print(f"  {name}: relative error vs float64 reference {rel:.2e}; padded rows all zero: {bool((pad_rows == 0).all())}")
    print("backend selection for this call:")
    print(dpa.last_selection.report())


if __name__ == "__main__":
    main()
