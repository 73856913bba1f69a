"""MultiheadAttention's projections, holding TransformerEngine's parameters under TE's names.

TE builds MultiheadAttention from its ``Linear`` and ``LayerNormLinear`` modules, and a TE
checkpoint stores their parameters by those modules' names. :class:`Projection` holds the same
parameters, with the same names, shapes and order, so a state dict moves between TE and this
package unchanged, and computes the same thing in plain PyTorch:

- ``weight`` [out, in] and ``bias`` [out] (TE's Linear); with ``blocks`` (TE's
  ``parameters_split``) one parameter per block of rows instead, ``{name}_weight`` for every
  block and then ``{name}_bias`` for every block. The blocks are consecutive row ranges of one
  buffer, so joining them back is a view while they still lie there in order; after ``.to()``
  (which moves each parameter on its own) it is a copy.
- with ``normalization`` (TE's LayerNormLinear), first ``layer_norm_weight`` [in] and, for
  LayerNorm (not RMSNorm), ``layer_norm_bias`` [in]: the norm applied to the input.
- ``bias=False``: no bias parameter (the names are None attributes, as TE leaves no entry).
- TE's ``_extra_state`` entry (:mod:`.dot_product_attention.extra_state`).

Tensor parallelism is the caller's: a projection holds this rank's rows (column-parallel) or
columns (row-parallel), and its parameters carry TE's/Megatron's marks (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``; ``sequence_parallel`` on the norm and on a row-parallel
bias, whose gradients the framework sums over the group under sequence parallelism).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .dot_product_attention.extra_state import keep_extra_state, kept_extra_state

Blocks = Sequence[Tuple[str, int]]  # (name, rows) per parameter block, top to bottom


class _JoinRows(torch.autograd.Function):
    """Row blocks joined into one tensor (a view when they lie back to back in one buffer, else
    a copy); the gradient is split back into the blocks."""

    @staticmethod
    def forward(ctx, *parts: torch.Tensor) -> torch.Tensor:
        ctx.rows = [p.shape[0] for p in parts]
        first = parts[0]
        if _back_to_back(parts):
            return first.as_strided((sum(ctx.rows), *first.shape[1:]), first.stride(), first.storage_offset())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return tuple(grad.split(ctx.rows))


def _back_to_back(parts: Sequence[torch.Tensor]) -> bool:
    """Whether contiguous ``parts`` follow one another in one storage (host facts only)."""
    first = parts[0]
    base = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for p in parts:
        if not p.is_contiguous() or p.dtype != first.dtype or p.untyped_storage().data_ptr() != base \
                or p.storage_offset() != offset or p.shape[1:] != first.shape[1:]:
            return False
        offset += p.numel()
    return True


def join_rows(parts: List[torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    if torch.compiler.is_compiling():  # storage pointers are not traceable; a copy is
        return torch.cat(parts)
    return _JoinRows.apply(*parts)


class Projection(torch.nn.Module):
    """``y = norm(x) @ W.T + b`` with TE's parameter names (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, factory: dict, blocks: Optional[Blocks] = None,
                 normalization: Optional[str] = None, eps: float = 1e-5) -> None:
        super().__init__()
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.normalization, self.eps = normalization, eps
        if normalization is not None:  # TE registers the norm's parameters first
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(in_features, **factory))
            bias_ln = torch.nn.Parameter(torch.zeros(in_features, **factory)) if normalization == "LayerNorm" else None
            self.register_parameter("layer_norm_bias", bias_ln)
        blocks = tuple(blocks) if blocks else (("", out_features),)
        self.weight_names = [f"{name}_weight" if name else "weight" for name, _ in blocks]
        self.bias_names = [f"{name}_bias" if name else "bias" for name, _ in blocks]
        rows = [n for _, n in blocks]
        weights = torch.empty(out_features, in_features, **factory).split(rows)
        biases = torch.zeros(out_features, **factory).split(rows) if bias else [None] * len(rows)
        for name, w in zip(self.weight_names, weights):  # all weights, then all biases, as TE
            self.register_parameter(name, torch.nn.Parameter(w))
        for name, b in zip(self.bias_names, biases):
            self.register_parameter(name, torch.nn.Parameter(b) if b is not None else None)

    def weights(self) -> List[torch.Tensor]:
        return [getattr(self, name) for name in self.weight_names]

    def joined_weight(self) -> torch.Tensor:
        """The whole [out, in] weight (blocks joined)."""
        return join_rows(self.weights())

    def joined_bias(self) -> Optional[torch.Tensor]:
        return join_rows([getattr(self, name) for name in self.bias_names]) if self.use_bias else None

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The input norm (identity without one)."""
        if self.normalization is None:
            return x
        if self.normalization == "LayerNorm":
            return F.layer_norm(x, (self.in_features,), self.layer_norm_weight, self.layer_norm_bias, self.eps)
        return F.rms_norm(x, (self.in_features,), self.layer_norm_weight, self.eps)

    def project(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        """The linear part alone (``x`` already normalized)."""
        return F.linear(x, self.joined_weight(), self.joined_bias() if with_bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.normalize(x))

    @torch.no_grad()
    def reset_parameters(self, init_method: Callable[[torch.Tensor], object]) -> None:
        """Each weight block drawn with ``init_method`` (as TE draws each split parameter), biases
        zero, the norm's weight one and bias zero."""
        for w in self.weights():
            init_method(w)
        for name in self.bias_names if self.use_bias else ():
            getattr(self, name).zero_()
        if self.normalization is not None:
            self.layer_norm_weight.fill_(1.0)
            if self.layer_norm_bias is not None:
                self.layer_norm_bias.zero_()

    def mark_parallel(self, mode: Optional[str], sequence_parallel: bool) -> None:
        """TE's parallelism attributes on the parameters (read by Megatron-style frameworks)."""
        for w in self.weights():  # TE marks every weight, in any mode (dim 1 for row-parallel)
            w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, 1 if mode == "row" else 0, 1
        for name in self.bias_names if self.use_bias else ():
            b = getattr(self, name)
            if mode == "row":
                b.sequence_parallel = sequence_parallel
            elif mode == "column":
                b.tensor_model_parallel, b.partition_dim, b.partition_stride = True, 0, 1
        if self.normalization is not None:
            for p in (self.layer_norm_weight, self.layer_norm_bias):
                if p is not None:
                    p.sequence_parallel = sequence_parallel

    def get_extra_state(self) -> torch.Tensor:
        """TE's ``_extra_state``: empty (no FP8 state), or what a checkpoint loaded."""
        return kept_extra_state(self)

    def set_extra_state(self, state) -> None:
        keep_extra_state(self, state)
