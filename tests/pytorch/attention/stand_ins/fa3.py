"""FA3 (``flash_attn_interface``, the Hopper build of flash-attention): ``flash_attn_func`` and
``flash_attn_varlen_func`` with FA3's signatures (facts of its hopper/flash_attn_interface.py);
semantics in :mod:`.public_api` (``seqused_q/k`` valid lengths, physical offsets as
``cu_seqlens``)."""

from __future__ import annotations

from types import SimpleNamespace

from . import public_api


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
                    window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
                    sm_margin=0, return_attn_probs=False): ...


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
                           softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
                           window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, sm_margin=0, return_attn_probs=False): ...


def install(monkeypatch) -> SimpleNamespace:
    """``.dense`` / ``.varlen``: the two recorded functions (``.calls`` each)."""
    return public_api.install(monkeypatch, "flash_attn_interface", flash_attn_func, flash_attn_varlen_func)
