"""KV-cache core (issue #25, part 1): InferenceParams, its non-paged and paged managers and
attention over the cache, on the CPU.

Randomized schedules (hypothesis) of sequences joining with a prefill, growing by decode steps or
chunks, finishing and re-joining, in any batch order, with resets, for bshd/sbhd/thd inputs
(padding tokens and batch rows NaN), paged or not, GQA, two layers. The oracle recomputes each
sequence's attention from scratch over its whole history in float64, with no cache
(``reference.py``); the cache's contents must equal the history exactly (copies), the attention
within 1e-12 (other reduction orders), and every output row no sequence owns exactly 0. The
metadata an attention kernel would take (THD view, padded offsets, page table) is checked by
running the packed reference over it. Bad input gets a named error. The GPU side (sync-free
append, CUDA-graph replay across joins and finishes) is in test_gpu_kv_cache.py.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import transformer_engine.pytorch as te
from transformer_engine.pytorch.attention.inference import (
    InferenceParams,
    KVCacheManager,
    KVCacheStep,
    NonPagedKVCacheManager,
    PagedKVCacheManager,
    attention_over_cache,
    inference_attn_mask_type,
)

from .kv_schedules import LAYERS, Config, Packing, Picker, Simulation, check_output, configs, no_host_reads, pack, poison
from .reference import reference_thd


def run_step(params: InferenceParams, sim: Simulation, step_dict, packing: Packing, guard=contextlib.nullcontext) -> None:
    """Each layer: append the step's K/V and attend over the cache (inside ``guard``), then check."""
    cfg = sim.cfg
    for layer in LAYERS:
        q_in, k_in, v_in = (
            pack(cfg, step_dict, [sim.history[(layer, s)][which][-n:] for s, n in step_dict.items()], packing)
            for which in range(3)
        )
        with guard():
            step = params.step(layer, k_in, v_in, cfg.fmt)
            out = attention_over_cache(q_in, step, attn_mask_type=cfg.mask, window_size=cfg.window)
        step, q_in, out = on_cpu(step), q_in.cpu(), out.cpu()
        check_output(out, sim, layer, step_dict)
        check_cache_contents(params, step, sim, layer)
        check_thd_contract(step, q_in, out, cfg)


def on_cpu(step: KVCacheStep) -> KVCacheStep:
    return KVCacheStep(*(f.cpu() if isinstance(f, torch.Tensor) else f for f in step))


