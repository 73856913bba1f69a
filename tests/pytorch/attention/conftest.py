"""Fixtures shared by the attention tests: the library stand-ins (``stand_ins/``) for one test,
and a count of the calls that take the module's full path (not the fast path)."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa_module

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


@pytest.fixture
def full_paths(monkeypatch):
    """Counts the calls that took the full path."""
    calls = []
    real = dpa_module.prepare

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dpa_module, "prepare", counted)
    return calls


@pytest.fixture
def as_on_cuda(monkeypatch):
    """The CUDA path's host work on the CPU: no value reads, offsets bounded by made_safe and
    remembered (prepare/metadata_cache.py)."""
    from transformer_engine.pytorch.attention.dot_product_attention.prepare import packed_seqs

    monkeypatch.setattr(packed_seqs, "value_checks_on", lambda device: False)
    monkeypatch.setattr(packed_seqs, "bounded_on_device", lambda device: True)


@pytest.fixture
def empty_metadata_cache():
    """A test that starts and ends with nothing remembered (prepare/metadata_cache.py)."""
    from transformer_engine.pytorch.attention.dot_product_attention.prepare import metadata_cache

    metadata_cache.clear()
    yield
    metadata_cache.clear()
