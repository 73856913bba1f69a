"""Bound kernel calls (prepare/fast_path.py ``bound_call``, backends/kernel_autograd.py
``bind_kernel``): a fast-path THD call whose kernel half is already derived for its recipe's
key, its remembered sides, softmax_scale and num_splits runs ``launch(call, q, k, v)`` without
building its inputs record or plan again; and FA4's keyword dicts built once per problem.

Teeth: the layers of a model share one bound call (``run`` and ``bind`` counted), every bound
call matches the unfused backend forward and backward with NaN-filled buffers (rows no sequence
owns exactly 0), calls whose keys differ (mask type, grad mode, training) bind apart and a call
with gradients hangs off the module's autograd Function (the stand-in kernels write under
no_grad, as real ones do), declared qkv_layer / kv_layer packings bind, what the key does not
hold (softmax_scale, num_splits, the rows fact) makes a new binding, calls with a per-call
tensor or write never bind, unbound calls bound their sides once, dropout under a bound call
draws inside the RNG tracker's fork as the ordinary route does, and FA4's eager keyword dicts
equal the registered op's and keep none of a call's tensors."""

from __future__ import annotations

import contextlib

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention.backends import fa4
from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.declaration import FusedAttention
from transformer_engine.pytorch.attention.dot_product_attention.backends.fa4 import FlashAttentionV4
from transformer_engine.pytorch.attention.dot_product_attention.backends.kernel_problem import (
    KernelProblem, KernelRun, ScoreFeatures)
from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType, MaskSpec
from transformer_engine.pytorch.attention.dot_product_attention.prepare import metadata_cache

from .spies import ForkingTracker, spy_inputs, spy_zeroing_ops
from .stand_ins.cudnn import pack_of

H, HG, D = 4, 2, 8
BACKENDS = {"FlashAttention v4": FlashAttentionV4, "FusedAttention": FusedAttention}

pytestmark = pytest.mark.usefixtures("empty_metadata_cache")


def _cu(lengths, slots=None):
    out = [0]
    for n in (slots or lengths):
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _leaves(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, h, D, generator=g, dtype=torch.float64, requires_grad=True) for h in (H, HG, HG)]


def _train(dpa, backend, qkv, **kwargs):
    """(out, dq, dk, dv) of one call and its backward."""
    for t in qkv:
        t.grad = None
    with backend_scope(force=backend):
        out = dpa(*qkv, **kwargs)
    out.backward(torch.ones_like(out))
    return [out.detach()] + [t.grad.clone() for t in qkv]


def _counted(monkeypatch, backend):
    """(run's inputs list, bind count list) of ``backend``: each call of either is recorded."""
    runs = spy_inputs(monkeypatch, backend)
    binds = []
    real = backend.bind.__func__

    def bind(cls, inp, training):
        binds.append(inp)
        return real(cls, inp, training)

    monkeypatch.setattr(backend, "bind", classmethod(bind))
    return runs, binds


def _layer(**kwargs):
    return DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal", **kwargs)


def _reference(qkv, lengths, slots, **kwargs):
    """The unfused backend on the same call (its own module: no recipe or binding shared)."""
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    return _train(_layer(**kwargs), "UnfusedDotProductAttention", leaves, **_thd_kwargs(lengths, slots))


def _thd_kwargs(lengths, slots=None, cu=None, pad=None):
    cu = _cu(lengths) if cu is None else cu
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    if slots is not None:
        pad = _cu(lengths, slots) if pad is None else pad
        kwargs.update(cu_seqlens_q_padded=pad, cu_seqlens_kv_padded=pad)
    return kwargs


def _assert_matches(got, want, owned):
    for a, b in zip(got, want):
        torch.testing.assert_close(a[owned], b[owned], rtol=1e-6, atol=1e-6)
        assert torch.all(a[~owned] == 0)  # rows no sequence owns: exactly 0 (a NaN row fails too)