def check_cache_contents(params: InferenceParams, step, sim: Simulation, layer: int) -> None:
    """The cache holds each sequence's whole history, bit for bit, where the record says."""
    for b, (seq, m) in enumerate(sim.lengths.items()):
        _, k_hist, v_hist = sim.history[(layer, seq)]
        if step.is_paged:
            pages = params.cache_manager.get_page_list(seq)
            assert len(pages) == -(-m // sim.cfg.page_size)
            assert step.page_table[b].tolist() == pages + [0] * (step.page_table.shape[1] - len(pages))
            k, v = (torch.cat([pool[p] for p in pages])[:m] for pool in (step.k_cache, step.v_cache))
        else:
            k, v = step.k_cache[b, :m], step.v_cache[b, :m]
        assert torch.equal(k, k_hist) and torch.equal(v, v_hist)


def check_thd_contract(step, q_in, out, cfg: Config) -> None:
    """A THD kernel given the record's fields (queries at cu_seqlens_q_padded, the non-paged
    cache as [B*S] rows at cu_seqlens_kv_padded, valid lengths from cu_seqlens) computes ``out``."""
    if step.is_paged:  # the pages in table order, gathered here row by row
        k, v = (torch.stack([torch.cat([pool[p] for p in row]) for row in step.page_table.tolist()]).flatten(0, 1)
                for pool in (step.k_cache, step.v_cache))
        offsets_kv = torch.arange(step.batch_size + 1) * cfg.max_seqlen
    else:
        k, v, offsets_kv = step.k_cache_thd, step.v_cache_thd, step.cu_seqlens_kv_padded
    mask = inference_attn_mask_type(cfg.mask)
    ref = reference_thd(step.queries_as_thd(q_in), k, v, step.cu_seqlens_q, step.cu_seqlens_kv, step.cu_seqlens_q_padded,
                        offsets_kv, [mask] * step.batch_size, [cfg.window] * step.batch_size, 1.0 / math.sqrt(cfg.d))
    torch.testing.assert_close(step.output_from_thd(ref), out, rtol=1e-12, atol=1e-12)


def check_bookkeeping(params: InferenceParams, sim: Simulation, step_dict) -> None:
    cfg = sim.cfg
    pad = [0] * (cfg.max_batch - len(step_dict))
    lens_q, lens_kv = list(step_dict.values()), list(sim.lengths.values())
    assert list(params.sequences.items()) == list(sim.lengths.items()) and params.batch_size == len(step_dict)
    assert list(params.sequences_pre_step.values()) == [m - n for m, n in zip(lens_kv, lens_q)]
    assert params.cu_seqlens_q.tolist() == [sum(lens_q[:i]) for i in range(len(lens_q) + 1)] + [sum(lens_q)] * len(pad)
    assert params.cu_seqlens_kv.tolist() == [sum(lens_kv[:i]) for i in range(len(lens_kv) + 1)] + [sum(lens_kv)] * len(pad)
    assert params.get_seqlens_pre_step().tolist() == [m - n for m, n in zip(lens_kv, lens_q)] + pad
    if cfg.paged:
        manager = params.cache_manager
        held = [p for seq in sim.lengths for p in manager.get_page_list(seq)]
        assert len(held) == len(set(held)), "a page belongs to two sequences"
        assert sorted(held + list(manager.free_pages)) == list(range(cfg.total_pages))


@settings(max_examples=80, deadline=None)
@given(cfg=configs(), data=st.data())
def test_random_schedules_match_recomputation(cfg, data):
    params = cfg.params()
    poison(params)
    pick = Picker(data=data)
    sim = Simulation(cfg, seed=pick.int(0, 2**16, "seed"))
    for _ in range(pick.int(1, 7, "steps")):
        if sim.lengths and pick.int(0, 9, "reset?") == 0:
            params.reset()
            sim.reset()
        step_dict = sim.draw_step(pick)
        if cfg.paged and not sim.fits_pool(step_dict):
            _check_pool_refusal(params, step_dict)
            continue
        params.pre_step(step_dict)
        sim.apply(step_dict)
        check_bookkeeping(params, sim, step_dict)
        packing = Packing(extra_b=pick.int(0, cfg.max_batch - len(step_dict), "extra rows"),
                          extra_s=pick.int(0, 1, "extra positions"), tail=pick.int(0, 2, "thd tail"))
        run_step(params, sim, step_dict, packing)


def _check_pool_refusal(params: InferenceParams, step_dict) -> None:
    """A step the pool cannot hold raises by name and changes nothing."""
    manager = params.cache_manager
    before = (OrderedDict(manager.sequences), {s: list(p) for s, p in manager.allocated_pages.items()},
              list(manager.free_pages), manager.page_table.clone(), params.cu_seqlens_kv.clone())
    with pytest.raises(ValueError, match=r"total_num_pages=\d+ is too small for this step"):
        params.pre_step(step_dict)
    after = (OrderedDict(manager.sequences), {s: list(p) for s, p in manager.allocated_pages.items()},
             list(manager.free_pages), manager.page_table.clone(), params.cu_seqlens_kv.clone())
    assert before[:3] == after[:3] and torch.equal(before[3], after[3]) and torch.equal(before[4], after[4])


# --- chosen cases ---------------------------------------------------------------------------


def _small(fmt="bshd", paged=True, **overrides) -> InferenceParams:
    kwargs = dict(max_batch_size=2, max_sequence_length=4, num_heads_kv=1, head_dim_k=2, dtype=torch.float64,
                  is_paged=paged, total_num_pages=2 if paged else None, page_size=2 if paged else None,
                  max_ctx_len=4, qkv_format=fmt, device="cpu")
    kwargs.update(overrides)
    params = InferenceParams(**kwargs)
    params.allocate_memory(1)
    return params


def _tokens(*values, heads=1, dim=2) -> torch.Tensor:
    """[1, len(values), heads, dim]: token i filled with values[i] (bshd, one sequence)."""
    return torch.tensor(values, dtype=torch.float64).view(1, -1, 1, 1).expand(1, len(values), heads, dim).contiguous()


def test_finished_sequence_pages_go_to_the_next_one():
    params = _small()
    params.pre_step(OrderedDict([(7, 4)]))  # both pages
    params.step(1, _tokens(1, 2, 3, 4), _tokens(1, 2, 3, 4), "bshd")
    pages_of_7 = params.cache_manager.get_page_list(7)
    params.pre_step(OrderedDict([(8, 3)]))  # 7 finishes in the same step 8 joins
    step = params.step(1, _tokens(5, 6, 7), _tokens(5, 6, 7), "bshd")
    assert sorted(params.cache_manager.get_page_list(8)) == sorted(pages_of_7)
    k, _ = params.convert_paged_to_nonpaged(1)
    assert k[0, :3, 0, 0].tolist() == [5.0, 6.0, 7.0]
    assert step.page_table.tolist() == [params.cache_manager.get_page_list(8)]
    with pytest.raises(ValueError, match=r"sequence id 7 is not in the KV cache; cached ids: \[8\]"):
        params.cache_manager.get_page_list(7)


def test_a_pool_too_small_raises_before_any_page_moves():
    params = _small()
    params.pre_step(OrderedDict([(1, 3)]))
    with pytest.raises(ValueError, match=r"total_num_pages=2 is too small for this step: it needs 2 more pages of "
                                         r"page_size=2 tokens and 0 are free \(after freeing the finished sequences \[\]\)"):
        params.pre_step(OrderedDict([(1, 1), (2, 3)]))
    assert params.cache_manager.get_page_list(1) == [0, 1] and list(params.sequences.items()) == [(1, 3)]
    assert params.cu_seqlens_kv.tolist() == [0, 3, 3]


def test_batch_order_is_the_step_dicts_and_rows_follow_it():
    params = _small(paged=False, max_batch_size=3)
    params.pre_step(OrderedDict([(1, 2), (2, 2)]))
    k = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64).view(2, 2, 1, 1).expand(2, 2, 1, 2).contiguous()
    params.step(1, k, k, "bshd")
    params.pre_step(OrderedDict([(3, 1), (2, 1), (1, 1)]))  # a new one first, the others swapped
    new = torch.tensor([9.0, 5.0, 6.0], dtype=torch.float64).view(3, 1, 1, 1).expand(3, 1, 1, 2).contiguous()
    step = params.step(1, new, new, "bshd")
    assert step.k_cache[0, :1, 0, 0].tolist() == [9.0]  # past a sequence's length a row holds anything
    assert step.k_cache[1:, :3, 0, 0].tolist() == [[3.0, 4.0, 5.0], [1.0, 2.0, 6.0]]
    assert list(params.sequences.items()) == [(3, 1), (2, 3), (1, 3)]


