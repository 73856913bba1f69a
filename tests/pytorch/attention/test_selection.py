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
    ("bias-dense", replace(THD, qkv_format="bshd", qkv_layout=None, attn_mask_type=M.CAUSAL, core_attention_bias_type="post_scale_bias",
                           core_attention_bias_shape="1hss"), ALL, {}, "FusedAttention",
     {"FlashAttention v2": "core_attention_bias_type=post_scale_bias"}),
    ("pre-scale-bias", replace(THD, qkv_format="bshd", qkv_layout=None, attn_mask_type=M.CAUSAL, core_attention_bias_type="pre_scale_bias",
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
    ("arbitrary", replace(THD, qkv_format="bshd", qkv_layout=None, attn_mask_type=M.ARBITRARY, window_size=(-1, -1)), ALL, {},
     "UnfusedDotProductAttention", {"FlashAttention v4": "attn_mask_type=arbitrary", "FusedAttention": "arbitrary"}),
    ("top-left-cross", replace(THD, shared_cu_seqlens=False), ALL, {}, "FusedAttention",
     {"FlashAttention v4": "bottom-right"}),
    ("bottom-right-cross", replace(THD, shared_cu_seqlens=False, attn_mask_type=M.PADDING_CAUSAL_BOTTOM_RIGHT), ALL, {},
     "FlashAttention v4", {}),
    ("head-dim-512", replace(THD, head_dim_qk=512, head_dim_v=512), ALL, {}, "UnfusedDotProductAttention",
     {"FlashAttention v4": "head_dim_qk=512", "FusedAttention": "head_dim_qk=512"}),
    ("alibi-dense", replace(THD, qkv_format="bshd", qkv_layout=None, attn_mask_type=M.NO_MASK, window_size=(-1, -1),
                            core_attention_bias_type="alibi"), ALL, {}, "FlashAttention v2",
     {"FlashAttention v4": "core_attention_bias_type=alibi", "FusedAttention": "needs a right bound of 0"}),
    ("dense-padding", replace(THD, qkv_format="bshd", qkv_layout=None, has_padding_mask=True), ALL, {}, "FusedAttention",
     {"FlashAttention v4": "attention_mask"}),
    ("env-flash-off", THD, ALL, {"NVTE_FLASH_ATTN": "0"}, "FusedAttention", {"FlashAttention v4": "NVTE_FLASH_ATTN=0"}),
    ("env-v4-off", THD, ALL, {"NVTE_FLASH_ATTN_V4": "0"}, "FusedAttention", {"FlashAttention v4": "NVTE_FLASH_ATTN_V4=0"}),
    ("env-fused-off", replace(THD, compute_capability=(8, 0)), ALL, {"NVTE_FUSED_ATTN": "0"}, "FlashAttention v2",
     {"FusedAttention": "NVTE_FUSED_ATTN=0"}),
    ("fp8", replace(THD, fp8=True), ALL, {"NVTE_UnfusedDPA_Emulate_FP8": "0"}, None,
     {"UnfusedDotProductAttention": "NVTE_UnfusedDPA_Emulate_FP8=0", "FusedAttention": "thd with FP8 gradients",
      "FlashAttention v3": "forward-only", "FlashAttention v4": "fp8=True"}),
    ("fp8-emulated", replace(THD, fp8=True), ALL, {"NVTE_UnfusedDPA_Emulate_FP8": "1"}, "UnfusedDotProductAttention", {}),
    ("fp8-thd-f16-backward", replace(THD, fp8=True), ALL, {"NVTE_FP8_DPA_BWD": "0"}, "FusedAttention", {}),
    ("fp8-dense", replace(THD, qkv_format="bshd", qkv_layout=None, attn_mask_type=M.CAUSAL, fp8=True), ALL,
     {"NVTE_UnfusedDPA_Emulate_FP8": "1"}, "FusedAttention", {"FlashAttention v4": "fp8=True"}),
    ("fp8-current-scaling", replace(THD, qkv_format="bshd", qkv_layout=None, attn_mask_type=M.CAUSAL, fp8=True,
                                    fp8_recipe="Float8CurrentScaling"), ALL, {"NVTE_UnfusedDPA_Emulate_FP8": "1"},
     "UnfusedDotProductAttention", {"FusedAttention": "fp8_recipe=Float8CurrentScaling"}),
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


# ------------------------------------------------------------------------- TE's spelling
# TE's tests (tests/pytorch/utils.py: get_available_attention_backends) build AttentionParams from
# a model configuration with a layout string and string mask types, unpack the six-element tuple,
# record it in _attention_backends and compare the fused element with FusedAttnBackend[...] for
# each NVTE_FUSED_ATTN_BACKEND. The same steps here, written for this package.


class _Config:
    """A TE-style model configuration (the fields TE's ModelConfig carries)."""

    def __init__(self, batch_size, max_seqlen_q, num_heads, head_dim_qk, attn_mask_type="no_mask", attn_bias_type="no_bias",
                 dropout_p=0.0, num_gqa_groups=None):
        self.batch_size, self.max_seqlen_q, self.max_seqlen_kv = batch_size, max_seqlen_q, max_seqlen_q
        self.num_heads, self.num_gqa_groups = num_heads, num_gqa_groups or num_heads
        self.head_dim_qk = self.head_dim_v = head_dim_qk
        self.attn_mask_type, self.attn_bias_type, self.dropout_p = attn_mask_type, attn_bias_type, dropout_p


def _te_style_backends(config, qkv_dtype, qkv_layout, monkeypatch, window_size=None, fp8=False, fp8_meta=None,
                       is_training=True):
    from transformer_engine.pytorch.attention.dot_product_attention import _attention_backends
    from transformer_engine.pytorch.attention.dot_product_attention.utils import AttentionLogging
    from transformer_engine.pytorch.attention.dot_product_attention.utils import AttentionParams as UtilsParams
    from transformer_engine.pytorch.attention.dot_product_attention.utils import get_attention_backend as utils_select
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend

    if not AttentionLogging._is_logging_setup:
        AttentionLogging.setup_logging()
    fused_backends, available, flash_backend = [], None, None
    for i, name in enumerate(("F16_max512_seqlen", "F16_arbitrary_seqlen", "FP8")):
        monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", str(i))
        params = UtilsParams(
            qkv_dtype=qkv_dtype, qkv_layout=qkv_layout, batch_size=config.batch_size, num_heads=config.num_heads,
            num_gqa_groups=config.num_gqa_groups, max_seqlen_q=config.max_seqlen_q, max_seqlen_kv=config.max_seqlen_kv,
            head_dim_qk=config.head_dim_qk, head_dim_v=config.head_dim_v, attn_mask_type=config.attn_mask_type,
            window_size=window_size, alibi_slopes_shape=None, core_attention_bias_type=config.attn_bias_type,
            core_attention_bias_shape=None, core_attention_bias_requires_grad=False, pad_between_seqs=False,
            attention_dropout=config.dropout_p, context_parallel=False, deterministic=False, fp8=fp8, fp8_meta=fp8_meta,
            is_training=is_training, inference_params=None)
        (use_flash_attention, flash_backend, use_fused_attention, fused_attention_backend, use_unfused_attention,
         available) = utils_select(params)
        _attention_backends.update(use_flash_attention=use_flash_attention, use_fused_attention=use_fused_attention,
                                   flash_attention_backend=flash_backend, fused_attention_backend=fused_attention_backend,
                                   use_unfused_attention=use_unfused_attention, backend_selection_requires_update=False)
        if fused_attention_backend == FusedAttnBackend[name]:
            fused_backends.append(fused_attention_backend)
    return available, flash_backend, fused_backends


@pytest.mark.parametrize("layout", ["thd_thd_thd", "bshd_bshd_bshd", "sbh3d", "bs3hd", "thd_t2hd"])
def test_te_call_pattern_on_a_machine_with_every_library(layout, monkeypatch):
    from packaging.version import Version

    from transformer_engine.pytorch.attention.dot_product_attention.selection import backend_selection
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend

    monkeypatch.setattr(backend_selection, "installed_libraries", lambda: ALL)  # TE's call passes no libraries
    mask = "padding_causal" if layout.startswith("t") else "causal"
    config = _Config(2, 2048, 16, 128, attn_mask_type=mask)
    available, flash_backend, fused_backends = _te_style_backends(config, torch.bfloat16, layout, monkeypatch)
    assert available == [True, True, True]
    assert flash_backend == Version("4.0.0b36") and isinstance(flash_backend, Version)
    assert fused_backends == [FusedAttnBackend["F16_arbitrary_seqlen"]]
    assert int(fused_backends[0]) == 1


def test_te_call_pattern_without_gpu_libraries(monkeypatch):
    from transformer_engine.pytorch.attention.dot_product_attention import _attention_backends
    from transformer_engine.pytorch.attention.dot_product_attention.selection import backend_selection

    monkeypatch.setattr(backend_selection, "installed_libraries", lambda: NONE)
    config = _Config(2, 128, 16, 64, attn_mask_type="padding_causal")
    available, flash_backend, fused_backends = _te_style_backends(config, torch.bfloat16, "thd_thd_thd", monkeypatch)
    assert (available, flash_backend, fused_backends) == ([False, False, True], None, [])
    assert _attention_backends["use_unfused_attention"] is True and _attention_backends["use_flash_attention"] is False


def test_te_call_pattern_fp8_meta_without_fp8_dpa_is_high_precision_attention(monkeypatch):
    from transformer_engine.common.recipe import DelayedScaling
    from transformer_engine.pytorch.attention.dot_product_attention.selection import backend_selection

    monkeypatch.setattr(backend_selection, "installed_libraries", lambda: ALL)
    config = _Config(2, 512, 16, 64, attn_mask_type="causal")
    meta = {"recipe": DelayedScaling(fp8_dpa=False)}
    available, _, _ = _te_style_backends(config, torch.bfloat16, "bshd_bshd_bshd", monkeypatch, fp8=True, fp8_meta=meta)
    assert available == [True, True, True]
    params = AttentionParams(qkv_layout="bshd_bshd_bshd", fp8=True, fp8_meta=meta)
    assert params.fp8 is False
    assert AttentionParams(qkv_layout="bshd_bshd_bshd", fp8=True, fp8_meta={"recipe": DelayedScaling(fp8_dpa=True)}).fp8 is True
    with pytest.raises(TypeError, match="fp8_meta must be None or TE's FP8 metadata dict"):
        AttentionParams(fp8=True, fp8_meta=[1])


@pytest.mark.parametrize("mask", [m.value for m in M])
def test_string_mask_types_are_parsed_once(mask):
    params = AttentionParams(attn_mask_type=mask, qkv_layout="thd_thd_thd" if mask.startswith("padding") else "bshd_bshd_bshd")
    assert params.attn_mask_type is M(mask)
    assert params.window_size == ((-1, 0) if "causal" in mask else (-1, -1))  # TE's window=None, normalized
    get_attention_backend(params, ALL)  # the selection reads .is_causal: once an AttributeError on a str


def test_unknown_mask_type_is_named():
    with pytest.raises(ValueError, match="attn_mask_type must be one of no_mask, padding, .*; got 'causal_top_left'"):
        AttentionParams(attn_mask_type="causal_top_left")


@pytest.mark.parametrize("layout,fmt", [
    ("sb3hd", "sbhd"), ("sbh3d", "sbhd"), ("sbhd_sb2hd", "sbhd"), ("bshd_bsh2d", "bshd"), ("bshd_bshd_bshd", "bshd"),
    ("t3hd", "thd"), ("thd_th2d", "thd"), ("thd_thd_thd", "thd"), ("thd_bshd_bshd", "thd_2bshd"),
    ("sbhd_bshd_bshd", "sbhd_2bshd"), ("paged_kv_thd_sbhd_sbhd", "thd_2sbhd"), ("paged_kv_bshd_bshd_bshd", "bshd"),
])
def test_the_format_is_read_from_the_layout(layout, fmt):
    params = AttentionParams(qkv_layout=layout)
    assert (params.qkv_format, params.qkv_layout) == (fmt, layout)
    assert AttentionParams(qkv_format=fmt, qkv_layout=layout) == params


def test_format_alone_implies_separate_tensors_and_nothing_gives_tes_default():
    assert AttentionParams(qkv_format="thd").qkv_layout == "thd_thd_thd"
    assert AttentionParams(qkv_format="thd_2bshd").qkv_layout == "thd_bshd_bshd"
    assert (AttentionParams().qkv_format, AttentionParams().qkv_layout) == ("sbhd", "sbh3d")


@pytest.mark.parametrize("kwargs,exc,message", [
    (dict(qkv_layout="thd_thd_thd", qkv_format="sbhd"), ValueError,
     "qkv_format='sbhd' does not match qkv_layout='thd_thd_thd', whose format is 'thd'"),
    (dict(qkv_layout="bshd_thd_thd"), ValueError, "qkv_layout must be one of sb3hd, sbh3d, .*; got 'bshd_thd_thd'"),
    (dict(qkv_format="hbsd"), ValueError, "qkv_format must be None or one of sbhd, bshd, thd, .*; got 'hbsd'"),
    (dict(qkv_type=int), TypeError, "qkv_type must be torch.Tensor or a subclass of it .*; got <class 'int'>"),
])
def test_bad_te_fields_are_named(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        AttentionParams(**kwargs)


def test_mixed_format_layouts_are_refused_by_reason():
    selection = get_attention_backend(AttentionParams(qkv_layout="thd_bshd_bshd", attn_mask_type="padding_causal"), ALL)
    assert selection.backend is None
    assert "qkv_format=thd_2bshd (supported: bshd, sbhd, thd)" in "; ".join(map(str, selection.reasons_for("FusedAttention")))


def test_te_only_fields_reach_the_reasons():
    from transformer_engine.pytorch.tensor import Float8Tensor

    selection = get_attention_backend(replace(THD, qkv_type=Float8Tensor), ALL)
    assert selection.backend is None
    assert "qkv_type=Float8Tensor (supported: torch.Tensor" in "; ".join(map(str, selection.reasons_for("UnfusedDotProductAttention")))
    kv = AttentionParams(qkv_layout="bshd_bshd_bshd", inference_params=object())
    assert kv.kv_cache is True and kv == replace(kv, inference_params=object())  # folded; the object is not compared
    assert "inference_params=given (KV caching)" in "; ".join(map(str, get_attention_backend(kv, ALL).reasons_for("FlashAttention v3")))
    assert "requires_grad=True with inference_params" in "; ".join(map(str, get_attention_backend(kv, ALL).reasons_for("FusedAttention")))
    assert AttentionParams(context_parallel=True).cp_comm_type == "p2p"  # TE's default
    assert AttentionParams(alibi_slopes_shape=[16], compute_capability=[9, 0]).alibi_slopes_shape == (16,)


def test_the_tuple_follows_the_choice_and_a_forced_backend():
    from transformer_engine.pytorch.attention import backend_scope
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend

    a100 = get_attention_backend(replace(THD, compute_capability=(8, 0)), ALL)
    assert a100.label == "FusedAttention"
    use_flash, flash_version, use_fused, fused, use_unfused, available = a100
    assert (use_flash, use_fused, use_unfused, available) == (False, True, False, [True, True, True])
    assert str(flash_version) == "2.7.4"  # flash-attn 2 could run it (FA4 needs sm90)
    assert fused is FusedAttnBackend["F16_arbitrary_seqlen"]
    assert a100[2] is True and len(a100) == 6 and a100.label == "FusedAttention"  # still the rich object
    with backend_scope(force="unfused"):
        forced = tuple(get_attention_backend(THD, ALL))
    assert forced == (False, None, False, None, True, [False, False, True])


def test_a_hopper_build_without_metadata_reads_as_version_3():
    from packaging.version import Version

    fa3_only = InstalledLibraries(flash_attn_3="unknown")
    assert get_attention_backend(THD, fa3_only)[1] == Version("3")


def test_te_spelling_survives_the_compile_key():
    from transformer_engine.pytorch.attention.dot_product_attention.selection.params import params_from_key, params_key

    params = AttentionParams(qkv_layout="thd_t2hd", attn_mask_type="padding_causal", window_size=None, fp8=True,
                             fp8_meta={"recipe": None}, inference_params=object(), deterministic=True)
    assert params_from_key(params_key(params)) == params


def test_cli_says_what_a_machine_with_every_library_would_choose(capsys, monkeypatch):
    from transformer_engine.pytorch.attention.dot_product_attention.selection import explain

    monkeypatch.setattr(explain, "installed_libraries", lambda: NONE)
    assert explain_main(["--format", "thd", "--mask", "padding_causal", "--head-dim", "128"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("selected: UnfusedDotProductAttention")
    assert ("note: this answer is for this machine, where flash-attn (2.x), flash_attn_interface (FA3, the hopper build of "
            "flash-attention), flash-attn-4, nvidia-cudnn-frontend are not installed; with every GPU library installed, "
            "FlashAttention v4 would be selected (run with --assume-all-libraries for its report)") in out
    assert explain_main(["--format", "thd", "--device", "cpu"]) == 0  # the same answer everywhere: no note
    assert "note:" not in capsys.readouterr().out
    assert explain_main(["--format", "thd", "--assume-all-libraries"]) == 0
    assert "note:" not in capsys.readouterr().out


def test_sq_equals_skv_is_one_fact_for_selection_and_the_cudnn_runner(monkeypatch):
    """One cu_seqlens tensor for both sides means sq == skv for every sequence, whatever the
    padded offsets: selection (shared_cu_seqlens) and the cuDNN runner read the same property
    (before, selection also required the same offsets and refused what the runner would run)."""
    from transformer_engine.pytorch import DotProductAttention
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa_module

    from .packing import make_thd

    seen = {}
    real = dpa_module.selection_params

    def spy(module, inp, fmt, layout):
        params = real(module, inp, fmt, layout)
        seen["params"], seen["inp"] = params, inp
        return params

    monkeypatch.setattr(dpa_module, "selection_params", spy)
    p = make_thd([3, 4], gaps_q=[1, 2], h=4, d=8)
    kw = dict(cu_seqlens_q=p.cu_q, cu_seqlens_kv=p.cu_q, cu_seqlens_q_padded=p.off_q,
              cu_seqlens_kv_padded=p.off_q.clone(), max_seqlen_q=4, max_seqlen_kv=4)
    DotProductAttention(4, 8, qkv_format="thd", attn_mask_type="padding_causal")(p.q, p.k, p.v, **kw)
    assert seen["params"].shared_cu_seqlens and seen["params"].same_lengths and seen["inp"].same_lengths
    kw["cu_seqlens_kv"] = p.cu_q.clone()  # equal values, another tensor: not known without reading them
    DotProductAttention(4, 8, qkv_format="thd", attn_mask_type="padding_causal")(p.q, p.k, p.v, **kw)
    assert not seen["params"].shared_cu_seqlens and not seen["params"].same_lengths and not seen["inp"].same_lengths


def test_hand_built_params_derive_same_lengths_from_their_facts():
    """Params built by hand (no tensors) derive sq == skv from their host facts, the same
    answer AttentionInputs.same_lengths gives the module's calls."""
    assert AttentionParams().same_lengths
    assert not AttentionParams(max_seqlen_q=128, max_seqlen_kv=64).same_lengths
    assert not AttentionParams(has_padding_mask=True).same_lengths
    assert AttentionParams(qkv_format="thd", max_seqlen_q=128, max_seqlen_kv=64).same_lengths  # shared cu_seqlens
    assert not AttentionParams(qkv_format="thd", shared_cu_seqlens=False).same_lengths
