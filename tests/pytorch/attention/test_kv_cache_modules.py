"""KV caching through DotProductAttention and MultiheadAttention (TE's ``inference_params``;
issue #25, part 2), on the CPU's unfused backend.

Randomized schedules (hypothesis; part 1's, ``kv_schedules.py``) of sequences joining, growing
and finishing, bshd/sbhd/thd, paged or not, GQA: each step's output must equal the float64
recomputation of every sequence over its whole history without a cache, within 1e-12 (other
reduction orders), and rows no sequence owns must be exactly 0 (padding tokens are NaN). TE's
call pattern passes ``cu_seqlens_*``/``max_seqlen_*`` along, which the cache's lengths replace:
wrong ones are passed here and must change nothing. MultiheadAttention's rotary embeddings must
put each new token at its position in its sequence. A repeated step takes the recipe the first
one left (no checks, no selection), nothing reads a tensor's values on the host, bad input gets
a named error before anything is appended, and the example runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch import DotProductAttention, InferenceParams, MultiheadAttention
from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa_module
from transformer_engine.pytorch.attention.dot_product_attention.cp.comm import CPComm
from transformer_engine.pytorch.attention.inference import params as params_module
from transformer_engine.pytorch.attention.dot_product_attention.selection.backend_selection import NoBackendError

from .gpu_helpers import env
from .kv_schedules import (LAYERS, Config, Packing, Picker, Simulation, check_output, configs, load_example, no_host_reads, pack,
                           poison, starts)

DECOYS = dict(cu_seqlens_q=torch.tensor([0, 7], dtype=torch.int32), cu_seqlens_kv=torch.tensor([0, 1], dtype=torch.int32),
              max_seqlen_q=1, max_seqlen_kv=1)  # TE's callers pass these; the cache's lengths replace them


def te_window(cfg: Config) -> Config:
    """The window the module applies: (-1, 0) on a non-causal mask means no window (TE's rule,
    with a warning), which part 1's oracle would read as causal."""
    if cfg.mask == "padding" and cfg.window == (-1, 0):
        return dataclasses.replace(cfg, window=None)
    return cfg


def make_dpa(cfg: Config, layer: int) -> DotProductAttention:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TE's window normalization warns
        return DotProductAttention(cfg.heads, (cfg.d, cfg.dv), num_gqa_groups=cfg.hkv, qkv_format=cfg.fmt,
                                   attn_mask_type=cfg.mask, window_size=cfg.window, layer_number=layer)


def step_inputs(sim: Simulation, step_dict, layer: int, packing: Packing):
    return [pack(sim.cfg, step_dict, [sim.history[(layer, s)][w][-n:] for s, n in step_dict.items()], packing) for w in range(3)]


def run_dpa_step(modules, params, sim: Simulation, step_dict, packing: Packing, decoys: bool) -> None:
    cfg = sim.cfg
    for layer in LAYERS:
        q, k, v = step_inputs(sim, step_dict, layer, packing)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TE's window normalization warns
            out = modules[layer](q, k, v, inference_params=params, **(DECOYS if decoys else {}))
        assert out.shape == (*q.shape[:-2], cfg.heads * cfg.dv)
        check_output(out.view(*out.shape[:-1], cfg.heads, cfg.dv), sim, layer, step_dict)
        assert modules[layer].last_selection.label == "UnfusedDotProductAttention"


@settings(max_examples=40, deadline=None)
@given(cfg=configs(), data=st.data())
def test_dpa_over_the_cache_matches_recomputation(cfg, data):
    cfg = te_window(cfg)
    params = cfg.params()
    poison(params)  # cache slots never written must never be read
    modules = {layer: make_dpa(cfg, layer) for layer in LAYERS}
    pick = Picker(data=data)
    sim = Simulation(cfg, seed=pick.int(0, 2**16, "seed"))
    for _ in range(pick.int(1, 6, "steps")):
        step_dict = sim.draw_step(pick)
        if cfg.paged and not sim.fits_pool(step_dict):
            continue
        params.pre_step(step_dict)
        sim.apply(step_dict)
        packing = Packing(extra_b=pick.int(0, cfg.max_batch - len(step_dict), "extra rows"),
                          extra_s=pick.int(0, 1, "extra positions"), tail=pick.int(0, 2, "thd tail"))
        run_dpa_step(modules, params, sim, step_dict, packing, decoys=bool(pick.int(0, 1, "decoys")))