def test_reset_forgets_sequences_and_frees_every_page():
    params = _small()
    params.pre_step(OrderedDict([(1, 2), (2, 1)]))
    params.reset()
    manager = params.cache_manager
    assert params.sequences == OrderedDict() and params.batch_size == 0 and manager.sequences == OrderedDict()
    assert sorted(manager.free_pages) == [0, 1] and manager.allocated_pages == {}
    assert not manager.page_table.any() and not params.cu_seqlens_kv.any() and not params.get_seqlens_pre_step().any()
    assert list(params.cache_manager.cache) == [1]  # caches stay allocated
    params.pre_step(OrderedDict([(1, 4)]))  # 1 joins again, as a new sequence of 4 tokens
    assert params.cache_manager.get_page_count(1) == 2


def test_continuing_sequences_may_take_chunks():
    params = _small(paged=False)
    params.pre_step(OrderedDict([(1, 1)]))
    params.pre_step(OrderedDict([(1, 3)]))  # a chunked prefill: TE itself only advances by 1
    assert list(params.sequences.items()) == [(1, 4)] and params.get_seqlens_pre_step().tolist() == [1, 0]


def test_record_fields_and_te_names():
    params = _small(fmt="thd", paged=False, max_ctx_len=3)
    params.pre_step(OrderedDict([(5, 3), (6, 1)]))
    new = torch.randn(5, 1, 2, dtype=torch.float64)  # one tail row
    step = params.step(1, new, new, "thd")
    assert step.batch_size == 2 and step.max_seqlen_q == 3 and step.max_seqlen_kv == 4
    assert step.output_qkv_format == params.output_qkv_format == "thd_2bshd"
    assert step.cu_seqlens_q_padded is step.cu_seqlens_q and step.cu_seqlens_kv_padded.tolist() == [0, 4, 8]
    assert step.seqlens_q.tolist() == [3, 1] and step.seqlens_kv.tolist() == [3, 1]
    assert step.k_cache.shape == (2, 4, 1, 2) and step.k_cache_thd.shape == (8, 1, 2) and step.page_table is None
    assert params.cache_qkv_format == "bshd" and "is_paged=False" in repr(params)
    for name in ("InferenceParams", "KVCacheManager", "NonPagedKVCacheManager", "PagedKVCacheManager"):
        assert getattr(te, name).__module__.startswith("transformer_engine.pytorch.attention.inference")


