"""Where cuDNN's FP8 forward quantizes the softmax (S), on the GPU: normalized probabilities, or
the unnormalized exp(s - rowmax) that a flash kernel holds before dividing by the row sum?

One bshd call (2 x 512 tokens, 4 heads, d128) through DotProductAttention on FusedAttention in
FP8, with the S scale set by hand (1, fp8_max, and fp8_max / amax_s the way delayed scaling
would set it), against two float64 models of the same FP8 pipeline (the same E4M3 Q/K/V, the
same O scale): ``normalized`` quantizes softmax(QK^T) with the S scale, ``unnormalized``
quantizes P / rowmax(P) (= exp(s - rowmax), <= 1) and multiplies the row max back. The model
that matches cuDNN to ~1e-3 of the output range is the kernel's quantization point; the
distance to the float64 result says what each S scale costs. The package caps the S scale it
hands cuDNN at fp8_max (``fp8.quantize.kernel_s_scale``); the row marked "uncapped" lifts the
cap, as TE passes the recipe's scale, to show what the cap avoids.

  python benchmarks/attention/probe_fp8_softmax_scale.py > probe_fp8_softmax_scale.log
"""

from __future__ import annotations

import contextlib
import math

import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.attention import backend_scope

B, S, H, D = 2, 512, 4, 128
E4M3, FP8_MAX = torch.float8_e4m3fn, 448.0
SLOT_QKV, SLOT_O, SLOT_S = 2, 3, 8


def q8(x, scale):
    return (x * scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3).double() / scale


def model(q, k, v, causal, s_scale, o_scale, where):
    """float64 attention with the FP8 points; ``where`` None: no S quantization."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    if causal:
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    p = torch.softmax(s, -1)
    if where == "normalized":
        p = q8(p, s_scale)
    elif where == "unnormalized":
        m = p.amax(-1, keepdim=True)
        p = q8(p / m, s_scale) * m
    o = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return o if o_scale is None else q8(o, o_scale)


@contextlib.contextmanager
def _cap(on: bool):
    """The package's cap on the S scale (on), or the recipe's scale handed to cuDNN as is (off)."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import fp8 as cudnn_fp8

    capped = cudnn_fp8.kernel_s_scale
    if not on:
        cudnn_fp8.kernel_s_scale = lambda quantizer: quantizer.scale
    try:
        yield
    finally:
        cudnn_fp8.kernel_s_scale = capped


def rel(a, b):
    return ((a - b).pow(2).mean().sqrt() / (b.max() - b.min())).item()


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    qkv_scale = FP8_MAX / torch.stack([t.abs().amax() for t in (q, k, v)]).amax().float()
    qd, kd, vd = (q8(t.float(), qkv_scale) for t in (q, k, v))
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; B={B} S={S} H={H} D={D}, Q/K/V scale {qkv_scale.item():.4g}")
    print("| mask | S scale | cuDNN amax_s | cuDNN vs normalized | cuDNN vs unnormalized | cuDNN vs float64 | normalized vs float64 | unnormalized vs float64 |")
    print("|---|---|---|---|---|---|---|---|")
    for mask in ("no_mask", "causal"):
        causal = mask == "causal"
        exact = model(q.double(), k.double(), v.double(), causal, None, None, None)
        same_inputs = model(qd, kd, vd, causal, None, None, None)
        amax_s = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", qd, kd) / math.sqrt(D)
                               + (torch.full((S, S), float("-inf"), device="cuda", dtype=torch.float64).triu(1) if causal else 0), -1).amax()
        o_scale = FP8_MAX / same_inputs.abs().amax().float()
        uncapped = (FP8_MAX / amax_s).item()
        for name, s_scale, cap in (("1", 1.0, True), ("fp8_max", FP8_MAX, True), ("fp8_max/amax_s, capped", uncapped, True),
                                   ("fp8_max/amax_s, uncapped", uncapped, False)):
            kernel_scale = s_scale if not cap else min(s_scale, FP8_MAX)  # what cuDNN quantizes with
            dpa = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type=mask)
            with backend_scope(allow=["cudnn"]), te.autocast(recipe=recipe.DelayedScaling(fp8_dpa=True, amax_history_len=1)):
                dpa(q, k, v)  # creates the state
            state = dpa._fp8_state
            with backend_scope(allow=["cudnn"]), te.autocast(recipe=recipe.DelayedScaling(fp8_dpa=True, amax_history_len=1)), \
                    _cap(cap):
                state.fwd.scale[SLOT_QKV], state.fwd.scale[SLOT_S], state.fwd.scale[SLOT_O] = qkv_scale, s_scale, o_scale
                state.fwd.amax_history.zero_()
                out = dpa(q, k, v).view(B, S, H, D).double()
                got_amax_s = state.fwd.amax_history[0, SLOT_S].item()
            norm = model(qd, kd, vd, causal, kernel_scale, o_scale, "normalized")
            unnorm = model(qd, kd, vd, causal, kernel_scale, o_scale, "unnormalized")
            print(f"| {mask} | {name} = {s_scale:.4g} | {got_amax_s:.4g} | {rel(out, norm):.2e} | {rel(out, unnorm):.2e} | "
                  f"{rel(out, exact):.2e} | {rel(norm, exact):.2e} | {rel(unnorm, exact):.2e} |")


if __name__ == "__main__":
    main()
