"""Persistent device tensors filled from the host once per step.

A CUDA graph replays its kernels on the addresses it captured, so what changes from step to step
(lengths, offsets, the page table) is copied into the same device memory each time, never
reallocated.
"""

from __future__ import annotations

from typing import Sequence

import torch


def cache_device(device=None) -> torch.device:
    """``device`` with its CUDA index spelled out (tensors report ``cuda:0``, never ``cuda``);
    by default where TE puts its caches (the current CUDA device), or the CPU without CUDA."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class StagedTensor:
    """A device tensor (``device_tensor``, fixed address) and the host tensor it is filled from.

    On CUDA the host side is pinned and :meth:`upload` is asynchronous; :meth:`host_for_write`
    waits for the previous upload to have read the host side before handing it out again (an
    event that has normally long completed)."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
        self.device_tensor = torch.zeros(tuple(shape), dtype=dtype, device=device)
        on_cuda = self.device_tensor.is_cuda
        self._host = torch.zeros(tuple(shape), dtype=dtype, pin_memory=on_cuda)
        self._uploaded = torch.cuda.Event() if on_cuda else None
        self._pending = False

    def host_for_write(self) -> torch.Tensor:
        if self._pending:
            self._uploaded.synchronize()
            self._pending = False
        return self._host

    def upload(self) -> None:
        self.device_tensor.copy_(self._host, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
            self._pending = True
