"""The four tensor-parallel regions of MultiheadAttention, as autograd functions.

With ``set_parallel_mode=True`` the QKV projection is column-parallel (each rank computes its
own heads) and the output projection row-parallel (each rank multiplies its heads' slice; the
partial sums are added across ``tp_group``). Forward and backward are each other's duals:

============================  ========================  =============================
region                        forward                   backward
============================  ========================  =============================
enter column-parallel         identity                  all-reduce
leave row-parallel            all-reduce                identity
enter (sequence parallel)     all-gather along dim 0    reduce-scatter along dim 0
leave (sequence parallel)     reduce-scatter, dim 0     all-gather along dim 0
============================  ========================  =============================

Only ``torch.distributed`` collectives are used, so it runs on gloo (CPU) as on NCCL.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def tp_world_size(tp_size: int, tp_group: Any) -> int:
    """The tensor-parallel size as TE reads it: ``tp_group``'s world size when a group is given
    (1 while torch.distributed is not initialized), else ``tp_size``."""
    if tp_group is None:
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be a positive int; got {tp_size!r}")
        return tp_size
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(tp_group)


def per_partition(name: str, count: int, tp_size: int) -> int:
    """Heads (or GQA groups) one tensor-parallel rank works on; ``count`` is the global one."""
    if count % tp_size:
        raise ValueError(f"{name}={count} must be divisible by the tensor-parallel size {tp_size} (tp_size, or tp_group's world size)")
    return count // tp_size


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather_dim0(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter_dim0(x: torch.Tensor, group: Any) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[0] % world:
        raise ValueError(f"sequence parallelism needs dim 0 ({x.shape[0]}) divisible by the tensor-parallel size {world}")
    x = x.contiguous()
    if dist.get_backend(group) == "nccl":
        out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x, group=group)
        return out
    # gloo has no reduce-scatter: reduce everywhere, keep this rank's chunk.
    return _all_reduce(x, group).chunk(world, dim=0)[rank].contiguous()


class _EnterColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _LeaveRowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim0(grad, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


def enter_column_parallel(x: torch.Tensor, group: Any, sequence_parallel: bool) -> torch.Tensor:
    """The input of a column-parallel projection (all-gathered along dim 0 under sequence parallelism)."""
    return _GatherSequence.apply(x, group) if sequence_parallel else _EnterColumnParallel.apply(x, group)


def leave_row_parallel(x: torch.Tensor, group: Any, sequence_parallel: bool) -> torch.Tensor:
    """The summed output of a row-parallel projection (reduce-scattered along dim 0 under sequence parallelism)."""
    return _ScatterSequence.apply(x, group) if sequence_parallel else _LeaveRowParallel.apply(x, group)
