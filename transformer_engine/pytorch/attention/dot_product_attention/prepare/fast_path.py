"""Repeated forward calls reuse DotProductAttention's host decisions.

On launch-bound batches (many short sequences) forward's Python costs as much as the kernels.
Its decisions (qkv layout, input checks, mask and window normalization, which offsets each
packed side uses, backend selection) read host facts only: shapes, strides, dtypes, devices,
which cu_seqlens tensors are the same object, the arguments, the module's settings, grad mode
and the NVTE_* switches. :func:`call_key` gathers them; a call whose key matches an earlier
one reuses that call's :class:`CallRecipe` and only assembles its inputs (:meth:`CallRecipe.inputs`).

THD batch values (number of sequences, max_seqlen) are not in the key, so packed batches of a
fixed token count keep hitting the cache as their sequence counts and lengths change: THD
selection reads neither (``test_fast_path`` checks it over every backend's declaration), and
the checks that do read them are repeated here. Per-sequence policies take the fast path too:
their spelling, the dict's keys, the id tensors' metadata and the batch size are in the key,
the parsed policies in the recipe (:class:`.policies.PolicyRecipe`), and each call
builds only its device tensor of policy indices. Always on the full path: calls whose extra
tensors matter beyond their metadata (attention_mask, a bias, alibi_slopes), THD calls
without max_seqlen (it is derived with a sync), dense calls with cu_seqlens, layouts found by
pointer inspection, NVTE_ATTN_VALIDATE=1, and torch.compile tracing (which guards on these
facts itself).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch

from ..masks import AttnMaskType
from .packed_qkv import ResolvedQKV, split_packed
from .inputs import AttentionInputs, assemble_inputs, static_half
from .policies import PolicyRecipe
from .call import PackedSides, bshd_views
from .packed_seqs import sides_of, validation_enabled
from ..environment import compiling, env_snapshot
from ..selection.autotune import key_part as autotune_key
from .layouts import stride_rules_out_packing
from .metadata_cache import derived_from, owns
from ..selection.support import BackendSupport

# A module meets few distinct signatures (one per layer shape and mode); a full cache is
# emptied rather than managed, which only costs the next calls a full path each.
MAX_RECIPES = 32


@dataclass(frozen=True)
class CallRecipe:
    """What the full path decided for one key: how to find q/k/v and the packed offsets, the
    static half of its :class:`AttentionInputs`, and the backend selection."""

    qkv_format: str
    packing: Optional[str]  # "qkv" / "kv" when declared through qkv_layer / kv_layer
    interleave_dim: int
    q_padded: bool  # THD: the queries' offsets are cu_seqlens_q_padded (else cu_seqlens_q)
    kv_padded: bool
    static: Mapping[str, Any]  # inputs.static_half() of the full path's inputs
    selection: Any  # selection.BackendSelection
    policy: Optional[PolicyRecipe] = None  # THD calls given per-sequence policies
    # Calls of this recipe may run a bound kernel call (:func:`bound_call`): one int per distinct
    # key, so the layers of a model (equal keys, one recipe each) share their bound calls. None
    # where the recipe's calls never bind (see :func:`_binds`).
    token: Optional[int] = None

    def tensors(self, layers: Sequence[Optional[torch.Tensor]]):
        """(q, k, v, the declared packed buffer or None) of a call's layers."""
        query, key, value, qkv_layer, kv_layer = layers
        if self.packing == "qkv":
            return (*split_packed(qkv_layer, self.interleave_dim), qkv_layer)
        if self.packing == "kv":
            return (query, *split_packed(kv_layer, self.interleave_dim), kv_layer)
        return query, key, value, None

    def sides(self, cus, max_seqlens, query: torch.Tensor, key: torch.Tensor) -> PackedSides:
        """Both THD sides as make_packed builds them, without its checks (the key fixed their outcome)."""
        cu_q, cu_kv, cu_q_pad, cu_kv_pad = cus
        return sides_of(cu_q, cu_q_pad if self.q_padded else cu_q, max_seqlens[0], query.shape[0],
                        cu_kv, cu_kv_pad if self.kv_padded else cu_kv, max_seqlens[1], key.shape[0])

    def inputs(self, module, layers: Sequence[Optional[torch.Tensor]], cus, max_seqlens,
               packed: Optional[PackedSides] = None, per_seq=None, is_causal=None,
               num_splits: Optional[int] = None, fp8=None) -> AttentionInputs:
        """The call's inputs as :func:`.call.prepare` would build them (``packed``: both THD
        sides already prepared by the caller for these arguments; ``per_seq`` / ``is_causal``:
        the call's ``attn_mask_type_per_seq`` / ``thd_sequence_is_causal``; ``num_splits``: its
        split-KV hint, a per-call field; ``fp8``: its FP8 context, a per-call
        field whose mode is in the key)."""
        query, key, value, layer = self.tensors(layers)
        fmt = self.qkv_format
        if fmt == "sbhd":
            query, key, value = bshd_views(query, key, value, fmt)
        pq = pk = policies = None
        if fmt == "thd":
            pq, pk = packed if packed is not None else self.sides(cus, max_seqlens, query, key)
            if self.policy is not None:
                policies = self.policy.policies(per_seq, is_causal, pq.batch_size, query.device)
        return assemble_inputs(self.static, query, key, value, pq, pk, policies, module.softmax_scale, module.softmax_offset,
                               num_splits, fp8, layer)