def test_paged_record_has_no_thd_view():
    params = _small()
    params.pre_step(OrderedDict([(1, 1)]))
    step = params.step(1, _tokens(1.0), _tokens(1.0), "bshd")
    assert step.cu_seqlens_kv_padded is None and step.page_table.dtype == torch.int32
    with pytest.raises(ValueError, match="a paged cache has no THD view; read it through page_table"):
        step.k_cache_thd
    with pytest.raises(ValueError, match=r"query has batch 1 and sequence length 2 \(bshd\); the step's keys and values had 1 and 1"):
        step.queries_as_thd(torch.zeros(1, 2, 1, 2, dtype=torch.float64))


def test_inference_mask_types():
    assert inference_attn_mask_type("padding_causal") == "padding_causal_bottom_right"
    assert inference_attn_mask_type("padding") == "padding"
    with pytest.raises(ValueError, match=r"attn_mask_type must be a padding kind with inference_params "
                                         r"\(padding, padding_causal, padding_causal_bottom_right\); got 'causal'"):
        inference_attn_mask_type("causal")


# --- bad input: each error by name ----------------------------------------------------------


def _ctor(**overrides):
    kwargs = dict(max_batch_size=2, max_sequence_length=4, num_heads_kv=1, head_dim_k=2, dtype=torch.float64, device="cpu")
    kwargs.update(overrides)
    return lambda: InferenceParams(**kwargs)


CONSTRUCTOR_ERRORS = [
    ("required", _ctor(num_heads_kv=None, head_dim_k=None, dtype=None), ValueError,
     r"InferenceParams needs num_heads_kv, head_dim_k and dtype \(as TE since 2.2\); missing: num_heads_kv, head_dim_k, dtype"),
    ("dtype", _ctor(dtype=torch.int32), TypeError, r"dtype must be a floating torch.dtype \(the KV cache's\); got torch.int32"),
    ("batch", _ctor(max_batch_size=0), ValueError, "max_batch_size must be a positive int; got 0"),
    ("batch type", _ctor(max_batch_size=2.5), TypeError, "max_batch_size must be a positive int; got float"),
    ("page_size", _ctor(is_paged=True, total_num_pages=4), ValueError, r"is_paged=True needs page_size \(tokens per page\); got None"),
    ("pages", _ctor(is_paged=True, page_size=2), ValueError,
     r"is_paged=True needs total_num_pages \(pages in each layer's pool\); got None"),
    ("no pages", _ctor(is_paged=True, page_size=2, total_num_pages=0), ValueError, "total_num_pages must be a positive int; got 0"),
    ("page multiple", _ctor(is_paged=True, page_size=3, total_num_pages=4), ValueError,
     "max_sequence_length=4 must be a multiple of page_size=3"),
    ("thd ctx", _ctor(qkv_format="thd"), ValueError, r"qkv_format='thd' needs max_ctx_len .*; got None"),
    ("ctx bound", _ctor(max_ctx_len=5), ValueError, "max_ctx_len=5 must be at most max_sequence_length=4"),
    ("format", _ctor(qkv_format="bhsd"), ValueError, "qkv_format must be one of bshd, sbhd, thd; got 'bhsd'"),
    ("manager", _ctor(custom_cache_manager=dict), TypeError,
     "custom_cache_manager must be a subclass of KVCacheManager; got <class 'dict'>"),
]


