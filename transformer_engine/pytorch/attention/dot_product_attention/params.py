"""The two records a backend sees: hashable facts for selection, and the tensors to run on.

Shape legend: B = batch, S = sequence length, T = total packed tokens, H = query heads,
HG = key/value heads (GQA groups), D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Tuple

import torch

from .masks import AttnMaskType, MaskSpec
from .per_seq_policy import SeqPolicies
from .thd import PackedSeqs

QKV_FORMATS = ("sbhd", "bshd", "thd")
BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")


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


# eq=False: a record of tensors compares (and hashes) by identity, never element by element.
@dataclass(frozen=True, eq=False)
class AttentionInputs:
    """The tensors and resolved options of one call: built once, complete, by
    :func:`.prepare.prepare` (the full path) or :meth:`.fast_path.CallRecipe.inputs` (a repeat),
    then only read. Derive a variant with ``dataclasses.replace``.

    ``q``/``k``/``v`` are [B, S, H, D] for dense formats (sbhd arrives as a transposed view)
    and [T, H, D] for THD. ``q_valid``/``kv_valid`` ([B, S] bool) mark real tokens of a dense
    padded batch; ``arbitrary_mask`` is True where attention is NOT allowed.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qkv_format: str  # "thd" or "bshd" (sbhd runs as a bshd view)
    mask: MaskSpec
    softmax_scale: float
    dropout_p: float = 0.0
    packed_q: Optional[PackedSeqs] = None
    packed_kv: Optional[PackedSeqs] = None
    policies: Optional[SeqPolicies] = None
    q_valid: Optional[torch.Tensor] = None
    kv_valid: Optional[torch.Tensor] = None
    arbitrary_mask: Optional[torch.Tensor] = None
    bias_type: str = "no_bias"
    bias: Optional[torch.Tensor] = None
    # TE's shape string of ``bias`` ("1hss", "bhss", "111s", ...), None without one.
    bias_shape: Optional[str] = None
    alibi_slopes: Optional[torch.Tensor] = None
    # Softmax variant: ``softmax_offset`` is the per-head sink logit [H] (zeros for
    # "off-by-one", the learnable parameter for "learnable", None for "vanilla").
    softmax_type: str = "vanilla"
    softmax_offset: Optional[torch.Tensor] = None
    # The backend's ``run`` then returns (output, max logit [H]) instead of the output alone.
    return_max_logit: bool = False

    @property
    def is_thd(self) -> bool:
        return self.qkv_format == "thd"

    @property
    def same_lengths(self) -> bool:
        """Whether every sequence is known, from host facts, to have sq == skv: THD with one
        ``cu_seqlens`` tensor for both sides (the valid lengths; padded offsets may differ), or a
        dense batch with equal lengths and no padding. The one home of this fact: selection
        (``AttentionParams.shared_cu_seqlens``) and the cuDNN runner both read it."""
        if self.is_thd:
            return self.packed_q.cu_seqlens is self.packed_kv.cu_seqlens
        return self.q.shape[1] == self.k.shape[1] and self.q_valid is None and self.kv_valid is None


# What differs between two calls that share a fast-path key (fast_path.call_key): their tensors
# (the per-sequence policies hold one), and what the key does not cover (the module's
# softmax_scale and its softmax_offset tensor, which .to() replaces). Every other field is the
# same for both: the cached static half.
PER_CALL_FIELDS = ("q", "k", "v", "packed_q", "packed_kv", "policies", "softmax_scale", "softmax_offset")
STATIC_FIELDS = tuple(f.name for f in fields(AttentionInputs) if f.name not in PER_CALL_FIELDS)


def static_half(inp: AttentionInputs) -> Mapping[str, Any]:
    return {name: getattr(inp, name) for name in STATIC_FIELDS}


def assemble_inputs(static: Mapping[str, Any], q, k, v, packed_q, packed_kv, policies, softmax_scale,
                    softmax_offset) -> AttentionInputs:
    """A record from a cached :func:`static_half` and one call's values, for the fast path.

    The generated frozen ``__init__`` sets each of the ~20 fields through
    ``object.__setattr__`` (about 2 us per call on a CPU core, a tenth of the fast path's host
    time); filling the instance dict directly costs 0.4 us. Eager only: under torch.compile
    the full path runs and builds the record with ``__init__``."""
    inp = object.__new__(AttentionInputs)
    state = inp.__dict__
    state.update(static)
    state["q"], state["k"], state["v"], state["packed_q"], state["packed_kv"] = q, k, v, packed_q, packed_kv
    state["policies"] = policies
    state["softmax_scale"], state["softmax_offset"] = softmax_scale, softmax_offset
    return inp
