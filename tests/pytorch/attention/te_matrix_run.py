"""One case of TE's configuration matrix (te_matrix.py): its sizes on the device, its inputs in
its layout, the float64 reference, the run on a forced backend and the comparison."""

from __future__ import annotations

import itertools
import math
import warnings
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .gpu_helpers import env  # the NVTE switches for one case, restored after it
from .reference import reference_dense, reference_thd, standard_slopes
from .te_matrix import BACKENDS, Case

# Low-precision dtypes on CUDA; on the CPU bf16 cases run in float64 and fp16 cases in float32.
DTYPES = {"cuda": {"bf16": torch.bfloat16, "fp16": torch.float16}, "cpu": {"bf16": torch.float64, "fp16": torch.float32}}
# Relative (Frobenius) error allowed for the output; gradients get 4x.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5, torch.float64: 1e-10}


# ------------------------------------------------------------------------------------ sizes


@dataclass(frozen=True)
class Shape:
    b: int
    h: int
    hg: int
    sq: int
    skv: int
    dqk: int
    dv: int
    window: Optional[Tuple[int, int]]


def sized(c: Case, device: str) -> Shape:
    """The case's sizes on ``device``: on the CPU sequence lengths and head dims shrink 16x."""
    if device != "cpu":
        return Shape(c.b, c.h, c.hg, c.sq, c.skv, c.dqk, c.dv, c.window)
    s = lambda n: max(1, n // 16)  # noqa: E731
    d = lambda n: max(2, n // 16)  # noqa: E731
    return Shape(min(c.b, 2), c.h, c.hg, s(c.sq), s(c.skv), d(c.dqk), d(c.dv), c.window)


# ------------------------------------------------------------------------------------ inputs


@dataclass
class Inputs:
    """A case's tensors. ``leaves`` get gradients; ``q``/``k``/``v`` are the (possibly packed)
    views the module sees; ``rows_q``/``rows_kv`` mark real tokens (THD: [T]; dense: [B, S])."""

    call: dict
    leaves: Dict[str, torch.Tensor]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    lengths_q: List[int]
    lengths_kv: List[int]
    starts_q: List[int]
    starts_kv: List[int]
    rows_q: torch.Tensor
    rows_kv: torch.Tensor
    bias: Optional[torch.Tensor] = None
    slopes: Optional[torch.Tensor] = None


def _lengths(gen: torch.Generator, n: int, s: int) -> List[int]:
    """TE's test draws lengths in [1, s); with two or more sequences the first here takes the
    full s (the edge)."""
    if s <= 1:
        return [1] * n
    drawn = [int(x) for x in torch.randint(1, s, (n,), generator=gen)]
    return [s] + drawn[1:] if n > 1 else drawn


def _buffers(c: Case, sh: Shape, lead_q, lead_kv, gen) -> Tuple[Dict[str, torch.Tensor], tuple]:
    """Random float64 CPU buffers in the layout, and the q/k/v views into them."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    dim = c.interleave_dim
    if c.packing == "qkv":
        buf = rnd(*lead_q, 3, sh.h, sh.dqk) if dim == -3 else rnd(*lead_q, sh.h, 3, sh.dqk)
        return {"qkv": buf}, ("qkv", dim)
    q = rnd(*lead_q, sh.h, sh.dqk)
    if c.packing == "kv":
        kv = rnd(*lead_kv, 2, sh.hg, sh.dqk) if dim == -3 else rnd(*lead_kv, sh.hg, 2, sh.dqk)
        return {"q": q, "kv": kv}, ("kv", dim)
    return {"q": q, "k": rnd(*lead_kv, sh.hg, sh.dqk), "v": rnd(*lead_kv, sh.hg, sh.dv)}, (None, dim)


def _views(leaves, packing, dim):
    if packing == "qkv":
        return tuple(leaves["qkv"].select(dim, i) for i in range(3))
    if packing == "kv":
        return (leaves["q"],) + tuple(leaves["kv"].select(dim, i) for i in range(2))
    return leaves["q"], leaves["k"], leaves["v"]


def _thd_rows(lengths, gaps, tail):
    starts, rows, pos = [], [], 0
    for n, g in zip(lengths, gaps):
        starts.append(pos)
        rows += [True] * n + [False] * g
        pos += n + g
    return starts, rows + [False] * tail


def make_inputs(c: Case, device: str, seed: int = 0) -> Inputs:
    """The case's inputs on ``device`` in its dtype. THD gap rows and the tail hold NaN when
    the batch declares its gaps (they must never leak), finite values otherwise (rows past the
    last sequence are not guarded without padded offsets)."""
    sh = sized(c, device)
    dtype = DTYPES[device][c.dtype]
    gen = torch.Generator().manual_seed(zlib.crc32(c.id.encode()) + seed)
    cross = c.sq != c.skv
    lq = _lengths(gen, sh.b, sh.sq) if c.fmt == "thd" or "padding" in c.mask else [sh.sq] * sh.b
    lkv = (_lengths(gen, sh.b, sh.skv) if c.fmt == "thd" or "padding" in c.mask else [sh.skv] * sh.b) if cross else lq
    if c.fmt == "thd":
        gaps = [1 + int(x) for x in torch.randint(0, 3, (sh.b,), generator=gen)] if c.gaps else [0] * sh.b
        tail = 3
        sq_, rq = _thd_rows(lq, gaps, tail)
        skv_, rkv = _thd_rows(lkv, gaps[::-1], tail) if cross else (sq_, rq)
        lead_q, lead_kv = (len(rq),), (len(rkv),)
        rows_q, rows_kv = torch.tensor(rq), torch.tensor(rkv)
    else:
        sq_, skv_ = [0] * sh.b, [0] * sh.b
        lead_q, lead_kv = ((sh.b, sh.sq), (sh.b, sh.skv)) if c.fmt == "bshd" else ((sh.sq, sh.b), (sh.skv, sh.b))
        rows_q = torch.arange(sh.sq).view(1, -1) < torch.tensor(lq).view(-1, 1)
        rows_kv = torch.arange(sh.skv).view(1, -1) < torch.tensor(lkv).view(-1, 1)
    leaves, (packing, dim) = _buffers(c, sh, lead_q, lead_kv, gen)
    if c.fmt == "thd":
        _poison(leaves, packing, dim, rows_q, rows_kv, float("nan") if c.gaps else 7.0)
    leaves = {k: t.to(device=device, dtype=dtype).requires_grad_(c.grad) for k, t in leaves.items()}
    q, k, v = _views(leaves, packing, dim)
    inp = Inputs({}, leaves, q, k, v, lq, lkv, sq_, skv_, rows_q.to(device), rows_kv.to(device))
    inp.call = _call_args(c, sh, inp, packing, dim, device, gen)
    return inp


def _poison(leaves, packing, dim, rows_q, rows_kv, value):
    with torch.no_grad():
        for name, t in leaves.items():
            rows = rows_kv if name in ("k", "v", "kv") else rows_q
            t[~rows] = value


def _i32(values, device):
    return torch.tensor([0] + list(torch.tensor(values).cumsum(0).tolist()), dtype=torch.int32, device=device)


def _call_args(c: Case, sh: Shape, inp: Inputs, packing, dim, device, gen) -> dict:
    call = {}
    if packing == "qkv" and c.declared:
        call.update(qkv_layer=inp.leaves["qkv"], qkv_interleave_dim=dim)
    elif packing == "kv" and c.declared:
        call.update(query_layer=inp.q, kv_layer=inp.leaves["kv"], qkv_interleave_dim=dim)
    else:
        call.update(query_layer=inp.q, key_layer=inp.k, value_layer=inp.v)
    if c.fmt == "thd":
        cu_q = _i32(inp.lengths_q, device)
        cu_kv = cu_q if c.sq == c.skv else _i32(inp.lengths_kv, device)  # self-attention shares them
        call.update(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=sh.sq, max_seqlen_kv=sh.skv)
        if c.gaps:
            off_q = torch.tensor(inp.starts_q + [int(inp.rows_q.numel()) - 3], dtype=torch.int32, device=device)
            off_kv = off_q if c.sq == c.skv else torch.tensor(inp.starts_kv + [int(inp.rows_kv.numel()) - 3], dtype=torch.int32, device=device)
            call.update(cu_seqlens_q_padded=off_q, cu_seqlens_kv_padded=off_kv)
    elif "padding" in c.mask:
        pad_q, pad_kv = ~inp.rows_q.view(sh.b, 1, 1, sh.sq), ~inp.rows_kv.view(sh.b, 1, 1, sh.skv)
        call["attention_mask"] = pad_q if c.sq == c.skv else (pad_q, pad_kv)
    if c.bias == "post_scale_bias":
        shape = {"11ss": (1, 1, sh.sq, sh.skv), "1hss": (1, sh.h, sh.sq, sh.skv), "b1ss": (sh.b, 1, sh.sq, sh.skv),
                 "bhss": (sh.b, sh.h, sh.sq, sh.skv), "111s": (1, 1, 1, sh.skv)}[c.bias_shape]
        dtype = DTYPES[device][c.dtype]
        inp.bias = torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype).requires_grad_(c.grad)
        call.update(core_attention_bias_type="post_scale_bias", core_attention_bias=inp.bias)
    elif c.bias == "alibi":
        call["core_attention_bias_type"] = "alibi"
        if c.bias_shape != "vanilla":
            shape = (sh.h,) if c.bias_shape == "h" else (sh.b, sh.h)
            inp.slopes = (torch.rand(*shape, generator=gen, dtype=torch.float64) * 0.5 + 0.05).to(device=device, dtype=torch.float32)
            call["alibi_slopes"] = inp.slopes
    if c.checkpoint:
        call["checkpoint_core_attention"] = True
    return call


def make_module(c: Case, device: str):
    from transformer_engine.pytorch import DotProductAttention

    sh = sized(c, device)
    channels = sh.dqk if sh.dqk == sh.dv else (sh.dqk, sh.dv)
    return DotProductAttention(sh.h, channels, num_gqa_groups=sh.hg, qkv_format=c.fmt, attn_mask_type=c.mask, window_size=sh.window,
                               attention_type="self" if c.sq == c.skv else "cross")


# ------------------------------------------------------------------------------------ reference


def reference(c: Case, inp: Inputs, device: str):
    """(float64 output in the module's layout, float64 leaves {q, k, v, bias}) for backward:
    the float64 reference of reference.py on the case's inputs."""
    sh = sized(c, device)
    ref = {n: t.detach().to(torch.float64).requires_grad_() for n, t in (("q", inp.q), ("k", inp.k), ("v", inp.v))}
    if inp.bias is not None:
        ref["bias"] = inp.bias.detach().to(torch.float64).requires_grad_()
    scale = 1.0 / math.sqrt(sh.dqk)
    slopes = None
    if c.bias == "alibi":
        slopes = inp.slopes.double() if inp.slopes is not None else standard_slopes(sh.h).to(device)
    if c.fmt == "thd":
        cu_q, cu_kv = ([0] + list(itertools.accumulate(lengths)) for lengths in (inp.lengths_q, inp.lengths_kv))
        out = reference_thd(ref["q"], ref["k"], ref["v"], cu_q, cu_kv, inp.starts_q, inp.starts_kv, c.mask, sh.window, scale,
                            slopes=slopes)
        return out.flatten(-2), ref
    q, k, v = (ref[n] if c.fmt == "bshd" else ref[n].transpose(0, 1) for n in "qkv")
    out = reference_dense(q, k, v, c.mask, sh.window, scale, inp.lengths_q, inp.lengths_kv, bias=ref.get("bias"), slopes=slopes)
    out = out if c.fmt == "bshd" else out.transpose(0, 1)
    return out.flatten(-2), ref


# ------------------------------------------------------------------------------------ one case


def refusal_reason(message: str, label: str) -> Optional[str]:
    """The forced backend's line of a NoBackendError report ("  <label>: <reasons>")."""
    for line in message.splitlines():
        if line.startswith(f"  {label}: "):
            return line[len(label) + 4 :].strip()
    return None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if b.numel() else 0.0


def run_case(c: Case, short: str, device: str) -> dict:
    """Run one case on one forced backend; the result as a JSON-able dict."""
    from transformer_engine.pytorch.attention.dot_product_attention.selection.backend_selection import NoBackendError

    label, switches = BACKENDS[short]
    result = dict(id=c.id, backend=label, family=c.family, status="fail", detail="")
    torch.manual_seed(0)
    inp = make_inputs(c, device)
    dpa = make_module(c, device)
    try:
        with env(**switches), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # q/k/v passed as views of one buffer
            out = dpa(**inp.call)
            ran = dpa.last_selection.label
            if ran != label:
                return dict(result, detail=f"selection ran {ran}, not the forced {label}")
            grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(out)
            if c.grad:
                out.backward(grad_out)
            if device == "cuda":
                torch.cuda.synchronize()
    except NoBackendError as err:
        why = refusal_reason(str(err), label)
        if why is not None and why.startswith("library=not installed"):
            return dict(result, status="skip", detail=why)
        if not why or "switched off by the environment" in why:
            return dict(result, detail=f"refused without a reason of {label}'s own: {str(err)[:600]}")
        return dict(result, status="refused", detail=why)
    except Exception as err:  # noqa: BLE001 - a crash of an accepted configuration is a declaration bug: recorded
        return dict(result, detail=f"{type(err).__name__}: {str(err)[:600]}")
    problems = compare(c, inp, out, grad_out, device)
    return dict(result, status="fail" if problems else "pass", detail="; ".join(problems))


def _grads(c: Case, inp: Inputs):
    """dq, dk, dv as views of the leaves' gradients (packed buffers: select on the same dim)."""
    if "qkv" in inp.leaves:
        g = inp.leaves["qkv"].grad
        return {n: g.select(c.interleave_dim, i) for i, n in enumerate("qkv")}
    if "kv" in inp.leaves:
        g = inp.leaves["kv"].grad
        return {"q": inp.leaves["q"].grad, "k": g.select(c.interleave_dim, 0), "v": g.select(c.interleave_dim, 1)}
    return {n: inp.leaves[n].grad for n in "qkv"}


def compare(c: Case, inp: Inputs, out: torch.Tensor, grad_out: torch.Tensor, device: str) -> List[str]:
    """Every way ``out`` and the gradients differ from the reference (empty: they match)."""
    want, ref = reference(c, inp, device)
    tol = TOLERANCE[out.dtype]
    problems = _compare_one("out", out, want, inp.rows_q, c.fmt, tol)
    if not c.grad:
        return problems
    want.backward(grad_out.double())
    got = _grads(c, inp)
    for n in "qkv":
        rows = inp.rows_q if n == "q" else inp.rows_kv
        if got[n] is None:
            problems.append(f"d{n} is None")
            continue
        problems += _compare_one(f"d{n}", got[n], ref[n].grad, rows, c.fmt, 4 * tol)
    if inp.bias is not None:
        if inp.bias.grad is None:
            problems.append("dbias is None")
        elif _rel(inp.bias.grad, ref["bias"].grad) > 4 * tol:
            problems.append(f"dbias rel err {_rel(inp.bias.grad, ref['bias'].grad):.2e} > {4 * tol:.0e}")
    return problems


def _compare_one(name: str, got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor, fmt: str, tol: float) -> List[str]:
    """All values finite. THD: rows outside every sequence exactly 0, real rows within ``tol``.
    Dense: the whole tensor within ``tol`` (as TE's test compares it; padded tokens are 0 in the
    reference)."""
    if fmt == "sbhd":  # rows are [B, S]; the tensors are [S, B, ...]
        rows = rows.transpose(0, 1)
    got, want = got.detach(), want.detach()
    out = []
    if not bool(torch.isfinite(got).all()):
        out.append(f"{name} has {int((~torch.isfinite(got)).sum())} non-finite values")
        got = torch.nan_to_num(got, nan=1e30)
    if fmt == "thd" and bool((got[~rows] != 0).any()):
        out.append(f"{name}: {int((got[~rows] != 0).flatten(1).any(1).sum())} rows outside the sequences are not 0")
    err = _rel(got[rows], want[rows]) if fmt == "thd" else _rel(got, want)
    if err > tol or math.isnan(err):
        out.append(f"{name} rel err {err:.2e} > {tol:.0e}")
    return out