@pytest.mark.parametrize("make,exc,message", [c[1:] for c in CONSTRUCTOR_ERRORS], ids=[c[0] for c in CONSTRUCTOR_ERRORS])
def test_constructor_errors(make, exc, message):
    with pytest.raises(exc, match=f"^{message}"):
        make()


PRE_STEP_ERRORS = [
    ("batch", OrderedDict([(1, 1), (2, 1), (3, 1)]), ValueError, "step_dict has 3 sequences; max_batch_size is 2"),
    ("empty step", OrderedDict([(1, 0)]), ValueError, r"step_dict\[1\] \(new tokens this step\) must be a positive int; got 0"),
    ("length type", OrderedDict([(1, 1.0)]), TypeError, r"step_dict\[1\] \(new tokens this step\) must be a positive int; got float"),
    ("tensor id", OrderedDict([(torch.tensor(1), 1)]), TypeError,
     r"step_dict keys must be sequence ids such as ints \(use .tolist\(\)\); got a tensor"),
    ("ctx", OrderedDict([(1, 4)]), ValueError, r"step_dict\[1\]=4 is longer than max_ctx_len=3, the longest step per sequence"),
    ("longer than the cache", OrderedDict([(9, 3)]), ValueError,
     r"step_dict\[9\]=3: sequence 9 would hold 5 tokens \(2 cached \+ 3 new\); max_sequence_length is 4"),
    ("not a dict", [(1, 1)], TypeError, "step_dict must be an OrderedDict of sequence id -> step length; got list"),
]


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("step_dict,exc,message", [c[1:] for c in PRE_STEP_ERRORS], ids=[c[0] for c in PRE_STEP_ERRORS])
def test_pre_step_errors_change_nothing(paged, step_dict, exc, message):
    params = _small(paged=paged, max_ctx_len=3, total_num_pages=4 if paged else None)
    params.pre_step(OrderedDict([(9, 2)]))
    with pytest.raises(exc, match=f"^{message}"):
        params.pre_step(step_dict)
    assert list(params.sequences.items()) == [(9, 2)] and list(params.cache_manager.sequences.items()) == [(9, 2)]
    assert params.cu_seqlens_kv.tolist() == [0, 2, 2]


def _kv(shape, dtype=torch.float64):
    return torch.zeros(shape, dtype=dtype)


