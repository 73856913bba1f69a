"""The fast path (fast_path.py): a repeated call reuses the full path's decisions.

Its teeth: a call that hits the cache must give bit-identical outputs and gradients to a fresh
module running the full path on the same inputs; every host fact that changes a decision must
miss; per-call values outside the key are still checked; and THD selection must not read the
values the key leaves out (batch size, max_seqlen)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention.dot_product_attention.prepare import fast_path
from transformer_engine.pytorch.attention.dot_product_attention.selection.libraries import InstalledLibraries
from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType, MaskSpec
from transformer_engine.pytorch.attention.dot_product_attention.selection.params import AttentionParams
from transformer_engine.pytorch.attention.dot_product_attention.selection.backend_selection import NoBackendError, get_attention_backend

from .gpu_helpers import env
from .packing import make_thd
from .spies import spy_inputs

H, HG, D = 4, 2, 8


def _thd_batch(lengths, gaps=None, lengths_kv=None, tail=0, seed=0):
    return make_thd(lengths, lengths_kv=lengths_kv, gaps_q=gaps, gaps_kv=gaps if lengths_kv is not None else None, h=H,
                    hg=HG, d=D, tail=tail, seed=seed)


def _thd_call(p, gaps, shared, mask_kwargs, layers="separate"):
    """(args, kwargs, leaves) of one THD call."""
    kw = p.kwargs(gaps, int((p.cu_q[1:] - p.cu_q[:-1]).max()), int((p.cu_kv[1:] - p.cu_kv[:-1]).max()), shared=shared)
    kw.update(mask_kwargs)
    if layers == "separate":
        return (p.q, p.k, p.v), kw, [p.q, p.k, p.v]
    kv = torch.stack([p.k.detach(), p.v.detach()], dim=1).requires_grad_()  # [T, 2, HG, D]
    return (p.q,), dict(kw, kv_layer=kv), [p.q, kv]


def _outputs(dpa, args, kwargs, leaves):
    for t in leaves:
        t.grad = None
    out = dpa(*args, **kwargs)
    out.backward(torch.ones_like(out))
    return [out.detach()] + [t.grad.clone() for t in leaves]


# exact: the fast path must run the very ops of the full path on the same data (bit-identical)
def _assert_identical(got, want):
    for a, b in zip(got, want):
        assert torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))


# Two batches of the same token count with different sequence counts and lengths: the second
# call hits the first one's recipe (max_seqlen and the number of sequences are not in the key).
THD_CASES = {
    "plain, shared": dict(a=dict(lengths=[5, 3, 7, 4]), b=dict(lengths=[10, 9]), gaps=False, shared=True),
    "gaps, shared": dict(a=dict(lengths=[5, 3, 7, 4], gaps=[2, 0, 3, 1]), b=dict(lengths=[9, 8], gaps=[4, 4]), gaps=True,
                         shared=True),
    "cross, gaps": dict(a=dict(lengths=[5, 3], lengths_kv=[2, 9], gaps=[1, 2]), b=dict(lengths=[4, 4], lengths_kv=[6, 5], gaps=[1, 2]),
                        gaps=True, shared=False, mask=dict(attn_mask_type="padding_causal_bottom_right")),
    "window": dict(a=dict(lengths=[5, 3, 7, 4]), b=dict(lengths=[19]), gaps=False, shared=True, mask=dict(window_size=(2, 0))),
    "kv_layer": dict(a=dict(lengths=[5, 3, 7, 4]), b=dict(lengths=[1, 18]), gaps=False, shared=True, layers="kv_layer",
                     mask=dict(qkv_interleave_dim=-3)),
}


@pytest.mark.parametrize("name", list(THD_CASES))
def test_thd_hit_equals_full_path(name, full_paths):
    case = THD_CASES[name]
    mask = case.get("mask", {})
    layers = case.get("layers", "separate")
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal")
    _outputs(dpa, *_thd_call(_thd_batch(**case["a"]), case["gaps"], case["shared"], mask, layers))
    p = _thd_batch(**case["b"], seed=1)
    call = _thd_call(p, case["gaps"], case["shared"], mask, layers)
    got = _outputs(dpa, *call)
    assert len(full_paths) == 1, "the second call should reuse the first call's decisions"
    fresh = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal")
    _assert_identical(got, _outputs(fresh, *call))
    assert dpa.last_selection == fresh.last_selection


DENSE_CASES = [("bshd", "causal", None), ("sbhd", "no_mask", None), ("sbhd", "causal", -2), ("bshd", "no_mask", -3)]


@pytest.mark.parametrize("fmt,mask,packed", DENSE_CASES)
def test_dense_hit_equals_full_path(fmt, mask, packed, full_paths):
    g = torch.Generator().manual_seed(3)

    def call():
        if packed is None:
            leaves = [torch.randn(2, 6, h, D, generator=g, dtype=torch.float64).requires_grad_() for h in (H, HG, HG)]
            return tuple(leaves), {}, leaves
        shape = [2, 6, H, D]
        shape.insert(len(shape) + 1 + packed, 3)
        qkv = torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
        return (), dict(qkv_layer=qkv, qkv_interleave_dim=packed), [qkv]

    heads = H if packed is not None else HG
    dpa = DotProductAttention(H, D, num_gqa_groups=heads, qkv_format=fmt, attn_mask_type=mask)
    _outputs(dpa, *call())
    second = call()
    got = _outputs(dpa, *second)
    assert len(full_paths) == 1
    _assert_identical(got, _outputs(DotProductAttention(H, D, num_gqa_groups=heads, qkv_format=fmt, attn_mask_type=mask),
                                    *second))


def _captured_inputs(monkeypatch):
    """The AttentionInputs each call hands its backend (the unfused one, on the CPU)."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends.unfused import UnfusedDotProductAttention

    return spy_inputs(monkeypatch, UnfusedDotProductAttention)


