"""A call with TE's ``inference_params``: the step's queries attend over the layer's KV cache.

As in TE: the module needs ``layer_number`` (one cache per layer), the mask must be a padding
kind and ``padding_causal`` aligns bottom-right (a step's queries come after the cached tokens),
the step's K/V are appended to the cache (stored bshd) and attention runs over everything cached,
with the lengths ``pre_step`` gave: the call's ``cu_seqlens_*``, ``max_seqlen_*`` and
``pad_between_seqs`` are not read (TE replaces them with the step's). The output has the input's
format, heads flattened.

The call is prepared into an ordinary :class:`AttentionInputs` (see its ``kv_cache`` field) and
selected like any call, from host facts only (:func:`kv_selection_params`): the backend sees a
THD call of the step's query rows over the cache, with ``kv_cache`` and the page size set.
Nothing here reads a tensor's values, so a decode step captures in a CUDA graph. Repeated steps
take a :class:`KVRecipe` cached under :func:`kv_call_key` (host facts only), so a decode step
neither checks nor selects again; what changes per step (the lengths, the page table) lives in
the cache's device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import torch

from ..environment import compiling, env_snapshot
from ..masks import AttnMaskType, MaskSpec, normalize_window
from ..selection.libraries import compute_capability
from ..selection.params import AttentionParams
from .fast_path import exact_window, layer_facts, module_settings
from .inputs import AttentionInputs
from .packed_qkv import resolve_qkv, split_packed
from .packed_seqs import PackedSeqs
from .validation import check_format, check_qkv
from ...inference import InferenceParams, KVCacheStep, inference_attn_mask_type
from ...inference.checks import batch_and_seq


def reject_with_kv_cache(inference_params: Any, cp_size: int, *, attention_mask, bias_type: str, bias, alibi_slopes,
                         per_seq, is_causal, bottom_right_diagonal: Optional[bool], fp8: bool = False) -> None:
    """What a KV call does not take, each named (host facts only; run on every call)."""
    if not isinstance(inference_params, InferenceParams):
        raise TypeError(f"inference_params must be an InferenceParams; got {type(inference_params).__name__}")
    refused = (
        ("attention_mask", attention_mask is not None, "None (the cache's padding comes from inference_params.pre_step)"),
        ("core_attention_bias_type", bias_type != "no_bias" or bias is not None or alibi_slopes is not None,
         "'no_bias' without core_attention_bias or alibi_slopes"),
        ("attn_mask_type_per_seq / thd_sequence_is_causal", per_seq is not None or is_causal is not None, "None"),
        ("bottom_right_diagonal", bottom_right_diagonal is False, "None or True (causal masks over a cache align bottom-right)"),
        ("cp_group", cp_size > 1, "no context parallelism (or a group of one rank)"),
        ("FP8 attention (an FP8 autocast region with fp8_dpa=True)", fp8, "attention in bf16/fp16 (fp8_dpa=False)"),
    )
    for name, given, accepted in refused:
        if given:
            raise NotImplementedError(f"{name} is not supported with inference_params (KV caching); accepted: {accepted}")


def kv_mask(module: Any, attn_mask_type: Optional[str], window_size) -> MaskSpec:
    """The mask over the cache: a padding kind, causal aligned bottom-right (TE's rule)."""
    mask = attn_mask_type if attn_mask_type is not None else module.attn_mask_type
    mask = AttnMaskType(inference_attn_mask_type(AttnMaskType.parse(mask).value))
    return MaskSpec(mask, normalize_window(window_size if window_size is not None else module.window_size, mask))


def _step_sizes(inference_params: InferenceParams, query: torch.Tensor, qkv_format: str) -> Tuple[int, int]:
    """(B, Sq) of the step's record, from host facts: thd rows form max_batch_size sequences of
    at most max_ctx_len queries; bshd/sbhd have their batch and sequence dims."""
    if qkv_format == "thd":
        return inference_params.max_batch_size, inference_params.max_ctx_len or 0
    return batch_and_seq(query.shape, qkv_format)


def kv_selection_params(module: Any, inference_params: InferenceParams, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, qkv_format: str, spec: MaskSpec) -> AttentionParams:
    """The host facts of a KV call, describing what the backend runs: the step's queries as a
    THD call (B sequences of at most Sq rows) over a cache of max_sequence_length tokens per
    sequence, paged (``kv_page_size``) or with padding between the sequences' slots.

    Gradients are wanted (``requires_grad``, refused by every backend) only in training mode: a
    module in eval mode runs the step as inference, without gradients, even where grad mode is
    on and the inputs require grad (TE's generation loops run so; TE's cache takes no gradient
    either)."""
    device = q.device
    cc = compute_capability(device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else None
    batch, max_q = _step_sizes(inference_params, q, qkv_format)
    paged = inference_params.is_paged
    return AttentionParams(
        qkv_dtype=q.dtype, device_type=device.type, compute_capability=cc, qkv_format="thd", qkv_layout="thd_thd_thd",
        batch_size=batch, num_heads=q.shape[-2], num_gqa_groups=k.shape[-2], max_seqlen_q=max_q,
        max_seqlen_kv=inference_params.max_sequence_length, head_dim_qk=q.shape[-1], head_dim_v=v.shape[-1],
        attn_mask_type=spec.mask_type, window_size=spec.window, attention_dropout=module.attention_dropout,
        pad_between_seqs=not paged, shared_cu_seqlens=False, is_training=module.training,
        requires_grad=module.training and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
        softmax_type=module.softmax_type, return_max_logit=module.return_max_logit, kv_cache=True,
        kv_page_size=inference_params.page_size if paged else None,
    )


def kv_record(module: Any, query: torch.Tensor, step: KVCacheStep, spec: MaskSpec) -> AttentionInputs:
    """The prepared KV call (see ``AttentionInputs.kv_cache``) of ``query`` (the step's format)
    over the cache ``step`` describes."""
    q = step.queries_as_thd(query)
    packed_q = PackedSeqs(step.cu_seqlens_q, step.cu_seqlens_q_padded, step.max_seqlen_q, q.shape[0])
    if step.is_paged:
        k, v, packed_kv = step.k_cache, step.v_cache, None
    else:
        k, v = step.k_cache_thd, step.v_cache_thd
        packed_kv = PackedSeqs(step.cu_seqlens_kv, step.cu_seqlens_kv_padded, step.max_seqlen_kv, k.shape[0])
    return AttentionInputs(q, k, v, "thd", spec, module.softmax_scale, packed_q=packed_q, packed_kv=packed_kv, kv_cache=step)


@dataclass(frozen=True)
class KVRecipe:
    """What the first KV call of a key decided: the format, how q/k/v are found, the mask and
    the backend."""

    qkv_format: str
    packing: Optional[str]  # "qkv" / "kv" when declared through qkv_layer / kv_layer
    interleave_dim: int
    spec: MaskSpec
    backend: Optional[type] = None  # the selected backend, whose run_kv_cache runs the call
    selection: Any = None  # its selection.BackendSelection (None under torch.compile)

    def qkv(self, layers: Sequence[Optional[torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value, qkv_layer, kv_layer = layers
        if self.packing == "qkv":
            return split_packed(qkv_layer, self.interleave_dim)
        if self.packing == "kv":
            return (query, *split_packed(kv_layer, self.interleave_dim))
        return query, key, value

    def inputs(self, module: Any, inference_params: InferenceParams, layers) -> AttentionInputs:
        """Append the step's K/V to the layer's cache and return the call's record (the caller
        runs both without autograd: the cache must not keep a graph across steps)."""
        q, k, v = self.qkv(layers)
        step = inference_params.step(module.layer_number, k, v, self.qkv_format)
        return kv_record(module, q, step, self.spec)


def prepare_kv_call(module: Any, inference_params: InferenceParams, layers, interleave_dim: int, qkv_format: Optional[str],
                    attn_mask_type: Optional[str], window_size) -> Tuple[KVRecipe, AttentionParams]:
    """The checked decisions of a KV call (the recipe without its selection) and the facts
    selection reads. Nothing is appended yet: a call no backend runs leaves the cache as it was."""
    fmt = check_format(qkv_format if qkv_format is not None else module.qkv_format)
    qkv = resolve_qkv(*layers, interleave_dim, fmt)
    check_qkv(qkv.q, qkv.k, qkv.v, fmt, module.num_attention_heads_per_partition, module.num_gqa_groups_per_partition,
              module.head_dims)
    spec = kv_mask(module, attn_mask_type, window_size)
    params = kv_selection_params(module, inference_params, qkv.q, qkv.k, qkv.v, fmt, spec)
    recipe = KVRecipe(fmt, qkv.packing if qkv.declared else None, interleave_dim, spec)
    return recipe, params


def kv_call_key(module: Any, inference_params: InferenceParams, layers, interleave_dim: int, qkv_format: Optional[str],
                attn_mask_type, window_size) -> Optional[tuple]:
    """Every host fact a KV call's decisions read, or None where the full path must run."""
    if compiling():
        return None
    if not exact_window(window_size):
        return None  # a window the full path must see (and may reject)
    facts = layer_facts(layers)
    if facts is None:
        return None
    ip = inference_params
    cache = (ip.is_paged, ip.page_size, ip.max_sequence_length, ip.max_batch_size, ip.max_ctx_len)
    return ("kv", qkv_format, facts, interleave_dim, attn_mask_type, window_size, cache, module_settings(module),
            torch.is_grad_enabled(), env_snapshot())
