"""Backend selection as a table: configuration -> chosen backend and reason substrings. GPU
availability is faked at the selection level only (AttentionParams and InstalledLibraries)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from transformer_engine.pytorch.attention.dot_product_attention import AttentionParams, get_attention_backend, support_matrix_markdown
from transformer_engine.pytorch.attention.dot_product_attention.selection.explain import main as explain_main
from transformer_engine.pytorch.attention.dot_product_attention.selection.libraries import InstalledLibraries
from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType as M
from transformer_engine.pytorch.attention.dot_product_attention.masks import MaskSpec
from transformer_engine.pytorch.attention.dot_product_attention.selection.backend_selection import NoBackendError, require_backend

ALL = InstalledLibraries(flash_attn_2="2.7.4", flash_attn_3=None, flash_attn_4="4.0.0b36", cudnn_frontend="1.32.0")
FA2_CUDNN = replace(ALL, flash_attn_4=None)
FA2_ONLY = replace(FA2_CUDNN, cudnn_frontend=None)
NONE = InstalledLibraries()
THD = AttentionParams(qkv_format="thd", attn_mask_type=M.PADDING_CAUSAL, window_size=(-1, 0), head_dim_qk=128, head_dim_v=128)
POLICIES = (MaskSpec(M.PADDING, (-1, -1)), MaskSpec(M.PADDING_CAUSAL, (-1, 0)))

TABLE = [
    # (id, params, libraries, env, chosen, {other backend: reason substring})
    ("thd-h200", THD, ALL, {}, "FlashAttention v4", {}),
    ("fp32", replace(THD, qkv_dtype=torch.float32), ALL, {}, "UnfusedDotProductAttention",
     {"FlashAttention v4": "qkv_dtype=torch.float32", "FusedAttention": "qkv_dtype=torch.float32"}),
    ("cpu", replace(THD, device_type="cpu", compute_capability=None), ALL, {}, "UnfusedDotProductAttention",
     {"FlashAttention v4": "device=cpu", "FusedAttention": "device=cpu"}),
    ("a100", replace(THD, compute_capability=(8, 0)), ALL, {}, "FusedAttention",
     {"FlashAttention v4": "compute_capability=sm80"}),
    ("dropout", replace(THD, attention_dropout=0.1), ALL, {}, "FusedAttention",
     {"FlashAttention v4": "attention_dropout=0.1"}),
    ("dropout-bottom-right-cross", replace(THD, attention_dropout=0.1, shared_cu_seqlens=False,
                                           attn_mask_type=M.PADDING_CAUSAL_BOTTOM_RIGHT), ALL, {}, "FlashAttention v2",
     {"FusedAttention": "padding_causal_bottom_right with dropout (supported: top-left masks"}),
    ("dropout-bottom-right-self", replace(THD, attention_dropout=0.1, attn_mask_type=M.PADDING_CAUSAL_BOTTOM_RIGHT), ALL, {},
     "FusedAttention", {}),
    ("alibi-thd-causal", replace(THD, core_attention_bias_type="alibi"), ALL, {}, "FusedAttention",
     {"FlashAttention v4": "core_attention_bias_type=alibi"}),
    ("alibi-custom-slopes", replace(THD, core_attention_bias_type="alibi", alibi_slopes_shape=(16,)), ALL, {},
     "FlashAttention v2", {"FusedAttention": "alibi_slopes=shape (16,)"}),
    ("alibi-cross", replace(THD, core_attention_bias_type="alibi", shared_cu_seqlens=False), ALL, {},
     "UnfusedDotProductAttention", {"FusedAttention": "sq != skv possible with alibi"}),
    ("bias-dense", replace(THD, qkv_format="bshd", attn_mask_type=M.CAUSAL, core_attention_bias_type="post_scale_bias",
                           core_attention_bias_shape="1hss"), ALL, {}, "FusedAttention",
     {"FlashAttention v2": "core_attention_bias_type=post_scale_bias"}),
    ("pre-scale-bias", replace(THD, qkv_format="bshd", attn_mask_type=M.CAUSAL, core_attention_bias_type="pre_scale_bias",
                               core_attention_bias_shape="1hss"), ALL, {}, "UnfusedDotProductAttention",
     {"FusedAttention": "cuDNN adds a bias after scaling only"}),
    ("bias-thd", replace(THD, core_attention_bias_type="post_scale_bias", core_attention_bias_shape="1hss"), ALL, {}, None,
     {"FusedAttention": "no packed layout", "UnfusedDotProductAttention": "no packed layout"}),
    ("dropout-eval", replace(THD, attention_dropout=0.1, is_training=False), ALL, {}, "FlashAttention v4", {}),
    ("gaps-no-fa4", replace(THD, pad_between_seqs=True), FA2_CUDNN, {}, "FusedAttention",
     {"FlashAttention v2": "seqused", "FlashAttention v4": "library=not installed"}),
    ("gaps-fa2-only", replace(THD, pad_between_seqs=True), FA2_ONLY, {}, "UnfusedDotProductAttention",
     {"FlashAttention v2": "pad_between_seqs=True"}),
    ("per-seq-fa2-only", replace(THD, per_seq_policies=POLICIES), FA2_ONLY, {}, "UnfusedDotProductAttention",
     {"FlashAttention v2": "attn_mask_type_per_seq"}),
    ("per-seq", replace(THD, per_seq_policies=POLICIES, pad_between_seqs=True), ALL, {}, "FlashAttention v4", {}),
    ("arbitrary", replace(THD, qkv_format="bshd", attn_mask_type=M.ARBITRARY, window_size=(-1, -1)), ALL, {},
     "UnfusedDotProductAttention", {"FlashAttention v4": "attn_mask_type=arbitrary", "FusedAttention": "arbitrary"}),
    ("top-left-cross", replace(THD, shared_cu_seqlens=False), ALL, {}, "FusedAttention",
     {"FlashAttention v4": "bottom-right"}),
    ("bottom-right-cross", replace(THD, shared_cu_seqlens=False, attn_mask_type=M.PADDING_CAUSAL_BOTTOM_RIGHT), ALL, {},
     "FlashAttention v4", {}),
    ("head-dim-512", replace(THD, head_dim_qk=512, head_dim_v=512), ALL, {}, "UnfusedDotProductAttention",
     {"FlashAttention v4": "head_dim_qk=512", "FusedAttention": "head_dim_qk=512"}),
    ("alibi-dense", replace(THD, qkv_format="bshd", attn_mask_type=M.NO_MASK, window_size=(-1, -1),
                            core_attention_bias_type="alibi"), ALL, {}, "FlashAttention v2",
     {"FlashAttention v4": "core_attention_bias_type=alibi", "FusedAttention": "needs a right bound of 0"}),
    ("dense-padding", replace(THD, qkv_format="bshd", has_padding_mask=True), ALL, {}, "FusedAttention",
     {"FlashAttention v4": "attention_mask"}),
    ("env-flash-off", THD, ALL, {"NVTE_FLASH_ATTN": "0"}, "FusedAttention", {"FlashAttention v4": "NVTE_FLASH_ATTN=0"}),
    ("env-v4-off", THD, ALL, {"NVTE_FLASH_ATTN_V4": "0"}, "FusedAttention", {"FlashAttention v4": "NVTE_FLASH_ATTN_V4=0"}),
    ("env-fused-off", replace(THD, compute_capability=(8, 0)), ALL, {"NVTE_FUSED_ATTN": "0"}, "FlashAttention v2",
     {"FusedAttention": "NVTE_FUSED_ATTN=0"}),
    ("fp8", replace(THD, fp8=True), ALL, {}, None, {"UnfusedDotProductAttention": "fp8"}),
    ("cp-p2p", replace(THD, context_parallel=True, cp_comm_type="p2p"), ALL, {}, "FlashAttention v4", {}),
    ("cp-p2p-fa2-only", replace(THD, context_parallel=True, cp_comm_type="p2p"), FA2_ONLY, {}, "UnfusedDotProductAttention",
     {"FlashAttention v2": "cp_comm_type=p2p (supported: a2a (context parallelism))"}),
]


@pytest.mark.parametrize("case", TABLE, ids=[c[0] for c in TABLE])
def test_selection_table(case, monkeypatch):
    _, params, libs, env, chosen, reasons = case
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    selection = get_attention_backend(params, libs)
    assert selection.label == chosen, selection.report()
    for label, fragment in reasons.items():
        text = "; ".join(map(str, selection.reasons_for(label)))
        assert fragment in text, f"{label}: {text!r} lacks {fragment!r}"


def test_env_switch_is_read_at_call_time(monkeypatch):
    assert get_attention_backend(THD, ALL).label == "FlashAttention v4"
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    assert get_attention_backend(THD, ALL).label == "FusedAttention"
    monkeypatch.setenv("NVTE_FLASH_ATTN", "1")
    assert get_attention_backend(THD, ALL).label == "FlashAttention v4"


def test_no_backend_lists_every_reason(monkeypatch):
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
    params = replace(THD, device_type="cpu", compute_capability=None)
    with pytest.raises(NoBackendError) as err:
        require_backend(params)
    text = str(err.value)
    for label in ("FlashAttention v4", "FusedAttention", "FlashAttention v2", "UnfusedDotProductAttention"):
        assert label in text
    assert "NVTE_UNFUSED_ATTN=0" in text and "device=cpu" in text


def test_debug_logging(monkeypatch, caplog):
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
    get_attention_backend(replace(THD, num_heads=8, num_gqa_groups=8), ALL)
    assert "selected: FlashAttention v4" in caplog.text
    caplog.clear()
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "1")
    get_attention_backend(replace(THD, num_heads=8, num_gqa_groups=8), ALL)
    monkeypatch.delenv("NVTE_DEBUG")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
    get_attention_backend(replace(THD, num_heads=8, num_gqa_groups=8), ALL)
    assert "selected:" not in caplog.text, "logged below level 2 or without NVTE_DEBUG=1"


def test_explain_backends_maps_every_backend_to_its_reasons():
    from transformer_engine.pytorch.attention.dot_product_attention import explain_backends

    reasons = explain_backends(replace(THD, compute_capability=(8, 0)), ALL)
    assert set(reasons) == {"FlashAttention v4", "FlashAttention v3", "FusedAttention", "FlashAttention v2", "UnfusedDotProductAttention"}
    assert reasons["FusedAttention"] == ()
    assert any("compute_capability=sm80" in r for r in reasons["FlashAttention v4"])


def test_cli_reports_reasons(capsys):
    assert explain_main(["--assume-all-libraries", "--cc", "8.0", "--pad-between-seqs"]) == 0
    out = capsys.readouterr().out
    assert "selected: FusedAttention" in out and "FlashAttention v4: compute_capability=sm80" in out


def test_readme_support_matrix_is_generated_from_declarations():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    assert support_matrix_markdown() in readme, "regenerate the README matrix with: te-attention-backend --matrix"