class _Bound:
    """The bound calls of one recipe token, backend, scale and hint over one remembered pair of
    THD sides (kept in a table derived from the sides, metadata_cache.py): the plan (None: not
    derived yet; False: the backend binds none), and per value of its rows fact the KernelCall
    (False where that call cannot bind)."""

    __slots__ = ("plan", "calls")

    def __init__(self) -> None:
        self.plan = None
        self.calls: Dict[bool, Any] = {}


def bound_call(recipe: CallRecipe, module, layers, cus, max_seqlens, packed: Optional[PackedSides],
               num_splits: Optional[int], training: bool) -> Tuple[Optional[tuple], PackedSides]:
    """((KernelCall, q, k, v) for ``kernel_autograd.launch``, or None where the caller must run
    the call through :meth:`CallRecipe.inputs` and its backend's ``run``; the call's THD sides,
    which that run takes as ``packed``: bounding them again would launch its kernels twice, and
    a graph capture, which never binds, would record both). Launches nothing else (the caller
    launches inside its dropout RNG fork).

    A THD call's kernel half (plan, NaN-guard mode, flags, KernelCall: what
    ``kernel_autograd.run_kernel`` derives from the prepared inputs) reads only host facts the
    fast-path key fixes, the remembered sides, the module's softmax_scale, the num_splits hint
    and the plan's rows fact. The first call of a recipe token over a remembered pair of sides
    derives it through the ordinary route (``backend.bind``, the same derivation as ``run``);
    later calls with the same facts (the other layers of the step, their recomputations) launch
    it on their q/k/v directly, skipping the inputs record, the plan lookup and run_kernel's
    preamble (about 3 us of a CPU core's forward). Only calls with nothing else per call bind:
    no policies, bias, sink, max logit, FP8 or NaN-guard write (see ``bind_kernel``)."""
    q, k, v = layers[:3] if recipe.packing is None else recipe.tensors(layers)[:3]
    pq, pk = packed = packed if packed is not None else recipe.sides(cus, max_seqlens, q, k)
    if not owns(pk):
        return None, packed  # sides not remembered (capture, inference mode, a cache switched off)
    backend = recipe.selection.backend
    # One table per remembered pair of sides (one of the side's derivation slots, whatever the
    # number of tokens, scales and hints met), emptied when full.
    table = derived_from(pq, ("bound", id(pk)), dict)
    key = (recipe.token, backend, module.softmax_scale, num_splits)
    bound = table.get(key)
    if bound is None:
        if len(table) >= MAX_BINDINGS:
            table.clear()
        bound = table[key] = _Bound()
    plan = bound.plan
    call = None if plan is None else False if plan is False else bound.calls.get(plan.every_row_owned())
    if call is None:
        made = backend.bind(recipe.inputs(module, layers, cus, max_seqlens, packed, num_splits=num_splits), training)
        if made is None:
            bound.plan = False  # the backend binds none of these calls
            return None, packed
        plan, call = made
        # A refusal (FA4's NaN guard over gap rows, a plan not remembered) is only ever made while
        # the rows fact is not known to hold: filed under False, so a fact that lands meanwhile
        # cannot make it permanent.
        owned = call.problem.every_row_owned if call is not None else False
        call = bound.calls[owned] = call or False
        bound.plan = plan  # set last: another thread reads calls only once a plan is there
    return None if call is False else (call, q, k, v), packed


def recipe_of(inp: AttentionInputs, selection, qkv_format: str, qkv: ResolvedQKV, interleave_dim: int,
              by_ids: Optional[bool] = None, key: Optional[tuple] = None) -> Optional[CallRecipe]:
    """The recipe of a full-path call, or None when part of its outcome came from tensor values
    or pointers (that part would not repeat for another call with the same key). ``by_ids``:
    None without per-sequence policies, else whether they came as attn_mask_type_per_seq;
    ``key``: the call's fast-path key (its token lets the recipe's calls bind)."""
    if inp.q_valid is not None or inp.kv_valid is not None or inp.arbitrary_mask is not None:
        return None
    if not qkv.declared and not stride_rules_out_packing(qkv.q, qkv.k, qkv.v):
        return None
    static = static_half(inp)
    if any(isinstance(value, torch.Tensor) for value in static.values()):
        return None  # a tensor of this call (a bias): not the next call's
    q_padded = kv_padded = False
    if inp.is_thd:
        q_padded = inp.packed_q.offsets is not inp.packed_q.cu_seqlens
        kv_padded = inp.packed_kv.offsets is not inp.packed_kv.cu_seqlens
    policy = None if by_ids is None else PolicyRecipe.of(inp.policies, by_ids)
    token = _token(key) if key is not None and _binds(inp, selection, policy) else None
    return CallRecipe(qkv_format, qkv.packing if qkv.declared else None, interleave_dim, q_padded, kv_padded, static, selection,
                      policy, token)


