"""What backend selection looks at: the hashable host facts of one call (:class:`AttentionParams`).

Shape legend: B = batch, S = sequence length, T = total packed tokens, H = query heads,
HG = key/value heads (GQA groups), D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional, Tuple, Union

import torch

from ..masks import AttnMaskType, MaskSpec, normalize_window
from .te_compat import resolve_format_and_layout


@dataclass(frozen=True)
class AttentionParams:
    """Everything backend selection looks at: host facts only, hashable, so it can be cached.

    Build one directly to ask what would run for a configuration (no tensors needed). TE's
    spelling is accepted and parsed here, once: ``attn_mask_type`` as a string,
    ``window_size=None``, ``alibi_slopes_shape`` as a list, ``qkv_layout`` alone (the format is
    read from it; ``qkv_format`` alone implies separate q, k, v; both must agree), and TE's
    fields ``qkv_type``, ``core_attention_bias_requires_grad``, ``deterministic``, ``fp8_meta``
    and ``inference_params``. ``fp8`` here means FP8 attention: TE's ``fp8`` (inside an FP8
    autocast) with ``fp8_meta["recipe"].fp8_dpa`` False is attention in high precision, so it
    reads ``fp8=False``. ``compute_capability`` describes the configuration asked about
    (sm90 by default), not necessarily this machine.
    """

    qkv_dtype: torch.dtype = torch.bfloat16
    device_type: str = "cuda"
    compute_capability: Optional[Tuple[int, int]] = (9, 0)
    qkv_format: Optional[str] = None
    qkv_layout: Optional[str] = None
    batch_size: int = 1
    num_heads: int = 16
    num_gqa_groups: int = 16
    max_seqlen_q: int = 128
    max_seqlen_kv: int = 128
    head_dim_qk: int = 64
    head_dim_v: int = 64
    attn_mask_type: Union[AttnMaskType, str] = AttnMaskType.NO_MASK
    window_size: Optional[Tuple[int, int]] = (-1, -1)
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
    # FP8 attention's recipe class name ("DelayedScaling" or "Float8CurrentScaling"; read from
    # fp8_meta["recipe"] when given, DelayedScaling, TE's default, otherwise; None without fp8):
    # cuDNN's FP8 support depends on it.
    fp8_recipe: Optional[str] = None
    context_parallel: bool = False
    # "vanilla", "off-by-one" or "learnable" (see DotProductAttention), and whether the call
    # returns TE's per-head max logit.
    softmax_type: str = "vanilla"
    return_max_logit: bool = False
    cp_comm_type: Optional[str] = None  # with context_parallel: p2p, all_gather, a2a or a2a+p2p
    # TE's fields this package's module does not set. qkv_type: torch.Tensor, or TE's quantized
    # tensor class for FP8 inputs. kv_cache: a KV cache is in use (set from inference_params).
    qkv_type: type = torch.Tensor
    core_attention_bias_requires_grad: bool = True
    deterministic: bool = False
    kv_cache: bool = False
    # With kv_cache: the page size of a paged cache, None for a non-paged one (from
    # inference_params.is_paged / page_size). The module's KV calls describe what the backend
    # runs: qkv_format "thd" (the step's queries as packed rows), max_seqlen_q the step's query
    # bound, max_seqlen_kv the cache's max_sequence_length.
    kv_page_size: Optional[int] = None
    # Objects, folded into the plain facts above at construction and not compared (selection's
    # cache keys on the facts): fp8_meta into fp8, inference_params into kv_cache and kv_page_size.
    fp8_meta: Optional[dict] = field(default=None, compare=False, repr=False)
    inference_params: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # TE's spellings, parsed once; what this package's module passes is already canonical.
        fmt, layout = resolve_format_and_layout(self.qkv_format, self.qkv_layout)
        mask = AttnMaskType.parse(self.attn_mask_type)
        if not (isinstance(self.qkv_type, type) and issubclass(self.qkv_type, torch.Tensor)):
            raise TypeError(f"qkv_type must be torch.Tensor or a subclass of it (TE's FP8 tensor class); got {self.qkv_type!r}")
        derived = dict(qkv_format=fmt, qkv_layout=layout, attn_mask_type=mask,
                       window_size=normalize_window(self.window_size, mask))
        for name in ("alibi_slopes_shape", "compute_capability"):  # TE passes lists
            if getattr(self, name) is not None:
                derived[name] = tuple(getattr(self, name))
        if self.fp8 and _fp8_attention_off(self.fp8_meta):
            derived["fp8"] = False
        derived["fp8_recipe"] = _fp8_recipe_name(self.fp8_meta, self.fp8_recipe) if derived.get("fp8", self.fp8) else None
        if self.inference_params is not None:
            derived.update(_kv_cache_facts(self.inference_params, self.is_training))
        if self.context_parallel and self.cp_comm_type is None:
            derived["cp_comm_type"] = "p2p"  # TE's default
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def mask_specs(self) -> Tuple[MaskSpec, ...]:
        """Every mask policy this call runs (one unless per-sequence policies are given)."""
        if self.per_seq_policies is not None:
            return self.per_seq_policies
        return (MaskSpec(self.attn_mask_type, self.window_size),)

    @property
    def same_lengths(self) -> bool:
        """Whether every sequence is known (from host facts) to have sq == skv: the module's
        calls fill shared_cu_seqlens from :attr:`AttentionInputs.same_lengths` (the fact's home,
        read from the tensors), and this reads it back. A second spelling because params are
        also built by hand, without tensors (TE's spelling, ``dataclasses.replace``): a stored
        copy of the record's value would go stale when a replace changes the facts it follows."""
        if self.qkv_format == "thd":
            return self.shared_cu_seqlens
        return self.max_seqlen_q == self.max_seqlen_kv and not self.has_padding_mask


def _kv_cache_facts(inference_params: Any, is_training: bool) -> dict:
    """TE's ``inference_params`` folded into plain facts: a KV cache, its page size when paged,
    and, as TE's selection assumes for an inference call (``is_training=False``; TE's
    AttentionParams has no requires_grad), no gradients."""
    facts = dict(kv_cache=True)
    if getattr(inference_params, "is_paged", False):
        facts["kv_page_size"] = inference_params.page_size
    if not is_training:
        facts["requires_grad"] = False
    return facts


def _fp8_attention_off(fp8_meta: Optional[dict]) -> bool:
    """Whether TE's ``fp8_meta`` says attention stays in high precision inside an FP8 autocast
    (its recipe's ``fp8_dpa`` is False)."""
    if fp8_meta is None:
        return False
    if not isinstance(fp8_meta, dict):
        raise TypeError(f"fp8_meta must be None or TE's FP8 metadata dict (with a 'recipe' entry); got {type(fp8_meta).__name__}")
    recipe = fp8_meta.get("recipe")
    return recipe is not None and not getattr(recipe, "fp8_dpa", False)


def fp8_recipe_kind(recipe: Any) -> str:
    """"DelayedScaling" or "Float8CurrentScaling" for those recipes and their subclasses (as
    megatron-core's TEDelayedScaling), else the recipe's class name."""
    if getattr(recipe, "delayed", lambda: False)():
        return "DelayedScaling"
    if getattr(recipe, "float8_current_scaling", lambda: False)():
        return "Float8CurrentScaling"
    return type(recipe).__name__


def _fp8_recipe_name(fp8_meta: Optional[dict], given: Optional[str]) -> str:
    recipe = None if fp8_meta is None else fp8_meta.get("recipe")
    if recipe is not None:
        return fp8_recipe_kind(recipe)
    return given if given is not None else "DelayedScaling"


# The compared fields: fp8_meta and inference_params are folded into fp8 and kv_cache.
_KEY_FIELDS = tuple(f for f in fields(AttentionParams) if f.compare)


def params_key(params: AttentionParams) -> tuple:
    """AttentionParams as nested tuples of plain values: what torch.compile can hand to a
    function it treats as constant (it cannot pass the dataclass itself)."""
    out = []
    for f in _KEY_FIELDS:
        value = getattr(params, f.name)
        if isinstance(value, AttnMaskType):
            value = value.value
        elif f.name == "per_seq_policies" and value is not None:
            value = tuple((s.mask_type.value, s.window) for s in value)
        out.append(value)
    return tuple(out)


def params_from_key(key: tuple) -> AttentionParams:
    values = dict(zip((f.name for f in _KEY_FIELDS), key))
    values["attn_mask_type"] = AttnMaskType(values["attn_mask_type"])
    if values["per_seq_policies"] is not None:
        values["per_seq_policies"] = tuple(MaskSpec(AttnMaskType(m), w) for m, w in values["per_seq_policies"])
    return AttentionParams(**values)