STEP_ERRORS = [
    ("layer None", dict(layer=None), ValueError,
     r"layer_number is None; KV caching keeps one cache per layer \(set DotProductAttention's layer_number\)"),
    ("layer missing", dict(layer=5), ValueError,
     r"layer_number=5 has no KV cache; allocated: \[1\] \(call inference_params.allocate_memory\(5\) first\)"),
    ("dtype", dict(k=_kv((2, 2, 1, 2), torch.float32)), TypeError, "new_k has dtype torch.float32; the KV cache holds torch.float64"),
    ("heads", dict(k=_kv((2, 2, 2, 2))), ValueError, "new_k has 2 heads; the KV cache has num_heads_kv=1"),
    ("head dim k", dict(k=_kv((2, 2, 1, 3))), ValueError, "new_k has head dim 3; the KV cache has head_dim_k=2"),
    ("head dim v", dict(v=_kv((2, 2, 1, 3))), ValueError, "new_v has head dim 3; the KV cache has head_dim_v=2"),
    ("rank", dict(k=_kv((4, 1, 2))), ValueError, r"new_k must have rank 4 for qkv_format='bshd'; got shape \(4, 1, 2\)"),
    ("type", dict(k=[0.0]), TypeError, "new_k must be a tensor; got list"),
    ("k and v", dict(v=_kv((2, 3, 1, 2))), ValueError, r"new_k and new_v must agree outside the last two dims; got \(2, 2, 1, 2\) and \(2, 3, 1, 2\)"),
    ("batch dim", dict(k=_kv((1, 2, 1, 2)), v=_kv((1, 2, 1, 2))), ValueError,
     r"new_k's batch dim is 1 \(bshd\); it must cover the step's 2 sequences and be at most max_batch_size=2"),
    ("sbhd batch dim", dict(fmt="sbhd", k=_kv((2, 3, 1, 2)), v=_kv((2, 3, 1, 2))), ValueError,
     r"new_k's batch dim is 3 \(sbhd\); it must cover the step's 2 sequences and be at most max_batch_size=2"),
    ("seq dim", dict(k=_kv((2, 1, 1, 2)), v=_kv((2, 1, 1, 2))), ValueError,
     r"new_k's sequence dim is 1 \(bshd\); the step's longest sequence has 2 new tokens"),
    ("thd tokens", dict(fmt="thd", k=_kv((2, 1, 2)), v=_kv((2, 1, 2))), ValueError,
     r"new_k has 2 tokens \(qkv_format='thd'\); the step has 3 \(pre_step\)"),
    ("format", dict(fmt="bhsd"), ValueError, "qkv_format must be one of bshd, sbhd, thd; got 'bhsd'"),
]


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("case,exc,message", [c[1:] for c in STEP_ERRORS], ids=[c[0] for c in STEP_ERRORS])
def test_step_errors(paged, case, exc, message):
    params = _small(paged=paged, total_num_pages=4 if paged else None)
    params.pre_step(OrderedDict([(1, 2), (2, 1)]))
    with pytest.raises(exc, match=f"^{message}"):
        params.step(case.get("layer", 1), case.get("k", _kv((2, 2, 1, 2))), case.get("v", _kv((2, 2, 1, 2))),
                     case.get("fmt", "bshd"))


def test_thd_step_needs_max_ctx_len_and_layers_allocate_once():
    params = _small(paged=False, max_ctx_len=None)
    params.pre_step(OrderedDict([(1, 1)]))
    with pytest.raises(ValueError, match=r"^qkv_format='thd' needs max_ctx_len \(the queries' bound\), which InferenceParams was not given"):
        params.step(1, _kv((1, 1, 2)), _kv((1, 1, 2)), "thd")
    with pytest.raises(ValueError, match="^layer_number=1 already has a KV cache; allocate_memory makes one per layer"):
        params.allocate_memory(1)


def test_reference_needs_a_whole_number_of_query_heads_per_kv_head():
    params = _small(paged=False, num_heads_kv=2)
    params.pre_step(OrderedDict([(1, 1)]))
    step = params.step(1, _kv((1, 1, 2, 2)), _kv((1, 1, 2, 2)), "bshd")
    with pytest.raises(ValueError, match="^query has 3 heads; they must be a multiple of the cache's 2 KV heads"):
        attention_over_cache(_kv((1, 1, 3, 2)), step)
    with pytest.raises(ValueError, match="^attn_mask_type must be a padding kind"):
        attention_over_cache(_kv((1, 1, 2, 2)), step, attn_mask_type="no_mask")


# --- custom cache managers (TE's hook) ------------------------------------------------------


class TeStyleManager(KVCacheManager):
    """A manager written against TE's signatures (no ``device``), wrapping the built-in one."""

    def __init__(self, max_batch_size, max_seqlen, num_heads, head_dim_k, dtype, head_dim_v=None):
        super().__init__()
        self.inner = NonPagedKVCacheManager(max_batch_size, max_seqlen, num_heads, head_dim_k, dtype, head_dim_v, device="cpu")
        self.cache, self.calls = self.inner.cache, []

    def allocate_memory(self, layer_number):
        self.inner.allocate_memory(layer_number)

    def pre_step(self, step_dict):
        self.calls.append(dict(step_dict))
        return self.inner.pre_step(step_dict)

    def step(self, layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format):
        return self.inner.step(layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format)


