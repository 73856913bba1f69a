"""flash-attn 2 (``flash_attn``): ``flash_attn_func`` and ``flash_attn_varlen_func`` with its
2.x signatures (no ``seqused``); semantics in :mod:`.public_api`."""

from __future__ import annotations

from types import SimpleNamespace

from . import public_api


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False): ...


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                           causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None): ...


def install(monkeypatch) -> SimpleNamespace:
    """``.dense`` / ``.varlen``: the two recorded functions (``.calls`` each)."""
    return public_api.install(monkeypatch, "flash_attn", flash_attn_func, flash_attn_varlen_func)