def _same_record(a, b):
    """Field by field: tensors as the same view of the same memory; PackedSeqs by the tensors
    it uses (identity decides gaps and sharing) and its sizes."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert (x.data_ptr(), x.shape, x.stride(), x.dtype) == (y.data_ptr(), y.shape, y.stride(), y.dtype), f.name
        elif f.name in ("packed_q", "packed_kv") and x is not None:
            assert x.cu_seqlens is y.cu_seqlens and x.offsets is y.offsets, f.name
            assert (x.max_seqlen, x.total_tokens, x.bounded) == (y.max_seqlen, y.total_tokens, y.bounded), f.name
        elif f.name == "policies" and x is not None:
            # Each call builds its own tensor of policy indices: equal values, and equal host facts.
            assert (x.specs, x.maybe_nonempty, x.sizes) == (y.specs, y.maybe_nonempty, y.sizes)
            assert x.policy_of_seq.dtype == y.policy_of_seq.dtype and torch.equal(x.policy_of_seq, y.policy_of_seq)
        else:
            assert x == y, f.name


@pytest.mark.parametrize("fmt,softmax_type", [("thd", "vanilla"), ("thd", "off-by-one"), ("sbhd", "learnable")])
def test_a_hit_builds_the_record_prepare_builds(fmt, softmax_type, monkeypatch, full_paths):
    """The cached static half plus a call's own tensors is the record prepare() builds for
    that call, every field; and the record is immutable."""
    seen = _captured_inputs(monkeypatch)
    torch.manual_seed(5)
    if fmt == "thd":
        calls = [_thd_call(_thd_batch(**THD_CASES["gaps, shared"][k], seed=i), True, True, {})[:2] for i, k in enumerate("ab")]
    else:
        calls = [((*(torch.randn(6, 2, h, D, dtype=torch.float64) for h in (H, HG, HG)),), {}) for _ in range(2)]
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format=fmt, attn_mask_type="causal" if fmt != "thd" else "padding_causal",
                              softmax_type=softmax_type)
    for args, kw in calls:
        dpa(*args, **kw)
    assert len(full_paths) == 1
    dpa._recipes.clear()
    dpa(*calls[1][0], **calls[1][1])
    assert len(full_paths) == 2
    hit, prepared = seen[1], seen[2]
    _same_record(hit, prepared)
    with pytest.raises(dataclasses.FrozenInstanceError):
        hit.mask = None


def _base_call():
    p = _thd_batch([5, 3, 7, 4], gaps=[2, 0, 3, 1])
    return p, (p.q, p.k, p.v), p.kwargs(True, 7, 7, shared=True)


def _changed_calls():
    """(what changed, how to call) pairs; each must take the full path after the base call."""
    p, args, kw = _base_call()
    other_cu = p.cu_q.clone()  # equal values, another object: no longer "shared"
    q_strided = torch.randn(p.q.shape[0], 2 * H, D, dtype=torch.float64)[:, ::2].requires_grad_()
    return {
        "mask type": lambda dpa: dpa(*args, **kw, attn_mask_type="padding"),
        "window": lambda dpa: dpa(*args, **kw, window_size=(3, 0)),
        "separate cu_seqlens objects": lambda dpa: dpa(*args, **dict(kw, cu_seqlens_kv=other_cu)),
        "no padded offsets": lambda dpa: dpa(*args, **{k: v for k, v in kw.items() if "padded" not in k}),
        "pad_between_seqs given": lambda dpa: dpa(*args, **kw, pad_between_seqs=True),
        "grad mode": lambda dpa: _no_grad(dpa, args, kw),
        "strides": lambda dpa: dpa(q_strided, p.k, p.v, **kw),
        "dtype": lambda dpa: dpa(*(t.detach().float() for t in args), **kw),
        "eval mode": lambda dpa: dpa.eval()(*args, **kw),
        "module mask attribute": lambda dpa: _set(dpa, "attn_mask_type", AttnMaskType.PADDING)(*args, **kw),
        "selection switch": lambda dpa: _with_env(dpa, args, kw, NVTE_FLASH_ATTN="0"),
    }


def _no_grad(dpa, args, kw):
    with torch.no_grad():
        return dpa(*args, **kw)


def _set(dpa, name, value):
    setattr(dpa, name, value)
    return dpa


def _with_env(dpa, args, kw, **switches):
    with env(**switches):
        return dpa(*args, **kw)


@pytest.mark.parametrize("change", list(_changed_calls()))
def test_each_host_fact_in_the_key_misses(change, full_paths):
    _, args, kw = _base_call()
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal")
    dpa(*args, **kw)
    dpa(*args, **kw)
    assert len(full_paths) == 1
    _changed_calls()[change](dpa)
    assert len(full_paths) == 2, f"a changed {change} reused the old decisions"


def test_a_switch_that_removes_every_backend_raises_on_a_repeated_call():
    _, args, kw = _base_call()
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal")
    dpa(*args, **kw)
    with env(NVTE_UNFUSED_ATTN="0"), pytest.raises(NoBackendError):
        dpa(*args, **kw)


def _empty_cus():
    cu, padded = torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    return dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)


# Each change keeps which cu_seqlens objects are the same ones, so only the per-call check
# itself can catch it (a changed identity would miss the cache and be caught by the full path).
BAD_REPEATS = {
    "max_seqlen_q negative": (True, dict(max_seqlen_q=-1), TypeError, "max_seqlen for cu_seqlens_q"),
    "max_seqlen_kv a tensor": (True, dict(max_seqlen_kv=torch.tensor(7)), TypeError, "max_seqlen for cu_seqlens_kv"),
    "cu_seqlens_kv length": (False, dict(cu_seqlens_kv=torch.tensor([0, 5, 8], dtype=torch.int32)), ValueError,
                             "cu_seqlens_kv must have length batch_size"),
    "cu_seqlens empty": (True, "empty", ValueError, "cu_seqlens_q must be a 1-D int32 tensor"),
    "cu_seqlens_q a list": (False, dict(cu_seqlens_q=[0, 5, 8, 15, 19]), TypeError, "cu_seqlens_q must be a 1-D int32 tensor"),
    "cu_seqlens_q int64": (False, dict(cu_seqlens_q=torch.tensor([0, 5, 8, 15, 19], dtype=torch.int64)), ValueError, "int32"),
}


@pytest.mark.parametrize("bad", list(BAD_REPEATS))
def test_values_outside_the_key_are_still_checked(bad):
    shared, change, error, text = BAD_REPEATS[bad]
    p = _thd_batch([5, 3, 7, 4], gaps=[2, 0, 3, 1])
    args, kw = (p.q, p.k, p.v), p.kwargs(True, 7, 7, shared=shared)
    if not shared:
        kw["cu_seqlens_kv"] = kw["cu_seqlens_kv"].clone()  # four distinct objects
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal")
    dpa(*args, **kw)
    with pytest.raises(error, match=text):
        dpa(*args, **dict(kw, **(_empty_cus() if change == "empty" else change)))


def test_float_window_is_rejected_even_on_the_fast_path():
    """A call with (2, 0) fills the module's fast-path cache; (2.0, 0) equals it as a dict key
    but must still be rejected by name."""
    q = torch.randn(2, 5, H, D, dtype=torch.float64)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal")
    dpa(q, q, q, window_size=(2, 0))
    dpa(q, q, q, window_size=(2, 0))
    with pytest.raises(TypeError, match=r"window_size"):
        dpa(q, q, q, window_size=(2.0, 0))


def test_value_validation_and_pointer_detection_always_take_the_full_path(full_paths):
    _, args, kw = _base_call()
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal")
    with env(NVTE_ATTN_VALIDATE="1"):
        dpa(*args, **kw)
        dpa(*args, **kw)
    assert len(full_paths) == 2
    qkv = torch.randn(19, 3, H, D, dtype=torch.float64)
    p = _thd_batch([5, 3, 7, 4])
    mha = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal")
    with pytest.warns(DeprecationWarning):  # views of one buffer, found by pointers: never cached
        for _ in range(2):
            mha(*qkv.unbind(1), **p.kwargs(False, 7, 7, shared=True))
    assert len(full_paths) == 4


def test_the_cache_stays_bounded():
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal")
    _, args, kw = _base_call()
    for left in range(fast_path.MAX_RECIPES + 5):
        dpa(*args, **kw, window_size=(left, 0))
    assert 0 < len(dpa._recipes) <= fast_path.MAX_RECIPES


# ------------------------------------------------------------------ what the key leaves out

ALL_LIBS = InstalledLibraries(flash_attn_2="2.7.4", flash_attn_3="3.0.0", flash_attn_4="4.0.0b36", cudnn_frontend="1.32.0")


# Per-sequence policies take the fast path too, whose key holds their batch size but not
# max_seqlen: selection must not read max_seqlen with them either.
_POLICY_SETS = (None, (MaskSpec(AttnMaskType.PADDING, (-1, -1)), MaskSpec(AttnMaskType.PADDING_CAUSAL, (-1, 0))),
                (MaskSpec(AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT, (8, 0)), MaskSpec(AttnMaskType.PADDING, (4, 4))))


def _thd_params():
    masks = [m for m in AttnMaskType if m is not AttnMaskType.ARBITRARY and m.is_padding]
    for mask, window, dropout, bias, gaps, shared, cc, training, policies in itertools.product(
            masks, [(-1, -1), (8, 0), (4, 4)], [0.0, 0.1], ["no_bias", "alibi"], [False, True], [False, True],
            [(8, 0), (9, 0), (10, 0)], [False, True], _POLICY_SETS):
        if mask.is_causal and window[1] not in (-1, 0):
            continue
        window = (window[0], 0) if mask.is_causal else window
        yield AttentionParams(qkv_format="thd", qkv_layout="thd_thd_thd", attn_mask_type=mask, window_size=window,
                              attention_dropout=dropout, core_attention_bias_type=bias, pad_between_seqs=gaps,
                              shared_cu_seqlens=shared, compute_capability=cc, is_training=training,
                              per_seq_policies=policies)


def test_thd_selection_reads_neither_batch_size_nor_max_seqlen():
    """The key leaves these per-batch values out; this holds only while no backend's rules read
    them for THD beyond what the key carries: the two such facts, "max_seqlen_q == 1" (cuDNN
    refuses sinks there) and "max_seqlen_q == 1 < max_seqlen_kv" (cuDNN's decode-shaped
    backward rule), are in the key, so selection must be the same for every batch within each
    class they make. A rule that reads more must add it too. Sinks and a cuDNN that runs them
    (9.26) are included, so the sink rules are exercised."""
    libs = dataclasses.replace(ALL_LIBS, cudnn=92600)
    classes = (((3, 4096, 128), (1000, 128, 65536), (5, 2, 2)),  # more than one query row
               ((1, 1, 1), (9, 1, 1)),  # one query row and one key
               ((1, 1, 512), (7, 1, 2), (1000, 1, 65536)))  # decode-shaped
    for params in _thd_params():
        for softmax_type in ("vanilla", "off-by-one") if params.attention_dropout == 0 else ("vanilla",):
            for shapes in classes:
                want = None
                for b, sq, skv in shapes:
                    varied = dataclasses.replace(params, batch_size=b, max_seqlen_q=sq, max_seqlen_kv=skv,
                                                 softmax_type=softmax_type)
                    got = get_attention_backend(varied, libs)
                    want = got if want is None else want
                    assert got == want, varied


def test_decode_shape_is_part_of_the_thd_key():
    from transformer_engine.pytorch.attention.dot_product_attention.prepare.fast_path import _thd_facts

    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    cus = (cu, cu, None, None)
    assert _thd_facts(cus, (1, 512), None) != _thd_facts(cus, (4, 512), None)
    assert _thd_facts(cus, (4, 512), None) == _thd_facts(cus, (64, 8), None)
    # one query row: cuDNN's sink rule, whatever the keys
    assert _thd_facts(cus, (1, 1), None) != _thd_facts(cus, (4, 4), None)
    assert _thd_facts(cus, (1, 1), None) != _thd_facts(cus, (1, 512), None)


def test_eager_calls_between_compiled_ones_cause_no_recompile():
    """torch.compile traces the full path; eager calls that fill the recipe cache in between
    must not make the compiled step recompile (the fast path's dict is mutable module state)."""
    torch._dynamo.reset()
    p, args, kw = _base_call()
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding_causal")
    args = tuple(t.detach().nan_to_num() for t in args)
    compiled = torch.compile(lambda *a: dpa(*a, **kw), fullgraph=True)
    first = compiled(*args)
    dpa(*args, **kw)  # eager: fills the cache
    dpa(*args, **kw, window_size=(3, 0))  # and adds a second entry
    assert len(dpa._recipes) == 2
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = compiled(*args)
    # exact: the same compiled graph on the same data
    assert torch.equal(first, again)


def test_multihead_attention_repeats_take_the_fast_path(full_paths):
    """MultiheadAttention hands its fused projection through as qkv_layer: a second packed batch
    of the same token count (other lengths) reuses the first call's decisions and matches a
    fresh module."""
    from transformer_engine.pytorch import MultiheadAttention

    torch.manual_seed(4)
    mha = MultiheadAttention(H * D, H, attention_dropout=0.0, attn_mask_type="padding_causal", fuse_qkv_params=True,
                             params_dtype=torch.float64, device="cpu", qkv_format="thd")
    x = torch.randn(10, H * D, dtype=torch.float64)
    mha(x, cu_seqlens_q=(cu := torch.tensor([0, 3, 8, 10], dtype=torch.int32)), cu_seqlens_kv=cu, max_seqlen_q=5,
        max_seqlen_kv=5)
    cu2 = torch.tensor([0, 6, 10], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu2, cu_seqlens_kv=cu2, max_seqlen_q=6, max_seqlen_kv=6)
    got = mha(x, **kw)
    assert len(full_paths) == 1
    mha.core_attention._recipes.clear()
    # exact: the full path must run the fast path's ops on the same data
    assert torch.equal(got, mha(x, **kw)) and len(full_paths) == 2


# ------------------------------------------------------------------ per-sequence policies

POLICY_LENGTHS = ([5, 3, 7, 4, 2, 6], [1, 9, 4, 6, 5, 2])  # the same sequence count, other lengths


def _ids(*xs, dtype=torch.int64):
    return torch.tensor(xs, dtype=dtype)


# name -> (policy keyword arguments of the first call, of the second call: same key, new values)
POLICY_CASES = {
    "dict": (dict(attn_mask_type_per_seq={"padding_causal": _ids(0, 2, 4), "padding": _ids(1, 3, 5)}),
             dict(attn_mask_type_per_seq={"padding_causal": _ids(5, 1, 0), "padding": _ids(4, 2, 3)})),
    "dict, int32 ids, own windows": (
        dict(attn_mask_type_per_seq={("padding_causal", (2, 0)): _ids(0, 3, dtype=torch.int32),
                                     "padding_causal_bottom_right": _ids(1, dtype=torch.int32),
                                     ("padding", (1, 2)): _ids(2, 4, 5, dtype=torch.int32)}),
        dict(attn_mask_type_per_seq={("padding_causal", (2, 0)): _ids(5, 4, dtype=torch.int32),
                                     "padding_causal_bottom_right": _ids(0, dtype=torch.int32),
                                     ("padding", (1, 2)): _ids(1, 2, 3, dtype=torch.int32)})),
    "dict, one policy owns all": (dict(attn_mask_type_per_seq={"padding": _ids(), "padding_causal": _ids(*range(6))}),
                                  dict(attn_mask_type_per_seq={"padding": _ids(), "padding_causal": _ids(5, 4, 3, 2, 1, 0)})),
    "is_causal": (dict(thd_sequence_is_causal=torch.tensor([True, False, True, True, False, False])),
                  dict(thd_sequence_is_causal=torch.tensor([False, False, True, False, True, True]))),
}


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("name", list(POLICY_CASES))
def test_policy_hit_equals_full_path(name, gaps, full_paths):
    """A repeat with new lengths, new ids and new values reuses the recipe and gives what a
    fresh module's full path gives, bit for bit; so does the backend choice."""
    first, second = POLICY_CASES[name]
    gap_rows = [2, 0, 3, 1, 0, 2] if gaps else None
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding")
    _outputs(dpa, *_thd_call(_thd_batch(POLICY_LENGTHS[0], gaps=gap_rows), gaps, True, first))
    call = _thd_call(_thd_batch(POLICY_LENGTHS[1], gaps=gap_rows, seed=1), gaps, True, second)
    got = _outputs(dpa, *call)
    assert len(full_paths) == 1, "the second call should reuse the first call's decisions"
    fresh = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding")
    _assert_identical(got, _outputs(fresh, *call))
    assert dpa.last_selection == fresh.last_selection


@pytest.mark.parametrize("name", list(POLICY_CASES))
def test_a_policy_hit_builds_the_record_prepare_builds(name, monkeypatch, full_paths):
    seen = _captured_inputs(monkeypatch)
    calls = [_thd_call(_thd_batch(POLICY_LENGTHS[i], gaps=[2, 0, 3, 1, 0, 2], seed=i), True, True, POLICY_CASES[name][i])[:2]
             for i in range(2)]
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding")
    for args, kw in calls:
        dpa(*args, **kw)
    dpa._recipes.clear()
    dpa(*calls[1][0], **calls[1][1])
    assert len(full_paths) == 2
    _same_record(seen[1], seen[2])
    assert (seen[1].policies is None) == (name == "dict, one policy owns all")


def _policy_base():
    p = _thd_batch(POLICY_LENGTHS[0], gaps=[2, 0, 3, 1, 0, 2])
    return p, (p.q, p.k, p.v), p.kwargs(True, 7, 7, shared=True)


def _policy_changes():
    """(what changed, the policy keywords) pairs; each must miss a recipe made for the base
    ({"padding_causal": [0, 2, 4], "padding": [1, 3, 5]})."""
    return {
        "key order": dict(attn_mask_type_per_seq={"padding": _ids(1, 3, 5), "padding_causal": _ids(0, 2, 4)}),
        "key mask type": dict(attn_mask_type_per_seq={"padding_causal_bottom_right": _ids(0, 2, 4), "padding": _ids(1, 3, 5)}),
        "key window": dict(attn_mask_type_per_seq={("padding_causal", (2, 0)): _ids(0, 2, 4), "padding": _ids(1, 3, 5)}),
        "policy sizes": dict(attn_mask_type_per_seq={"padding_causal": _ids(0, 2), "padding": _ids(1, 3, 4, 5)}),
        "id dtype": dict(attn_mask_type_per_seq={"padding_causal": _ids(0, 2, 4, dtype=torch.int32), "padding": _ids(1, 3, 5)}),
        "a policy owns all": dict(attn_mask_type_per_seq={"padding_causal": _ids(*range(6)), "padding": _ids()}),
        "spelling": dict(thd_sequence_is_causal=torch.tensor([True, False, True, False, True, False])),
        "no policies": dict(),
    }


@pytest.mark.parametrize("change", list(_policy_changes()))
def test_each_policy_fact_in_the_key_misses(change, full_paths):
    _, args, kw = _policy_base()
    base = dict(attn_mask_type_per_seq={"padding_causal": _ids(0, 2, 4), "padding": _ids(1, 3, 5)})
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding")
    dpa(*args, **kw, **base)
    dpa(*args, **kw, **base)
    assert len(full_paths) == 1
    dpa(*args, **kw, **_policy_changes()[change])
    assert len(full_paths) == 2, f"a changed {change} reused the old decisions"


BAD_POLICY_REPEATS = {
    # Values outside the key: the CPU's value checks run on a hit too.
    "id out of range": (dict(attn_mask_type_per_seq={"padding_causal": _ids(0, 2, 6), "padding": _ids(1, 3, 5)}), ValueError,
                        r"ids must be sequence indices in \[0, 6\); got \[6\]"),
    "id repeated": (dict(attn_mask_type_per_seq={"padding_causal": _ids(0, 2, 4), "padding": _ids(1, 3, 3)}), ValueError,
                    r"ids \[3\] are repeated and \[5\] missing"),
    # Facts the key holds, so these miss and the full path names them.
    "count vs batch": (dict(attn_mask_type_per_seq={"padding_causal": _ids(0, 2, 4), "padding": _ids(1, 3, 5, 6)}), ValueError,
                       "place each of the 6 sequences in exactly one entry; its entries hold 7"),
    "window of floats": (dict(attn_mask_type_per_seq={("padding_causal", (2.0, 0)): _ids(0, 2, 4), "padding": _ids(1, 3, 5)}),
                         TypeError, "window of attn_mask_type_per_seq key 'padding_causal' must be None or a"),
    "ids not a tensor": (dict(attn_mask_type_per_seq={("padding_causal", (2, 0)): [0, 2, 4], "padding": _ids(1, 3, 5)}), TypeError,
                         "must be a 1-D integer tensor of sequence ids; got list"),
    "both spellings": (dict(attn_mask_type_per_seq={("padding_causal", (2, 0)): _ids(0, 2, 4), "padding": _ids(1, 3, 5)},
                            thd_sequence_is_causal=torch.ones(6, dtype=torch.bool)), ValueError, "not both"),
}


@pytest.mark.parametrize("bad", list(BAD_POLICY_REPEATS))
def test_policy_values_are_still_checked_on_a_repeat(bad):
    _, args, kw = _policy_base()
    change, error, text = BAD_POLICY_REPEATS[bad]
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding")
    good = {"padding_causal": _ids(0, 2, 4), "padding": _ids(1, 3, 5)}
    window_key = {("padding_causal", (2, 0)): _ids(0, 2, 4), "padding": _ids(1, 3, 5)}
    dpa(*args, **kw, attn_mask_type_per_seq=good)
    dpa(*args, **kw, attn_mask_type_per_seq=window_key)
    assert len(dpa._recipes) == 2
    with pytest.raises(error, match=text):
        dpa(*args, **kw, **change)


def test_policies_on_a_dense_format_never_reach_the_fast_path():
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask")
    q = torch.randn(2, 5, H, D)
    dpa(q, q, q)
    with pytest.raises(NotImplementedError, match="thd_sequence_is_causal needs qkv_format='thd'"):
        dpa(q, q, q, thd_sequence_is_causal=torch.ones(2, dtype=torch.bool))


@pytest.mark.parametrize("spelling", ["dict", "is_causal"])
def test_policy_counts_are_checked_against_a_new_batch_size(spelling):
    """The batch size is in a policy call's key: a batch of the same tokens cut into one more
    sequence, with the old ids, misses and the full path names the count."""
    dpa = DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="thd", attn_mask_type="padding")
    if spelling == "dict":
        policy = dict(attn_mask_type_per_seq={"padding_causal": _ids(0, 2, 4), "padding": _ids(1, 3, 5)})
        text = "place each of the 7 sequences in exactly one entry; its entries hold 6"
    else:
        policy = dict(thd_sequence_is_causal=torch.tensor([True, False] * 3))
        text = r"thd_sequence_is_causal must hold one value per sequence \(7\); got 6"
    _, args, kw = _policy_base()
    dpa(*args, **kw, **policy)
    p = _thd_batch([5, 3, 7, 4, 2, 3, 3], gaps=[2, 0, 3, 1, 0, 2, 0])  # 35 rows, as the base
    assert p.q.shape == args[0].shape
    with pytest.raises(ValueError, match=text):
        dpa(p.q, p.k, p.v, **p.kwargs(True, 7, 7, shared=True), **policy)


