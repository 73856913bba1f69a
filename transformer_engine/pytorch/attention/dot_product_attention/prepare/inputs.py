"""The prepared call a backend runs on: :class:`AttentionInputs`, built once and then only read.

Shape legend: B = batch, S = sequence length, T = total packed tokens, H = query heads,
HG = key/value heads (GQA groups), D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

import torch

from ..masks import MaskSpec
from .policies import SeqPolicies
from .packed_seqs import PackedSeqs
from ...inference.record import KVCacheStep

QKV_FORMATS = ("sbhd", "bshd", "thd")
BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")


# eq=False: a record of tensors compares (and hashes) by identity, never element by element.
@dataclass(frozen=True, eq=False)
class AttentionInputs:
    """The tensors and resolved options of one call: built once, complete, by
    :func:`.call.prepare` (the full path) or :meth:`.fast_path.CallRecipe.inputs` (a repeat),
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
    # TE's split-KV hint (forward's ``num_splits``; None: not given). Backends pass it where
    # their declaration's NUM_SPLITS_MAJORS says so and ignore it elsewhere: results do not
    # depend on it. Per call: selection never reads it, so the fast path's key leaves it out.
    num_splits: Optional[int] = None
    # Context parallelism: q/k/v hold this rank's share (1/cp_size of every sequence, TE's
    # zigzag split) and THD metadata indexes the GLOBAL rows; 1 for an ordinary call. A record
    # with cp_size > 1 is run by the cp/ entry, never by a backend directly.
    cp_size: int = 1
    # FP8 attention: the call's fp8.context.FP8Context (None: high precision).
    fp8: Optional[Any] = None
    # KV-cache inference (TE's inference_params): the step's cache record; None for an ordinary
    # call. Such a record is a THD call of the step's query rows (``q``: [B*Sq, H, D] for
    # bshd/sbhd steps, [T, H, D] for thd; ``packed_q`` at the step's padded offsets) over the
    # cache: non-paged, ``k``/``v`` are its [B*S, Hkv, D] view and ``packed_kv`` has slots of
    # max_sequence_length (padding between sequences); paged, ``k``/``v`` are the page pools
    # [P, page_size, Hkv, D] and ``packed_kv`` is None (the lengths and the page table are the
    # step's). Run by ``run_kv_cache`` of the selected backend, never by ``run``.
    kv_cache: Optional[KVCacheStep] = None
    # Declared packing (qkv_layer / kv_layer): "qkv" or "kv", and the buffer q/k/v (or k/v)
    # are views of, so that an FP8 backend quantizes it once (None: separate tensors).
    packing: Optional[str] = None
    packed_layer: Optional[torch.Tensor] = None

    @property
    def is_thd(self) -> bool:
        return self.qkv_format == "thd"

    @property
    def same_lengths(self) -> bool:
        """Whether every sequence is known, from host facts, to have sq == skv: THD with one
        ``cu_seqlens`` tensor for both sides (the valid lengths; padded offsets may differ), or a
        dense batch with equal lengths and no padding. The one home of this fact: selection
        (``AttentionParams.shared_cu_seqlens``, filled from it) and the cuDNN runner both read
        it. ``AttentionParams.same_lengths`` derives the same answer from host facts alone, for
        params built by hand without tensors."""
        if self.is_thd:
            return self.packed_q.cu_seqlens is self.packed_kv.cu_seqlens
        return self.q.shape[1] == self.k.shape[1] and self.q_valid is None and self.kv_valid is None


# What differs between two calls that share a fast-path key (fast_path.call_key): their tensors
# (the per-sequence policies hold one; so does the FP8 context), and what the key does not cover
# (the module's softmax_scale and its softmax_offset tensor, which .to() replaces; the num_splits
# hint). Every other field is the same for both: the cached static half.
PER_CALL_FIELDS = ("q", "k", "v", "packed_q", "packed_kv", "policies", "softmax_scale", "softmax_offset", "num_splits",
                   "fp8", "packed_layer")
STATIC_FIELDS = tuple(f.name for f in fields(AttentionInputs) if f.name not in PER_CALL_FIELDS)


def static_half(inp: AttentionInputs) -> Mapping[str, Any]:
    return {name: getattr(inp, name) for name in STATIC_FIELDS}


def assemble_inputs(static: Mapping[str, Any], q, k, v, packed_q, packed_kv, policies, softmax_scale,
                    softmax_offset, num_splits: Optional[int] = None, fp8=None, packed_layer=None) -> AttentionInputs:
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
    state["softmax_scale"], state["softmax_offset"], state["num_splits"] = softmax_scale, softmax_offset, num_splits
    state["fp8"], state["packed_layer"] = fp8, packed_layer
    return inp
