"""The unfused backend's attention probabilities P: formed in place of the scores and
differentiated without a third score-sized tensor (see :mod:`.unfused_math` for the whole
computation and its memory budget)."""

from __future__ import annotations

from typing import Optional

import torch

# dS is formed in this many row blocks: the backward's temporaries are 2/_GRAD_BLOCKS of a chunk.
_GRAD_BLOCKS = 8


def probabilities(scores: torch.Tensor, row_ok: Optional[torch.Tensor], sink: Optional[torch.Tensor],
                  recomputed: bool) -> torch.Tensor:
    """P from the masked scores, in place (see :class:`Probabilities`). Without a graph to record
    the Function is skipped: torch.compile traces ``mark_dirty`` only where autograd records."""
    if scores.requires_grad or (sink is not None and sink.requires_grad):
        return Probabilities.apply(scores, row_ok, sink, recomputed)
    if scores.shape[-1] > 0:
        _softmax_(scores, row_ok, sink)
    return scores


class Probabilities(torch.autograd.Function):
    """The softmax, formed in place of the masked scores [B, HG, G, R, SKV] (no second
    score-sized tensor), with the sink's extra logit in the denominator. Saves only P.

    ``row_ok`` [.., R, 1] (None: every row has a key) marks rows with at least one allowed key;
    the others come out 0, as in the kernels (the vanilla softmax would spread them uniformly
    over the masked keys; with a sink their weight goes to the sink by itself).
    ``sink`` [1, HG, G, 1, 1] or None. Backward: dS = P * (dP - rowsum(P * dP)); the sink, a
    logit without a value, gets -sum over rows of p_sink * rowsum(P * dP)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, row_ok: Optional[torch.Tensor], sink: Optional[torch.Tensor],
                recomputed: bool):
        ctx.mark_dirty(scores)
        ctx.sink_shape = None if sink is None else sink.shape
        ctx.recomputed = recomputed
        sink_weight = None
        if scores.shape[-1] > 0:  # a sequence without keys has nothing to normalize
            sink_weight = _softmax_(scores, row_ok, sink)
        ctx.save_for_backward(scores, sink_weight)
        return scores

    @staticmethod
    def backward(ctx, dprobs: torch.Tensor):
        if torch.is_grad_enabled():  # create_graph=True: this backward records no graph of its own
            raise NotImplementedError(
                "the unfused attention backward is differentiable once: double backward "
                "(create_graph=True through DotProductAttention) is not supported")
        probs, sink_weight = ctx.saved_tensors
        # A checkpointed chunk's P is a private recomputation for this backward pass: its
        # other readers (P @ V, the probs hook) ran their backward already, so dS may take its
        # place. Otherwise P may be needed again (retain_graph, gradcheck): dS gets its own.
        dscores = probs if ctx.recomputed else probs.clone()
        weighted = _score_grads_(dscores, dprobs)
        dsink = None
        if sink_weight is not None:
            dsink = -(sink_weight * weighted).sum_to_size(ctx.sink_shape)
        return dscores, None, dsink, None


def _score_grads_(probs: torch.Tensor, dprobs: torch.Tensor) -> torch.Tensor:
    """Overwrite ``probs`` with dS = P * (dP - rowsum(P * dP)); returns the row sums. A block of
    rows at a time: the temporaries are two small blocks, not score-sized."""
    rows = probs.shape[-2]
    step = max(1, rows // _GRAD_BLOCKS)
    sums = []
    for r0 in range(0, max(rows, 1), step):  # rows = 0: one empty block
        p, dp = probs[..., r0 : r0 + step, :], dprobs[..., r0 : r0 + step, :]
        sums.append((p * dp).sum(dim=-1, keepdim=True))
        p.mul_(dp - sums[-1])
    return sums[0] if len(sums) == 1 else torch.cat(sums, dim=-2)


def _softmax_(scores: torch.Tensor, row_ok: Optional[torch.Tensor], sink: Optional[torch.Tensor]
              ) -> Optional[torch.Tensor]:
    """Normalize ``scores`` in place (see :class:`Probabilities`); returns the sink's own
    weight p_sink [.., R, 1] (None without a sink). With a sink, P = softmax * (1 - p_sink) and
    p_sink = sigmoid(sink - lse), where lse = max - log(max of the softmax): exact algebra, no
    second pass of exponentials."""
    top = scores.amax(dim=-1, keepdim=True) if sink is not None else None
    # torch's softmax kernels (CPU and CUDA) finish reading a row before writing it, so out= may
    # alias the input; ~5x faster on the CPU than exp_ (which crawls on the masked entries).
    torch.softmax(scores, dim=-1, out=scores)
    if sink is None:
        if row_ok is not None:
            scores.mul_(row_ok)
        return None
    lse = top - torch.log(scores.amax(dim=-1, keepdim=True))
    scores.mul_(torch.sigmoid(lse - sink))
    return torch.sigmoid(sink - lse)
