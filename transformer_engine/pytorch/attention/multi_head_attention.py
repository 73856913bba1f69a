"""MultiheadAttention: TransformerEngine's module, with TE's checkpoint layout, in plain PyTorch.

**State dict.** The submodules and parameters have TE's names and shapes, so a TE state dict
loads here with ``strict=True`` and one saved here loads into TE. Per variant (every TE module
also has its ``_extra_state``, see :mod:`.dot_product_attention.extra_state`):

===========================  ==============================================================
self, ``input_layernorm``    ``layernorm_qkv.{layer_norm_weight, layer_norm_bias, weight, bias}``
self, no input layernorm     ``qkv.{weight, bias}``
cross, ``input_layernorm``   ``layernorm_query.{layer_norm_weight, layer_norm_bias, weight, bias}``
cross, no input layernorm    ``query_layer.{weight, bias}``
cross                        ``key_value.{weight, bias}``
always                       ``core_attention`` (``softmax_offset`` when learnable), ``proj.{weight, bias}``
===========================  ==============================================================

RMSNorm has no ``layer_norm_bias``; ``bias=False`` leaves out every ``bias``. With
``fuse_qkv_params=False`` (TE's default) TE splits the QKV parameters by role:
``query_weight, key_weight, value_weight, query_bias, key_bias, value_bias``
(``layernorm_query``: ``query_*``; ``key_value``: ``key_*, value_*``; ``query_layer`` keeps
``weight``/``bias``). Here they are row blocks of one buffer, still one GEMM.

**Row order of the QKV weight** [(h + 2g) d, hidden] (h heads, g GQA groups, d head size):

- ``qkv_weight_interleaved=True`` with ``fuse_qkv_params=True``: group by group, the group's h/g
  query heads, then its key, then its value: the rows viewed as [g, h/g + 2, d].
- otherwise (always with ``fuse_qkv_params=False``: TE turns interleaving off there): all
  queries, then all keys, then all values: [h d | g d | g d].

``key_value`` [2 g d, hidden] is [g, 2, d] (key, value per group) when interleaved (fused
parameters only, as above), else [2, g, d].
Query head j uses group j // (h/g). Under tensor parallelism each rank holds these rows for its
h/tp heads and g/tp groups, laid out as in a tp=1 module of those counts (TE's per-rank
checkpoint), ``proj.weight``'s columns of its heads, and the whole norm and ``proj.bias``.

**Packed hand-off.** The QKV projection output goes to DotProductAttention as a declared packed
buffer (``qkv_layer``, or ``kv_layer`` plus a query view), never sliced and re-detected. The
sliced path is used only where a per-tensor op needs it (rotary embeddings) or where the packing
is not a plain view (interleaved GQA, whose query heads sit between key and value per group).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Tuple, Union

import torch

from .dot_product_attention import DotProductAttention
from .projections import Projection
from .tensor_parallel import enter_column_parallel, leave_row_parallel, per_partition, tp_world_size
from .inference import InferenceParams
from .rotary import rotate_cached_step, rotate_packed

_INPUT_LAYOUTS = {"sbhd": (3, "[s, b, hidden={}]"), "bshd": (3, "[b, s, hidden={}]"), "thd": (2, "[t, hidden={}]")}


class MultiheadAttention(torch.nn.Module):
    """Self- or cross-attention with input/output projections, in TE's argument order.

    State dict layout and QKV row order: see the module docstring. ``device=None`` means CUDA
    when available, else CPU.

    Tensor parallelism (``set_parallel_mode=True``, tp from ``tp_group``'s world size, else
    ``tp_size``): the QKV projection is column-parallel (each rank holds the rows of its
    ``h/tp`` heads and ``g/tp`` groups), the output projection row-parallel (each rank holds the
    columns of its heads; the partial products are all-reduced over ``tp_group``, then the bias
    is added once). With ``sequence_parallel=True`` the input arrives split along dim 0 and is
    all-gathered (after the input norm) before the QKV projection, and the output is
    reduce-scattered along dim 0, as TE's linear layers do. Weights are drawn with
    ``init_method`` / ``output_layer_init_method`` (default: normal, std 0.023, as TE), one draw
    per parameter, inside the RNG tracker's ``fork()`` when one is given; biases start at 0.

    TE's attributes are here with TE's meanings (``hidden_size_per_attention_head``,
    ``num_attention_heads_per_partition``, ``num_gqa_groups_per_partition``, ``hidden_size_q``,
    ``hidden_size_kv``, ``qkv_weight_interleaved``, ``params_dtype``, ``cp_size``, ``cp_rank``,
    ``layer_number`` (1 when None) ...). megatron-core 0.16 reads none of them: it never builds
    TE's MultiheadAttention.
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        kv_channels: Optional[int] = None,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        init_method: Optional[Callable[[torch.Tensor], Any]] = None,
        output_layer_init_method: Optional[Callable[[torch.Tensor], Any]] = None,
        layer_number: Optional[int] = None,
        attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        tp_group: Any = None,
        tp_size: int = 1,
        num_gqa_groups: Optional[int] = None,
        fuse_wgrad_accumulation: bool = False,
        get_rng_state_tracker: Any = None,
        sequence_parallel: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        return_bias: bool = False,
        return_layernorm_output: bool = False,
        input_layernorm: bool = False,
        attention_type: str = "self",
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        rotary_pos_interleaved: bool = False,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        bias: bool = True,
        normalization: str = "LayerNorm",
        device: Optional[Union[str, torch.device]] = None,
        qkv_format: str = "sbhd",
        name: Optional[str] = None,
        qk_norm_type: Optional[str] = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        seq_length: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        softmax_type: str = "vanilla",
    ) -> None:
        super().__init__()
        _reject_unsupported(fuse_wgrad_accumulation=fuse_wgrad_accumulation, zero_centered_gamma=zero_centered_gamma,
                            rotary_pos_interleaved=rotary_pos_interleaved, ub_overlap_ag=ub_overlap_ag,
                            ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
                            ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad, qk_norm_type=qk_norm_type)
        _check_args(num_attention_heads, normalization, attention_type, layer_number, return_layernorm_output, input_layernorm)
        device = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        self.hidden_size, self.qkv_format, self.attn_mask_type, self.window_size = hidden_size, qkv_format, attn_mask_type, window_size
        self.layer_number = 1 if layer_number is None else layer_number  # as TE
        self.input_layernorm, self.attention_type, self.name, self.softmax_type = input_layernorm, attention_type, name, softmax_type
        self.get_rng_state_tracker, self.tp_group, self.set_parallel_mode = get_rng_state_tracker, tp_group, set_parallel_mode
        self.return_bias, self.return_layernorm_output = return_bias, return_layernorm_output
        self.params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.fuse_qkv_params = fuse_qkv_params
        # As TE: separate query/key/value parameters are never interleaved.
        self.qkv_weight_interleaved = qkv_weight_interleaved and fuse_qkv_params
        self.rotary_pos_interleaved, self.qk_norm_before_rope = rotary_pos_interleaved, qk_norm_before_rope
        self.q_norm = self.k_norm = None  # qk_norm_type is refused above
        self.tp_size = tp_world_size(tp_size, tp_group)
        if self.tp_size > 1 and not set_parallel_mode:
            raise ValueError(f"a tensor-parallel size of {self.tp_size} (tp_size / tp_group) needs set_parallel_mode=True; "
                             "got set_parallel_mode=False")
        # As in TE: sequence parallelism only means something across more than one rank.
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel
        self.num_attention_heads, self.num_gqa_groups = num_attention_heads, num_gqa_groups or num_attention_heads
        self.num_attention_heads_per_partition = per_partition("num_attention_heads", num_attention_heads, self.tp_size)
        self.num_gqa_groups_per_partition = per_partition("num_gqa_groups", self.num_gqa_groups, self.tp_size)
        self.hidden_size_per_attention_head = d = kv_channels or hidden_size // num_attention_heads
        self.hidden_size_q, self.hidden_size_kv = d * num_attention_heads, d * self.num_gqa_groups
        factory = dict(device=device, dtype=self.params_dtype)
        self._build_input_projections(bias, normalization if input_layernorm else None, layernorm_epsilon, factory)
        self.core_attention = DotProductAttention(
            num_attention_heads, d, num_gqa_groups=self.num_gqa_groups, attention_dropout=attention_dropout,
            qkv_format=qkv_format, attn_mask_type=attn_mask_type, window_size=window_size,
            sequence_parallel=sequence_parallel, tp_size=self.tp_size, get_rng_state_tracker=get_rng_state_tracker,
            tp_group=tp_group, layer_number=self.layer_number, attention_type=attention_type, softmax_type=softmax_type,
        )
        # Row-parallel: its bias is added once, after the partial products are summed.
        self.proj = Projection(self.hidden_size_q // self.tp_size, hidden_size, bias, factory)
        self.proj.mark_parallel("row" if set_parallel_mode else None, self.sequence_parallel)
        self._init_weights(init_method, output_layer_init_method, get_rng_state_tracker)

    def _build_input_projections(self, bias: bool, norm: Optional[str], eps: float, factory: dict) -> None:
        """This rank's QKV side (the whole one at tp=1), with TE's module and parameter names."""
        q_rows, kv_rows = self.hidden_size_q // self.tp_size, self.hidden_size_kv // self.tp_size
        split = not self.fuse_qkv_params  # TE's parameters_split
        if self.attention_type == "self":
            self._input_projection = "layernorm_qkv" if norm else "qkv"
            blocks = (("query", q_rows), ("key", kv_rows), ("value", kv_rows)) if split else None
            projections = {self._input_projection: Projection(self.hidden_size, q_rows + 2 * kv_rows, bias, factory, blocks, norm, eps)}
        else:
            self._input_projection = "layernorm_query" if norm else "query_layer"
            blocks = (("query", q_rows),) if split and norm else None
            projections = {self._input_projection: Projection(self.hidden_size, q_rows, bias, factory, blocks, norm, eps),
                           "key_value": Projection(self.hidden_size, 2 * kv_rows, bias, factory,
                                                   (("key", kv_rows), ("value", kv_rows)) if split else None)}
        for name, module in projections.items():
            module.mark_parallel("column" if self.set_parallel_mode else None, self.sequence_parallel)
            setattr(self, name, module)

    def _input_projections(self):
        names = (self._input_projection,) + (("key_value",) if self.attention_type == "cross" else ())
        return [getattr(self, name) for name in names]

    @torch.no_grad()
    def _init_weights(self, init_method, output_layer_init_method, get_rng_state_tracker) -> None:
        # TE draws tensor-parallel shards on the tracker's model-parallel stream.
        fork = get_rng_state_tracker().fork if get_rng_state_tracker is not None else contextlib.nullcontext
        with fork():
            for module in self._input_projections():
                module.reset_parameters(init_method or _default_init)
            self.proj.reset_parameters(output_layer_init_method or _default_init)

    @property
    def cp_size(self) -> int:
        """The context-parallel size (TE's attribute; 1 without context parallelism)."""
        cfg = self.core_attention.cp_config
        return cfg.size if cfg is not None else 1

    @property
    def cp_rank(self) -> int:
        """This rank in the context-parallel group, the one the data is partitioned for (TE's attribute)."""
        cfg = self.core_attention.cp_config
        return cfg.rank if cfg is not None else 0

    def set_tensor_parallel_group(self, tp_group: Any) -> None:
        """Supply the tensor-parallel group after construction (built with ``tp_size``), as in TE."""
        world = tp_world_size(1, tp_group)
        if tp_group is not None and world != self.tp_size:
            raise ValueError(f"tp_group has {world} ranks but this module was built for tp_size={self.tp_size}")
        self.tp_group = tp_group
        self.core_attention.tp_group = tp_group

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        encoder_output: Optional[torch.Tensor] = None,
        attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        is_first_microbatch: Optional[bool] = None,
        checkpoint_core_attention: bool = False,
        inference_params: Any = None,
        rotary_pos_emb: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[torch.Tensor] = None,
        alibi_slopes: Optional[torch.Tensor] = None,
        cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_kv: Optional[torch.Tensor] = None,
        cu_seqlens_q_padded: Optional[torch.Tensor] = None,
        cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_kv: Optional[int] = None,
        fast_zero_fill: bool = True,
        pad_between_seqs: Optional[bool] = None,
        **per_seq_policy,
    ):
        """hidden_states: [s, b, hidden] / [b, s, hidden] / [t, hidden] by ``qkv_format`` (this
        rank's dim-0 shard of it under sequence parallelism); ``encoder_output`` likewise, for
        cross attention.

        Returns the output, then the projection bias if ``return_bias``, then the layernorm
        output if ``return_layernorm_output``, as TE does. ``attn_mask_type`` / ``window_size``
        default to the module's. Extra keywords (``attn_mask_type_per_seq``,
        ``thd_sequence_is_causal``) go to DotProductAttention. With ``inference_params`` the
        layer's KV cache is made on first use (TE's ``allocate_memory(layer_number)``) and rotary
        embeddings put each new token at its position in its sequence."""
        first = getattr(self, self._input_projection)
        self._check_input("hidden_states", hidden_states, first)
        if self.attention_type == "cross":
            if encoder_output is None:
                raise ValueError("attention_type='cross' needs encoder_output; got None")
            self._check_input("encoder_output", encoder_output, self.key_value)
        if inference_params is not None:
            self._allocate_kv_cache(inference_params)
        ln_out = first.normalize(hidden_states)
        x, enc = ln_out, encoder_output
        if self.set_parallel_mode:
            x = enter_column_parallel(x, self.tp_group, self.sequence_parallel)
            if enc is not None:
                enc = enter_column_parallel(enc, self.tp_group, self.sequence_parallel)
        packed = self._project(first, x, enc)
        if rotary_pos_emb is not None and inference_params is not None:
            packed = rotate_cached_step(packed, rotary_pos_emb, self.qkv_format, inference_params)
        elif rotary_pos_emb is not None:
            cus = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
            packed = rotate_packed(packed, rotary_pos_emb, self.qkv_format, (self.cp_size, self.cp_rank), cus,
                                   (max_seqlen_q, max_seqlen_kv), pad_between_seqs)
        ctx = self.core_attention(
            attention_mask=attention_mask, attn_mask_type=self.attn_mask_type if attn_mask_type is None else attn_mask_type,
            window_size=self.window_size if window_size is None else window_size,
            checkpoint_core_attention=checkpoint_core_attention, inference_params=inference_params,
            core_attention_bias_type=core_attention_bias_type, core_attention_bias=core_attention_bias,
            alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
            cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
            max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, fast_zero_fill=fast_zero_fill,
            pad_between_seqs=pad_between_seqs, **packed, **per_seq_policy,
        )
        out = self.proj.project(ctx, with_bias=False)
        if self.set_parallel_mode:
            out = leave_row_parallel(out, self.tp_group, self.sequence_parallel)
        outputs = (out,) if self.return_bias or self.proj.bias is None else (out + self.proj.bias,)
        if self.return_bias:
            outputs += (self.proj.bias,)
        if self.return_layernorm_output:
            outputs += (ln_out,)
        return outputs if len(outputs) > 1 else outputs[0]

    def set_context_parallel_group(self, cp_group: Any, cp_global_ranks: Any, cp_stream: Any, cp_comm_type: str = "p2p") -> None:
        """Context parallelism for the core attention (TE's method); inputs are then each rank's
        share of the sequence, see DotProductAttention."""
        self.core_attention.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def _allocate_kv_cache(self, inference_params: Any) -> None:
        """This layer's KV cache, made on first use (TE's ``allocate_memory(layer_number)``)."""
        if not isinstance(inference_params, InferenceParams):
            raise TypeError(f"inference_params must be an InferenceParams; got {type(inference_params).__name__}")
        if self.attention_type == "cross":
            raise NotImplementedError("inference_params with attention_type='cross' is not implemented (a KV cache "
                                      "holds self-attention's keys and values); accepted: attention_type='self'")
        if self.layer_number not in inference_params.cache_manager.cache:
            inference_params.allocate_memory(self.layer_number)

    def _check_input(self, name: str, t: Any, projection: Projection) -> None:
        """What the projections need, named (host facts only: no sync); torch's own errors say
        ``mat1 and mat2 ...``."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        ndim, layout = _INPUT_LAYOUTS[self.qkv_format]
        if t.dim() != ndim or t.shape[-1] != projection.in_features:
            raise ValueError(f"{name} must be {layout.format(projection.in_features)} (qkv_format={self.qkv_format!r}, "
                             f"this module's hidden_size); got shape {tuple(t.shape)}")
        weight = projection.weights()[0]
        if t.device != weight.device:
            raise ValueError(f"{name} is on {t.device} but this module's parameters are on {weight.device}; "
                             "move the input or the module (.to())")
        if t.dtype != weight.dtype and not torch.is_autocast_enabled(t.device.type):
            raise TypeError(f"{name} has dtype {t.dtype} but this module's parameters are {weight.dtype}; pass "
                            f"{weight.dtype} (or convert the module with .to(), or run under torch.autocast)")

    def _project(self, first: Projection, x: torch.Tensor, encoder_output: Optional[torch.Tensor]) -> dict:
        """Keyword arguments for DotProductAttention: a declared packed buffer where possible."""
        lead = x.shape[:-1]
        h, hg, d = self.num_attention_heads_per_partition, self.num_gqa_groups_per_partition, self.hidden_size_per_attention_head
        if self.attention_type == "self":
            mixed = first.project(x)
            if not self.qkv_weight_interleaved:
                if h == hg:
                    return dict(qkv_layer=mixed.view(*lead, 3, h, d), qkv_interleave_dim=-3)
                q = mixed[..., : h * d].view(*lead, h, d)
                return dict(query_layer=q, kv_layer=mixed[..., h * d :].view(*lead, 2, hg, d), qkv_interleave_dim=-3)
            grouped = mixed.view(*lead, hg, h // hg + 2, d)
            if h == hg:
                return dict(qkv_layer=grouped, qkv_interleave_dim=-2)
            # Interleaved GQA: the query heads of a group are not one strided view; copy them only.
            q = grouped[..., : h // hg, :].reshape(*lead, h, d)
            return dict(query_layer=q, kv_layer=grouped[..., h // hg :, :], qkv_interleave_dim=-2)
        q = first.project(x).view(*lead, h, d)
        kv = self.key_value(encoder_output)
        kv_lead = encoder_output.shape[:-1]
        if self.qkv_weight_interleaved:
            return dict(query_layer=q, kv_layer=kv.view(*kv_lead, hg, 2, d), qkv_interleave_dim=-2)
        return dict(query_layer=q, kv_layer=kv.view(*kv_lead, 2, hg, d), qkv_interleave_dim=-3)


def _default_init(weight: torch.Tensor) -> None:
    """TE's default weight init: normal, mean 0, std 0.023."""
    torch.nn.init.normal_(weight, mean=0.0, std=0.023)


def _check_args(heads, normalization, attention_type, layer_number, return_layernorm_output, input_layernorm) -> None:
    if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0:
        raise ValueError(f"num_attention_heads must be a positive int; got {heads!r}")
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm'; got {normalization!r}")
    if attention_type not in ("self", "cross"):
        raise ValueError(f"attention_type must be 'self' or 'cross'; got {attention_type!r}")
    if layer_number is not None and (not isinstance(layer_number, int) or layer_number <= 0):
        raise ValueError(f"layer_number must be a positive int or None; got {layer_number!r}")
    if return_layernorm_output and not input_layernorm:
        raise ValueError("return_layernorm_output=True needs input_layernorm=True (there is no layernorm output otherwise)")


def _reject_unsupported(qk_norm_type: Optional[str], **flags: bool) -> None:
    """TE options this module does not implement: each named when asked for."""
    for name, value in flags.items():
        if value:
            raise NotImplementedError(f"{name}=True is not implemented by MultiheadAttention (accepted: False)")
    if qk_norm_type is not None:
        raise NotImplementedError(f"qk_norm_type={qk_norm_type!r} is not implemented by MultiheadAttention (accepted: None)")
