"""One class per backend: its support declaration and the translation into its library.

Shape legend: T = packed tokens, B = batch, S = length, H = query heads, HG = key/value heads,
D = head dim. ``run`` takes :class:`AttentionInputs` and returns [B, S, H, Dv] or [T, H, Dv].

Packed (THD) batches reach every GPU library the same way (:class:`VarlenPlan`): physical slot
offsets as ``cu_seqlens``, valid lengths as per-sequence lengths (``seqused``), and one call per
live mask policy in which the other policies' sequences have length 0. Rows no call owns (gaps
between sequences, the tail, other policies' rows) come out exactly 0, forward and backward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, List, Optional, Sequence, Tuple

import torch

from .environment import Switch
from .gpu_ops import ops  # the kernels (registers the custom ops; imports no GPU library)
from .gap_rows import FA4_MAX_TILE_ROWS
from .masks import AttnMaskType, MaskSpec
from .params import AttentionInputs
from .support import ALL_FLOAT, SOFTMAX_TYPES, BackendSupport, Reason
from .thd import PackedSeqs
from .unfused import unfused_attention



# ---------------------------------------------------------------------------------- THD routing


@dataclass
class VarlenCall:
    """One kernel call: its mask policy, and per-sequence valid lengths (None = from cu_seqlens)."""

    policy: int
    spec: MaskSpec
    seqused_q: Optional[torch.Tensor]
    seqused_kv: Optional[torch.Tensor]
    # (len_q, len_kv) for kernels that always take lengths (cuDNN), made once per forward and
    # reused by the backward.
    lengths: Optional[Tuple[torch.Tensor, torch.Tensor]] = None


@dataclass
class VarlenPlan:
    """How a packed batch maps onto varlen kernel calls: physical offsets and one call per live
    policy (the other policies' sequences get length 0)."""

    offsets_q: torch.Tensor
    offsets_kv: torch.Tensor
    calls: List[VarlenCall]
    has_gaps: bool


def plan_varlen(inp: AttentionInputs) -> VarlenPlan:
    pq, pk = inp.packed_q, inp.packed_kv
    policies = inp.policies
    spec = inp.mask if policies is None else policies.uniform_spec()
    gaps = pq.has_gaps or pk.has_gaps
    if spec is not None:
        if not gaps:
            return VarlenPlan(pq.cu_seqlens, pk.cu_seqlens, [VarlenCall(0, spec, None, None)], False)
        return VarlenPlan(pq.offsets, pk.offsets, [VarlenCall(0, spec, *_valid_lengths(pq, pk))], True)
    len_q, len_kv = _valid_lengths(pq, pk)
    calls = []
    for p in policies.active():
        mine = policies.seq_mask(p)
        calls.append(VarlenCall(p, policies.specs[p], torch.where(mine, len_q, 0), torch.where(mine, len_kv, 0)))
    return VarlenPlan(pq.offsets, pk.offsets, calls, gaps)


def _valid_lengths(pq: PackedSeqs, pk: PackedSeqs) -> Tuple[torch.Tensor, torch.Tensor]:
    len_q = pq.seqlens()
    return len_q, len_q if pk.cu_seqlens is pq.cu_seqlens else pk.seqlens()


def _row_owner(p: PackedSeqs, seq_policy: Optional[torch.Tensor]) -> torch.Tensor:
    """[T] int64: the policy of each row's sequence (0 without policies), -1 where no sequence lives."""
    if p.batch_size == 0:
        return torch.full((p.total_tokens,), -1, dtype=torch.int64, device=p.offsets.device)
    if seq_policy is None:
        seq_policy = torch.zeros(p.batch_size, dtype=torch.int64, device=p.offsets.device)
    seq = p.token_seq_ids().clamp(0, p.batch_size - 1)
    return torch.where(p.token_valid(), seq_policy[seq], -1)


def _owners(inp: AttentionInputs) -> Tuple[torch.Tensor, torch.Tensor]:
    seq_policy = inp.policies.policy_of_seq if inp.policies is not None else None
    return _row_owner(inp.packed_q, seq_policy), _row_owner(inp.packed_kv, seq_policy)


def combine_rows(owner: torch.Tensor, parts: Sequence[Tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Row r of the result is row r of the part whose policy owns it; unowned rows are 0."""
    view = tuple(owner.shape) + (1,) * (parts[0][1].dim() - owner.dim())
    result = torch.zeros((), dtype=parts[0][1].dtype, device=parts[0][1].device)
    for policy, part in parts:
        result = torch.where(owner.view(view) == policy, part, result)
    return result


class _MaskRowGrad(torch.autograd.Function):
    """Identity forward; the backward keeps only rows where ``keep`` is True (others exactly 0).

    Used around libraries with their own autograd, which allocate gradients without zeroing
    the rows they skip."""

    @staticmethod
    def forward(ctx, x, keep):
        ctx.save_for_backward(keep)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return torch.where(keep.view(-1, *([1] * (grad.dim() - 1))), grad, 0), None


def fa_mask_args(spec: MaskSpec) -> Tuple[bool, int, int]:
    """(causal, window_left, window_right) in FlashAttention's bottom-right convention."""
    left, right = spec.window
    if spec.mask_type.is_causal and left < 0:
        return True, -1, -1
    return False, left, right


@dataclass
class ScoreFeatures:
    """What a kernel adds on the way from scores to output: a post-scale ``bias`` (already in
    the inputs' dtype), ALiBi, dropout with its Philox ``rng`` (int64 [seed, offset], drawn
    once per forward from torch's generator and reused by the backward, so both see one mask),
    and the attention ``sink`` logits (float32 [H]; off-by-one passes zeros)."""

    bias: Optional[torch.Tensor] = None
    alibi: bool = False
    dropout_p: float = 0.0
    rng: Optional[torch.Tensor] = None
    sink: Optional[torch.Tensor] = None

    def cudnn_args(self) -> tuple:
        return self.bias, self.rng, self.alibi, self.dropout_p


def _draw_rng(device: torch.device) -> torch.Tensor:
    # On the device, from torch's generator: no host sync, CUDA graphs capture it, and
    # torch.manual_seed makes a run repeatable.
    return torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=device)


@dataclass
class KernelCall:
    """The non-tensor half of one kernel run: who translates the arguments (``kernel``), the
    inputs and THD plan, the NaN guard mode, and the score features' flags. One object, so the
    autograd.Function gets five arguments instead of eleven (each costs host time in apply)."""

    kernel: Any
    inp: AttentionInputs
    plan: Optional[VarlenPlan]
    guard: str
    need_stats: bool
    alibi: bool
    dropout_p: float

    def forward(self, q, k, v, bias, sink):
        """(q, k, v as the kernel read them, out, rng, stats)."""
        if self.guard == "copy":
            q, k, v = _zero_spill_rows(self.inp, *(t.clone() for t in (q, k, v)))
        rng = _draw_rng(q.device) if self.dropout_p > 0 else None
        features = ScoreFeatures(bias, self.alibi, self.dropout_p, rng, sink)
        out, stats = self.kernel.forward(q, k, v, features, self.inp, self.plan, _calls(self.inp, self.plan), self.need_stats)
        return q, k, v, out, rng, stats


class _KernelAttention(torch.autograd.Function):
    """FA4 and cuDNN through their custom ops; ``call.kernel`` translates the arguments and
    decides how the calls of several policies are combined (see each kernel class)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sink, call: KernelCall):
        q, k, v, out, rng, stats = call.forward(q, k, v, bias, sink)
        ctx.call = call
        ctx.save_for_backward(q, k, v, out, bias, rng, sink, *stats)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, bias, rng, sink, *stats = ctx.saved_tensors
        call = ctx.call
        dout = dout if dout.stride() == out.stride() else dout.contiguous()
        features = ScoreFeatures(bias, call.alibi, call.dropout_p, rng, sink)
        dq, dk, dv, dbias, dsink = call.kernel.backward(dout, q, k, v, out, stats, features, ctx.needs_input_grad[3],
                                                        call.inp, call.plan, _calls(call.inp, call.plan))
        if not ctx.needs_input_grad[4]:
            dsink = None
        return dq, dk, dv, dbias, dsink, None  # nothing for ``call``


def _gap_guard(plan: Optional[VarlenPlan], kernel) -> str:
    """How the NaN guard of FA4 (and FA3) runs for this call: "inplace" (default), "copy", "off".

    FA4 loads whole tiles, so the rows just past a sequence end enter its products with weight
    0, and 0 * NaN = NaN: NaN in a gap would leak into valid rows (seen on the H200). The guard
    zeroes the first FA4_MAX_TILE_ROWS unowned rows after each sequence (no kernel reads further).
    In place, it writes only those rows of the caller's q/k/v, which belong to no sequence;
    NVTE_FLASH_ATTN_SANITIZE_GAPS=copy works on copies instead (inputs untouched, one copy per
    tensor); =0 skips the guard (gap rows known to be finite). Under torch.compile the guard
    copies: an in-place write to graph inputs would become a copy there anyway."""
    if plan is None or not plan.has_gaps or not kernel.SANITIZE_GAPS:
        return "off"
    mode = _SANITIZE_GAPS.get("1")
    if mode == "0":
        return "off"
    if mode == "copy" or torch.compiler.is_compiling():
        return "copy"
    return "inplace"


_SANITIZE_GAPS = Switch("NVTE_FLASH_ATTN_SANITIZE_GAPS")


def _zero_spill_rows(inp: AttentionInputs, q, k, v):
    """Zero, in place, the rows of q/k/v that FA4 may load past each sequence end."""
    pq, pk = inp.packed_q, inp.packed_kv
    if k is v:  # one tensor passed as both: the registered fused op must not get it twice
        ops.zero_gap_rows(q, pq.cu_seqlens, pq.offsets, FA4_MAX_TILE_ROWS)
        ops.zero_gap_rows(k, pk.cu_seqlens, pk.offsets, FA4_MAX_TILE_ROWS)
    else:
        ops.zero_gap_rows_qkv(q, k, v, pq.cu_seqlens, pq.offsets, pk.cu_seqlens, pk.offsets, FA4_MAX_TILE_ROWS)
    return q, k, v


def _zero_spill_rows_in_place(inp: AttentionInputs) -> None:
    with torch.no_grad():
        _zero_spill_rows(inp, inp.q.detach(), inp.k.detach(), inp.v.detach())
    # The eager kernel writes through raw pointers; tell autograd the tensors changed, so a node
    # that saved one of them before this call fails loudly instead of using the new values.
    torch.autograd.graph.increment_version([inp.q, inp.k, inp.v])


def _run_kernel(kernel, inp: AttentionInputs, plan: Optional[VarlenPlan], training: bool) -> torch.Tensor:
    guard = _gap_guard(plan, kernel)
    if guard == "inplace":
        _zero_spill_rows_in_place(inp)
    bias = _kernel_bias(inp)
    # The sink logits in float32 (what FA4 and cuDNN take), [H]; the cast keeps the gradient path.
    sink = None if inp.softmax_type == "vanilla" else inp.softmax_offset.reshape(-1).float().contiguous()
    # Without gradients FA4 may skip its log-sum-exp (``needs_input_grad`` ignores no_grad).
    need_stats = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (inp.q, inp.k, inp.v, bias, sink))
    call = KernelCall(kernel, inp, plan, guard, need_stats, inp.bias_type == "alibi", inp.dropout_p if training else 0.0)
    if not need_stats:  # nothing to differentiate: skip autograd.Function.apply (~10 us of host time)
        return call.forward(inp.q, inp.k, inp.v, bias, sink)[3]
    return _KernelAttention.apply(inp.q, inp.k, inp.v, bias, sink, call)


def _kernel_bias(inp: AttentionInputs) -> Optional[torch.Tensor]:
    """The post-scale bias as the kernels take it: the inputs' dtype, contiguous, and a
    [1, 1, 1, SKV] row expanded over the queries (autograd sums dBias back into the row)."""
    if inp.bias_type != "post_scale_bias":
        return None
    bias = inp.bias.to(inp.q.dtype)
    if bias.shape[2] != inp.q.shape[1]:
        bias = bias.expand(1, 1, inp.q.shape[1], bias.shape[3])
    return bias.contiguous()


def _calls(inp: AttentionInputs, plan: Optional[VarlenPlan]) -> List[VarlenCall]:
    return plan.calls if plan is not None else [VarlenCall(0, inp.mask, None, None)]


# ---------------------------------------------------------------------------------- backends


class UnfusedDotProductAttention(BackendSupport):
    """Pure PyTorch: every feature, every device; the reference the others are checked against."""

    NAME = "UnfusedDotProductAttention"
    ENV_VARS = ("NVTE_UNFUSED_ATTN",)
    SUPPORTED_DEVICES = frozenset({"cpu", "cuda"})
    SUPPORTED_DTYPES = ALL_FLOAT
    SUPPORTED_MASK_TYPES = frozenset(AttnMaskType)
    SUPPORTED_BIAS_TYPES = frozenset({"no_bias", "pre_scale_bias", "post_scale_bias", "alibi"})
    MAX_HEAD_DIM = 1 << 16
    HEAD_DIM_MULTIPLE = 1
    SUPPORTS_DROPOUT = True
    SUPPORTS_PAD_BETWEEN_SEQS = True
    SUPPORTS_PER_SEQ_POLICY = True
    SUPPORTED_SOFTMAX_TYPES = frozenset(SOFTMAX_TYPES)
    SUPPORTS_RETURN_MAX_LOGIT = True
    CP_COMM_TYPES = frozenset({"p2p", "all_gather", "a2a", "a2a+p2p"})

    @classmethod
    def _check_special(cls, params, libs):
        return _bias_thd_reasons(params)

    @staticmethod
    def run(inp: AttentionInputs, training: bool) -> torch.Tensor:
        return unfused_attention(inp, training)


class FlashAttention(BackendSupport):
    """FlashAttention; one subclass per library version. Its diagonal is always bottom-right."""

    NAME = "FlashAttention"
    VERSION: ClassVar[int] = 0
    SUPPORTS_TOP_LEFT_CROSS = False
    SUPPORTS_DENSE_PADDING = False
    NOTES = {
        "attention_mask": "FlashAttention takes padding only as cu_seqlens (qkv_format='thd')",
        "attn_mask_type": "FlashAttention aligns causal masks bottom-right only",
        "softmax_type": "this FlashAttention library takes no attention-sink logits",
        "return_max_logit": "FlashAttention returns only the log-sum-exp, which bounds the max logit "
                            "(max <= lse <= max + log(skv)) but does not give it",
    }

    @classmethod
    def label(cls) -> str:
        return f"FlashAttention v{cls.VERSION}"


class FlashAttentionV4(FlashAttention):
    """flash-attn-4 (``flash_attn.cute``): Hopper and Blackwell, JIT-compiled CuTe kernels."""

    VERSION = 4
    ENV_VARS = ("NVTE_FLASH_ATTN", "NVTE_FLASH_ATTN_V4")
    LIBRARY = "flash_attn_4"
    COMPUTE_CAPABILITY_MAJORS = frozenset({9, 10})
    SUPPORTS_PAD_BETWEEN_SEQS = True
    SUPPORTS_PER_SEQ_POLICY = True
    # flash-attn-4 (4.0.0b36) takes ``learnable_sink`` [H] in the forward and returns its
    # gradient from the backward (dense and varlen, sm90 and sm10x); off-by-one is a sink of 0.
    SUPPORTED_SOFTMAX_TYPES = frozenset(SOFTMAX_TYPES)
    NOTES = {field: note for field, note in FlashAttention.NOTES.items() if field != "softmax_type"}
    CP_COMM_TYPES = frozenset({"p2p", "all_gather", "a2a", "a2a+p2p"})

    @classmethod
    def _check_special(cls, params, libs):
        cc = params.compute_capability
        dims = (params.head_dim_qk, params.head_dim_v)
        if cc is not None and cc[0] == 10 and max(dims) > 128 and dims != (256, 256):
            return [Reason("head_dim_qk", str(params.head_dim_qk), "<= 128 or (256, 256) on sm10x")]
        if cc is not None and cc[0] == 10 and dims == (256, 256) and params.softmax_type != "vanilla" and params.requires_grad:
            return [Reason("softmax_type", repr(params.softmax_type),
                           "vanilla with head dim 256 on sm10x when gradients are needed (FA4's dedicated hd256 backward has no sink)")]
        if cc is not None and cc[0] == 9 and params.requires_grad and dims[0] != dims[1]:
            # Probed on the H200 (benchmarks/results/2026-12-03-h200/probe_fa4.log): the forward
            # runs, the backward refuses (GQA) or exceeds shared memory at launch.
            return [Reason("head_dim_v", f"{dims[1]} != head_dim_qk={dims[0]} with gradients",
                           "head_dim_v == head_dim_qk for the backward on sm9x (the forward alone runs either)")]
        return []

    @staticmethod
    def run(inp: AttentionInputs, training: bool) -> torch.Tensor:
        return _run_kernel(_FA4Kernel, inp, plan_varlen(inp) if inp.is_thd else None, training)


class _FA4Kernel:
    """Argument translation for flash_attn.cute (FA4): physical offsets as cu_seqlens, valid
    lengths as seqused_q/k; the log-sum-exp is [H, T] (varlen) or [B, H, S] (dense).

    FA4 leaves the rows it skips unwritten in the forward and in dQ/dK/dV, so the calls of all
    policies write their own rows of one buffer each, and only the rows no sequence owns (gaps,
    the tail) are zeroed, by ``zero_gap_rows``: no memset of the whole buffer, no combining pass
    (the GPU tests assert those zeros, and that skipped rows of other policies stay 0)."""

    SANITIZE_GAPS = True

    @staticmethod
    def forward(q, k, v, features, inp, plan, calls, need_lse):  # features: none declared (no bias, ALiBi, dropout)
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = None
        if need_lse:  # without it FA4 runs its inference variant (no LSE store)
            shape = (q.shape[-2], q.shape[0]) if plan is not None else (q.shape[0], q.shape[2], q.shape[1])
            lse = torch.empty(shape, dtype=torch.float32, device=q.device)
        sink = {} if features.sink is None else {"learnable_sink": features.sink}
        for call in calls:
            ops.fa4_fwd(q, k, v, out, lse, *_FA4Kernel._varlen(inp, plan, call), inp.softmax_scale, *fa_mask_args(call.spec),
                        **sink)
        if plan is not None:
            ops.zero_gap_rows(out, inp.packed_q.cu_seqlens, plan.offsets_q, -1)
        return out, [lse]

    @staticmethod
    def backward(dout, q, k, v, out, stats, features, need_dbias, inp, plan, calls):
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        dsink, sink = None, {}
        if features.sink is not None:
            # Each policy's call adds the sum over its own rows (FA4 reduces -exp(sink - lse) *
            # rowsum(dO * O) over the rows it runs).
            dsink = torch.zeros_like(features.sink)
            sink = {"learnable_sink": features.sink, "dsink": dsink}
        for call in calls:
            ops.fa4_bwd(dout, q, k, v, out, stats[0], dq, dk, dv, *_FA4Kernel._varlen(inp, plan, call),
                        inp.softmax_scale, *fa_mask_args(call.spec), torch.are_deterministic_algorithms_enabled(), **sink)
        if plan is not None:
            ops.zero_gap_rows_qkv(dq, dk, dv, inp.packed_q.cu_seqlens, plan.offsets_q, inp.packed_kv.cu_seqlens,
                                  plan.offsets_kv, -1)
        return dq, dk, dv, None, dsink

    @staticmethod
    def _varlen(inp: AttentionInputs, plan: Optional[VarlenPlan], call: VarlenCall):
        if plan is None:
            return None, None, None, None, inp.q.shape[1], inp.k.shape[1]
        return (plan.offsets_q, plan.offsets_kv, call.seqused_q, call.seqused_kv,
                inp.packed_q.max_seqlen, inp.packed_kv.max_seqlen)


class FlashAttentionV3(FlashAttention):
    """FA3 (``flash_attn_interface``, the Hopper build of flash-attention); not on PyPI."""

    VERSION = 3
    ENV_VARS = ("NVTE_FLASH_ATTN", "NVTE_FLASH_ATTN_V3")
    LIBRARY = "flash_attn_3"
    COMPUTE_CAPABILITY_MAJORS = frozenset({9})
    SUPPORTS_PAD_BETWEEN_SEQS = True
    SUPPORTS_PER_SEQ_POLICY = True
    SANITIZE_GAPS = True  # whole-tile reads, like FA4

    @staticmethod
    def run(inp: AttentionInputs, training: bool) -> torch.Tensor:
        import flash_attn_interface as fa3

        if not inp.is_thd:
            causal, left, right = fa_mask_args(inp.mask)
            return _first(fa3.flash_attn_func(inp.q, inp.k, inp.v, softmax_scale=inp.softmax_scale, causal=causal,
                                              window_size=(left, right), deterministic=torch.are_deterministic_algorithms_enabled()))
        plan = plan_varlen(inp)
        return _run_library_varlen(_guard_library_inputs(inp, plan, FlashAttentionV3), plan, _fa3_varlen_call)


def _guard_library_inputs(inp: AttentionInputs, plan: VarlenPlan, backend) -> AttentionInputs:
    """FA4's NaN guard (see ``_gap_guard``) for a library with its own autograd: FA3 reads whole
    tiles too. The copy variant clones under autograd, so gradients still reach the inputs."""
    guard = _gap_guard(plan, backend)
    if guard == "inplace":
        _zero_spill_rows_in_place(inp)
    elif guard == "copy":
        copies = [t.clone() for t in (inp.q, inp.k, inp.v)]
        with torch.no_grad():
            _zero_spill_rows(inp, *(t.detach() for t in copies))
        inp = dataclasses.replace(inp, q=copies[0], k=copies[1], v=copies[2])
    return inp


def _fa3_varlen_call(q, k, v, inp: AttentionInputs, plan: VarlenPlan, call: VarlenCall):
    import flash_attn_interface as fa3

    causal, left, right = fa_mask_args(call.spec)
    return _first(fa3.flash_attn_varlen_func(
        q, k, v, plan.offsets_q, plan.offsets_kv, inp.packed_q.max_seqlen, inp.packed_kv.max_seqlen,
        seqused_q=call.seqused_q, seqused_k=call.seqused_kv, softmax_scale=inp.softmax_scale,
        causal=causal, window_size=(left, right), deterministic=torch.are_deterministic_algorithms_enabled(),
    ))


class FlashAttentionV2(FlashAttention):
    """flash-attn 2 (``flash_attn``): Ampere and newer; dropout and ALiBi, no ``seqused``."""

    VERSION = 2
    ENV_VARS = ("NVTE_FLASH_ATTN", "NVTE_FLASH_ATTN_V2")
    LIBRARY = "flash_attn_2"
    MIN_COMPUTE_CAPABILITY = (8, 0)
    SUPPORTS_DROPOUT = True
    SUPPORTED_BIAS_TYPES = frozenset({"no_bias", "alibi"})
    NOTES = {
        **FlashAttention.NOTES,
        "pad_between_seqs": "flash-attn 2 has no seqused_q/k, so it cannot skip gaps between sequences",
        "attn_mask_type_per_seq": "per-sequence policies need seqused_q/k, which flash-attn 2 lacks",
    }

    @staticmethod
    def run(inp: AttentionInputs, training: bool) -> torch.Tensor:
        import flash_attn

        causal, left, right = fa_mask_args(inp.mask)
        kwargs = dict(dropout_p=inp.dropout_p if training else 0.0, softmax_scale=inp.softmax_scale, causal=causal,
                      window_size=(left, right), alibi_slopes=_fa2_alibi(inp),
                      deterministic=torch.are_deterministic_algorithms_enabled())
        if not inp.is_thd:
            return flash_attn.flash_attn_func(inp.q, inp.k, inp.v, **kwargs)

        def call_fn(q, k, v, inp, plan, call):
            return flash_attn.flash_attn_varlen_func(q, k, v, plan.offsets_q, plan.offsets_kv, inp.packed_q.max_seqlen,
                                                     inp.packed_kv.max_seqlen, **kwargs)

        # No gaps here (declared unsupported), but rows past cu_seqlens[-1] are left unwritten.
        return _run_library_varlen(inp, plan_varlen(inp), call_fn)


def _fa2_alibi(inp: AttentionInputs):
    if inp.bias_type != "alibi":
        return None
    from .unfused import default_alibi_slopes

    slopes = inp.alibi_slopes if inp.alibi_slopes is not None else default_alibi_slopes(inp.q.shape[-2])
    return slopes.to(device=inp.q.device, dtype=torch.float32)


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def _run_library_varlen(inp: AttentionInputs, plan: VarlenPlan, call_fn) -> torch.Tensor:
    """For libraries with their own autograd, which allocate outputs and gradients themselves
    (skipped rows, the tail included, hold garbage): each call sees inputs whose gradient keeps
    only that call's rows, and the outputs are combined row by row."""
    owner_q, owner_kv = _owners(inp)
    parts = []
    for call in plan.calls:
        q = _MaskRowGrad.apply(inp.q, owner_q == call.policy)
        k = _MaskRowGrad.apply(inp.k, owner_kv == call.policy)
        v = _MaskRowGrad.apply(inp.v, owner_kv == call.policy)
        parts.append((call.policy, call_fn(q, k, v, inp, plan, call)))
    return combine_rows(owner_q, parts)


class FusedAttention(BackendSupport):
    """cuDNN 9 SDPA through nvidia-cudnn-frontend's graph API (THD via ragged offsets)."""

    NAME = "FusedAttention"
    ENV_VARS = ("NVTE_FUSED_ATTN",)
    LIBRARY = "cudnn_frontend"
    MIN_COMPUTE_CAPABILITY = (8, 0)
    MAX_HEAD_DIM = 256
    SUPPORTS_PAD_BETWEEN_SEQS = True
    SUPPORTS_PER_SEQ_POLICY = True
    SUPPORTS_DROPOUT = True
    SUPPORTED_BIAS_TYPES = frozenset({"no_bias", "post_scale_bias", "alibi"})
    NOTES = {
        "core_attention_bias_type": "cuDNN adds a bias after scaling only",
        # Facts for whoever wires them: cudnn-frontend 1.32's sdpa/sdpa_backward take
        # sink_token / dSink_token ([1, H, 1, 1] float32; needs cuDNN >= 9.13, and >= 9.26 for
        # the ragged (THD) backward) and sdpa can output score_max (per-row max logit).
        "softmax_type": "cuDNN's sink_token is not wired here yet",
        "return_max_logit": "cuDNN's score_max output is not wired here yet",
    }
    CP_COMM_TYPES = frozenset({"p2p", "all_gather", "a2a", "a2a+p2p"})

    @classmethod
    def _check_special(cls, params, libs):
        cc = params.compute_capability
        out = []
        if cc is not None and cc[0] == 8 and max(params.head_dim_qk, params.head_dim_v) > 128:
            out.append(Reason("head_dim_qk", str(params.head_dim_qk), "<= 128 on sm8x"))
        if params.qkv_format == "thd" and params.head_dim_qk == 256 and params.head_dim_v != 256:
            # Probed on the H200 (benchmarks/results/2026-12-03-h200/probe_cudnn.log): non-finite
            # results for THD at (256, 128); dense layouts and every other pair probed are fine.
            out.append(Reason("head_dim_v", f"{params.head_dim_v} with head_dim_qk=256 in thd", "256 with head_dim_qk=256 in thd"))
        return out + _bias_thd_reasons(params) + _cudnn_feature_reasons(params)

    @staticmethod
    def run(inp: AttentionInputs, training: bool) -> torch.Tensor:
        return _run_kernel(_CudnnKernel, inp, plan_varlen(inp) if inp.is_thd else None, training)


def _bias_thd_reasons(params) -> List[Reason]:
    if params.qkv_format == "thd" and params.core_attention_bias_type in ("pre_scale_bias", "post_scale_bias"):
        # Named by format: FusedAttention's note on core_attention_bias_type (pre- vs
        # post-scale) would not explain this one.
        return [Reason("qkv_format", f"thd with {params.core_attention_bias_type}",
                       "bshd or sbhd for a bias tensor (it has no packed layout; thd takes no_bias or alibi)")]
    return []


def _cudnn_feature_reasons(params) -> List[Reason]:
    """cuDNN's rules for bias, ALiBi and dropout (cudnn-frontend's SDPA validation)."""
    alibi = params.core_attention_bias_type == "alibi"
    features = [name for name, on in (("a bias", params.core_attention_bias_type == "post_scale_bias"), ("ALiBi", alibi),
                                      ("dropout", params.attention_dropout > 0 and params.is_training)) if on]
    if not features:
        return []
    out = []
    for spec in params.mask_specs:
        # Bottom-right bands cannot carry them; where sq == skv the band runs top-left instead.
        if spec.mask_type.bottom_right and spec.has_band and not params.same_lengths:
            out.append(Reason("attn_mask_type", f"{spec.mask_type.value} with {' and '.join(features)}",
                              "top-left masks, or sq == skv known for every sequence"))
        if alibi and spec.right != 0:
            out.append(Reason("attn_mask_type", f"{spec.mask_type.value}, window {spec.window} with alibi",
                              "causal masks (cuDNN's ALiBi needs a right bound of 0)"))
    if alibi and params.alibi_slopes_shape is not None:
        out.append(Reason("alibi_slopes", f"shape {params.alibi_slopes_shape}", "None (cuDNN computes the standard slopes)"))
    if alibi and not params.same_lengths:
        # cuDNN's ALiBi is slope * (j - i) under its causal mask; the reference's
        # -slope * |j - i - (skv - sq)| agrees with it (up to a per-row constant, which softmax
        # drops) where sq == skv.
        out.append(Reason("sequence lengths", "sq != skv possible with alibi",
                          "sq == skv for every sequence (self-attention sharing cu_seqlens, or dense without padding)"))
    return out


class _CudnnKernel:
    """Argument translation for the cuDNN graph ops: ragged offsets from the physical offsets,
    per-sequence lengths from the valid ones; stats are [B, H, SQ, 1] float32.

    One call (any gaps) returns zero-filled outputs that are used as they are. cuDNN may write
    zeros over rows of sequences it runs with length 0, so several policies' calls get their
    own outputs, combined row by row (one ``where`` per tensor)."""

    SANITIZE_GAPS = False

    @staticmethod
    def forward(q, k, v, features, inp, plan, calls, need_stats):
        # need_stats is not used: the graphs always generate stats (an inference variant would be
        # a second cached graph per configuration, for a store of [B, H, SQ] floats).
        results = [ops.cudnn_fwd(q, k, v, *_CudnnKernel._args(inp, plan, call), *features.cudnn_args()) for call in calls]
        if len(results) == 1:
            return results[0][0], [results[0][1]]
        owner_q, _ = _owners(inp)
        out = combine_rows(owner_q, [(call.policy, o) for call, (o, _) in zip(calls, results)])
        return out, [s for _, s in results]

    @staticmethod
    def backward(dout, q, k, v, out, stats, features, need_dbias, inp, plan, calls):
        det = torch.are_deterministic_algorithms_enabled()
        grads = [ops.cudnn_bwd(dout, q, k, v, out, st, *_CudnnKernel._args(inp, plan, call), det, *features.cudnn_args(), need_dbias)
                 for call, st in zip(calls, stats)]
        dbias = grads[0][3] if need_dbias else None  # a bias never meets per-sequence policies
        if len(grads) == 1:
            return (*grads[0][:3], dbias, None)  # no sink: declared unsupported
        owner_q, owner_kv = _owners(inp)
        return (*(combine_rows(owner, [(call.policy, g[i]) for call, g in zip(calls, grads)])
                  for i, owner in ((0, owner_q), (1, owner_kv), (2, owner_kv))), dbias, None)

    @staticmethod
    def _args(inp: AttentionInputs, plan: Optional[VarlenPlan], call: VarlenCall):
        causal = call.spec.mask_type.is_causal
        left, right = call.spec.window
        # Where every sequence has sq == skv the two alignments coincide; top-left is the one cuDNN
        # combines with bias, ALiBi and dropout.
        bottom_right = call.spec.mask_type.bottom_right and call.spec.has_band and not _same_lengths(inp)
        if plan is None:
            b, sq, skv = inp.q.shape[0], inp.q.shape[1], inp.k.shape[1]
            lens = (None, None)
            if inp.q_valid is not None or inp.kv_valid is not None:
                lens = (_dense_lengths(inp.q_valid, b, sq, inp.q.device), _dense_lengths(inp.kv_valid, b, skv, inp.q.device))
            return (None, None, *lens, b, sq, skv, inp.softmax_scale, causal, left, right, bottom_right)
        pq, pk = inp.packed_q, inp.packed_kv
        if call.lengths is None:
            call.lengths = (call.seqused_q, call.seqused_kv) if call.seqused_q is not None else _valid_lengths(pq, pk)
        return (plan.offsets_q, plan.offsets_kv, *call.lengths, pq.batch_size, pq.max_seqlen, pk.max_seqlen,
                inp.softmax_scale, causal, left, right, bottom_right)


def _same_lengths(inp: AttentionInputs) -> bool:
    """Whether every sequence is known to have sq == skv (the tensor side of
    ``AttentionParams.same_lengths``)."""
    if inp.is_thd:
        return inp.packed_q.cu_seqlens is inp.packed_kv.cu_seqlens
    return inp.q.shape[1] == inp.k.shape[1] and inp.q_valid is None and inp.kv_valid is None


def _dense_lengths(valid: Optional[torch.Tensor], b: int, s: int, device) -> torch.Tensor:
    if valid is None:
        return torch.full((b,), s, dtype=torch.int32, device=device)
    return valid.sum(dim=1, dtype=torch.int32)


# Preference order, fastest first on the measured H200 (benchmarks/results): FA4/FA3, then
# cuDNN, then flash-attn 2, then the unfused reference.
BACKENDS: Tuple[type, ...] = (FlashAttentionV4, FlashAttentionV3, FusedAttention, FlashAttentionV2, UnfusedDotProductAttention)


def backend_label(cls: type) -> str:
    return cls.label() if issubclass(cls, FlashAttention) else cls.NAME
