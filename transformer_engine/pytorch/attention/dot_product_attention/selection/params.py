"""What backend selection looks at: the hashable host facts of one call (:class:`AttentionParams`).

Shape legend: B = batch, S = sequence length, T = total packed tokens, H = query heads,
HG = key/value heads (GQA groups), D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Tuple

import torch

from ..masks import AttnMaskType, MaskSpec


@dataclass(frozen=True)
class AttentionParams:
    """Everything backend selection looks at: host facts only, hashable, so it can be cached.

    Build one directly to ask what would run for a configuration (no tensors needed).
    """

    qkv_dtype: torch.dtype = torch.bfloat16
    device_type: str = "cuda"
    compute_capability: Optional[Tuple[int, int]] = (9, 0)
    qkv_format: str = "sbhd"
    qkv_layout: str = "sbhd_sbhd_sbhd"
    batch_size: int = 1
    num_heads: int = 16
    num_gqa_groups: int = 16
    max_seqlen_q: int = 128
    max_seqlen_kv: int = 128
    head_dim_qk: int = 64
    head_dim_v: int = 64
    attn_mask_type: AttnMaskType = AttnMaskType.NO_MASK
    window_size: Tuple[int, int] = (-1, -1)
    attention_dropout: float = 0.0
    core_attention_bias_type: str = "no_bias"
    core_attention_bias_shape: Optional[str] = None
    alibi_slopes_shape: Optional[Tuple[int, ...]] = None
    pad_between_seqs: bool = False
    per_seq_policies: Optional[Tuple[MaskSpec, ...]] = None
    # THD: cu_seqlens_q is cu_seqlens_kv, so every sequence has sq == skv and top-left and
    # bottom-right diagonals coincide (FlashAttention only knows bottom-right).
    shared_cu_seqlens: bool = True
    has_padding_mask: bool = False
    is_training: bool = True
    requires_grad: bool = True
    fp8: bool = False
    context_parallel: bool = False
    # "vanilla", "off-by-one" or "learnable" (see DotProductAttention), and whether the call
    # returns TE's per-head max logit.
    softmax_type: str = "vanilla"
    return_max_logit: bool = False
    cp_comm_type: Optional[str] = None  # with context_parallel: p2p, all_gather, a2a or a2a+p2p

    @property
    def mask_specs(self) -> Tuple[MaskSpec, ...]:
        """Every mask policy this call runs (one unless per-sequence policies are given)."""
        if self.per_seq_policies is not None:
            return self.per_seq_policies
        return (MaskSpec(self.attn_mask_type, self.window_size),)

    @property
    def same_lengths(self) -> bool:
        """Whether every sequence is known (from host facts) to have sq == skv."""
        if self.qkv_format == "thd":
            return self.shared_cu_seqlens
        return self.max_seqlen_q == self.max_seqlen_kv and not self.has_padding_mask


def params_key(params: AttentionParams) -> tuple:
    """AttentionParams as nested tuples of plain values: what torch.compile can hand to a
    function it treats as constant (it cannot pass the dataclass itself)."""
    out = []
    for f in fields(params):
        value = getattr(params, f.name)
        if isinstance(value, AttnMaskType):
            value = value.value
        elif f.name == "per_seq_policies" and value is not None:
            value = tuple((s.mask_type.value, s.window) for s in value)
        out.append(value)
    return tuple(out)


def params_from_key(key: tuple) -> AttentionParams:
    values = dict(zip((f.name for f in fields(AttentionParams)), key))
    values["attn_mask_type"] = AttnMaskType(values["attn_mask_type"])
    if values["per_seq_policies"] is not None:
        values["per_seq_policies"] = tuple(MaskSpec(AttnMaskType(m), w) for m, w in values["per_seq_policies"])
    return AttentionParams(**values)
