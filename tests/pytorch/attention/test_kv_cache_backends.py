"""KV caching (TE's ``inference_params``) on each backend, on the CPU: the declarations as
selection reads them, and the FA4 and cuDNN translations against stand-in libraries.

- Selection: each backend accepts or refuses a KV call as its declaration says (non-paged,
  paged, page-size multiples, forward only, no sinks or dropout), TE's spelling included, and
  the README's KV table is rendered from the declarations.
- FA4: the FA4 stand-in (``stand_ins/fa4.py``: flash-attn-4 4.0.0b36's keywords only, page
  table, seqused, bottom-right causal, in float64): the cache reaches it without a copy, with the page table, the cached
  lengths as ``seqused_k`` and the padded query offsets; results equal the float64 oracle.
- cuDNN: the cuDNN stand-in (``stand_ins/cudnn.py``), whose graphs record every declaration
  (dims, strides, ragged offsets, the sdpa arguments) and execute them in float64 by reading the
  pack's tensors through exactly those declarations: so the pools' strides, the block tables, the lengths and
  the ragged offsets must be right for the output to match the oracle (bf16, its rounding).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import replace

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention, InferenceParams
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention import AttentionParams, get_attention_backend
from transformer_engine.pytorch.attention.dot_product_attention.backends import BACKENDS, backend_label
from transformer_engine.pytorch.attention.dot_product_attention.selection.backend_selection import kv_cache_support_markdown
from transformer_engine.pytorch.attention.dot_product_attention.selection.explain import TESTED_LIBRARIES, main as explain_main

from .kv_schedules import LAYERS, Config, Packing, Picker, Simulation, check_output, pack, round_history
from .spies import spy_zeroing

ALL = TESTED_LIBRARIES
KV = AttentionParams(qkv_format="thd", attn_mask_type="padding_causal_bottom_right", head_dim_qk=128, head_dim_v=128,
                     num_heads=16, num_gqa_groups=2, max_seqlen_q=1, max_seqlen_kv=4096, pad_between_seqs=True,
                     shared_cu_seqlens=False, is_training=False, requires_grad=False, kv_cache=True)
FA4, FA3, CUDNN, FA2, UNFUSED = (backend_label(b) for b in BACKENDS)


def _runs(params):
    selection = get_attention_backend(params, ALL)
    return {label for label, why in selection.reasons if not why}, selection


@pytest.mark.parametrize("page,runs", [
    (None, {FA4, CUDNN, UNFUSED}), (256, {FA4, CUDNN, UNFUSED}), (64, {FA4, CUDNN, UNFUSED}), (16, {FA4, UNFUSED}),
    (8, {UNFUSED}), (1, {UNFUSED}),
])
def test_each_declaration_takes_the_caches_it_declares(page, runs):
    can, selection = _runs(replace(KV, kv_page_size=page, pad_between_seqs=page is None))
    assert can == runs
    assert selection.label == (FA4 if FA4 in runs else UNFUSED), "FA4 first on Hopper where it applies"
    for cls in BACKENDS:
        declared = cls.SUPPORTS_KV_CACHE and (page is None or (cls.SUPPORTS_PAGED_KV_CACHE and page % cls.KV_PAGE_SIZE_MULTIPLE == 0))
        assert (backend_label(cls) in runs) == declared, cls
    for label in (FA3, FA2):
        assert "inference_params=given (KV caching)" in "; ".join(map(str, selection.reasons_for(label)))
        assert "KV-cache entry is not wired here" in "; ".join(map(str, selection.reasons_for(label)))
    if page in (8, 16):
        assert f"page_size={page} (supported: multiples of 64)" in "; ".join(map(str, selection.reasons_for(CUDNN)))


@pytest.mark.parametrize("change,field", [
    (dict(requires_grad=True), "requires_grad=True with inference_params"),
    (dict(softmax_type="off-by-one"), "softmax_type='off-by-one' with inference_params"),
    (dict(return_max_logit=True), "return_max_logit=True with inference_params"),
    (dict(attention_dropout=0.1, is_training=True), "attention_dropout=0.1 with inference_params"),
])
def test_the_shared_kv_rules_refuse_on_every_backend(change, field):
    can, selection = _runs(replace(KV, **change))
    assert can == set()
    for label in (FA4, CUDNN, UNFUSED):
        assert field in "; ".join(map(str, selection.reasons_for(label)))


def test_te_spelling_of_a_kv_call():
    """TE's callers pass the InferenceParams itself and a layout with q in its own format
    (``thd_bshd_bshd``); an inference call (is_training=False) needs no gradients."""
    params = InferenceParams(2, 128, num_heads_kv=2, head_dim_k=128, dtype=torch.bfloat16, is_paged=True, page_size=64,
                             total_num_pages=4, max_ctx_len=16, qkv_format="thd", device="cpu")
    te_kv = AttentionParams(qkv_layout="paged_kv_thd_bshd_bshd", attn_mask_type="padding_causal_bottom_right", head_dim_qk=128,
                            head_dim_v=128, is_training=False, inference_params=params)
    assert (te_kv.kv_cache, te_kv.kv_page_size, te_kv.requires_grad, te_kv.qkv_format) == (True, 64, False, "thd_2bshd")
    can, selection = _runs(te_kv)
    assert {FA4, CUDNN, UNFUSED} <= can and selection.label == FA4
    use_flash, _, use_fused, _, use_unfused, available = selection
    assert (use_flash, use_fused, use_unfused, available) == (True, False, False, [True, True, True])


def test_the_readme_kv_table_is_rendered_from_the_declarations(capsys):
    readme = (__import__("pathlib").Path(__file__).resolve().parents[3] / "README.md").read_text()
    assert kv_cache_support_markdown() in readme, "regenerate the README's KV table with: te-attention-backend --kv-matrix"
    assert explain_main(["--kv-matrix"]) == 0 and capsys.readouterr().out.strip() == kv_cache_support_markdown()
    assert explain_main(["--kv-cache", "paged", "--page-size", "16", "--assume-all-libraries"]) == 0
    assert "selected: FlashAttention v4" in capsys.readouterr().out


# ------------------------------------------------------------------ schedules on stand-in libraries


def _schedule(cfg: Config, module_kwargs: dict, force: str, dtype: torch.dtype, tol: float, steps: int = 5, seed: int = 0):
    """Random steps (part 1's schedule) through DotProductAttention on ``force``, each layer's
    output checked against the float64 oracle; returns the InferenceParams."""
    params = cfg.params(dtype=dtype)
    sim, pick = Simulation(cfg, seed=seed), Picker(rng=__import__("random").Random(seed))
    modules = {layer: DotProductAttention(cfg.heads, (cfg.d, cfg.dv), num_gqa_groups=cfg.hkv, qkv_format=cfg.fmt,
                                          attn_mask_type=cfg.mask, window_size=cfg.window, layer_number=layer, **module_kwargs)
               for layer in LAYERS}
    for layer in LAYERS:
        params.allocate_memory(layer)
    for _ in range(steps):
        step_dict = sim.draw_step(pick)
        params.pre_step(step_dict)
        sim.apply(step_dict)
        round_history(sim, dtype)
        for layer in LAYERS:
            q, k, v = (pack(cfg, step_dict, [sim.history[(layer, s)][w][-n:] for s, n in step_dict.items()], Packing(0, 1, 2)).to(dtype)
                       for w in range(3))
            with backend_scope(force=force), torch.no_grad():
                out = modules[layer](q, k, v, inference_params=params)
            check_output(out.view(*out.shape[:-1], cfg.heads, cfg.dv), sim, layer, step_dict, tol)
    return params


def _cfg(fmt: str, paged: bool, page_size: int = 4, mask: str = "padding_causal", window=None) -> Config:
    return Config(fmt=fmt, paged=paged, page_size=page_size, max_seqlen=4 * page_size, max_batch=3,
                  total_pages=12 if paged else None, hkv=2, group=2, d=8, dv=8, max_ctx=5, mask=mask, window=window)


# ------------------------------------------------------------------ FA4 (flash_attn.cute)


def _last_forward(fa4_lib) -> dict:
    """The keywords of the last forward the FA4 stand-in (``stand_ins/fa4.py``) ran; a KV call
    hands it no key offsets and asks for no LSE."""
    kw = [kw for kind, kw in fa4_lib.calls if kind == "fwd"][-1]
    assert kw["cu_seqlens_k"] is None and kw["lse"] is None and kw["return_lse"] is False
    return kw


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("mask,window", [("padding_causal", None), ("padding", (2, 1)), ("padding_causal", (2, 0))])
def test_fa4_gets_the_cache_as_stored(fa4_lib, fmt, paged, mask, window):
    cfg = _cfg(fmt, paged, mask=mask, window=window)
    params = _schedule(cfg, {}, "fa4", torch.float64, 1e-12)
    kw = _last_forward(fa4_lib)
    manager = params.cache_manager
    assert kw["k"].data_ptr() == manager.cache[LAYERS[-1]][0].data_ptr(), "the cache itself, not a copy"
    if paged:
        assert kw["k"].shape == (cfg.total_pages, cfg.page_size, cfg.hkv, cfg.d)
        assert kw["page_table"].dtype == torch.int32 and kw["page_table"].data_ptr() == manager.page_table.data_ptr()
    else:
        assert "page_table" not in kw and kw["k"].shape[1:] == (cfg.max_seqlen, cfg.hkv, cfg.d)
    b = kw["cu_seqlens_q"].numel() - 1
    assert kw["seqused_k"].tolist() == list(params.sequences.values()) + [0] * (b - params.batch_size)
    assert kw["seqused_q"].tolist()[: params.batch_size] == list(params._step_lens)
    assert kw["max_seqlen_k"] == cfg.max_seqlen and kw["softmax_scale"] == 1.0 / math.sqrt(cfg.d)
    assert (kw["causal"], kw["window_size_left"], kw["window_size_right"]) == (
        (True, None, None) if window is None else ((False, 2, 1) if mask == "padding" else (False, 2, 0)))


def test_unowned_rows_are_zeroed_unless_every_row_holds_a_token(fa4_lib, monkeypatch):
    """FA4 leaves rows it does not run unwritten: they are zeroed, one launch that a step whose
    rows all hold tokens (a full decode batch, eager) skips."""
    zeroed = spy_zeroing(monkeypatch)
    cfg = _cfg("bshd", True)
    params = cfg.params()
    params.allocate_memory(1)
    dpa = DotProductAttention(cfg.heads, cfg.d, num_gqa_groups=cfg.hkv, qkv_format="bshd", attn_mask_type="padding_causal",
                              layer_number=1)
    gen = torch.Generator().manual_seed(0)

    def step(step_dict, batch, width):
        params.pre_step(OrderedDict(step_dict))
        q, k, v = (torch.randn(batch, width, h, cfg.d, dtype=torch.float64, generator=gen) for h in (cfg.heads, cfg.hkv, cfg.hkv))
        with backend_scope(force="fa4"), torch.no_grad():
            return dpa(q, k, v, inference_params=params).view(batch, width, cfg.heads, cfg.d)

    step([(0, 3), (1, 3)], 2, 3)
    probe = cfg.params()  # the same step's record, from params of its own (a step appends: this layer's K/V stay as they are)
    probe.allocate_memory(1)
    probe.pre_step(OrderedDict([(0, 3), (1, 3)]))
    assert zeroed == [] and probe.step(1, *(torch.zeros(2, 3, cfg.hkv, cfg.d, dtype=torch.float64),) * 2, "bshd").rows_all_valid
    out = step([(0, 1), (1, 1)], 3, 2)  # a third batch row and a second position: padding
    assert zeroed == [(6, cfg.heads, cfg.d)] and torch.count_nonzero(out[2]) == 0 and torch.count_nonzero(out[:, 1]) == 0


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_a_causal_decode_step_runs_every_entry_instead_of_zeroing(fa4_lib, monkeypatch, fmt):
    """One query row per entry: FA4 runs every entry (seqused_q None) and the entry past the
    batch, with no keys, comes out 0 from the kernel itself (as on the H200), so no zeroing
    launch even while a graph could be capturing; a wider step keeps the zeroing."""
    zeroed = spy_zeroing(monkeypatch)
    cfg = _cfg(fmt, True)
    params = cfg.params()
    params.allocate_memory(1)
    dpa = DotProductAttention(cfg.heads, cfg.d, num_gqa_groups=cfg.hkv, qkv_format=fmt, attn_mask_type="padding_causal",
                              layer_number=1)
    gen = torch.Generator().manual_seed(1)

    def step(step_dict, batch, width):
        params.pre_step(OrderedDict(step_dict))
        shape = (batch, width) if fmt == "bshd" else (width, batch)
        q, k, v = (torch.randn(*shape, h, cfg.d, dtype=torch.float64, generator=gen) for h in (cfg.heads, cfg.hkv, cfg.hkv))
        with backend_scope(force="fa4"), torch.no_grad():
            out = dpa(q, k, v, inference_params=params)
        return out.view(*shape, cfg.heads, cfg.d)

    step([(0, 3), (1, 2)], 2, 3)
    zeroed.clear()
    out = step([(0, 1), (1, 1)], 3, 1)  # a third batch entry: no sequence, no keys
    assert _last_forward(fa4_lib)["seqused_q"] is None and zeroed == []
    row = out[2] if fmt == "bshd" else out[:, 2]
    assert torch.count_nonzero(row) == 0 and out.isfinite().all()
    step([(0, 2)], 3, 2)
    assert _last_forward(fa4_lib)["seqused_q"] is not None and zeroed == [(6, cfg.heads, cfg.d)]


# ------------------------------------------------------------------ cuDNN (cudnn-frontend's graph API)


def _cudnn_forwards(cudnn_lib) -> list:
    """The sdpa graphs the cuDNN stand-in (``stand_ins/cudnn.py``) ran, each as one dict of its
    declared tensors and arguments by cudnn-frontend's names."""
    return [{**node.args, **node.tensors} for node, _ in cudnn_lib.of("fwd")]


BF16_TOL = 2e-2  # a bf16 output of values below ~2, against the float64 oracle over the same bf16 inputs


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("mask,window", [("padding_causal", None), ("padding", None), ("padding_causal", (2, 0))])
def test_cudnn_paged_graph_reads_the_pools_through_strides(cudnn_lib, fmt, mask, window):
    cfg = _cfg(fmt, True, mask=mask, window=window)
    params = _schedule(cfg, {}, "cudnn", torch.bfloat16, BF16_TOL)
    ran = _cudnn_forwards(cudnn_lib)
    paged = [a for a in ran if a["paged_attention_k_table"] is not None]
    assert paged and len(paged) == len(ran), "every KV call ran the paged graph"
    a = paged[-1]
    page, hkv, d = cfg.page_size, cfg.hkv, cfg.d
    assert a["k"].dim == [cfg.total_pages, hkv, page, d] and a["k"].stride == [page * hkv * d, d, hkv * d, 1]
    pages = cfg.max_seqlen // page
    table = a["paged_attention_k_table"]
    assert table.dim[1:] == [1, pages, 1] and table.stride == [pages, pages, 1, 1] and table.data_type == "data_type.INT32"
    assert a["paged_attention_v_table"].uid != table.uid and a["paged_attention_max_seq_len_kv"] == cfg.max_seqlen
    assert a["use_padding_mask"] is True and a["generate_stats"] is False
    assert (a["q"].ragged is not None) == (fmt == "thd"), "thd queries are ragged, bshd/sbhd dense"
    assert a["diagonal_alignment"] == ("diagonal_alignment.BOTTOM_RIGHT" if mask == "padding_causal" or window
                                       else "diagonal_alignment.TOP_LEFT")
    assert a.get("diagonal_band_right_bound") == (0 if mask == "padding_causal" else None)
    assert a.get("diagonal_band_left_bound") == (3 if window else None)
    _, pack_ = cudnn_lib.of("fwd")[-1]
    for side in ("k", "v"):  # the manager's own table, viewed as cuDNN's [B, 1, pages, 1], not a copy
        bound = pack_[a[f"paged_attention_{side}_table"].uid]
        assert bound.data_ptr() == params.cache_manager.page_table.data_ptr() and bound.shape[1:] == (1, pages, 1)


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_cudnn_non_paged_cache_runs_the_ragged_graph(cudnn_lib, fmt):
    cfg = _cfg(fmt, False)
    _schedule(cfg, {}, "cudnn", torch.bfloat16, BF16_TOL)
    a = _cudnn_forwards(cudnn_lib)[-1]
    assert a["paged_attention_k_table"] is None and a["k"].ragged is not None and a["q"].ragged is not None
    assert a["k"].dim[2] == cfg.max_seqlen  # each sequence's slot: max_sequence_length rows of the cache


def test_cudnn_refuses_pages_it_was_not_probed_with():
    cfg = _cfg("bshd", True, page_size=4)
    params = cfg.params(dtype=torch.bfloat16)
    params.allocate_memory(1)
    params.pre_step(OrderedDict([(0, 2)]))
    dpa = DotProductAttention(cfg.heads, cfg.d, num_gqa_groups=cfg.hkv, qkv_format="bshd", attn_mask_type="padding_causal",
                              layer_number=1)
    q, k, v = (torch.zeros(1, 2, h, cfg.d, dtype=torch.bfloat16) for h in (cfg.heads, cfg.hkv, cfg.hkv))
    with backend_scope(allow=["cudnn"]), torch.no_grad(), pytest.raises(NotImplementedError, match="page_size=4 \\(supported: multiples of 64\\)"):
        dpa(q, k, v, inference_params=params)
