"""One forward call, checked once and prepared into the record the backends run on.

:func:`prepare` is the full path: it checks the arguments, derives every fact of the call once
(format, mask and window, packed metadata and gaps, per-sequence policies, dense padding, bias
shape, softmax variant) and returns a finished, immutable :class:`AttentionInputs`.
:meth:`.fast_path.CallRecipe.inputs` builds the same record for a repeated call from what an
earlier :func:`prepare` decided, without the checks. :func:`selection_params` reads the
record's host facts into the :class:`AttentionParams` that backend selection looks at.

Context parallelism enters here too (``cp_size`` > 1): the same checks and facts, with TE's CP
contract where it differs. Each rank passes its local rows with the GLOBAL THD metadata, so the
packed sides index ``cp_size`` times the local rows; dense lengths (masks, bias shapes) are the
global ones. The record says so (``cp_size``) and goes to the cp/ entry.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from ..selection.libraries import compute_capability
from ..masks import AttnMaskType, MaskSpec, normalize_window
from .packed_qkv import ResolvedQKV
from ..selection.params import AttentionParams, fp8_recipe_kind
from .inputs import AttentionInputs
from .policies import SeqPolicies, parse_policies, reject_per_seq
from .packed_seqs import PackedSeqs, prepare_sides
from .validation import check_bias, check_bottom_right_diagonal, check_mask_and_format, check_policy_diagonals, check_qkv, dense_padding

PackedSides = Tuple[PackedSeqs, PackedSeqs]


def bshd_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str) -> Tuple[torch.Tensor, ...]:
    """q/k/v as the backends take them: sbhd runs as a transposed bshd view (no copy)."""
    if qkv_format == "sbhd":
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    return q, k, v


def prepare(
    module: Any,
    qkv: ResolvedQKV,
    qkv_format: str,
    *,
    attention_mask: Any,
    cus: Tuple[Optional[torch.Tensor], ...],
    max_seqlens: Tuple[Optional[int], Optional[int]],
    attn_mask_type: Optional[str],
    window_size: Optional[Tuple[int, int]],
    pad_between_seqs: Optional[bool],
    per_seq: Any,
    is_causal: Optional[torch.Tensor],
    bottom_right_diagonal: Optional[bool],
    bias_type: str,
    bias: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor],
    packed: Optional[PackedSides] = None,
    num_splits: Optional[int] = None,
    cp_size: int = 1,
    fp8: Any = None,
) -> AttentionInputs:
    """The checked, complete inputs of one call of ``module`` (a DotProductAttention).

    ``cus`` = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded);
    ``max_seqlens`` = (q, kv); ``per_seq`` / ``is_causal`` are ``attn_mask_type_per_seq`` /
    ``thd_sequence_is_causal``. ``packed``: both THD sides as
    :func:`.packed_seqs.prepare_sides` already returned them for these same arguments
    (MultiheadAttention's rotary path), not built again; not read under context parallelism
    (``cp_size`` > 1: this rank holds 1/cp_size of the rows, see the module docstring).
    ``num_splits``: the forward's split-KV hint, checked by the caller (``check_num_splits``).
    ``fp8``: the call's FP8 context (:func:`..fp8.context.fp8_call_context`), None in high precision.
    """
    check_qkv(qkv.q, qkv.k, qkv.v, qkv_format, module.num_attention_heads_per_partition, module.num_gqa_groups_per_partition,
              module.head_dims)
    # Kept as given for the policies: each normalizes it against its own mask (normalized against
    # a causal module mask it would read (-1, 0), making every policy causal).
    raw_window = window_size if window_size is not None else module.window_size
    mask = AttnMaskType.parse(attn_mask_type if attn_mask_type is not None else module.attn_mask_type)
    mask = check_bottom_right_diagonal(bottom_right_diagonal, mask, raw_window, bias_type == "alibi")
    mask = check_mask_and_format(mask, qkv_format, attention_mask, cus[0] is not None)
    spec = MaskSpec(mask, normalize_window(raw_window, mask))
    q, k, v = bshd_views(qkv.q, qkv.k, qkv.v, qkv_format)
    pq = pk = policies = None
    dense: Tuple[Optional[torch.Tensor], ...] = (None, None, None)
    if qkv_format == "thd":
        if cp_size > 1:
            packed = prepare_sides(cus, max_seqlens, pad_between_seqs, (q.shape[0] * cp_size, k.shape[0] * cp_size), q.device)
        pq, pk, policies, spec = _packed_call(q, k, cus, max_seqlens, pad_between_seqs, per_seq, is_causal, raw_window, spec, packed,
                                              bottom_right_diagonal)
        sizes = (pq.batch_size, pq.max_seqlen, pk.max_seqlen)
    else:
        reject_per_seq(per_seq, is_causal, f"qkv_format={qkv_format!r}")
        sizes = (q.shape[0], q.shape[1] * cp_size, k.shape[1] * cp_size)
        dense = dense_padding(attention_mask, mask, *sizes, cus[0], cus[1], q.device)
    fmt = "thd" if qkv_format == "thd" else "bshd"
    bias_shape = check_bias(bias_type, bias, alibi_slopes, fmt, sizes[0], q.shape[-2], sizes[1], sizes[2])
    if policies is not None and bias_type != "no_bias":
        raise NotImplementedError(f"core_attention_bias_type={bias_type!r} cannot be combined with per-sequence mask policies yet; use 'no_bias'")
    return AttentionInputs(
        q, k, v, fmt, spec, module.softmax_scale, module.attention_dropout, packed_q=pq, packed_kv=pk, policies=policies,
        q_valid=dense[0], kv_valid=dense[1], arbitrary_mask=dense[2], bias_type=bias_type, bias=bias, bias_shape=bias_shape,
        alibi_slopes=alibi_slopes, softmax_type=module.softmax_type, softmax_offset=module.softmax_offset,
        return_max_logit=module.return_max_logit, num_splits=num_splits, cp_size=cp_size, fp8=fp8,
        packing=qkv.packing if qkv.declared else None, packed_layer=qkv.buffer)


def _packed_call(q, k, cus, max_seqlens, pad_between_seqs, per_seq, is_causal, raw_window, spec: MaskSpec,
                 packed: Optional[PackedSides], bottom_right_diagonal: Optional[bool] = None
                 ) -> Tuple[PackedSeqs, PackedSeqs, Optional[SeqPolicies], MaskSpec]:
    """Both packed sides, the per-sequence policies and the call's mask of a THD call."""
    if packed is None:
        packed = prepare_sides(cus, max_seqlens, pad_between_seqs, (q.shape[0], k.shape[0]), q.device)
    pq, pk = packed
    policies = parse_policies(per_seq, is_causal, pq.batch_size, q.device, raw_window)
    if policies is not None:  # checked before a uniform policy becomes the call's mask
        check_policy_diagonals(bottom_right_diagonal, policies.specs, "attn_mask_type_per_seq" if per_seq is not None else "thd_sequence_is_causal")
    if policies is not None and policies.uniform_spec() is not None:
        # A uniform policy is exactly the scalar path: one call, same results.
        return pq, pk, None, policies.uniform_spec()
    return pq, pk, policies, spec


def selection_params(module: Any, inp: AttentionInputs, qkv_format: str, layout: str, *, context_parallel: bool = False,
                     cp_comm_type: Optional[str] = None) -> AttentionParams:
    """The host facts of a prepared call that backend selection reads (``qkv_format`` as the
    caller named it: sbhd stays sbhd here). Under context parallelism (``context_parallel``,
    with the comm type) they describe the calls the backend will run: see :func:`_cp_call_form`."""
    q, k, v = inp.q, inp.k, inp.v
    thd = inp.is_thd
    device = q.device
    cc = compute_capability(device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else None
    gaps = thd and (inp.packed_q.has_gaps or inp.packed_kv.has_gaps)
    shared = thd and inp.same_lengths
    if context_parallel:
        qkv_format, layout, gaps, shared = _cp_call_form(inp, cp_comm_type, gaps)
    return AttentionParams(
        qkv_dtype=q.dtype,
        device_type=device.type,
        compute_capability=cc,
        qkv_format=qkv_format,
        qkv_layout=layout,
        batch_size=inp.packed_q.batch_size if thd else q.shape[0],
        num_heads=q.shape[-2],
        num_gqa_groups=k.shape[-2],
        max_seqlen_q=inp.packed_q.max_seqlen if thd else q.shape[1] * inp.cp_size,
        max_seqlen_kv=inp.packed_kv.max_seqlen if thd else k.shape[1] * inp.cp_size,
        head_dim_qk=q.shape[-1],
        head_dim_v=v.shape[-1],
        attn_mask_type=inp.mask.mask_type,
        window_size=inp.mask.window,
        attention_dropout=inp.dropout_p,
        core_attention_bias_type=inp.bias_type,
        core_attention_bias_shape=inp.bias_shape,
        alibi_slopes_shape=None if inp.alibi_slopes is None else tuple(inp.alibi_slopes.shape),
        pad_between_seqs=gaps,
        per_seq_policies=None if inp.policies is None else inp.policies.specs,
        shared_cu_seqlens=shared,
        has_padding_mask=inp.q_valid is not None or inp.kv_valid is not None,
        is_training=module.training,
        requires_grad=torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, inp.softmax_offset)),
        softmax_type=inp.softmax_type,
        return_max_logit=inp.return_max_logit,
        context_parallel=context_parallel,
        cp_comm_type=cp_comm_type,
        fp8=inp.fp8 is not None,
        fp8_recipe=None if inp.fp8 is None else fp8_recipe_kind(inp.fp8.recipe),
    )


def _cp_call_form(inp: AttentionInputs, cp_comm_type: Optional[str], gaps: bool) -> Tuple[str, str, bool, bool]:
    """(format, layout, gaps, sq == skv known) of the calls a backend runs under context
    parallelism. Every call takes separate q/k/v tensors the schedule made, whatever the
    caller's packed layout. The ring and all-gather schedules (p2p, all_gather, a2a+p2p) call
    the kernel interface on spans of the rows: packed, with gaps. a2a runs the backend's
    ordinary call on the whole sequences after the all-to-all, in the record's own form."""
    if cp_comm_type is None:
        raise ValueError("selection_params(context_parallel=True) needs cp_comm_type; got None")
    if cp_comm_type != "a2a":
        return "thd", "thd_thd_thd", True, inp.same_lengths
    fmt = inp.qkv_format
    return fmt, "_".join((fmt,) * 3), gaps, fmt == "thd" and inp.same_lengths
