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

This module is the matrix (the cases and their groups); ``te_matrix_run.py`` runs one case
(inputs, the reference, the comparison), and ``te_matrix_driver.py`` runs groups of cases in
worker processes: on CUDA a crash can poison the process (an illegal memory access), so it
restarts a fresh worker after the case that killed one::

    python -m tests.pytorch.attention.te_matrix --device cuda --jobs 8 --out te_matrix.jsonl
    python -m tests.pytorch.attention.te_matrix --worker fa4:thd:0     # one group, JSON lines

The summary table at the end counts pass/refused/skip/fail per backend and family and lists
every failure and every distinct refusal reason.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

UNFUSED = "UnfusedDotProductAttention"
BACKENDS = {  # short name -> (label, the switches that leave only that backend on)
    "fa4": ("FlashAttention v4", dict(NVTE_FLASH_ATTN="1", NVTE_FLASH_ATTN_V4="1", NVTE_FLASH_ATTN_V3="0", NVTE_FLASH_ATTN_V2="0",
                                      NVTE_FUSED_ATTN="0", NVTE_UNFUSED_ATTN="0")),
    "cudnn": ("FusedAttention", dict(NVTE_FLASH_ATTN="0", NVTE_FUSED_ATTN="1", NVTE_UNFUSED_ATTN="0")),
    "unfused": (UNFUSED, dict(NVTE_FLASH_ATTN="0", NVTE_FUSED_ATTN="0", NVTE_UNFUSED_ATTN="1")),
}
GPU_BACKENDS = ("fa4", "cudnn")
GROUP_SIZE = int(os.environ.get("TE_MATRIX_GROUP_SIZE", "40"))  # cases per worker process (groups run in parallel)


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


def recorded() -> Dict[Tuple[str, str], str]:
    """The last H200 run (``te_matrix_expected.json`` beside this file, written from that run's
    jsonl): {(backend label, case id): status}."""
    with open(os.path.join(os.path.dirname(__file__), "te_matrix_expected.json")) as f:
        outcomes = json.load(f)["outcomes"]
    return {(label, case_id): status for label, by_status in outcomes.items() for status, ids in by_status.items()
            for case_id in ids}


if __name__ == "__main__":  # the command line lives with the driver
    from .te_matrix_driver import main

    raise SystemExit(main())
