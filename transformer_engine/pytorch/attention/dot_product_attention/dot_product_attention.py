"""DotProductAttention: TransformerEngine's module, with its names and argument meanings.

``forward`` prepares the call once (:mod:`.prepare`, or :mod:`.prepare.fast_path` for a
repeat), asks for a backend and runs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Mapping, Optional, Tuple, Union

import torch
import torch.utils.checkpoint

from .cp.context_parallel import CPConfig, check_layout, cp_call, make_cp_config, run_cp
from .cp.support import reject_settings
from . import extra_state
from .environment import compiling
from .fp8.context import fp8_call_context
from ..tensor_parallel import per_partition, tp_world_size
from .backends.kernel_autograd import launch
from .prepare.fast_path import bound_call, call_key, lookup, recipe_of, remember
from .masks import AttnMaskType, normalize_window
from .prepare.packed_qkv import resolve_qkv
from .selection.params import AttentionParams, params_key
from .prepare.call import PackedSides, prepare, selection_params
from .prepare.inputs import AttentionInputs
from .prepare.kv_cache import kv_call_key, prepare_kv_call, reject_with_kv_cache
from .selection.support import SOFTMAX_TYPES
from .selection.autotune import tuned
from .selection.backend_selection import BACKENDS_BY_LABEL, chosen_backend_label, require_backend
from .prepare.validation import check_format, check_kv_channels, check_num_splits, check_softmax_scale

class DotProductAttention(torch.nn.Module):
    """Scaled dot-product attention over [s,b,h,d], [b,s,h,d] or packed [t,h,d] inputs.

    Output flattens heads: [s, b, h*dv], [b, s, h*dv] or [t, h*dv]. Tensor parallelism as TE
    defines it: ``num_attention_heads`` and ``num_gqa_groups`` are global counts and each rank
    passes its own ``h // tp`` heads (tp is ``tp_group``'s world size when given, else
    ``tp_size``). Context parallelism (``cp_group``) follows TE's contract; see
    :mod:`.cp.context_parallel`. As in TE, ``cp_group``, ``cp_global_ranks``, ``cp_stream`` and
    ``cp_comm_type`` are plain attributes, set by ``__init__`` and
    :meth:`set_context_parallel_group` and read at each call (megatron-core assigns
    ``cp_group`` and switches context parallelism on and off per call).
    """

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: Union[int, Tuple[int, int]],
        num_gqa_groups: Optional[int] = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker: Any = None,
        tp_group: Any = None,
        layer_number: Optional[int] = None,
        attention_type: str = "self",
        cp_group: Any = None,
        cp_global_ranks: Any = None,
        cp_stream: Any = None,
        cp_comm_type: str = "p2p",
        softmax_scale: Optional[float] = None,
        softmax_type: str = "vanilla",
        return_max_logit: bool = False,
    ) -> None:
        super().__init__()
        # As in TE: the group's size wins over tp_size; heads and groups are global counts.
        self.tp_size = tp_world_size(tp_size, tp_group)
        self.tp_group = tp_group
        # Under sequence parallelism TE draws attention dropout from the default generator, not
        # the tracker's model-parallel stream (see _dropout_rng).
        self.sequence_parallel = bool(sequence_parallel)
        if softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"softmax_type must be one of {', '.join(map(repr, SOFTMAX_TYPES))}; got {softmax_type!r}")
        if not isinstance(return_max_logit, bool):
            raise TypeError(f"return_max_logit must be a bool; got {return_max_logit!r}")
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        if not isinstance(num_attention_heads, int) or num_attention_heads <= 0:
            raise ValueError(f"num_attention_heads must be a positive int; got {num_attention_heads!r}")
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if not isinstance(self.num_gqa_groups, int) or self.num_gqa_groups <= 0 or num_attention_heads % self.num_gqa_groups:
            raise ValueError(f"num_gqa_groups must divide num_attention_heads={num_attention_heads}; got {num_gqa_groups!r}")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1); got {attention_dropout!r}")
        if attention_type not in ("self", "cross"):
            raise ValueError(f"attention_type must be 'self' or 'cross'; got {attention_type!r}")
        self.num_attention_heads = num_attention_heads
        self.num_attention_heads_per_partition = per_partition("num_attention_heads", num_attention_heads, self.tp_size)
        self.num_gqa_groups_per_partition = per_partition("num_gqa_groups", self.num_gqa_groups, self.tp_size)
        self.head_dims = check_kv_channels(kv_channels)
        self.attention_dropout = attention_dropout
        if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
            raise TypeError(f"get_rng_state_tracker must be a callable returning a tracker with .fork(); got {type(get_rng_state_tracker).__name__}")
        # As in TE: dropout draws its randomness inside the tracker's fork() (Megatron's
        # model-parallel RNG stream); without a tracker, from torch's default generator.
        self.get_rng_state_tracker = get_rng_state_tracker
        self.qkv_format = check_format(qkv_format)
        self.attn_mask_type = AttnMaskType.parse(attn_mask_type)
        normalize_window(window_size, self.attn_mask_type)  # reject a contradiction early
        # Kept as given: each call normalizes it against that call's mask type, as TE does.
        self.window_size = window_size
        self.attention_type = attention_type
        self.layer_number = layer_number
        self.softmax_scale = check_softmax_scale(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(self.head_dims[0])
        self.softmax_type, self.return_max_logit = softmax_type, return_max_logit
        _add_softmax_offset(self, softmax_type, self.num_attention_heads_per_partition, get_rng_state_tracker)
        self._recipes: dict = {}  # host decisions of earlier calls, by their host facts (prepare/fast_path.py)

    def forward(
        self,
        query_layer: Optional[torch.Tensor] = None,
        key_layer: Optional[torch.Tensor] = None,
        value_layer: Optional[torch.Tensor] = None,
        attention_mask: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        qkv_format: Optional[str] = None,
        cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_kv: Optional[torch.Tensor] = None,
        cu_seqlens_q_padded: Optional[torch.Tensor] = None,
        cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_kv: Optional[int] = None,
        attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[torch.Tensor] = None,
        alibi_slopes: Optional[torch.Tensor] = None,
        fast_zero_fill: bool = True,
        inference_params: Any = None,
        pad_between_seqs: Optional[bool] = None,
        fp8_output: bool = False,
        num_splits: Optional[int] = None,
        bottom_right_diagonal: Optional[bool] = None,
        *,
        qkv_layer: Optional[torch.Tensor] = None,
        kv_layer: Optional[torch.Tensor] = None,
        qkv_interleave_dim: int = -3,
        attn_mask_type_per_seq: Optional[Mapping[Any, torch.Tensor]] = None,
        thd_sequence_is_causal: Optional[torch.Tensor] = None,
        _packed_seqs: Optional[PackedSides] = None,
    ) -> torch.Tensor:
        """Attention over q/k/v (separate, or declared packed via ``qkv_layer``/``kv_layer``).

        ``attn_mask_type_per_seq`` / ``thd_sequence_is_causal`` give each packed sequence its own
        mask policy (THD only); see :mod:`.prepare.policies`.

        ``inference_params`` (TE's ``InferenceParams``): the step's K/V are appended to this
        layer's cache (``layer_number``) and the queries attend over everything cached, with the
        lengths of the last ``pre_step``; see :mod:`.prepare.kv_cache`.

        ``_packed_seqs`` is private (not TE's): both THD sides as
        :func:`.prepare.packed_seqs.prepare_sides` returned them for this call's cu_seqlens,
        max_seqlens and pad_between_seqs (MultiheadAttention's rotary path has built them
        already); not read under context parallelism, which prepares the global metadata itself.
        """
        if fp8_output:
            raise NotImplementedError("fp8_output is not implemented; pass False")
        if num_splits is not None:
            check_num_splits(num_splits)
        fp8 = fp8_call_context(self, (query_layer, qkv_layer))  # None unless an FP8 region asks for FP8 attention
        layers = (query_layer, key_layer, value_layer, qkv_layer, kv_layer)
        if inference_params is not None:
            reject_with_kv_cache(inference_params, self.cp_config.size if self.cp_group is not None else 1,
                                 attention_mask=attention_mask, bias_type=core_attention_bias_type, bias=core_attention_bias,
                                 alibi_slopes=alibi_slopes, per_seq=attn_mask_type_per_seq, is_causal=thd_sequence_is_causal,
                                 bottom_right_diagonal=bottom_right_diagonal, fp8=fp8 is not None)
            return self._forward_kv_cache(inference_params, layers, qkv_interleave_dim, qkv_format, attn_mask_type, window_size)
        cus = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
        max_seqlens = (max_seqlen_q, max_seqlen_kv)
        cp = self.cp_config if self.cp_group is not None else None  # the common case reads one attribute
        if cp is not None and cp.size > 1:
            return self._forward_cp(cp, layers, qkv_interleave_dim, qkv_format, checkpoint_core_attention, bottom_right_diagonal,
                                    attention_mask=attention_mask, cus=cus, max_seqlens=max_seqlens, attn_mask_type=attn_mask_type,
                                    window_size=window_size, pad_between_seqs=pad_between_seqs, per_seq=attn_mask_type_per_seq,
                                    is_causal=thd_sequence_is_causal, bias_type=core_attention_bias_type,
                                    bias=core_attention_bias, alibi_slopes=alibi_slopes)
        key = None
        if attention_mask is None and core_attention_bias is None and alibi_slopes is None and core_attention_bias_type == "no_bias":
            key = call_key(self, qkv_format, layers, qkv_interleave_dim, cus, max_seqlens, attn_mask_type, window_size,
                           pad_between_seqs, bottom_right_diagonal, attn_mask_type_per_seq, thd_sequence_is_causal, fp8)
        # Not read while torch.compile traces (key is None there), so the traced graph carries
        # nothing of this dict, which eager calls keep changing.
        recipe = lookup(self._recipes, key) if key is not None else None
        if recipe is not None:
            self._set_last_selection(recipe.selection)
            if fp8 is None and not checkpoint_core_attention and recipe.token is not None:
                out, _packed_seqs = self._bound(recipe, layers, cus, max_seqlens, _packed_seqs, num_splits)
                if out is not None:
                    return out
            inp = recipe.inputs(self, layers, cus, max_seqlens, _packed_seqs, attn_mask_type_per_seq, thd_sequence_is_causal,
                                num_splits, fp8)
            fmt, backend = recipe.qkv_format, recipe.selection.backend
        else:
            fmt = check_format(qkv_format if qkv_format is not None else self.qkv_format)
            qkv = resolve_qkv(*layers, qkv_interleave_dim, fmt)
            inp = prepare(self, qkv, fmt, attention_mask=attention_mask, cus=cus, max_seqlens=max_seqlens,
                          attn_mask_type=attn_mask_type, window_size=window_size, pad_between_seqs=pad_between_seqs,
                          per_seq=attn_mask_type_per_seq, is_causal=thd_sequence_is_causal,
                          bottom_right_diagonal=bottom_right_diagonal, bias_type=core_attention_bias_type,
                          bias=core_attention_bias, alibi_slopes=alibi_slopes, packed=_packed_seqs, num_splits=num_splits, fp8=fp8)
            backend = self._select(selection_params(self, inp, fmt, qkv.layout), inp)
            if key is not None and not self.last_selection.provisional:
                by_ids = None if attn_mask_type_per_seq is None and thd_sequence_is_causal is None else attn_mask_type_per_seq is not None
                remember(self._recipes, key, recipe_of(inp, self.last_selection, fmt, qkv, qkv_interleave_dim, by_ids, key))
        with self._dropout_rng():
            if checkpoint_core_attention and torch.is_grad_enabled():
                out = torch.utils.checkpoint.checkpoint(backend.run, inp, self.training, use_reentrant=False)
            else:
                out = backend.run(inp, self.training)
        if self.return_max_logit:  # as TE: (output, max logit [H])
            # A backend declaring SUPPORTS_RETURN_MAX_LOGIT returned both; one forced past its
            # declaration (backend_scope(force=...)) only the output.
            out, max_logit = out if isinstance(out, tuple) else (out, None)
            return _flatten(out, fmt), max_logit
        return _flatten(out, fmt)

    def set_context_parallel_group(self, cp_group: Any, cp_global_ranks: Any, cp_stream: Any, cp_comm_type: str = "p2p") -> None:
        """Set (or, with ``cp_group=None`` or a group of one rank, switch off) context
        parallelism, as TE's method does: it sets the four attributes, checked here."""
        config = make_cp_config(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = cp_group, cp_global_ranks, cp_stream, cp_comm_type
        self.__dict__["_cp_parsed"] = ((cp_group, cp_global_ranks, cp_stream, cp_comm_type), config)

    @property
    def cp_config(self) -> Optional[CPConfig]:
        """The four CP attributes parsed (None without a group). Parsed again when one was
        assigned directly (as megatron-core assigns ``cp_group``), so they keep TE's meaning."""
        attrs = (self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type)
        parsed = self.__dict__.get("_cp_parsed")
        if parsed is None or any(a is not b for a, b in zip(parsed[0], attrs)):
            parsed = (attrs, make_cp_config(*attrs))
            self.__dict__["_cp_parsed"] = parsed
        return parsed[1]

    def _forward_cp(self, cp: CPConfig, layers, interleave_dim: int, qkv_format: Optional[str], checkpoint: bool,
                    bottom_right_diagonal: Optional[bool], **call: Any) -> torch.Tensor:
        """The call under context parallelism: CP's own rules first (none reads a value the
        preparation checks, and all come before any communication), then the one preparation,
        told the CP size, the selection from its facts, and the cp/ entry."""
        reject_settings(self.softmax_type, self.return_max_logit, bottom_right_diagonal)
        fmt = check_format(qkv_format if qkv_format is not None else self.qkv_format)
        qkv = resolve_qkv(*layers, interleave_dim, fmt)
        check_layout(cp.size, fmt, qkv, call["cus"], call["pad_between_seqs"])
        inp = prepare(self, qkv, fmt, bottom_right_diagonal=bottom_right_diagonal, cp_size=cp.size, **call)
        cp_form = cp_call(inp, cp, self.training)
        backend = self._select(selection_params(self, inp, fmt, qkv.layout, context_parallel=True, cp_comm_type=cp.comm_type))
        with self._dropout_rng():
            return _flatten(run_cp(cp_form, backend, self.training, checkpoint), fmt)

    def _forward_kv_cache(self, inference_params, layers, interleave_dim: int, qkv_format: Optional[str],
                          attn_mask_type: Optional[str], window_size) -> torch.Tensor:
        """Attention over this layer's KV cache (TE's ``inference_params``; see
        :mod:`.prepare.kv_cache`). A repeated step reuses the first one's checks and selection."""
        key = kv_call_key(self, inference_params, layers, interleave_dim, qkv_format, attn_mask_type, window_size)
        recipe = lookup(self._recipes, key) if key is not None else None
        if recipe is None:
            recipe, params = prepare_kv_call(self, inference_params, layers, interleave_dim, qkv_format, attn_mask_type, window_size)
            backend = self._select(params)  # raises before anything is appended when no backend runs the call
            recipe = dataclasses.replace(recipe, backend=backend, selection=None if compiling() else self.last_selection)
            remember(self._recipes, key, recipe)
        else:
            self._set_last_selection(recipe.selection)
        with torch.no_grad():  # forward only (selection refused gradients in training mode)
            inp = recipe.inputs(self, inference_params, layers)
            out = inp.kv_cache.output_from_thd(recipe.backend.run_kv_cache(inp))  # the step's format (sbhd transposed back)
            return out.flatten(-2)  # heads flattened

    def _bound(self, recipe, layers, cus, max_seqlens, packed, num_splits) -> Tuple[Optional[torch.Tensor], PackedSides]:
        """(a fast-path call's output from its bound kernel call, or None where nothing has run
        and it takes the recipe's inputs and its backend's run; its THD sides, for that run: made
        once per call, so a graph capture records their bounding once)."""
        bound, packed = bound_call(recipe, self, layers, cus, max_seqlens, packed, num_splits, self.training)
        if bound is None:
            return None, packed
        fork = self._dropout_rng()
        if fork is _NO_FORK:  # no RNG fork to enter (the common case): a with-block less
            return _flatten(launch(*bound), "thd"), packed
        with fork:
            return _flatten(launch(*bound), "thd"), packed

    def _dropout_rng(self):
        if self.get_rng_state_tracker is None or self.sequence_parallel or not (self.training and self.attention_dropout > 0):
            return _NO_FORK
        return self.get_rng_state_tracker().fork()

    def _select(self, params: AttentionParams, inp: Optional[AttentionInputs] = None):
        """The backend for ``params``; with ``inp`` (an ordinary call, not context parallelism)
        measured among the accepting ones where NVTE_ATTN_AUTOTUNE asks (:mod:`.selection.autotune`)."""
        if compiling():
            return BACKENDS_BY_LABEL[chosen_backend_label(params_key(params))]
        selection = require_backend(params)
        if inp is not None:
            selection = tuned(selection, params, inp, self.training)
        self._set_last_selection(selection)
        return selection.backend

    def _set_last_selection(self, selection) -> None:
        """What ran, and why not the others (for reports). Set past nn.Module.__setattr__, which
        costs microseconds per call looking for parameters and submodules."""
        self.__dict__["last_selection"] = selection

    # TE's checkpoint entry ``_extra_state`` (FP8 state; empty without FP8): see extra_state.py.
    get_extra_state, set_extra_state = extra_state.get_extra_state, extra_state.set_extra_state
    _load_from_state_dict = extra_state.load_from_state_dict


_NO_FORK = contextlib.nullcontext()  # reentrant and stateless: one for every call without a tracker fork


def _add_softmax_offset(module: torch.nn.Module, softmax_type: str, heads: int, get_rng_state_tracker) -> None:
    """TE's ``softmax_offset``: the per-head sink logit [H] (float32). Learnable: a parameter
    drawn from N(0, 0.023) (TE's default init, inside the RNG tracker's fork when one is given);
    off-by-one: zeros, a non-persistent buffer (it follows .to() and stays out of the state dict,
    as TE's plain tensor does); vanilla: None."""
    # ``heads`` is this module's head count (under tensor parallelism: its partition's).
    if softmax_type == "learnable":
        module.softmax_offset = torch.nn.Parameter(torch.empty(heads, dtype=torch.float32))
        fork = get_rng_state_tracker().fork() if get_rng_state_tracker is not None else contextlib.nullcontext()
        with fork, torch.no_grad():
            torch.nn.init.normal_(module.softmax_offset, mean=0.0, std=0.023)
    elif softmax_type == "off-by-one":
        module.register_buffer("softmax_offset", torch.zeros(heads, dtype=torch.float32), persistent=False)
    else:
        module.softmax_offset = None


def _flatten(out: torch.Tensor, fmt: str) -> torch.Tensor:
    """Heads flattened ([..., H, D] -> [..., H * D]; a view wherever reshape's would be one).
    flatten(-2), not reshape(*shape[:-2], H * D): 1.1 against 2.9 us on a CPU core."""
    if fmt == "sbhd":
        out = out.transpose(0, 1)
    return out.flatten(-2)
