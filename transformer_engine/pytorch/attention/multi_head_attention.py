"""MultiheadAttention: a TE-compatible subset built on torch.nn.Linear/LayerNorm/RMSNorm.

Its fused QKV projection goes to DotProductAttention as a declared packed buffer
(``qkv_layer``, or ``kv_layer`` plus a query view), never sliced and re-detected. The sliced
path is used only where a per-tensor op needs it (rotary embeddings) or where the packing is
not a plain view (interleaved GQA, whose query heads sit between key and value per group).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .dot_product_attention import DotProductAttention
from .tensor_parallel import enter_column_parallel, leave_row_parallel, per_partition, tp_world_size
from .dot_product_attention.cp.partition import dense_positions, positions_of_local_rows
from .dot_product_attention.prepare.packed_seqs import PackedSeqs, prepare_sides, value_checks_on


class MultiheadAttention(torch.nn.Module):
    """Self- or cross-attention with input/output projections, in TE's argument order.

    ``qkv_weight_interleaved=True`` (TE's default) lays the fused projection out per key/value
    group as [g query heads, key, value], i.e. [.., HG, G+2, D]; False concatenates
    [all queries | all keys | all values]. ``device=None`` means CUDA when available, else CPU.

    Tensor parallelism (``set_parallel_mode=True``, tp from ``tp_group``'s world size, else
    ``tp_size``): the QKV projection is column-parallel (each rank holds the rows of its
    ``h/tp`` heads and ``g/tp`` groups, in the same layout as a tp=1 module of those counts),
    the output projection row-parallel (each rank holds the columns of its heads; the partial
    products are all-reduced over ``tp_group``, then the bias is added once). With
    ``sequence_parallel=True`` the input arrives split along dim 0 and is all-gathered before
    the QKV projection, and the output is reduce-scattered along dim 0, as TE's linear layers do.
    Weights are drawn with ``init_method`` / ``output_layer_init_method`` (default: normal,
    std 0.023, as TE), inside the RNG tracker's ``fork()`` when one is given; biases start at 0.
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
        factory = dict(device=device, dtype=params_dtype or torch.get_default_dtype())
        self.name, self.layer_number, self.softmax_type = name, layer_number, softmax_type
        self.tp_group, self.set_parallel_mode = tp_group, set_parallel_mode
        self.tp_size = tp_world_size(tp_size, tp_group)
        if self.tp_size > 1 and not set_parallel_mode:
            raise ValueError(f"a tensor-parallel size of {self.tp_size} (tp_size / tp_group) needs set_parallel_mode=True; "
                             "got set_parallel_mode=False")
        # As in TE: sequence parallelism only means something across more than one rank.
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel
        self.num_attention_heads, self.num_gqa_groups = num_attention_heads, num_gqa_groups or num_attention_heads
        self.h = per_partition("num_attention_heads", num_attention_heads, self.tp_size)  # per rank
        self.hg = per_partition("num_gqa_groups", self.num_gqa_groups, self.tp_size)
        self.d = kv_channels or hidden_size // num_attention_heads
        self.attention_type, self.qkv_format, self.return_bias = attention_type, qkv_format, return_bias
        self.return_layernorm_output = return_layernorm_output
        self.fuse_qkv_params, self.interleaved = fuse_qkv_params, qkv_weight_interleaved
        self.layernorm = None
        if input_layernorm:
            norm = torch.nn.LayerNorm if normalization == "LayerNorm" else torch.nn.RMSNorm
            self.layernorm = norm(hidden_size, eps=layernorm_epsilon, **factory)
        self._build_projections(hidden_size, bias, factory)
        self._init_weights(init_method, output_layer_init_method, get_rng_state_tracker)
        self.core_attention = DotProductAttention(
            num_attention_heads, self.d, num_gqa_groups=self.num_gqa_groups, attention_dropout=attention_dropout,
            qkv_format=qkv_format, attn_mask_type=attn_mask_type, window_size=window_size,
            sequence_parallel=sequence_parallel, tp_size=self.tp_size, get_rng_state_tracker=get_rng_state_tracker,
            tp_group=tp_group, layer_number=layer_number, attention_type=attention_type,
            softmax_type=softmax_type,
        )

    def _build_projections(self, hidden_size: int, bias: bool, factory: dict) -> None:
        """This rank's projections (the whole ones at tp=1)."""
        q_out, kv_out = self.h * self.d, 2 * self.hg * self.d
        if self.attention_type == "self" and self.fuse_qkv_params:
            self.qkv = torch.nn.Linear(hidden_size, q_out + kv_out, bias=bias, **factory)
        else:
            self.query = torch.nn.Linear(hidden_size, q_out, bias=bias, **factory)
            if self.attention_type == "cross" and self.fuse_qkv_params:
                self.key_value = torch.nn.Linear(hidden_size, kv_out, bias=bias, **factory)
            else:
                self.key = torch.nn.Linear(hidden_size, self.hg * self.d, bias=bias, **factory)
                self.value = torch.nn.Linear(hidden_size, self.hg * self.d, bias=bias, **factory)
        # Row-parallel: its bias is added once, after the partial products are summed.
        self.proj = torch.nn.Linear(q_out, hidden_size, bias=bias, **factory)

    @torch.no_grad()
    def _init_weights(self, init_method, output_layer_init_method, get_rng_state_tracker) -> None:
        init_method = init_method or _default_init
        output_layer_init_method = output_layer_init_method or _default_init
        # TE draws tensor-parallel shards on the tracker's model-parallel stream.
        fork = get_rng_state_tracker().fork if get_rng_state_tracker is not None else contextlib.nullcontext
        with fork():
            for name in ("qkv", "query", "key_value", "key", "value", "proj"):
                layer = getattr(self, name, None)
                if layer is None:
                    continue
                (output_layer_init_method if name == "proj" else init_method)(layer.weight)
                if layer.bias is not None:
                    layer.bias.zero_()

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
        rank's dim-0 shard of it under sequence parallelism).

        Returns the output, then the projection bias if ``return_bias``, then the layernorm
        output if ``return_layernorm_output``, as TE does. Extra keywords
        (``attn_mask_type_per_seq``, ``thd_sequence_is_causal``) go to DotProductAttention."""
        if self.attention_type == "cross" and encoder_output is None:
            raise ValueError("attention_type='cross' needs encoder_output; got None")
        ln_out = self.layernorm(hidden_states) if self.layernorm is not None else hidden_states
        x, enc = ln_out, encoder_output
        if self.set_parallel_mode:
            x = enter_column_parallel(x, self.tp_group, self.sequence_parallel)
            if enc is not None:
                enc = enter_column_parallel(enc, self.tp_group, self.sequence_parallel)
        packed = self._project(x, enc)
        if rotary_pos_emb is not None:
            packed = self._apply_rope(packed, rotary_pos_emb, (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded),
                                      (max_seqlen_q, max_seqlen_kv), pad_between_seqs)
        ctx = self.core_attention(
            attention_mask=attention_mask, attn_mask_type=attn_mask_type, window_size=window_size,
            checkpoint_core_attention=checkpoint_core_attention, inference_params=inference_params,
            core_attention_bias_type=core_attention_bias_type, core_attention_bias=core_attention_bias,
            alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
            cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
            max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, fast_zero_fill=fast_zero_fill,
            pad_between_seqs=pad_between_seqs, **packed, **per_seq_policy,
        )
        out = F.linear(ctx, self.proj.weight)
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

    def _project(self, x: torch.Tensor, encoder_output: Optional[torch.Tensor]) -> dict:
        """Keyword arguments for DotProductAttention: a declared packed buffer where possible."""
        lead = x.shape[:-1]
        h, hg, d = self.h, self.hg, self.d
        if self.attention_type == "self" and self.fuse_qkv_params:
            mixed = self.qkv(x)
            if not self.interleaved:
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
        q = self.query(x).view(*lead, h, d)
        source = encoder_output if self.attention_type == "cross" else x
        kv_lead = source.shape[:-1]
        if hasattr(self, "key_value"):
            kv = self.key_value(source)
            shape = (*kv_lead, hg, 2, d) if self.interleaved else (*kv_lead, 2, hg, d)
            return dict(query_layer=q, kv_layer=kv.view(shape), qkv_interleave_dim=-2 if self.interleaved else -3)
        return dict(query_layer=q, key_layer=self.key(source).view(*kv_lead, hg, d), value_layer=self.value(source).view(*kv_lead, hg, d))

    def _apply_rope(self, packed: dict, rope, cus, max_seqlens, pad_between) -> dict:
        """Rotary embeddings act on q and k separately, so this is the sliced path. THD: the
        packed metadata built here for the positions is handed to DotProductAttention, which
        would otherwise build it again from the same arguments. Under context parallelism each
        local row is rotated by its GLOBAL position (the rank holds chunks r and 2cp-1-r of
        every sequence), as TE does, and nothing is handed over: DotProductAttention prepares
        the global metadata over every rank's rows."""
        q, k, v = _split(packed)
        q_freqs, k_freqs = rope if isinstance(rope, tuple) else (rope, rope)
        cfg = self.core_attention.cp_config
        cp = (cfg.size, cfg.rank) if cfg is not None and cfg.size > 1 else (1, 0)
        out = {}
        q_pos = k_pos = None
        if self.qkv_format == "thd" and cp[0] > 1:
            q_pos, k_pos = _thd_cp_positions(q, k, cus, pad_between, cp)
        elif self.qkv_format == "thd":
            # DotProductAttention's own preparation (checks and, on CUDA, bounds), done once.
            sides = prepare_sides(cus, max_seqlens, pad_between, (q.shape[0], k.shape[0]), q.device)
            q_pos, k_pos = _positions(sides[0]), _positions(sides[1])
            out["_packed_seqs"] = sides
        elif cp[0] > 1:
            seq_dim = 0 if self.qkv_format == "sbhd" else 1
            q_freqs = _cp_dense_freqs(q_freqs, q.shape[seq_dim], cp)
            k_freqs = _cp_dense_freqs(k_freqs, k.shape[seq_dim], cp)
        out.update(query_layer=apply_rotary_pos_emb(q, q_freqs, self.qkv_format, q_pos),
                   key_layer=apply_rotary_pos_emb(k, k_freqs, self.qkv_format, k_pos), value_layer=v)
        return out


def _thd_cp_positions(q: torch.Tensor, k: torch.Tensor, cus, pad_between, cp: Tuple[int, int]):
    """Under context parallelism: the global position within its sequence of every local q and
    k row (0 on rows outside any sequence). The same checks (and, on CUDA, bounds) as
    DotProductAttention's; a length can be no more than the global rows, which stands in for
    the max_seqlen rotary does not need."""
    size, rank = cp
    totals = (q.shape[0] * size, k.shape[0] * size)  # the offsets index global rows
    pq, pk = prepare_sides(cus, totals, pad_between, totals, q.device)
    return tuple(positions_of_local_rows(p.offsets.long(), p.seqlens().long(), size, rank, t.shape[0])
                 for p, t in ((pq, q), (pk, k)))


def _cp_dense_freqs(freqs: torch.Tensor, local_len: int, cp: Tuple[int, int]) -> torch.Tensor:
    """The rows of ``freqs`` for a rank's bshd/sbhd rows under context parallelism."""
    size, rank = cp
    if freqs.shape[0] < local_len * size:
        raise ValueError(f"rotary_pos_emb must hold a row for every position: the global sequence has {local_len * size} "
                         f"positions ({local_len} local rows x cp size {size}) but rotary_pos_emb has {freqs.shape[0]} rows")
    return freqs.index_select(0, dense_positions(local_len, size, rank, freqs.device))


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


def _split(packed: dict):
    if "qkv_layer" in packed:
        t, dim = packed["qkv_layer"], packed["qkv_interleave_dim"]
        return tuple(t.select(dim, i) for i in range(3))
    if "kv_layer" in packed:
        t, dim = packed["kv_layer"], packed["qkv_interleave_dim"]
        return (packed["query_layer"], t.select(dim, 0), t.select(dim, 1))
    return packed["query_layer"], packed["key_layer"], packed["value_layer"]


def _positions(p: PackedSeqs) -> torch.Tensor:
    """Position of each token row within its sequence (0 on rows outside any sequence)."""
    seq = p.token_seq_ids().clamp(0, max(p.batch_size - 1, 0))
    rows = torch.arange(p.total_tokens, device=p.offsets.device)
    return torch.where(p.token_valid(), rows - p.offsets.long()[seq], 0) if p.batch_size else rows * 0


def _bounded_positions(positions: torch.Tensor, available: int) -> torch.Tensor:
    """Positions must index ``rotary_pos_emb``: checked where reading values is free (CPU, or
    NVTE_ATTN_VALIDATE=1), clamped on the device otherwise (an index past the end would be a
    device-side assert that ends the CUDA context)."""
    if value_checks_on(positions.device):
        if positions.numel() and int(positions.max()) >= available:
            raise ValueError(f"rotary_pos_emb must hold a row for every position: a sequence reaches position "
                             f"{int(positions.max())} but rotary_pos_emb has {available} rows")
        return positions
    return positions.clamp(max=max(available - 1, 0))


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, fmt: str, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotate-half RoPE on the first ``freqs.shape[-1]`` channels; ``freqs`` is [S, 1, 1, R]."""
    if fmt == "thd":
        f = freqs[_bounded_positions(positions, freqs.shape[0])].view(t.shape[0], 1, -1)
    elif fmt == "sbhd":
        f = freqs[: t.shape[0]]
    else:
        f = freqs[: t.shape[1]].transpose(0, 1)
    rot = f.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    out = x * f.cos().to(t.dtype) + rotated * f.sin().to(t.dtype)
    return torch.cat((out, rest), dim=-1)