# --- MultiheadAttention: its layer's cache on first use, rotary at each token's position -------


class HiddenSim(Simulation):
    """Part 1's schedule over hidden states: each live sequence's whole input [m, hidden]."""

    def __init__(self, cfg: Config, seed: int, hidden: int) -> None:
        super().__init__(cfg, seed)
        self.hidden = hidden

    def apply(self, step_dict) -> None:
        self.left += [seq for seq in self.lengths if seq not in step_dict]
        for seq, n in step_dict.items():
            new = torch.randn(n, self.hidden, generator=self.gen, dtype=torch.float64)
            self.history[seq] = torch.cat([self.history[seq], new]) if seq in self.lengths else new
        self.lengths = OrderedDict((seq, self.lengths.get(seq, 0) + n) for seq, n in step_dict.items())


def mha_pair(cfg: Config, layer: int, qkv_format: str):
    """A MultiheadAttention over the cache and the same weights for full recomputation."""
    kwargs = dict(num_gqa_groups=cfg.hkv, attention_dropout=0.0, input_layernorm=True, layer_number=layer,
                  params_dtype=torch.float64, device="cpu")
    hidden = cfg.heads * cfg.d
    cached = MultiheadAttention(hidden, cfg.heads, attn_mask_type=cfg.mask, qkv_format=qkv_format, **kwargs)
    full = MultiheadAttention(hidden, cfg.heads, attn_mask_type="causal", qkv_format="bshd", **kwargs)
    full.load_state_dict(cached.state_dict())
    return cached, full


def pack_hidden(cfg: Config, step_dict, parts, packing: Packing) -> torch.Tensor:
    """Hidden states [..., hidden] in the step's format (NaN padding), via the [.., 1, hidden] packing."""
    return pack(cfg, step_dict, [p[:, None] for p in parts], packing).squeeze(-2)


@settings(max_examples=15, deadline=None)
@given(fmt=st.sampled_from(["bshd", "sbhd", "thd"]), paged=st.booleans(), hkv=st.integers(1, 2), group=st.integers(1, 2),
       data=st.data())
