"""Q1-Q4 of probe_fp8_paged.py: cuDNN's per-tensor FP8 SDPA (cudnn-frontend's ``sdpa_fp8`` and
``sdpa_fp8_backward``) on this GPU, each case against a float32 reference.

Scales follow TE's current scaling (margin 0): Q/K/V/dO get fp8_max / amax, S gets 448 (its
values are probabilities), O and the gradients get fp8_max / amax of the float32 reference, dP
gets 448 / amax(dO V^T) (cudnn-frontend's own tests scale dP from that product). Every scale and
descale is a float32 [1, 1, 1, 1] device tensor. Two references: one from the dequantized FP8
inputs (the kernel's own error) and one from the unquantized inputs (TE's fp8_vs_f16 view:
RMSE < 0.11 x range decides ``match``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from probe_fp8_paged_common import (BF16, DTYPE_NAMES, E4M3, E5M2, FP8_MAX, TE_RMSE_OVER_RANGE, Refused, amax_buffer, bhsd,
                                    compare, dout_v_amax, execute, finish, graph_input, graph_output, graph_scalar, nans,
                                    new_graph, prefixed, quantize, reference, reference_grads, run_case, scalar_value,
                                    scale_for)

B, S, H, HKV = 2, 512, 16, 4
THD_LENS = [512, 100, 300, 77]
Q_SIDE = ("q", "o", "do", "dq")
FWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
BWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_do", "descale_s", "descale_dp", "scale_s",
               "scale_dq", "scale_dk", "scale_dv", "scale_dp")


def _const(value: float) -> torch.Tensor:
    return torch.full((1, 1, 1, 1), value, dtype=torch.float32, device="cuda")


@dataclass
class Fp8Qkv:
    orig: Tuple[torch.Tensor, ...]  # float32 [B, S, H, D]-shaped views before quantization
    fp8: Tuple[torch.Tensor, ...]  # the FP8 views the kernels read
    descale: Tuple[torch.Tensor, ...]

    def deq(self) -> Tuple[torch.Tensor, ...]:
        return tuple(dequant(x, d) for x, d in zip(self.fp8, self.descale))


def dequant(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """x in real units; the [1, 1, 1, 1] descale taken as a 0-dim tensor so a [T, H, D] stays 3-D."""
    return x.float() * descale.reshape(())


@dataclass
class GraphLayout:
    """Every graph tensor's cuDNN dims/strides by uid name; ``ragged_b`` > 0 makes it THD with that
    many sequences (ragged offsets and per-sequence lengths)."""
    descs: Dict[str, Tuple[List[int], List[int]]]
    ragged_b: int = 0
    ragged_stats: bool = False
    totals: Tuple[int, int] = (0, 0)  # packed token totals (q side, kv side), THD only


def _view(layout: str):
    return (lambda t: t.transpose(0, 1)) if layout == "sbhd" else (lambda t: t)


def _storage(layout: str, shape) -> Tuple[int, ...]:
    b, s, h, d = shape
    return (s, b, h, d) if layout == "sbhd" else (b, s, h, d)


def make(layout: str, shape, dtype, gen):
    """(float view, FP8 view, descale) of one random tensor stored as ``layout`` (bshd or sbhd)."""
    x = torch.randn(_storage(layout, shape), generator=gen, device="cuda")
    xq, descale = quantize(x, dtype)
    view = _view(layout)
    return view(x), view(xq), descale


def alloc(layout: str, shape, dtype) -> torch.Tensor:
    """A NaN-filled output of ``shape`` (B, S, H, D) stored as ``layout``."""
    return _view(layout)(nans(_storage(layout, shape), dtype))


def separate_inputs(layout: str, d: int, seed: int, hkv: int = HKV) -> Fp8Qkv:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    parts = [make(layout, (B, S, h, d), E4M3, gen) for h in (H, hkv, hkv)]
    return Fp8Qkv(*(tuple(p[i] for p in parts) for i in range(3)))


def packed_inputs(packing: str, d: int, seed: int) -> Fp8Qkv:
    """One E4M3 buffer, [B, S, 3, H, D] (bs3hd) or [B, S, H, 3, D] (bsh3d), with one scale; q, k,
    v are ``select`` views of it (zero-copy)."""
    dim = 2 if packing == "bs3hd" else 3
    shape = (B, S, 3, H, d) if dim == 2 else (B, S, H, 3, d)
    x = torch.randn(shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda")
    xq, descale = quantize(x, E4M3)
    return Fp8Qkv(tuple(x.select(dim, i) for i in range(3)), tuple(xq.select(dim, i) for i in range(3)), (descale,) * 3)


def dense_layout(**tensors) -> GraphLayout:
    descs = {name: bhsd(t) for name, t in tensors.items()}
    descs["stats"] = ([B, H, S, 1], [H * S, S, 1, 1])
    return GraphLayout(descs)


# ------------------------------------------------------------------ graphs


def _offset_name(name: str) -> str:
    """Which ragged offset a graph tensor takes: stats, query-side rows, or key-side rows."""
    return "off_stats" if name == "stats" else ("off_q" if name in Q_SIDE else "off_kv")


def _ragged_inputs(g, io: GraphLayout, t: dict) -> dict:
    """Offsets and lengths of a THD graph; sets the offsets on the inputs in ``t``; returns the
    graph tensors by name (for the outputs) and the sdpa keyword arguments."""
    b = io.ragged_b
    names = ("off_q", "off_kv") + (("off_stats",) if io.ragged_stats else ())
    off = {n: graph_input(g, n, [b + 1, 1, 1, 1], [1, 1, 1, 1], torch.int64) for n in names}
    for name, tensor in t.items():
        if _offset_name(name) in off:
            tensor.set_ragged_offset(off[_offset_name(name)])
    lens = {n: graph_input(g, n, [b, 1, 1, 1], [1, 1, 1, 1], torch.int32) for n in ("len_q", "len_kv")}
    return dict(offsets=off, kwargs=dict(use_padding_mask=True, seq_len_q=lens["len_q"], seq_len_kv=lens["len_kv"]))


def _declare(g_out, name: str, io: GraphLayout, dtype, ragged) -> None:
    graph_output(g_out, name, *io.descs[name], dtype)
    if ragged and _offset_name(name) in ragged["offsets"]:
        g_out.set_ragged_offset(ragged["offsets"][_offset_name(name)])


_FWD_GRAPHS: dict = {}  # built forward graphs (or refusals) by configuration: Q2 and Q4 repeat Q1's


def build_fp8_fwd(io: GraphLayout, dtypes: dict, causal: bool, scale: float, amax_s_out: bool):
    key = (tuple((n, tuple(d), tuple(st)) for n, (d, st) in sorted(io.descs.items())), io.ragged_b, io.ragged_stats,
           io.totals, tuple(sorted((n, str(t)) for n, t in dtypes.items())), causal, scale, amax_s_out)
    if key not in _FWD_GRAPHS:
        try:
            _FWD_GRAPHS[key] = _build_fp8_fwd(io, dtypes, causal, scale, amax_s_out)
        except Refused as e:
            _FWD_GRAPHS[key] = e
    if isinstance(_FWD_GRAPHS[key], Refused):
        raise _FWD_GRAPHS[key]
    return _FWD_GRAPHS[key]


def _build_fp8_fwd(io: GraphLayout, dtypes: dict, causal: bool, scale: float, amax_s_out: bool):
    g = new_graph(E4M3)
    t = {n: graph_input(g, n, *io.descs[n], dtypes[n]) for n in ("q", "k", "v")}
    ragged = _ragged_inputs(g, io, t) if io.ragged_b else None
    s = {n: graph_scalar(g, n) for n in FWD_SCALARS}
    o, stats, amax_s, amax_o = g.sdpa_fp8(q=t["q"], k=t["k"], v=t["v"], attn_scale=scale, generate_stats=True,
                                          use_causal_mask=causal, **s, **(ragged["kwargs"] if ragged else {}))
    _declare(o, "o", io, dtypes["o"], ragged)
    _declare(stats, "stats", io, torch.float32, ragged)
    graph_output(amax_o, "amax_o", [1, 1, 1, 1], [1, 1, 1, 1], torch.float32)
    if amax_s_out:
        graph_output(amax_s, "amax_s", [1, 1, 1, 1], [1, 1, 1, 1], torch.float32)
    return finish(g)


def build_fp8_bwd(io: GraphLayout, dtypes: dict, causal: bool, scale: float):
    g = new_graph(E4M3)
    t = {n: graph_input(g, n, *io.descs[n], dtypes[n]) for n in ("q", "k", "v", "o", "do")}
    t["stats"] = graph_input(g, "stats", *io.descs["stats"], torch.float32)
    ragged = _ragged_inputs(g, io, t) if io.ragged_b else None
    s = {n: graph_scalar(g, n) for n in BWD_SCALARS}
    extra = dict(ragged["kwargs"]) if ragged else {}
    if ragged:
        extra.update(max_total_seq_len_q=io.totals[0], max_total_seq_len_kv=io.totals[1])
    outs = g.sdpa_fp8_backward(
        q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"], stats=t["stats"], descale_q=s["descale_q"],
        descale_k=s["descale_k"], descale_v=s["descale_v"], descale_o=s["descale_o"], descale_dO=s["descale_do"],
        descale_s=s["descale_s"], descale_dP=s["descale_dp"], scale_s=s["scale_s"], scale_dQ=s["scale_dq"],
        scale_dK=s["scale_dk"], scale_dV=s["scale_dv"], scale_dP=s["scale_dp"], attn_scale=scale, use_causal_mask=causal,
        **extra)
    for name, out in zip(("dq", "dk", "dv"), outs[:3]):
        _declare(out, name, io, dtypes[name], ragged)
    for name, out in zip(("amax_dq", "amax_dk", "amax_dv", "amax_dp"), outs[3:7]):
        graph_output(out, name, [1, 1, 1, 1], [1, 1, 1, 1], torch.float32)
    return finish(g)


# ------------------------------------------------------------------ runs


@dataclass
class FwdRun:
    o: torch.Tensor
    stats: torch.Tensor
    amax_s: Optional[torch.Tensor]
    amax_o: torch.Tensor
    descale_o: torch.Tensor
    amax_s_note: str


def fp8_forward(x: Fp8Qkv, causal: bool, scale: float, o: torch.Tensor, scale_o: torch.Tensor,
                io: Optional[GraphLayout] = None, extra_pack: Optional[dict] = None) -> FwdRun:
    """One sdpa_fp8 call writing ``o``; Amax_S is declared an output when the library accepts that
    (the note says what happened)."""
    q, k, v = x.fp8
    io = io or dense_layout(q=q, k=k, v=v, o=o)
    stats_shape = [io.totals[0], H, 1] if io.ragged_stats else io.descs["stats"][0]
    stats = nans(stats_shape)
    dtypes = dict(q=q.dtype, k=k.dtype, v=v.dtype, o=o.dtype)
    try:
        built, note = build_fp8_fwd(io, dtypes, causal, scale, amax_s_out=True), "declared as an output"
    except Exception as e:  # noqa: BLE001 - retried without Amax_S, the reason kept
        built, note = build_fp8_fwd(io, dtypes, causal, scale, amax_s_out=False), f"left virtual (declared: {e})"[:600]
    amax_s, amax_o = amax_buffer(), amax_buffer()
    pack = dict(q=q, k=k, v=v, o=o, stats=stats, descale_q=x.descale[0], descale_k=x.descale[1], descale_v=x.descale[2],
                descale_s=_const(1 / FP8_MAX[E4M3]), scale_s=_const(FP8_MAX[E4M3]), scale_o=scale_o, amax_o=amax_o)
    if note.startswith("declared"):
        pack["amax_s"] = amax_s
    pack.update(extra_pack or {})
    execute(built, pack)
    return FwdRun(o, stats, amax_s if note.startswith("declared") else None, amax_o, 1.0 / scale_o, note)


def fwd_fields(run: FwdRun, ref, lse, orig, valid=None, to_ref=lambda t: t) -> dict:
    o = to_ref(dequant(run.o, run.descale_o))
    vs_orig = compare(o, orig, valid)
    fields = dict(o_dtype=DTYPE_NAMES[run.o.dtype], amax_s=scalar_value(run.amax_s) if run.amax_s is not None else None,
                  amax_s_output=run.amax_s_note, amax_o=scalar_value(run.amax_o), ref_amax_o=scalar_value(ref.abs().amax()),
                  **prefixed("vs_fp8_inputs_", compare(o, ref, valid)), **prefixed("vs_orig_", vs_orig))
    if lse is not None:
        fields["stats_max_abs_err"] = compare(run.stats.squeeze(-1), lse)["max_abs_err"]
    fields["match"] = vs_orig["finite"] and vs_orig["rmse_over_range"] < TE_RMSE_OVER_RANGE
    return fields


def forward_case(layout: str, d: int, causal: bool, x: Optional[Fp8Qkv] = None, o_dtype=E4M3) -> dict:
    x = x or separate_inputs(layout, d, seed=d)
    scale = d ** -0.5
    ref, lse = reference(*x.deq(), scale, causal)
    orig, _ = reference(*x.orig, scale, causal)
    o = alloc(layout, (B, S, H, d), o_dtype)
    run = fp8_forward(x, causal, scale, o, scale_for(ref.abs().amax(), o_dtype))
    heads = f"{x.fp8[0].shape[2]}:{x.fp8[1].shape[2]}"
    return dict(layout=layout, d=d, causal=causal, heads=heads, **fwd_fields(run, ref, lse, orig))


def fp8_backward(x: Fp8Qkv, fwd: FwdRun, do_q, descale_do, grads_ref, dp_amax, causal, scale, grads,
                 io: Optional[GraphLayout] = None, extra_pack: Optional[dict] = None):
    """One sdpa_fp8_backward call writing ``grads`` (dq, dk, dv); returns their scales and the
    four amax outputs (dQ, dK, dV, dP)."""
    q, k, v = x.fp8
    scales = [scale_for(g.abs().amax(), out.dtype) for g, out in zip(grads_ref, grads)]
    scale_dp = scale_for(dp_amax, E4M3)
    io = io or dense_layout(q=q, k=k, v=v, o=fwd.o, do=do_q, dq=grads[0], dk=grads[1], dv=grads[2])
    dtypes = dict(q=q.dtype, k=k.dtype, v=v.dtype, o=fwd.o.dtype, do=do_q.dtype, dq=grads[0].dtype, dk=grads[1].dtype,
                  dv=grads[2].dtype)
    built = build_fp8_bwd(io, dtypes, causal, scale)
    amaxes = [amax_buffer() for _ in range(4)]
    pack = dict(q=q, k=k, v=v, o=fwd.o, do=do_q, stats=fwd.stats, dq=grads[0], dk=grads[1], dv=grads[2],
                descale_q=x.descale[0], descale_k=x.descale[1], descale_v=x.descale[2], descale_o=fwd.descale_o,
                descale_do=descale_do, descale_s=_const(1 / FP8_MAX[E4M3]), descale_dp=1.0 / scale_dp,
                scale_s=_const(FP8_MAX[E4M3]), scale_dq=scales[0], scale_dk=scales[1], scale_dv=scales[2], scale_dp=scale_dp,
                amax_dq=amaxes[0], amax_dk=amaxes[1], amax_dv=amaxes[2], amax_dp=amaxes[3])
    pack.update(extra_pack or {})
    execute(built, pack)
    return scales, amaxes


def bwd_fields(grads, scales, amaxes, grads_ref, dp_amax, ds_amax, valid=None, to_ref=lambda t: t) -> dict:
    fields, match = {}, True
    for name, g, s, r, a in zip(("dq", "dk", "dv"), grads, scales, grads_ref, amaxes):
        c = compare(to_ref(dequant(g, 1.0 / s)), r, valid)
        fields.update({f"{name}_max_abs_err": c["max_abs_err"], f"{name}_rmse_over_range": c["rmse_over_range"],
                       f"{name}_finite": c["finite"], f"amax_{name}": scalar_value(a), f"ref_amax_{name}": c["ref_absmax"]})
        match = match and c["finite"] and c["rmse_over_range"] < TE_RMSE_OVER_RANGE
    fields.update(amax_dp=scalar_value(amaxes[3]), ref_amax_dOVt=scalar_value(dp_amax), ref_amax_dS=scalar_value(ds_amax),
                  grad_dtype=DTYPE_NAMES[grads[0].dtype], match=match)
    return fields


def backward_case(layout: str, d: int, causal: bool, do_dtype, o_dtype=E4M3, grad_dtype=None, packing=None) -> dict:
    """Forward then backward through cuDNN; ``packing`` (bs3hd) reads q/k/v from one buffer and
    writes dq/dk/dv into one gradient buffer of the same packing."""
    grad_dtype = grad_dtype or do_dtype
    x = packed_inputs(packing, d, seed=300) if packing else separate_inputs(layout, d, seed=100 + d)
    scale = d ** -0.5
    _, do_q, descale_do = make(layout, (B, S, H, d), do_dtype, torch.Generator(device="cuda").manual_seed(7))
    do_deq = dequant(do_q, descale_do)
    ref, _, grads_ref, ds_amax = reference_grads(*x.deq(), scale, causal, do_deq)
    o = alloc(layout, (B, S, H, d), o_dtype)
    fwd = fp8_forward(x, causal, scale, o, scale_for(ref.abs().amax(), o_dtype))
    if packing:
        buf = nans(tuple(x.fp8[0].shape[:2]) + ((3, H, d) if packing == "bs3hd" else (H, 3, d)), grad_dtype)
        grads = tuple(buf.select(2 if packing == "bs3hd" else 3, i) for i in range(3))
    else:
        grads = tuple(alloc(layout, t.shape, grad_dtype) for t in x.fp8)
    dp_amax = dout_v_amax(do_deq, x.deq()[2])
    scales, amaxes = fp8_backward(x, fwd, do_q, descale_do, grads_ref, dp_amax, causal, scale, grads)
    return dict(layout=packing or layout, d=d, causal=causal, heads=f"{x.fp8[0].shape[2]}:{x.fp8[1].shape[2]}",
                do_dtype=DTYPE_NAMES[do_dtype], o_dtype=DTYPE_NAMES[o_dtype],
                **bwd_fields(grads, scales, amaxes, grads_ref, dp_amax, ds_amax))


# ------------------------------------------------------------------ THD (Q3)


def _thd_rows(lens) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position) of every packed row."""
    b_idx = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lens)]).cuda()
    i_idx = torch.cat([torch.arange(n) for n in lens]).cuda()
    return b_idx, i_idx