# batch: q/kv slots (None: back to back); lengths 5, 3, 4
BATCHES = {"filled": None, "empty gaps": [5, 3, 4], "gaps": [6, 4, 5]}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_layers_share_one_bound_call(as_on_cuda, fa4_lib, cudnn_lib, monkeypatch, backend, batch):
    """Three layers (equal settings, one module each) over one cu_seqlens, twice over: each
    layer's first call takes the full path (it makes the layer's recipe, through ``run``); the
    first fast-path call derives the binding through ``bind`` (the same derivation ``run``
    makes), and every fast-path call of every layer launches it (no ``run``, no second
    ``bind``). Each call matches the unfused backend and leaves rows no sequence owns at 0
    (NaN-filled buffers). The rows fact is known at once on the CPU (no copy in flight): with
    real gaps the zeroing runs inside every bound call; FA4 there needs its NaN guard's
    in-place write before each call, so its calls never bind (the refusal is remembered: one
    ``bind``)."""
    runs, binds = _counted(monkeypatch, BACKENDS[backend])
    zeroed = spy_zeroing_ops(monkeypatch)
    lengths, slots = [5, 3, 4], BATCHES[batch]
    rows = sum(slots or lengths)
    owned = torch.zeros(rows, dtype=torch.bool)
    for start, n in zip(_cu(lengths, slots).tolist(), lengths):
        owned[start:start + n] = True
    kwargs = _thd_kwargs(lengths, slots)
    layers = [_layer() for _ in range(3)]
    for step in range(2):
        for i, layer in enumerate(layers):
            qkv = _leaves(rows, seed=10 * step + i)
            got = _train(layer, backend, qkv, **kwargs)
            _assert_matches(got, _reference(qkv, lengths, slots), owned)
    unbound = batch == "gaps" and backend == "FlashAttention v4"
    assert len(runs) == (6 if unbound else len(layers)) and len(binds) == 1
    assert bool(zeroed) == (batch == "gaps")


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_copy_in_flight_binds_again_once_it_lands(as_on_cuda, fa4_lib, cudnn_lib, monkeypatch, backend):
    """A batch given padded offsets equal to its lengths (no row left unowned, but not known to
    be until the rows fact lands), with the fact's copy in flight and then landed: the binding
    is per value of the rows fact. While the copy is in flight, cuDNN binds a call that zeroes
    the unowned rows and FA4 binds none (its NaN guard writes q/k/v first: every call runs
    through ``run``); once the copy has landed both bind a call that zeroes nothing."""
    landed = []

    class Event:
        def query(self):
            return bool(landed)

    monkeypatch.setattr(metadata_cache, "copy_to_host", lambda values: (values.clone(), Event()))
    runs, binds = _counted(monkeypatch, BACKENDS[backend])
    zeroed = spy_zeroing_ops(monkeypatch)
    lengths = [5, 3, 4]
    kwargs = _thd_kwargs(lengths, lengths)
    layer = _layer()
    owned = torch.ones(12, dtype=torch.bool)
    for _ in range(3):
        qkv = _leaves(12, 0)
        _assert_matches(_train(layer, backend, qkv, **kwargs), _reference(qkv, lengths, lengths), owned)
    fa4 = backend == "FlashAttention v4"
    assert (len(runs), len(binds)) == ((3, 1) if fa4 else (1, 1)) and zeroed
    landed.append(True)
    zeroed.clear()
    for _ in range(2):
        qkv = _leaves(12, 1)
        _assert_matches(_train(layer, backend, qkv, **kwargs), _reference(qkv, lengths, lengths), owned)
    assert (len(runs), len(binds)) == ((3, 2) if fa4 else (1, 2)) and zeroed == []