def _binds(inp: AttentionInputs, selection, policy) -> bool:
    """Whether calls of this recipe may bind (:func:`bound_call`): THD without per-sequence
    policies, a bias, a sink or the max logit, on a backend that binds (``bind`` overridden).
    FP8 and checkpointing are per-call arguments: the module checks them on each call."""
    binds = getattr(selection.backend, "bind", None)
    return (inp.is_thd and policy is None and inp.bias_type == "no_bias" and inp.softmax_type == "vanilla"
            and not inp.return_max_logit and getattr(binds, "__func__", None) not in (None, BackendSupport.bind.__func__))


MAX_BINDINGS = 8  # bound calls kept per remembered pair of sides (recipe tokens x scales x hints)
_TOKENS: Dict[tuple, int] = {}
_NEXT_TOKEN = itertools.count(1)


def _token(key: tuple) -> int:
    """One int per distinct key (never reused: a full table is emptied, and a key met again
    only gets a new one, so its recipes share less)."""
    token = _TOKENS.get(key)
    if token is None:
        if len(_TOKENS) >= 4 * MAX_RECIPES:
            _TOKENS.clear()
        token = _TOKENS[key] = next(_NEXT_TOKEN)
    return token


def layer_facts(layers) -> Optional[tuple]:
    """(shape, strides, dtype, device, requires_grad) of each layer given (None where absent), or
    None when one is not a plain tensor (the full path names it). Separate q/k/v (the common
    case) in one flat tuple, a form no other call's facts take (0.8 against 1.1 us a call)."""
    q, k, v, qkv, kv = layers
    if qkv is None and kv is None and type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor:
        return (q.shape, q.stride(), q.dtype, q.device, q.requires_grad, k.shape, k.stride(), k.dtype, k.device,
                k.requires_grad, v.shape, v.stride(), v.dtype, v.device, v.requires_grad)
    facts = []
    for t in layers:
        if t is None:
            facts.append(None)
        elif type(t) is torch.Tensor:
            facts.append((t.shape, t.stride(), t.dtype, t.device, t.requires_grad))
        else:
            return None
    return tuple(facts)


def _same_as(cus, c) -> int:
    """Index of the first of ``cus`` that is ``c`` itself (identity decides gaps and sharing)."""
    for i, other in enumerate(cus):
        if other is c:
            return i
    return -1


def _thd_facts(cus, max_seqlens, pad_between_seqs) -> Optional[tuple]:
    """The THD part of the key, or None where the full path must run (it also raises there)."""
    if pad_between_seqs is not None and type(pad_between_seqs) is not bool:
        return None
    cu_q, cu_kv, pad_q, pad_kv = cus
    max_q, max_kv = max_seqlens
    if (cu_kv is cu_q and pad_q is None and pad_kv is None and type(cu_q) is torch.Tensor and type(max_q) is int
            and type(max_kv) is int and max_q >= 0 and max_kv >= 0 and cu_q.numel()):
        # Self-attention on one cu_seqlens without padded offsets (the common case), spelled out:
        # the general facts below would be (facts, None, None, None) with the identity indices
        # 0, 0; this form ("self", ...) is one no other call's facts take.
        one_query = max_q == 1
        return "self", cu_q.dtype, cu_q.dim(), cu_q.device, pad_between_seqs, one_query, one_query and max_kv > 1
    if pad_between_seqs is False and ((pad_q is not None and pad_q is not cu_q) or (pad_kv is not None and pad_kv is not cu_kv)):
        return None  # the full path checks that such padded offsets equal cu_seqlens
    if type(max_q) is not int or type(max_kv) is not int or max_q < 0 or max_kv < 0:
        return None
    if type(cu_q) is not torch.Tensor or not cu_q.numel():
        return None  # needs cu_seqlens_q of at least one entry (the full path names what is wrong)
    n = cu_q.numel()
    facts = []
    for c in cus:
        if c is None:
            facts.append(None)
        elif type(c) is not torch.Tensor or c.numel() != n:
            return None
        else:
            facts.append((c.dtype, c.dim(), c.device, _same_as(cus, c)))
    # The THD selection rules that read max_seqlen (cuDNN refuses decode-shaped top-left causal
    # backward, and sinks with one query row): their conditions, not the values, are in the key.
    one_query = max_q == 1
    return tuple(facts), pad_between_seqs, one_query, one_query and max_kv > 1