def test_mha_over_the_cache_matches_recomputation(fmt, paged, hkv, group, data):
    cfg = Config(fmt=fmt, paged=paged, page_size=2, max_seqlen=10, max_batch=3, total_pages=15 if paged else None, hkv=hkv,
                 group=group, d=4, dv=4, max_ctx=4, mask="padding_causal", window=None)
    pick = Picker(data=data)
    sim = HiddenSim(cfg, seed=pick.int(0, 2**16, "seed"), hidden=cfg.heads * cfg.d)
    params = cfg.params()
    pairs = {layer: mha_pair(cfg, layer, fmt) for layer in LAYERS}
    rope = torch.randn(cfg.max_seqlen, 1, 1, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    for _ in range(pick.int(1, 5, "steps")):
        step_dict = sim.draw_step(pick)
        params.pre_step(step_dict)
        sim.apply(step_dict)
        x = pack_hidden(cfg, step_dict, [sim.history[s][-n:] for s, n in step_dict.items()], Packing(0, 1, 1))
        for layer, (cached, full) in pairs.items():
            with torch.no_grad():
                out = cached(x, inference_params=params, rotary_pos_emb=rope)
                for i, ((seq, n), start) in enumerate(zip(step_dict.items(), starts(list(step_dict.values())))):
                    want = full(sim.history[seq][None], rotary_pos_emb=rope)[0, -n:]
                    got = out[start : start + n] if fmt == "thd" else (out[i, :n] if fmt == "bshd" else out[:n, i])
                    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert sorted(params.cache_manager.cache) == list(LAYERS)  # each layer made its cache on first use


def test_a_step_computes_its_token_positions_once(monkeypatch):
    """The rotary embeddings and every layer's append read the step's token positions, made
    once per step (and input shape); the next pre_step makes them again."""
    made = []
    real = params_module.token_positions
    monkeypatch.setattr(params_module, "token_positions", lambda *args: made.append(tuple(args[3])) or real(*args))
    cfg = Config(fmt="bshd", paged=True, page_size=2, max_seqlen=8, max_batch=2, total_pages=8, hkv=1, group=2, d=4, dv=4,
                 max_ctx=4, mask="padding_causal", window=None)
    params, sim = cfg.params(), HiddenSim(cfg, seed=0, hidden=cfg.heads * cfg.d)
    layers = [mha_pair(cfg, layer, "bshd")[0] for layer in LAYERS]
    rope = torch.randn(cfg.max_seqlen, 1, 1, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    for step_dict in (OrderedDict([(0, 3), (1, 2)]), OrderedDict([(0, 1), (1, 1)])):
        params.pre_step(step_dict)
        sim.apply(step_dict)
        x = pack_hidden(cfg, step_dict, [sim.history[s][-n:] for s, n in step_dict.items()], Packing(0, 0, 0))
        with torch.no_grad():
            for mha in layers:
                mha(x, inference_params=params, rotary_pos_emb=rope)
    assert made == [(2, 3), (2, 1)]


def test_mha_refuses_what_a_cache_cannot_serve():
    params = InferenceParams(2, 4, num_heads_kv=2, head_dim_k=4, dtype=torch.float64, device="cpu")
    cross = MultiheadAttention(8, 2, attention_type="cross", params_dtype=torch.float64, device="cpu", qkv_format="bshd")
    with pytest.raises(NotImplementedError, match=r"^inference_params with attention_type='cross' is not implemented"):
        cross(torch.zeros(1, 1, 8, dtype=torch.float64), encoder_output=torch.zeros(1, 1, 8, dtype=torch.float64),
              inference_params=params)
    mha = MultiheadAttention(8, 2, params_dtype=torch.float64, device="cpu", qkv_format="bshd")
    with pytest.raises(TypeError, match=r"^inference_params must be an InferenceParams; got dict"):
        mha(torch.zeros(1, 1, 8, dtype=torch.float64), inference_params={})


# --- repeated steps, host reads, errors -------------------------------------------------------


def _decode_setup(fmt="bshd", paged=True, **kw):
    cfg = Config(fmt=fmt, paged=paged, page_size=2, max_seqlen=8, max_batch=2, total_pages=8 if paged else None, hkv=1,
                 group=2, d=4, dv=4, max_ctx=4, mask="padding_causal", window=None)
    cfg = dataclasses.replace(cfg, **kw)
    params = cfg.params()
    for layer in LAYERS:
        params.allocate_memory(layer)
    return cfg, params, Simulation(cfg, seed=1)


def _step(cfg, params, sim, modules, step_dict, packing=Packing(0, 0, 0), guard=contextlib.nullcontext):
    params.pre_step(step_dict)
    sim.apply(step_dict)
    for layer in LAYERS:
        q, k, v = step_inputs(sim, step_dict, layer, packing)
        with torch.no_grad(), guard():
            out = modules[layer](q, k, v, inference_params=params)
        check_output(out.view(*out.shape[:-1], cfg.heads, cfg.dv), sim, layer, step_dict)


def test_a_repeated_step_neither_prepares_nor_selects_again(monkeypatch):
    cfg, params, sim = _decode_setup()
    modules = {layer: make_dpa(cfg, layer) for layer in LAYERS}
    _step(cfg, params, sim, modules, OrderedDict([(0, 3), (1, 2)]))
    counts = {"prepare": 0, "select": 0}
    real_prepare, real_require = dpa_module.prepare_kv_call, dpa_module.require_backend

    def count(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(dpa_module, "prepare_kv_call", count("prepare", real_prepare))
    monkeypatch.setattr(dpa_module, "require_backend", count("select", real_require))
    _step(cfg, params, sim, modules, OrderedDict([(0, 1), (1, 1)]))  # decode: a new shape, a new recipe per layer
    assert counts == {"prepare": 2, "select": 2}
    for _ in range(3):
        _step(cfg, params, sim, modules, OrderedDict([(0, 1), (1, 1)]))
    assert counts == {"prepare": 2, "select": 2}, "decode steps of one shape reuse the first one's recipe"
    assert all(len(m._recipes) == 2 for m in modules.values())


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("paged", [False, True])
def test_a_step_reads_no_tensor_values_on_the_host(fmt, paged):
    """First (full path) and repeated (recipe) steps alike; on CUDA these reads are syncs."""
    cfg, params, sim = _decode_setup(fmt, paged)
    modules = {layer: make_dpa(cfg, layer) for layer in LAYERS}
    for step_dict in (OrderedDict([(0, 3), (1, 2)]), OrderedDict([(1, 1), (0, 1)]), OrderedDict([(1, 1), (0, 1)])):
        _step(cfg, params, sim, modules, step_dict, Packing(0, 1, 1), guard=no_host_reads)


def _one_step_call(module=None, q_requires_grad=False, **call):
    cfg, params, sim = _decode_setup()
    params.pre_step(OrderedDict([(0, 2)]))
    sim.apply(OrderedDict([(0, 2)]))
    q, k, v = step_inputs(sim, OrderedDict([(0, 2)]), 1, Packing(0, 0, 0))
    module = module or make_dpa(cfg, 1)
    return params, lambda: module(q.requires_grad_(q_requires_grad), k, v, inference_params=params, **call)


class _TwoRanks(CPComm):
    """A CP group of two ranks with no transport (a KV call refuses it before communicating)."""

    def __init__(self) -> None:  # no process group behind it
        self.group, self.size, self.rank, self.backend, self.stream = None, 2, 0, "none", None


KV_CALL_ERRORS = [
    ("mask", dict(attn_mask_type="causal"), ValueError,
     r"attn_mask_type must be a padding kind with inference_params \(padding, padding_causal, padding_causal_bottom_right\); "
     r"got 'causal'"),
    ("attention_mask", dict(attention_mask=torch.zeros(1, 1, 1, 2, dtype=torch.bool)), NotImplementedError,
     r"attention_mask is not supported with inference_params \(KV caching\); accepted: None \(the cache's padding comes"),
    ("bias", dict(core_attention_bias_type="post_scale_bias", core_attention_bias=torch.zeros(1, 2, 2, 2, dtype=torch.float64)),
     NotImplementedError, r"core_attention_bias_type is not supported with inference_params"),
    ("alibi", dict(core_attention_bias_type="alibi"), NotImplementedError, r"core_attention_bias_type is not supported"),
    ("diagonal", dict(bottom_right_diagonal=False), NotImplementedError,
     r"bottom_right_diagonal is not supported with inference_params \(KV caching\); accepted: None or True"),
    ("fp8", dict(fp8=True), NotImplementedError,
     r"FP8 attention \(an FP8 autocast region with fp8_dpa=True\) is not supported with inference_params"),
    ("layer", dict(module=DotProductAttention(2, 4, num_gqa_groups=1, qkv_format="bshd", attn_mask_type="padding_causal")),
     ValueError, r"layer_number is None; KV caching keeps one cache per layer"),
    ("per-sequence masks", dict(attn_mask_type_per_seq={"padding": torch.zeros(1, dtype=torch.int64)}), NotImplementedError,
     r"attn_mask_type_per_seq / thd_sequence_is_causal is not supported with inference_params \(KV caching\); accepted: None$"),
    ("per-sequence causal", dict(thd_sequence_is_causal=torch.ones(1, dtype=torch.bool)), NotImplementedError,
     r"attn_mask_type_per_seq / thd_sequence_is_causal is not supported with inference_params \(KV caching\); accepted: None$"),
    ("context parallelism", dict(module=DotProductAttention(2, 4, num_gqa_groups=1, qkv_format="bshd", attn_mask_type="padding_causal",
                                                            layer_number=1, cp_group=_TwoRanks())), NotImplementedError,
     r"cp_group is not supported with inference_params \(KV caching\); accepted: no context parallelism \(or a group of one rank\)"),
]


@pytest.mark.parametrize("call,exc,message", [c[1:] for c in KV_CALL_ERRORS], ids=[c[0] for c in KV_CALL_ERRORS])
def test_bad_kv_calls_are_named_and_append_nothing(call, exc, message):
    fp8 = call.pop("fp8", False)
    params, run = _one_step_call(**call)
    before = params.cache_manager.cache[1][0].clone()
    with torch.no_grad(), env(NVTE_UnfusedDPA_Emulate_FP8="1") if fp8 else contextlib.nullcontext():
        region = te.autocast(recipe=DelayedScaling(fp8_dpa=True)) if fp8 else contextlib.nullcontext()
        with region, pytest.raises(exc, match=f"^{message}"):
            run()
    assert torch.equal(params.cache_manager.cache[1][0], before)


REFUSED = [
    ("gradients", {}, True, r"requires_grad=True with inference_params \(q/k/v need gradients in training mode\) "
                            r"\(supported: False: attention over a KV cache runs forward only"),
    ("sinks", dict(softmax_type="learnable"), False, r"softmax_type='learnable' with inference_params \(supported: 'vanilla'"),
    ("dropout", dict(attention_dropout=0.1), False, r"attention_dropout=0.1 with inference_params \(supported: 0.0, or eval mode"),
]


@pytest.mark.parametrize("module_kwargs,needs_grad,seen", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_what_no_backend_runs_over_a_cache_is_refused_by_reason(module_kwargs, needs_grad, seen):
    """Refused by selection (every backend's reasons), before the step's K/V reach the cache."""
    module = DotProductAttention(2, 4, num_gqa_groups=1, qkv_format="bshd", attn_mask_type="padding_causal", layer_number=1,
                                 **module_kwargs)
    params, run = _one_step_call(module=module, q_requires_grad=needs_grad)
    before = params.cache_manager.cache[1][0].clone()
    with torch.set_grad_enabled(needs_grad), pytest.raises(NoBackendError, match=seen):
        run()
    assert torch.equal(params.cache_manager.cache[1][0], before)


def test_eval_mode_runs_without_dropout():
    """attention_dropout set, eval mode: the steps run, each output the float64 oracle's (no dropout)."""
    cfg, params, sim = _decode_setup()
    modules = {layer: DotProductAttention(cfg.heads, cfg.d, num_gqa_groups=cfg.hkv, qkv_format="bshd",
                                          attn_mask_type="padding_causal", layer_number=layer, attention_dropout=0.1).eval()
               for layer in LAYERS}
    for step_dict in (OrderedDict([(0, 3), (1, 2)]), OrderedDict([(0, 1), (1, 1)])):
        _step(cfg, params, sim, modules, step_dict)


def test_grad_mode_alone_does_not_refuse():
    """Inputs that need no gradient run with grad mode on (as TE's inference loops do)."""
    params, run = _one_step_call()
    assert not run().requires_grad


def test_in_eval_mode_a_step_runs_as_inference_and_the_cache_keeps_no_graph():
    """Grad mode on and inputs that require grad (TE's generation loops call so), module in eval
    mode: the step runs without gradients; nothing of autograd reaches the cache."""
    cfg, params, sim = _decode_setup()
    module = make_dpa(cfg, 1).eval()
    step_dict = OrderedDict([(0, 3), (1, 2)])
    params.pre_step(step_dict)
    sim.apply(step_dict)
    q, k, v = (t.requires_grad_() for t in step_inputs(sim, step_dict, 1, Packing(0, 0, 0)))
    out = module(q, k, v, inference_params=params)
    assert not out.requires_grad
    assert all(c.grad_fn is None and not c.requires_grad for c in params.cache_manager.cache[1])
    check_output(out.detach().view(*out.shape[:-1], cfg.heads, cfg.dv), sim, 1, step_dict)


# --- the example --------------------------------------------------------------------------------


@pytest.mark.parametrize("paged", ["--paged", "--no-paged"])
def test_the_generation_example_matches_recomputation(paged, capsys):
    args = ["--layers", "2", "--hidden", "16", "--heads", "2", "--gqa", "1", "--vocab", "11", "--batch", "2",
            "--requests", "3", "--prompt", "4", "--new-tokens", "4", "--page-size", "2", "--device", "cpu"]
    assert load_example().main(args + ([paged] if paged == "--no-paged" else [])) == 0
    printed = capsys.readouterr().out
    assert "match:" in printed and "MISMATCH" not in printed and "backend: UnfusedDotProductAttention" in printed
    assert printed.count("request ") == 3