def _differentiated_by_the_module(out) -> bool:
    """Whether ``out`` hangs off the module's autograd Function (the stand-in kernels write under
    no_grad, as real ones do: an output launched without the Function has no grad_fn)."""
    fn = out.grad_fn
    while fn is not None:
        if type(fn).__name__ == "_KernelAttentionBackward":
            return True
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return False


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("differ", ["mask type", "grad mode", "training"])
def test_keys_that_differ_share_no_binding(as_on_cuda, fa4_lib, cudnn_lib, monkeypatch, backend, differ):
    """Calls over one pair of remembered sides whose fast-path keys differ (another layer's mask
    type, grad mode, train/eval) bind apart: each matches the unfused backend for its own
    settings, a call with gradients hangs off the module's autograd Function, and an eval call
    runs without dropout."""
    runs, binds = _counted(monkeypatch, BACKENDS[backend])
    kwargs = _thd_kwargs([5, 3, 4])
    dropout = dict(attention_dropout=0.5) if differ == "training" and backend == "FusedAttention" else {}
    first = _layer(**dropout)
    second = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding") \
        if differ == "mask type" else first
    mode = torch.no_grad() if differ == "grad mode" else contextlib.nullcontext()
    with mode, backend_scope(force=backend):
        for _ in range(3):
            first(*_leaves(12, 0), **kwargs)
    if differ == "training":
        second.eval()
    cudnn_lib.runs.clear()
    mask = "padding" if differ == "mask type" else "padding_causal"
    for i in range(3):
        qkv = _leaves(12, i)
        with backend_scope(force=backend):
            out = second(*qkv, **kwargs)
        assert _differentiated_by_the_module(out)
        out.backward(torch.ones_like(out))
        got = [out.detach()] + [t.grad for t in qkv]
        want = _reference(qkv, [5, 3, 4], None) if mask == "padding_causal" else _train(
            DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type=mask), "UnfusedDotProductAttention",
            [t.detach().clone().requires_grad_() for t in qkv], **kwargs)
        _assert_matches(got, want, torch.ones(12, dtype=torch.bool))
    assert len(binds) == 2  # one binding per key
    if backend == "FusedAttention":
        assert all(node.dropout_p == 0.0 for node, _ in cudnn_lib.runs)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("packing", ["qkv", "kv"])
def test_declared_packings_bind(as_on_cuda, fa4_lib, cudnn_lib, monkeypatch, backend, packing):
    """qkv_layer / kv_layer calls bind too: the views are split on every call (one ``bind``, one
    ``run``), and every call matches the unfused backend on the same buffer."""
    runs, binds = _counted(monkeypatch, BACKENDS[backend])
    kwargs = _thd_kwargs([5, 3, 4])

    def call(layer, name, buf, q):
        buf.grad = None
        with backend_scope(force=name):
            out = layer(qkv_layer=buf, **kwargs) if packing == "qkv" else layer(q, kv_layer=buf, **kwargs)
        out.backward(torch.ones_like(out))
        return [out.detach(), buf.grad.clone()] + ([] if q is None else [q.grad.clone()])

    layer = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal")
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        buf = torch.randn(12, 3 if packing == "qkv" else 2, H, D, generator=g, dtype=torch.float64, requires_grad=True)
        q = None if packing == "qkv" else torch.randn(12, H, D, generator=g, dtype=torch.float64, requires_grad=True)
        got = call(layer, backend, buf, q)
        leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (buf, q)]
        want = call(DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal"), "UnfusedDotProductAttention",
                    *leaves)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)
    assert len(binds) == 1 and len(runs) == 1


def test_what_the_key_does_not_hold_binds_anew(as_on_cuda, fa4_lib, monkeypatch):
    """softmax_scale (a module attribute) and num_splits (a per-call hint) are in the binding's
    key: a changed scale gives the unfused backend's result at the new scale, a changed hint
    reaches FA4."""
    runs, binds = _counted(monkeypatch, FlashAttentionV4)
    lengths = [5, 3, 4]
    kwargs = _thd_kwargs(lengths)
    layer = _layer()
    qkv = _leaves(12, 3)
    _train(layer, "FlashAttention v4", qkv, **kwargs)
    _train(layer, "FlashAttention v4", qkv, **kwargs)
    layer.softmax_scale = 0.25
    got = _train(layer, "FlashAttention v4", qkv, **kwargs)
    _assert_matches(got, _reference(qkv, lengths, None, softmax_scale=0.25), torch.ones(12, dtype=torch.bool))
    fa4_lib.calls.clear()
    _train(layer, "FlashAttention v4", qkv, num_splits=3, **kwargs)
    assert [kw["num_splits"] for kw in fa4_lib.of("fwd")] == [3]
    assert len(binds) == 3 and len(runs) == 1