def _policy_facts(per_seq, is_causal, cu_seqlens_q: torch.Tensor) -> Optional[tuple]:
    """The per-sequence policies' part of a THD key ((), without them), or None where the full
    path must run (it also raises there). The batch size is in it: each count check compares
    the ids' shapes with it, so a key fixes the outcome of every check that reads no value."""
    if per_seq is None and is_causal is None:
        return ()
    if (per_seq is not None and is_causal is not None) or type(cu_seqlens_q) is not torch.Tensor:
        return None  # the full path names what is wrong
    batch = cu_seqlens_q.numel() - 1
    if is_causal is not None:
        return ("is_causal", _plain_tensor_facts(is_causal), batch) if type(is_causal) is torch.Tensor else None
    if type(per_seq) is not dict or not per_seq:
        return None
    entries = []
    for key, ids in per_seq.items():
        if not _exact_policy_key(key) or type(ids) is not torch.Tensor:
            return None
        entries.append((key, _plain_tensor_facts(ids)))
    return "per_seq", tuple(entries), batch


def _plain_tensor_facts(t: torch.Tensor) -> tuple:
    return t.dtype, t.shape, t.device


def _exact_policy_key(key) -> bool:
    """A mask type, or (mask type, window of two Python ints): keys that compare equal only
    when they parse alike (("padding", (2.0, 0)) equals ("padding", (2, 0)) as a key)."""
    if type(key) is tuple:
        return len(key) == 2 and type(key[0]) in (str, AttnMaskType) and exact_window(key[1])
    return type(key) in (str, AttnMaskType)


def call_key(module, qkv_format, layers, interleave_dim, cus, max_seqlens, attn_mask_type, window_size,
             pad_between_seqs, bottom_right_diagonal=None, per_seq=None, is_causal=None, fp8=None) -> Optional[tuple]:
    """Every host fact the full path's decisions read, or None if this call must take it.

    ``layers`` = (query, key, value, qkv_layer, kv_layer); ``cus`` = (cu_seqlens_q,
    cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded); ``max_seqlens`` = (q, kv);
    ``per_seq`` / ``is_causal``: ``attn_mask_type_per_seq`` / ``thd_sequence_is_causal``;
    ``fp8``: the call's FP8 context (its mode decides selection)."""
    if compiling() or validation_enabled():
        return None
    if not exact_window(window_size):
        return None  # (2.0, 0) equals (2, 0) as a key: the full path must see (and reject) it
    facts = layer_facts(layers)
    if facts is None:
        return None
    fmt = qkv_format if qkv_format is not None else module.qkv_format
    if fmt == "thd":
        thd = _thd_facts(cus, max_seqlens, pad_between_seqs)
        policy = None if thd is None else _policy_facts(per_seq, is_causal, cus[0])
        if policy is None:
            return None
        thd += policy
    elif any(c is not None for c in cus) or per_seq is not None or is_causal is not None:
        return None  # dense padding from cu_seqlens (built from the tensors on every call); policies need THD
    else:
        thd = None
    sink = getattr(module, "softmax_offset", None)
    settings = (module_settings(module), sink is not None and sink.requires_grad)
    return (fmt, facts, interleave_dim, thd, attn_mask_type, window_size, bottom_right_diagonal, settings,
            torch.is_grad_enabled(), env_snapshot(), None if fp8 is None else fp8.key,
            autotune_key(cus[0] if fmt == "thd" else None))


def module_settings(module) -> tuple:
    """The module's settings that a call's decisions read (both keys, :func:`call_key` and
    :func:`.kv_cache.kv_call_key`, hold them)."""
    return (module.training, module.attention_dropout, module.qkv_format, module.attn_mask_type, module.window_size,
            module.num_attention_heads_per_partition, module.num_gqa_groups_per_partition, module.head_dims,
            module.softmax_type, module.return_max_logit)


def exact_window(window) -> bool:
    """None, or a tuple of exactly two Python ints (what the full path accepted before)."""
    return window is None or (type(window) is tuple and len(window) == 2 and all(type(w) is int for w in window))


def lookup(cache: Dict[tuple, CallRecipe], key: Optional[tuple]) -> Optional[CallRecipe]:
    try:
        return cache.get(key)
    except TypeError:  # an unhashable argument (a window given as a list): the full path runs
        return None


def remember(cache: Dict[tuple, CallRecipe], key: Optional[tuple], recipe: Optional[CallRecipe]) -> None:
    if key is None or recipe is None:
        return
    if len(cache) >= MAX_RECIPES:
        cache.clear()
    try:
        cache[key] = recipe
    except TypeError:
        pass
