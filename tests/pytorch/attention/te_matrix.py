"""TransformerEngine's own attention test configurations as one matrix, run on a forced backend
against an independent float64 reference.

The configurations mirror the families of TE's ``tests/pytorch/attention/test_attention.py``
(base, qkv layouts, THD layouts with and without gaps, masks, MLA head dims, bias shapes and
ALiBi, sliding windows), scaled to sizes a test can afford: on CUDA sequences of 128-1024 tokens,
on the CPU the same cases shrunk 16x in sequence length and head dim. Every case builds its
inputs in its layout (packed layouts as views of one buffer, declared through ``qkv_layer`` /
``kv_layer`` or passed as views), runs ``DotProductAttention`` with only one backend switched on
and ends in one of:

- ``pass``: the forced backend ran and its output and dq/dk/dv (and dBias) match the reference;
  rows outside every sequence are exactly 0.
- ``refused``: selection refused the configuration, and the NoBackendError names the forced
  backend's reason (a refusal without a reason is a failure).
- ``skip``: the forced backend's library is not installed.
- ``fail``: anything else: a crash, a mismatch, another backend ran, a refusal without reason.

On CUDA a crash can poison the process (an illegal memory access), so the driver runs each group
of cases in a worker process and restarts a fresh worker after the case that killed one::

    python -m tests.pytorch.attention.te_matrix --device cuda --jobs 8 --out te_matrix.jsonl
    python -m tests.pytorch.attention.te_matrix --worker fa4:thd:0     # one group, JSON lines

The summary table at the end counts pass/refused/skip/fail per backend and family and lists
every failure and every distinct refusal reason.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import math
import os
import subprocess
import sys
import time
import warnings
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

import torch

from .gpu_helpers import env  # the NVTE switches for one case, restored after it
from .reference import reference_dense, reference_thd, standard_slopes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

UNFUSED = "UnfusedDotProductAttention"
BACKENDS = {  # short name -> (label, the switches that leave only that backend on)
    "fa4": ("FlashAttention v4", dict(NVTE_FLASH_ATTN="1", NVTE_FLASH_ATTN_V4="1", NVTE_FLASH_ATTN_V3="0", NVTE_FLASH_ATTN_V2="0",
                                      NVTE_FUSED_ATTN="0", NVTE_UNFUSED_ATTN="0")),
    "cudnn": ("FusedAttention", dict(NVTE_FLASH_ATTN="0", NVTE_FUSED_ATTN="1", NVTE_UNFUSED_ATTN="0")),
    "unfused": (UNFUSED, dict(NVTE_FLASH_ATTN="0", NVTE_FUSED_ATTN="0", NVTE_UNFUSED_ATTN="1")),
}
GPU_BACKENDS = ("fa4", "cudnn")
GROUP_SIZE = int(os.environ.get("TE_MATRIX_GROUP_SIZE", "40"))  # cases per worker process (groups run in parallel)
# Low-precision dtypes on CUDA; on the CPU bf16 cases run in float64 and fp16 cases in float32.
DTYPES = {"cuda": {"bf16": torch.bfloat16, "fp16": torch.float16}, "cpu": {"bf16": torch.float64, "fp16": torch.float32}}
# Relative (Frobenius) error allowed for the output; gradients get 4x.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5, torch.float64: 1e-10}
FATAL = ("illegal memory access", "illegal instruction", "CUDA error", "cudaError", "unspecified launch failure", "misaligned address")


# ------------------------------------------------------------------------------------ the cases


@dataclass(frozen=True)
class Case:
    """One configuration. Sizes are the CUDA sizes (TE's proportions, shorter sequences);
    :func:`sized` shrinks them for the CPU."""

    family: str
    config: str  # the TE configuration it mirrors
    layout: str
    dtype: str = "bf16"
    b: int = 2
    h: int = 8
    hg: int = 8
    sq: int = 128
    skv: int = 128
    dqk: int = 64
    dv: int = 64
    mask: str = "no_mask"
    window: Optional[Tuple[int, int]] = None
    bias: str = "no_bias"  # no_bias | post_scale_bias | alibi
    bias_shape: str = "1hss"  # post_scale_bias: 11ss 1hss b1ss bhss 111s; alibi: vanilla | h | bh (custom slopes)
    gaps: bool = False  # THD: padding between sequences (cu_seqlens_*_padded)
    declared: bool = True  # packed layouts: qkv_layer/kv_layer (else q/k/v views of the buffer)
    grad: bool = True
    checkpoint: bool = False

    @property
    def fmt(self) -> str:
        return "".join(c for c in self.layout.split("_")[0] if c.isalpha())

    @property
    def packing(self) -> Optional[str]:
        return "qkv" if "3" in self.layout else "kv" if "2" in self.layout else None

    @property
    def interleave_dim(self) -> int:
        packed = self.layout.split("_")[-1]
        return -3 if packed[-3] in "23" else -2  # "t3hd"/"bs2hd": the count before h; "th3d": after

    @property
    def id(self) -> str:
        parts = [self.family, self.config, self.layout, self.dtype]
        if self.fmt == "thd":
            parts.append("gaps" if self.gaps else "nogaps")
        if self.packing and not self.declared:
            parts.append("views")
        if not self.grad:
            parts.append("fwd")
        if self.checkpoint:
            parts.append("ckpt")
        return "/".join(parts)


DENSE_LAYOUTS = ("sb3hd", "sbh3d", "sbhd_sb2hd", "sbhd_sbh2d", "sbhd_sbhd_sbhd",
                 "bs3hd", "bsh3d", "bshd_bs2hd", "bshd_bsh2d", "bshd_bshd_bshd")
THD_LAYOUTS = ("t3hd", "th3d", "thd_t2hd", "thd_th2d", "thd_thd_thd")


def _fits(c: Case) -> bool:
    """A layout can hold the case: packed q/k/v needs one shape for all three (TE skips the
    others the same way), packed k/v needs dqk == dv."""
    if c.packing == "qkv":
        return c.sq == c.skv and c.h == c.hg and c.dqk == c.dv
    if c.packing == "kv":
        return c.dqk == c.dv
    return True


def _te_default_layout(c: Case) -> str:
    """The layout TE's test picks when a configuration names none."""
    plain = c.h == c.hg and c.dqk == c.dv
    if c.sq == c.skv:
        return "sb3hd" if plain else "sbhd_sbhd_sbhd"
    return "bshd_bs2hd" if plain else "bshd_bshd_bshd"


def _base_family() -> List[Case]:
    """model_configs_base (and test_dpa_checkpoint): head dims 64-1024, decode, cross."""
    out = []
    for cfg, b, sq, skv, d in [("base_1_0", 2, 128, 128, 64), ("base_1_1", 2, 128, 256, 64), ("base_2_0", 2, 512, 512, 128),
                               ("base_2_1", 1, 512, 1024, 128), ("base_3_0", 2, 1, 512, 128), ("base_3_1", 2, 1, 512, 256),
                               ("base_4_0", 2, 1, 512, 192), ("base_4_1", 2, 128, 512, 192), ("base_5_0", 2, 1, 512, 512),
                               ("base_5_1", 2, 128, 512, 512), ("base_6_0", 2, 1, 512, 1024), ("base_6_1", 2, 128, 512, 1024)]:
        c = Case("base", cfg, "", b=b, sq=sq, skv=skv, dqk=d, dv=d)
        for dtype in ("fp16", "bf16"):
            out.append(replace(c, layout=_te_default_layout(c), dtype=dtype))
        if cfg in ("base_1_1", "base_2_1"):
            out.append(replace(c, layout=_te_default_layout(c), checkpoint=True))
    return out


def _layout_family() -> List[Case]:
    """model_configs_layout over the 10 dense layouts."""
    configs = [Case("layout", "layout_0_0", "", b=2, sq=128, skv=128),
               Case("layout", "layout_0_1", "", b=2, sq=128, skv=128, mask="causal", bias="post_scale_bias"),
               Case("layout", "layout_0_2", "", b=1, sq=128, skv=256, mask="padding"),
               Case("layout", "layout_0_3", "", b=1, sq=128, skv=256, mask="padding_causal", bias="post_scale_bias"),
               Case("layout", "layout_2_0", "", b=2, sq=1, skv=256, dqk=256, dv=256),
               Case("layout", "layout_2_1", "", b=2, sq=256, skv=256, dqk=256, dv=256, mask="causal", bias="post_scale_bias")]
    out = []
    for i, c in enumerate(configs):
        out += [replace(c, layout=lay, declared=i % 2 == 0) for lay in DENSE_LAYOUTS]
    return [c for c in out if _fits(c)]


def _thd_family() -> List[Case]:
    """model_configs_layout_thd over the 5 THD layouts, with and without gaps."""
    out = []
    n = 0
    for mask, window in [("padding", None), ("padding_causal", None), ("padding_causal_bottom_right", None),
                         ("padding", (4, 4)), ("padding_causal", (4, 0)), ("padding_causal_bottom_right", (4, 0))]:
        for variant, hg, skv, d in [("self", 8, 256, 64), ("mqa", 1, 256, 128), ("cross", 8, 512, 128)]:
            c = Case("thd", f"{mask}{'' if window is None else '_swa'}_{variant}", "", b=3, hg=hg, sq=256, skv=skv, dqk=d, dv=d,
                     mask=mask, window=window)
            for lay in THD_LAYOUTS:
                for gaps in (False, True):
                    out.append(replace(c, layout=lay, gaps=gaps, declared=n % 2 == 0))
                    n += 1
    return [c for c in out if _fits(c)]


def _mask_family() -> List[Case]:
    """model_configs_mask: the five masks on self, MQA and cross attention, and decode."""
    out = []
    masks = ("causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right")
    for i, mask in enumerate(masks, start=1):
        for j, (hg, sq, skv, d) in enumerate([(8, 256, 256, 64), (1, 256, 256, 128), (8, 256, 512, 128)]):
            c = Case("mask", f"mask_{i}_{j}", "", hg=hg, sq=sq, skv=skv, dqk=d, dv=d, mask=mask)
            out.append(replace(c, layout=_te_default_layout(c)))
        for j, d in enumerate((128, 256)):
            c = Case("mask", f"mask_{i + 5}_{j}", "", sq=1, skv=512, dqk=d, dv=d, mask=mask)
            out.append(replace(c, layout=_te_default_layout(c)))
    return out


def _mla_family() -> List[Case]:
    """model_configs_mla (head_dim_qk != head_dim_v), fp16 and bf16 with gradients, and the
    forward alone (FA4 runs that on sm90; its backward is refused)."""
    out = []
    for cfg, sq, skv, dqk, dv, mask in [("mla_1_0", 128, 128, 64, 128, "no_mask"), ("mla_1_1", 128, 256, 64, 128, "no_mask"),
                                        ("mla_1_2", 128, 256, 192, 128, "no_mask"), ("mla_2_0", 256, 256, 128, 64, "causal"),
                                        ("mla_2_1", 256, 512, 128, 64, "causal"), ("mla_2_2", 256, 512, 192, 128, "causal"),
                                        ("mla_3_0", 1, 512, 128, 64, "no_mask"), ("mla_3_1", 1, 512, 256, 128, "no_mask"),
                                        ("mla_3_2", 1, 512, 192, 128, "no_mask"), ("mla_3_3", 1, 512, 160, 128, "no_mask"),
                                        ("mla_3_4", 1, 512, 160, 160, "no_mask")]:
        c = Case("mla", cfg, "", sq=sq, skv=skv, dqk=dqk, dv=dv, mask=mask)
        c = replace(c, layout=_te_default_layout(c), checkpoint=True)  # TE runs its MLA test with checkpointing
        out += [replace(c, dtype="fp16"), c, replace(c, grad=False, checkpoint=False)]
    return out


def _bias_family() -> List[Case]:
    """model_configs_bias, model_configs_bias_shapes, model_configs_alibi_slopes, and ALiBi
    with more queries than keys (TE aligns causal/padding_causal top-left)."""
    out = []
    for bias in ("post_scale_bias", "alibi"):
        for mask in ("no_mask", "padding", "causal", "padding_causal"):
            for variant, skv in (("self", 128), ("cross", 256)):
                c = Case("bias", f"{bias}_{mask}_{variant}", "", sq=128, skv=skv, mask=mask, bias=bias,
                         bias_shape="vanilla" if bias == "alibi" else "1hss")
                out.append(replace(c, layout=_te_default_layout(c)))
    for shape in ("11ss", "1hss", "b1ss", "bhss", "111s"):
        c = Case("bias", f"shape_{shape}", "", sq=256, skv=256, dqk=128, dv=128, bias="post_scale_bias", bias_shape=shape)
        out.append(replace(c, layout=_te_default_layout(c)))
    for slopes in ("h", "bh"):
        c = Case("bias", f"alibi_custom_{slopes}", "", sq=256, skv=256, dqk=128, dv=128, mask="causal", bias="alibi", bias_shape=slopes)
        out.append(replace(c, layout=_te_default_layout(c)))
    for mask in ("no_mask", "causal", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right"):
        c = Case("bias", f"alibi_sq_gt_skv_{mask}", "", sq=256, skv=128, mask=mask, bias="alibi", bias_shape="vanilla")
        out.append(replace(c, layout=_te_default_layout(c)))
    return out


def _swa_family() -> List[Case]:
    """model_configs_swa with TE's swa window (2, 2), cut to (2, 0) for causal masks as TE's
    window check does, on thd_thd_thd and sbhd_sbhd_sbhd."""
    out = []
    for mask in ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right"):
        window = (2, 0) if "causal" in mask else (2, 2)
        for variant, hg, skv, d in (("self", 8, 256, 64), ("gqa", 2, 256, 128), ("cross", 8, 512, 128)):
            for lay in ("thd_thd_thd", "sbhd_sbhd_sbhd"):
                m = mask
                if lay.startswith("thd") and "padding" not in mask:
                    m = "padding" if mask == "no_mask" else "padding_" + mask  # as TE's test converts them
                out.append(Case("swa", f"swa_{mask}_{variant}", lay, hg=hg, sq=256, skv=skv, dqk=d, dv=d, mask=m, window=window))
    return out


FAMILIES = {"base": _base_family, "layout": _layout_family, "thd": _thd_family, "mask": _mask_family, "mla": _mla_family,
            "bias": _bias_family, "swa": _swa_family}


def all_cases(families=None) -> List[Case]:
    out = []
    for name, make in FAMILIES.items():
        if families is None or name in families:
            out += make()
    return out


def cpu_cases() -> List[Case]:
    """The cases the CPU runs: one per configuration that stays distinct once :func:`sized`
    shrinks it (head dims 64 and 512 both become a few channels; what remains is the layout,
    the mask and window, the bias, gaps, dtype, gradients, and how heads, lengths and head
    dims relate)."""
    def shape(c: Case) -> tuple:
        heads = "mha" if c.hg == c.h else "mqa" if c.hg == 1 else "gqa"
        lengths = "eq" if c.sq == c.skv else "decode" if c.sq == 1 else "lt" if c.sq < c.skv else "gt"
        return heads, lengths, c.dqk == c.dv

    seen: Dict[tuple, Case] = {}
    for c in all_cases():
        key = (c.layout, c.mask, c.window is not None, c.bias, c.bias_shape if c.bias != "no_bias" else "", c.gaps,
               c.declared if c.packing else None, c.grad, c.checkpoint, c.dtype, shape(c))
        seen.setdefault(key, c)
    return list(seen.values())


def groups(backends, families=None) -> Dict[str, List[Case]]:
    """{"fa4:thd:0": [cases]}: one worker process per group."""
    out = {}
    for short in backends:
        for fam in FAMILIES:
            if families is not None and fam not in families:
                continue
            cases = FAMILIES[fam]()
            for i in range(0, len(cases), GROUP_SIZE):
                out[f"{short}:{fam}:{i // GROUP_SIZE}"] = cases[i : i + GROUP_SIZE]
    return out


def group_of(short: str, case: Case) -> str:
    cases = FAMILIES[case.family]()
    return f"{short}:{case.family}:{cases.index(case) // GROUP_SIZE}"


def recorded() -> Dict[Tuple[str, str], str]:
    """The last H200 run (``te_matrix_expected.json`` beside this file, written from that run's
    jsonl): {(backend label, case id): status}."""
    with open(os.path.join(os.path.dirname(__file__), "te_matrix_expected.json")) as f:
        outcomes = json.load(f)["outcomes"]
    return {(label, case_id): status for label, by_status in outcomes.items() for status, ids in by_status.items()
            for case_id in ids}


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


# ------------------------------------------------------------------------------------ driver


def worker(group: str, start: int, device: str) -> None:
    """Run a group's cases from ``start``, one RESULT line each; exit 3 after a CUDA error (the
    context may be poisoned: the driver continues in a fresh process)."""
    short = group.split(":")[0]
    cases = groups([short])[group]
    crash_at = os.environ.get("TE_MATRIX_CRASH_AT")  # tests of the driver: die hard at this case
    for i in range(start, len(cases)):
        if crash_at == cases[i].id:
            os._exit(134)
        t0 = time.perf_counter()
        r = run_case(cases[i], short, device)
        r.update(group=group, index=i, seconds=round(time.perf_counter() - t0, 3))
        print("RESULT " + json.dumps(r), flush=True)
        if r["status"] == "fail" and any(s in r["detail"] for s in FATAL):
            sys.exit(3)


def drive_group(group: str, device: str, n_cases: int) -> List[dict]:
    """All results of one group, restarting a worker after each case that ended one."""
    results: Dict[int, dict] = {}
    start = 0
    while start < n_cases:
        proc = subprocess.run([sys.executable, "-m", "tests.pytorch.attention.te_matrix", "--worker", group, "--start", str(start),
                               "--device", device], capture_output=True, text=True, cwd=ROOT, env=os.environ.copy())
        last = start - 1
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
                results[r["index"]] = r
                last = r["index"]
        if last + 1 < n_cases and proc.returncode != 3:
            results[last + 1] = dict(index=last + 1, group=group, status="fail", id=None,
                                     detail=f"worker died (rc {proc.returncode}) in this case: {proc.stderr[-600:]}")
            last += 1
        start = last + 1
    return [results[i] for i in sorted(results)]


def drive(device: str, backends, families=None, jobs: int = 4, only_groups=None) -> List[dict]:
    todo = {g: cs for g, cs in groups(backends, families).items() if only_groups is None or g in only_groups}
    out: List[dict] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(drive_group, g, device, len(cs)): g for g, cs in todo.items()}
        for fut in concurrent.futures.as_completed(futures):
            g = futures[fut]
            res = fut.result()
            for r in res:  # a dead worker's record names its case from the list
                if r.get("id") is None:
                    c = todo[g][r["index"]]
                    r.update(id=c.id, family=c.family, backend=BACKENDS[g.split(":")[0]][0])
            out += res
    return out


def summary(results: List[dict]) -> str:
    table: Dict[tuple, Counter] = defaultdict(Counter)
    for r in results:
        table[(r["backend"], r["family"])][r["status"]] += 1
    lines = ["| backend | family | pass | refused | skip | fail |", "|---|---|---|---|---|---|"]
    for (backend, fam), n in sorted(table.items()):
        lines.append(f"| {backend} | {fam} | {n['pass']} | {n['refused']} | {n['skip']} | {n['fail']} |")
    total = Counter(r["status"] for r in results)
    lines.append(f"\ntotal: {total['pass']} pass, {total['refused']} refused, {total['skip']} skip, {total['fail']} fail")
    fails = [r for r in results if r["status"] == "fail"]
    if fails:
        lines.append("\nfailures:")
        lines += [f"  {r['backend']} {r['id']}: {r['detail'][:300]}" for r in fails]
    reasons = Counter((r["backend"], r["detail"]) for r in results if r["status"] == "refused")
    if reasons:
        lines.append("\nrefusal reasons (count):")
        lines += [f"  {n:4d}  {b}: {why[:200]}" for (b, why), n in sorted(reasons.items())]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backends", default=None, help="comma list of fa4, cudnn, unfused (default: fa4,cudnn on cuda)")
    ap.add_argument("--families", default=None, help="comma list of " + ", ".join(FAMILIES))
    ap.add_argument("--jobs", type=int, default=8, help="worker processes at a time")
    ap.add_argument("--out", default=None, help="write every result as a JSON line here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker is not None:
        worker(a.worker, a.start, a.device)
        return 0
    backends = a.backends.split(",") if a.backends else (list(GPU_BACKENDS) if a.device == "cuda" else ["unfused"])
    families = a.families.split(",") if a.families else None
    t0 = time.perf_counter()
    results = drive(a.device, backends, families, a.jobs)
    if a.out:
        with open(a.out, "w") as f:
            for r in sorted(results, key=lambda r: (r["backend"], r["id"])):
                f.write(json.dumps(r) + "\n")
    print(summary(results))
    print(f"\n{len(results)} cases in {time.perf_counter() - t0:.0f} s on {a.device}")
    return 1 if any(r["status"] == "fail" for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