@pytest.mark.parametrize("case", ["learnable sink", "max logit", "policies", "checkpoint", "inference mode", "no cache"])
def test_calls_with_more_than_qkv_never_bind(as_on_cuda, fa4_lib, cudnn_lib, monkeypatch, case):
    """A per-call tensor (a sink, per-sequence policies), a second output (the max logit),
    checkpointing, or sides that are not remembered (inference mode, the cache switched off):
    every call runs through ``run``."""
    backend = "FusedAttention" if case == "max logit" else "FlashAttention v4"
    runs, binds = _counted(monkeypatch, BACKENDS[backend])
    settings = {"learnable sink": dict(softmax_type="learnable"), "max logit": dict(return_max_logit=True)}.get(case, {})
    kwargs = _thd_kwargs([5, 3, 4])
    if case == "policies":
        kwargs["thd_sequence_is_causal"] = torch.tensor([True, False, True])
    if case == "checkpoint":
        kwargs["checkpoint_core_attention"] = True
    if case == "no cache":
        monkeypatch.setenv("NVTE_ATTN_METADATA_CACHE", "0")
    layer = _layer(**settings)
    mode = torch.inference_mode() if case == "inference mode" else contextlib.nullcontext()
    with mode, backend_scope(force=backend):
        for _ in range(3):
            layer(*_leaves(12, 0), **kwargs)
    assert len(runs) == 3 and binds == []


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_an_unbound_call_bounds_its_sides_once(as_on_cuda, fa4_lib, cudnn_lib, monkeypatch, backend):
    """Sides that are not remembered (as in a CUDA graph capture; here the cache switched off)
    are bounded once per call: the sides the binding attempt made are the ones the ordinary
    route runs on (a capture would otherwise record the bounding launches twice)."""
    from transformer_engine.pytorch.attention.dot_product_attention.prepare import packed_seqs

    monkeypatch.setenv("NVTE_ATTN_METADATA_CACHE", "0")
    made = []
    real = packed_seqs._made_safe
    monkeypatch.setattr(packed_seqs, "_made_safe", lambda pq, pk: (made.append(1), real(pq, pk))[1])
    layer = _layer()
    kwargs = _thd_kwargs([5, 3, 4])
    with backend_scope(force=backend):
        layer(*_leaves(12, 0), **kwargs)  # the full path (makes the recipe)
        made.clear()
        for _ in range(3):
            layer(*_leaves(12, 0), **kwargs)
    assert len(made) == 3


def test_dropout_under_a_bound_call_draws_inside_the_fork(as_on_cuda, cudnn_lib, monkeypatch):
    """cuDNN with dropout: each call's Philox seed is drawn inside the tracker's fork, bound or
    not. Bound calls draw the same sequence of seeds as the ordinary route from the same tracker
    state, and leave the default generator alone."""

    def seeds(bind_on):
        if not bind_on:
            monkeypatch.setattr(FusedAttention, "bind", classmethod(lambda cls, inp, training: None))
        metadata_cache.clear()
        tracker = ForkingTracker(5)
        layer = _layer(attention_dropout=0.5, get_rng_state_tracker=lambda: tracker)
        cudnn_lib.runs.clear()
        before = torch.get_rng_state()
        kwargs = _thd_kwargs([5, 3, 4])
        with backend_scope(force="FusedAttention"):
            for _ in range(3):
                layer(*_leaves(12, 0), **kwargs)
        # The generator's state bytes, not floats: equal exactly when nothing drew from it.
        assert torch.equal(torch.get_rng_state(), before) and tracker.forks == 3
        return [pack_of(pack, "seed").item() for _, pack in cudnn_lib.of("fwd")]

    bound = seeds(True)
    assert len(set(bound)) == 3
    assert seeds(False) == bound


