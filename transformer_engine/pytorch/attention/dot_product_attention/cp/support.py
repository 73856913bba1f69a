"""What each context-parallel comm type runs, as data (:data:`COMM_TYPES`), and the rules a
prepared call must meet: :func:`cp_reasons` (rendered into one ``NotImplementedError`` before
any communication) and :func:`cp_support_markdown` (the README's CP table)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..masks import MaskSpec
from ..selection.support import Reason

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


@dataclass(frozen=True)
class CommTypeSupport:
    """What one comm type runs (the README's CP table is rendered from these)."""

    name: str
    windows: str  # "none", "causal" (left windows on causal masks), "all"
    dropout: bool
    any_backend: bool  # runs the backend's ordinary call on whole sequences, so every backend and feature applies
    needs_heads_divisible: bool


COMM_TYPES = {
    "p2p": CommTypeSupport("p2p", "none", False, False, False),
    "all_gather": CommTypeSupport("all_gather", "causal", False, False, False),
    "a2a": CommTypeSupport("a2a", "all", True, True, True),
    "a2a+p2p": CommTypeSupport("a2a+p2p", "none", False, False, True),
}


@dataclass(frozen=True)
class CPFacts:
    """Host facts about one CP call that decide whether its comm type can run it."""

    comm_type: str
    specs: Tuple[MaskSpec, ...]
    shared_qkv_meta: bool  # q and kv share cu_seqlens and slots (sq == skv per sequence)
    dropout: bool
    bias_type: str
    dense_padding_mask: bool
    num_heads: int
    num_gqa_groups: int
    a2a_size: int


def cp_reasons(f: CPFacts) -> List[Reason]:
    """Every rule of the comm type that this call breaks (empty: it can run)."""
    sup = COMM_TYPES[f.comm_type]
    out = []
    if f.bias_type != "no_bias":
        out.append(Reason("core_attention_bias_type", f"{f.bias_type} with context parallelism", "no_bias"))
    if f.dense_padding_mask:
        out.append(Reason("attention_mask", "a padding mask with context parallelism", "None (use qkv_format='thd' with cu_seqlens)"))
    if f.dropout and not sup.dropout:
        out.append(Reason("attention_dropout", f"> 0 with cp_comm_type={f.comm_type!r}", "0.0, or cp_comm_type='a2a'"))
    if sup.needs_heads_divisible and (f.num_heads % f.a2a_size or f.num_gqa_groups % f.a2a_size):
        out.append(Reason("num_attention_heads", f"{f.num_heads} (num_gqa_groups {f.num_gqa_groups}) with a2a size {f.a2a_size}",
                          "both divisible by the a2a group size"))
    for spec in f.specs:
        out.extend(_spec_reasons(spec, sup, f))
    return out


def _spec_reasons(spec: MaskSpec, sup: CommTypeSupport, f: CPFacts) -> List[Reason]:
    if sup.any_backend:
        return []
    out = []
    causal, windowed = spec.mask_type.is_causal, spec.window[0] >= 0 or (spec.window[1] >= 0 and not spec.mask_type.is_causal)
    if windowed and not (sup.windows == "causal" and causal):
        allowed = "causal masks with (left, 0) windows, or cp_comm_type='a2a'" if sup.windows == "causal" else "none: use cp_comm_type='all_gather' or 'a2a'"
        out.append(Reason("window_size", f"{spec.window} ({spec.mask_type.value}) with cp_comm_type={f.comm_type!r}", allowed))
    if causal and not f.shared_qkv_meta:
        out.append(Reason("attn_mask_type", f"{spec.mask_type.value} with q and kv lengths that may differ, cp_comm_type={f.comm_type!r}",
                          "self-attention sharing cu_seqlens_q/kv (and the padded ones), or cp_comm_type='a2a'"))
    return out


def reject_settings(softmax_type: str, return_max_logit: bool, bottom_right_diagonal: Optional[bool]) -> None:
    """What the context-parallel schedules do not carry yet, refused by name before preparing
    (so before any communication)."""
    for name, value, plain in (("softmax_type", softmax_type, "vanilla"), ("return_max_logit", return_max_logit, False),
                               ("bottom_right_diagonal", bottom_right_diagonal, None)):
        if value != plain:
            raise NotImplementedError(f"{name}={value!r} is not supported with context parallelism yet; use {plain!r}")


def cp_support_markdown() -> str:
    """The CP table of the README, from :data:`COMM_TYPES`."""
    rows = ["| cp_comm_type | masks | sliding windows | per-seq policies, pad_between_seqs | dropout | backends | heads |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in COMM_TYPES.values():
        masks = "all but arbitrary" if s.any_backend else "full and causal (causal needs sq == skv)"
        windows = {"none": "no", "causal": "causal (left, 0)", "all": "yes"}[s.windows]
        backends = "any (ordinary path)" if s.any_backend else "FA4, cuDNN, unfused"
        heads = "divisible by the a2a size" if s.needs_heads_divisible else "any"
        rows.append(f"| {s.name} | {masks} | {windows} | yes | {'yes' if s.dropout else 'no'} | {backends} | {heads} |")
    return "\n".join(rows)