class Thd:
    """The packed batch of THD_LENS: rows, offsets, lengths, and the dense <-> packed maps."""

    def __init__(self, d: int):
        self.lens, self.b, self.smax, self.total = THD_LENS, len(THD_LENS), max(THD_LENS), sum(THD_LENS)
        self.b_idx, self.i_idx = _thd_rows(self.lens)
        cu = torch.tensor([0] + list(itertools.accumulate(self.lens)), device="cuda")
        self.pack = dict(off_q=(cu * H * d).long().view(-1, 1, 1, 1), off_kv=(cu * HKV * d).long().view(-1, 1, 1, 1),
                         off_stats=(cu * H).long().view(-1, 1, 1, 1), len_q=torch.tensor(self.lens, dtype=torch.int32,
                                                                                           device="cuda").view(-1, 1, 1, 1))
        self.pack["len_kv"] = self.pack["len_q"]
        self.valid = torch.zeros(self.b, self.smax, dtype=torch.bool, device="cuda")
        self.valid[self.b_idx, self.i_idx] = True

    def pack_for(self, ragged_stats: bool) -> dict:
        """The offsets and lengths the graph names (an offset for the stats only when they are ragged)."""
        return {k: v for k, v in self.pack.items() if ragged_stats or k != "off_stats"}

    def dense(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((self.b, self.smax) + tuple(t.shape[1:]), dtype=torch.float32, device="cuda")
        out[self.b_idx, self.i_idx] = t.float()
        return out

    def layout(self, ragged_stats: bool, **tensors) -> GraphLayout:
        descs = {n: ([self.b, t.shape[1], self.smax, t.shape[2]], [self.smax * t.shape[1] * t.shape[2], t.shape[2],
                                                                  t.shape[1] * t.shape[2], 1]) for n, t in tensors.items()}
        stride = [self.smax * H, 1, H, 1] if ragged_stats else [H * self.smax, self.smax, 1, 1]
        descs["stats"] = ([self.b, H, self.smax, 1], stride)
        return GraphLayout(descs, ragged_b=self.b, ragged_stats=ragged_stats, totals=(self.total, self.total))

    def inputs(self, d: int, seed: int) -> Fp8Qkv:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        parts = []
        for h in (H, HKV, HKV):
            x = torch.randn(self.total, h, d, generator=gen, device="cuda")
            parts.append((x,) + quantize(x, E4M3))
        return Fp8Qkv(*(tuple(p[i] for p in parts) for i in range(3)))


def thd_forward_case(ragged_stats: bool, d: int = 128) -> dict:
    thd = Thd(d)
    x = thd.inputs(d, seed=5)
    scale = d ** -0.5
    ref, lse = reference(*(thd.dense(t) for t in x.deq()), scale, True, thd.lens, thd.lens)
    orig, _ = reference(*(thd.dense(t) for t in x.orig), scale, True, thd.lens, thd.lens)
    o = nans((thd.total, H, d), E4M3)
    io = thd.layout(ragged_stats, q=x.fp8[0], k=x.fp8[1], v=x.fp8[2], o=o)
    run = fp8_forward(x, True, scale, o, scale_for(ref.abs().amax(), E4M3), io, thd.pack_for(ragged_stats))
    fields = fwd_fields(run, ref, None, orig, thd.valid, thd.dense)
    stats = run.stats.squeeze(-1)
    got = stats if ragged_stats else stats.permute(0, 2, 1)[thd.b_idx, thd.i_idx]
    fields["stats_max_abs_err"] = compare(got, lse.permute(0, 2, 1)[thd.b_idx, thd.i_idx])["max_abs_err"]
    return dict(lens=thd.lens, d=d, heads=f"{H}:{HKV}", stats="ragged [T,H,1]" if ragged_stats else "dense [B,H,S,1]", **fields)


def thd_backward_case(d: int = 128) -> dict:
    """The THD backward with HYBRID (E5M2 dO and gradients); O and the stats come from the
    reference, so this runs whether or not the THD forward does."""
    thd = Thd(d)
    x = thd.inputs(d, seed=6)
    scale = d ** -0.5
    do_f = torch.randn(thd.total, H, d, generator=torch.Generator(device="cuda").manual_seed(8), device="cuda")
    do_q, descale_do = quantize(do_f, E5M2)
    do_deq = thd.dense(dequant(do_q, descale_do))
    dense = [thd.dense(t) for t in x.deq()]
    ref, lse, grads_ref, ds_amax = reference_grads(*dense, scale, True, do_deq, thd.lens)
    o_q, descale_o = quantize(ref[thd.b_idx, thd.i_idx], E4M3)
    fwd = FwdRun(o_q, lse.unsqueeze(-1).contiguous(), None, amax_buffer(), descale_o, "")
    grads = tuple(nans(t.shape, E5M2) for t in x.fp8)
    io = thd.layout(False, q=x.fp8[0], k=x.fp8[1], v=x.fp8[2], o=o_q, do=do_q, dq=grads[0], dk=grads[1], dv=grads[2])
    dp_amax = dout_v_amax(do_deq, dense[2])
    scales, amaxes = fp8_backward(x, fwd, do_q, descale_do, grads_ref, dp_amax, True, scale, grads, io, thd.pack_for(False))
    return dict(lens=thd.lens, d=d, **bwd_fields(grads, scales, amaxes, grads_ref, dp_amax, ds_amax, thd.valid, thd.dense))


# ------------------------------------------------------------------ BF16 output (Q4)


def bf16_output_case(d: int = 128) -> dict:
    """O declared BF16 in the FP8 graph (no dequantization pass), and whether scale_o still
    multiplies it (run again with scale_o = 2)."""
    fields = forward_case("bshd", d, True, o_dtype=BF16)
    x = separate_inputs("bshd", d, seed=d)
    o1, o2 = (alloc("bshd", (B, S, H, d), BF16) for _ in range(2))
    fp8_forward(x, True, d ** -0.5, o1, scale_for(torch.ones(1, device="cuda"), BF16))
    fp8_forward(x, True, d ** -0.5, o2, torch.full((1, 1, 1, 1), 2.0, device="cuda"))
    nz = o1.float().abs() > 1e-3
    fields["o_ratio_with_scale_o_2"] = scalar_value((o2.float()[nz] / o1.float()[nz]).median())
    return fields


# ------------------------------------------------------------------ the questions


def q1(deadline: float) -> None:
    for layout in ("bshd", "sbhd"):
        for d in (128, 64):
            for causal in (True, False):
                run_case("Q1", f"sdpa_fp8 fwd {layout} d{d} {'causal' if causal else 'no mask'} GQA {H}:{HKV}",
                         lambda: forward_case(layout, d, causal), deadline)


def q2(deadline: float) -> None:
    for d in (128, 64):
        for causal in (True, False):
            for do_dtype in (E5M2, E4M3):
                name = "HYBRID (dO, dQKV E5M2)" if do_dtype == E5M2 else "E4M3 (dO, dQKV E4M3)"
                run_case("Q2", f"sdpa_fp8_backward bshd d{d} {'causal' if causal else 'no mask'} {name}",
                         lambda: backward_case("bshd", d, causal, do_dtype), deadline)
    run_case("Q2", "sdpa_fp8_backward sbhd d128 causal HYBRID", lambda: backward_case("sbhd", 128, True, E5M2), deadline)


def q3(deadline: float) -> None:
    run_case("Q3", "sdpa_fp8 fwd THD ragged offsets + padding mask, dense stats", lambda: thd_forward_case(False), deadline)
    run_case("Q3", "sdpa_fp8 fwd THD ragged offsets + padding mask, ragged stats", lambda: thd_forward_case(True), deadline)
    run_case("Q3", "sdpa_fp8_backward THD ragged offsets HYBRID", thd_backward_case, deadline)


def q4(deadline: float) -> None:
    run_case("Q4", "sdpa_fp8 fwd with O declared BF16 (bshd d128 causal)", bf16_output_case, deadline)
    for packing in ("bs3hd", "bsh3d"):
        run_case("Q4", f"sdpa_fp8 fwd packed QKV {packing}: q/k/v select() views of one E4M3 buffer",
                 lambda: forward_case("bshd", 128, True, x=packed_inputs(packing, 128, seed=200)), deadline)
    run_case("Q4", "sdpa_fp8_backward packed bs3hd in, packed dQKV out (HYBRID)",
             lambda: backward_case("bshd", 128, True, E5M2, packing="bs3hd"), deadline)
    run_case("Q4", "sdpa_fp8_backward with O given as BF16 (HYBRID)",
             lambda: backward_case("bshd", 128, True, E5M2, o_dtype=BF16), deadline)
    run_case("Q4", "sdpa_fp8_backward with dQ/dK/dV declared BF16 (expected: Blackwell only)",
             lambda: backward_case("bshd", 128, True, E5M2, grad_dtype=BF16), deadline)
