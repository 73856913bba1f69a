"""Fixtures that install the library stand-ins (``stand_ins/``) for one test."""

from __future__ import annotations

import pytest
import torch

from .stand_ins import cudnn, fa2, fa3, fa4


@pytest.fixture
def nan_buffers():
    """torch's deterministic mode, in which every uninitialized float tensor (empty, new_empty,
    empty_like) is NaN-filled: a buffer row that no kernel writes and nothing zeroes shows."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(was)


@pytest.fixture
def fa4_lib(monkeypatch, nan_buffers) -> fa4.FA4Library:
    return fa4.install(monkeypatch)


@pytest.fixture
def cudnn_lib(monkeypatch, nan_buffers) -> cudnn.CudnnLibrary:
    return cudnn.install(monkeypatch)


@pytest.fixture
def fa3_lib(monkeypatch):
    return fa3.install(monkeypatch)


@pytest.fixture
def fa2_lib(monkeypatch):
    return fa2.install(monkeypatch)