@pytest.mark.parametrize("policy", ["dict", "is_causal"])
def test_missing_cu_seqlens_q_with_policies_is_named(policy):
    """The key builder must hand such a call to the full path, which names the argument (it
    once read the batch size from the missing tensor: an AttributeError)."""
    q = torch.randn(8, H, D)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    kw = (dict(thd_sequence_is_causal=torch.tensor([True, False])) if policy == "is_causal"
          else dict(attn_mask_type_per_seq={"padding_causal": torch.tensor([0]), "padding": torch.tensor([1])}))
    dpa = DotProductAttention(H, D, qkv_format="thd")
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        dpa(q, q, q, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5, **kw)


def test_packed_sides_use_the_dataclass_init_under_compile(monkeypatch):
    """The per-call PackedSeqs skip the frozen dataclass's __init__ in eager calls (a dict fill
    that torch 2.11's dynamo cannot trace: compile fullgraph broke on the H200); while compiling
    they are built with it (torch 2.13's dynamo traces either, so the switch is checked directly),
    and a compiled call still sees the right fields."""
    from transformer_engine.pytorch.attention.dot_product_attention.prepare import packed_seqs

    built = []
    init = packed_seqs.PackedSeqs.__init__
    monkeypatch.setattr(packed_seqs.PackedSeqs, "__init__", lambda self, *a, **k: built.append(a) or init(self, *a, **k))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    eager = packed_seqs.packed_side(cu, cu, 5, 8, True)
    assert built == [] and eager.max_seqlen == 5 and eager.bounded
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    compiled = packed_seqs.packed_side(cu, cu, 5, 8, True)
    assert len(built) == 1 and compiled.offsets is cu and compiled.total_tokens == 8 and compiled.bounded
    monkeypatch.undo()
    side = torch.compile(lambda c: packed_seqs.packed_side(c, c, 5, 8, True).offsets + 1, fullgraph=True, backend="eager")(cu)
    assert torch.equal(side, cu + 1)
