"""The few collectives context parallelism needs, over one torch.distributed group.

NCCL (and gloo on CPU tensors) move the tensors as they are: nothing here reads a value or
waits on the host; a pending exchange is waited on by the stream that consumes it.

Host staging exists for one case only: several ranks sharing ONE GPU in a test, where the
group must be gloo and gloo cannot move CUDA tensors. It copies through host memory (syncs)
and runs only when NVTE_CP_HOST_STAGING=1 selects it explicitly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from ..environment import CP_HOST_STAGING


def host_staging_selected() -> bool:
    return CP_HOST_STAGING.get("0") == "1"


@dataclass
class Pending:
    """A transfer in flight: ``wait()`` returns the received tensor."""

    finish: Callable[[], torch.Tensor]

    def wait(self) -> torch.Tensor:
        return self.finish()


class CPComm:
    """One group: its size, this rank's index in it, and the collectives."""

    def __init__(self, group: Any, stream: Optional[Any] = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group)).lower()
        self.stream = stream

    def _staged(self, t: torch.Tensor) -> bool:
        if t.device.type == "cpu" or self.backend != "gloo":
            return False
        if not host_staging_selected():
            raise NotImplementedError(
                "cp_group uses gloo, which cannot move CUDA tensors; use an NCCL group, or set "
                "NVTE_CP_HOST_STAGING=1 (tests on one GPU only: copies through host memory and syncs)"
            )
        return True

    @contextlib.contextmanager
    def _on_side_stream(self, t: torch.Tensor):
        """Issue NCCL work on ``cp_stream`` (after the producer's work), so the next block's
        transfer runs beside the current step's kernels."""
        if t.device.type != "cuda" or self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            yield

    def _join(self, t: torch.Tensor, works: List[Any]) -> torch.Tensor:
        for w in works:
            w.wait()  # NCCL: makes the current stream wait; no host sync
        if t.device.type == "cuda" and self.stream is not None:
            torch.cuda.current_stream(t.device).wait_stream(self.stream)
            t.record_stream(torch.cuda.current_stream(t.device))
        return t

    def exchange(self, send: torch.Tensor, dst: int, src: int) -> Pending:
        """Send ``send`` to group rank ``dst`` and receive a tensor like it from ``src``."""
        send = send.contiguous()
        if self._staged(send):
            host = send.cpu()
            recv = torch.empty_like(host)
            works = [dist.isend(host, group=self.group, group_dst=dst), dist.irecv(recv, group=self.group, group_src=src)]
            return Pending(lambda: (_wait_all(works), recv.to(send.device, non_blocking=False))[1])
        with self._on_side_stream(send):
            recv = torch.empty_like(send)
            if self.backend == "nccl":
                ops = [dist.P2POp(dist.isend, send, group=self.group, group_peer=dst),
                       dist.P2POp(dist.irecv, recv, group=self.group, group_peer=src)]
                works = dist.batch_isend_irecv(ops)
            else:
                works = [dist.isend(send, group=self.group, group_dst=dst), dist.irecv(recv, group=self.group, group_src=src)]
        return Pending(lambda: (send, self._join(recv, works))[1])

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[size, *t.shape]: every rank's ``t``, by group rank."""
        t = t.contiguous()
        if self._staged(t):
            return self.all_gather(t.cpu()).to(t.device)
        out = t.new_empty(self.size, *t.shape)
        if self.backend == "nccl":
            dist.all_gather_into_tensor(out, t, group=self.group)
        else:
            dist.all_gather(list(out.unbind(0)), t, group=self.group)
        return out

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` is [size, ...]; returns the sum over ranks of ``t[this rank]``."""
        t = t.contiguous()
        if self._staged(t):
            return self.reduce_scatter(t.cpu()).to(t.device)
        if self.backend == "nccl":
            out = t.new_empty(t.shape[1:])
            dist.reduce_scatter_tensor(out, t, group=self.group)
            return out
        dist.all_reduce(t, group=self.group)  # gloo has no reduce_scatter
        return t[self.rank].clone()

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` is [size, ...]: block i goes to rank i; returns block j from rank j."""
        t = t.contiguous()
        if self._staged(t):
            return self.all_to_all(t.cpu()).to(t.device)
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=self.group)
        return out


def _wait_all(works) -> None:
    for w in works:
        w.wait()