def test_fa4_eager_keywords_are_the_ops(fa4_lib):
    """FA4's eager route (keyword dicts built once per problem, ``problem.host``) passes the
    library what the registered ops' bodies pass (the route torch.compile traces), with a sink, a
    window, the split hint and two policies' runs, except the buffers: the eager route lets the
    library allocate the output, LSE and dQ/dK/dV on the first run (a buffer handed over is
    validated there) and hands those to the second run; both routes give the same results. The
    dicts are built once and keep none of a call's tensors."""
    t = 6
    q, k, v = (torch.randn(t, h, D, dtype=torch.float64) for h in (H, HG, HG))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    used_a, used_b = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    runs = (KernelRun(0, MaskSpec(AttnMaskType.parse("padding"), (2, 0)), cu, cu, used_a, used_a, 2),
            KernelRun(1, MaskSpec(AttnMaskType.parse("padding_causal"), (-1, 0)), cu, cu, used_b, used_b, 2))
    sink = torch.zeros(H)
    buffers = ("out", "lse", "dq", "dk", "dv")

    def passed(host):
        problem = KernelProblem(runs, 4, 4, 0.3, True, True, num_splits=2, host=host)
        fa4_lib.calls.clear()
        out, stats = fa4._FA4Kernel.forward(q, k, v, problem, ScoreFeatures(sink=sink), True)
        grads = fa4._FA4Kernel.backward(torch.ones_like(out), q, k, v, out, stats, problem,
                                        ScoreFeatures(sink=sink, need_dsink=True), False)
        keywords = [(d, {n: (id(x) if isinstance(x, torch.Tensor) and n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q",
                                                                              "seqused_k", "learnable_sink") else
                             (x.shape if isinstance(x, torch.Tensor) else x)) for n, x in kw.items() if n not in buffers})
                    for d, kw in fa4_lib.calls]
        return keywords, [out, stats[0], *grads[:3], grads[4]]

    host: dict = {}
    (eager, eager_results), (op, op_results) = passed(host), passed(None)
    assert eager == op and [d for d, _ in eager] == ["fwd", "fwd", "bwd", "bwd"]
    assert eager[0][1]["num_splits"] == 2 and eager[0][1]["window_size_left"] == 2
    for got, want in zip(eager_results, op_results):
        torch.testing.assert_close(got, want, equal_nan=True)  # row 5 is no run's: unwritten (NaN) in both
    # Eager: no buffer on the first run of each direction, the first run's on the second
    # (the stand-in records the keywords as passed; passed(host) ran first, so its calls are gone).
    _, (out, lse, dq, dk, dv, _) = passed(host)
    fwd, bwd = fa4_lib.of("fwd"), fa4_lib.of("bwd")
    assert fwd[0]["out"] is None and fwd[0]["lse"] is None and fwd[0]["return_lse"] is True
    assert fwd[1]["out"] is out and fwd[1]["lse"] is lse
    assert all(bwd[0][n] is None for n in ("dq", "dk", "dv"))
    assert bwd[1]["dq"] is dq and bwd[1]["dk"] is dk and bwd[1]["dv"] is dv
    made = {d: host[d] for d in ("fwd", "bwd")}
    passed(host)
    assert all(host[d] is made[d] for d in made)
    per_call = {"q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv", "learnable_sink", "return_lse", "deterministic"}
    assert all(not per_call & set(kw) for d in made for kw in made[d])


def test_fa4_eager_problem_without_runs_still_makes_its_buffers(fa4_lib):
    """A batch of no sequences under per-sequence policies plans no run: the eager route, whose
    buffers otherwise come from the library's first run, allocates them itself and calls nothing."""
    q, k, v = (torch.randn(3, h, D, dtype=torch.float64) for h in (H, HG, HG))
    cu = torch.zeros(1, dtype=torch.int32)
    problem = KernelProblem((), 0, 0, 0.3, True, True, (cu, cu), (cu, cu), host={})
    out, stats = fa4._FA4Kernel.forward(q, k, v, problem, ScoreFeatures(), True)
    assert out.shape == (3, H, D) and stats[0].shape == (H, 3) and not fa4_lib.calls
    dq, dk, dv, _, _ = fa4._FA4Kernel.backward(torch.ones_like(out), q, k, v, out, stats, problem, ScoreFeatures(), False)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert all(torch.all(t == 0) for t in (out, dq, dk, dv))  # every row unowned: zeroed