class ForgetfulManager(TeStyleManager):
    def pre_step(self, step_dict):
        return OrderedDict()


def test_custom_manager_gets_te_arguments_and_is_driven_by_the_params():
    params = _small(paged=False, custom_cache_manager=TeStyleManager)
    params.pre_step(OrderedDict([(4, 2)]))
    step = params.step(1, _tokens(1.0, 2.0), _tokens(1.0, 2.0), "bshd")
    assert params.cache_manager.calls == [{4: 2}] and step.k_cache[0, :2, 0, 0].tolist() == [1.0, 2.0]
    params = _small(paged=False, custom_cache_manager=ForgetfulManager)
    with pytest.raises(ValueError, match=r"^cache_manager.pre_step must return the step's sequences .*got \{\} for step_dict \{4: 2\}"):
        params.pre_step(OrderedDict([(4, 2)]))


def test_a_paged_custom_manager_needs_a_page_table():
    with pytest.raises(TypeError, match=r"^custom_cache_manager _PagedTeStyle has no attribute page_table; is_paged=True needs it"):
        InferenceParams(2, 4, num_heads_kv=1, head_dim_k=2, dtype=torch.float64, is_paged=True, page_size=2, total_num_pages=4,
                        custom_cache_manager=_PagedTeStyle, device="cpu")


class _PagedTeStyle(TeStyleManager):
    """TE's paged constructor signature, the non-paged cache inside and no ``page_table``."""

    def __init__(self, total_num_pages, page_size, num_heads, head_dim_k, dtype, max_batch_size, max_seqlen, head_dim_v=None):
        super().__init__(max_batch_size, max_seqlen, num_heads, head_dim_k, dtype, head_dim_v)


def test_the_base_manager_names_what_a_custom_one_must_implement():
    with pytest.raises(NotImplementedError, match=r"^KVCacheManager.pre_step: a cache manager updates its sequences"):
        KVCacheManager().pre_step(OrderedDict())
    with pytest.raises(NotImplementedError, match=r"^KVCacheManager.step"):
        KVCacheManager().step(1, None, None, None, None, "bshd")


def test_managers_alone_keep_te_constructor_signatures():
    manager = PagedKVCacheManager(4, 2, 1, 2, torch.float64, 2, 4, device="cpu")
    manager.allocate_memory(3)
    assert manager.cache[3][0].shape == (4, 2, 1, 2) and manager.page_table.shape == (2, 2)
    assert manager.pre_step(OrderedDict([(1, 3)])) == OrderedDict([(1, 3)]) and manager.get_page_count(1) == 2
    assert manager.get_sequence_count() == 1 and manager.get_sequence_lengths() == [3] and manager.has_free_page()


# --- no host reads on the step path (the GPU's sync-free steps and CUDA graphs: test_gpu_kv_cache.py) -------------------------------------

@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("paged", [False, True])
def test_step_and_reference_read_no_tensor_values_on_the_host(fmt, paged):
    cfg = Config(fmt=fmt, paged=paged, page_size=2, max_seqlen=8, max_batch=3, total_pages=12 if paged else None, hkv=2,
                 group=2, d=4, dv=4, max_ctx=4, mask="padding_causal", window=None)
    params, sim = cfg.params(), Simulation(cfg, seed=0)
    for layer in LAYERS:
        params.allocate_memory(layer)
    pick = Picker(rng=random.Random(0))
    for _ in range(4):
        step_dict = sim.draw_step(pick)
        params.pre_step(step_dict)
        sim.apply(step_dict)
        run_step(params, sim, step_dict, Packing(extra_b=0, extra_s=1, tail=1), guard=no_host_reads)
    with pytest.raises(AssertionError, match="host read of a tensor: Tensor.item"):
        with no_host_reads():
            torch.zeros(1).item()
