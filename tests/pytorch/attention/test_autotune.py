"""The opt-in per-shape choice (selection/autotune.py, NVTE_ATTN_AUTOTUNE) on the CPU.

Timings are stand-ins (``autotune.measure`` replaced by a table per backend), so what is
checked is the choice, not a clock: the fastest ACCEPTING backend wins, a backend whose
declaration refuses the call never runs or is timed whatever its stand-in time (drawn by
hypothesis over configurations), deterministic mode keeps the fixed order, buckets round the
token, sequence and dense-length counts up to powers of two and keep every other fact apart, a
bucket is timed once (per process, or once across processes through the cache file), and the
report says how the backend was chosen. The module path runs on the float64 stand-in library
of test_kernel_interface with FA4 and cuDNN declared runnable on the CPU.
"""

from __future__ import annotations

import dataclasses
import json
import types
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention.backends import FlashAttentionV4, FusedAttention
from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType, normalize_window
from transformer_engine.pytorch.attention.dot_product_attention.selection import autotune, backend_selection
from transformer_engine.pytorch.attention.dot_product_attention.selection.backend_selection import get_attention_backend
from transformer_engine.pytorch.attention.dot_product_attention.selection.libraries import InstalledLibraries
from transformer_engine.pytorch.attention.dot_product_attention.selection.params import AttentionParams

from .packing import make_thd
from .spies import spy_inputs

ALL = InstalledLibraries(flash_attn_2="2.7.4", flash_attn_3="3.0.0", flash_attn_4="4.0.0b36", cudnn_frontend="1.32.0",
                         cudnn=92600)
THD = AttentionParams(qkv_format="thd", qkv_layout="thd_thd_thd", attn_mask_type=AttnMaskType.PADDING_CAUSAL,
                      window_size=(-1, 0), batch_size=110, max_seqlen_q=512, max_seqlen_kv=512, num_heads=16,
                      num_gqa_groups=16, head_dim_qk=64, head_dim_v=64)
FA4, CUDNN, FA3, FA2 = "FlashAttention v4", "FusedAttention", "FlashAttention v3", "FlashAttention v2"


@pytest.fixture
def timings(monkeypatch):
    """Autotune on, a fresh process cache, and stand-in timings: ``timings.ms[label]``; every
    backend timed is recorded in ``timings.asked``."""
    monkeypatch.setenv("NVTE_ATTN_AUTOTUNE", "1")
    monkeypatch.delenv("NVTE_ATTN_AUTOTUNE_CACHE", raising=False)
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    autotune.forget()
    table = types.SimpleNamespace(ms={FA4: 2.0, FA3: 3.0, CUDNN: 1.0, FA2: 4.0}, asked=[])

    def measure(backend, inp, training, how):
        label = backend_selection.backend_label(backend)
        table.asked.append(label)
        return table.ms[label]

    monkeypatch.setattr(autotune, "measure", measure)
    monkeypatch.setattr(autotune, "installed_libraries", lambda: ALL)  # TE's tuple of the winner, from the fakes
    yield table
    autotune.forget()


def _inp(rows=30000):
    """What tuned() reads of the prepared inputs: q's rows and device."""
    return types.SimpleNamespace(q=torch.empty(rows, 1, 1))


def _tuned(params, rows=30000):
    return autotune.tuned(get_attention_backend(params, ALL), params, _inp(rows), True)


# ------------------------------------------------------------------ the choice


def test_the_fastest_accepting_backend_runs_and_the_report_says_why(timings):
    fixed = get_attention_backend(THD, ALL)
    assert fixed.label == FA4 and "fixed preference order" in fixed.report()
    chosen = _tuned(THD)
    assert chosen.label == CUDNN and sorted(timings.asked) == sorted([FA4, FA3, CUDNN, FA2])
    assert f"selected: FusedAttention (chosen by autotune (eager timing): {CUDNN} 1.000 ms vs {FA4} 2.000 ms" in chosen.report()
    assert chosen.reasons == fixed.reasons  # why the others were not chosen stays as selection said


def test_a_refusing_backend_is_never_timed_or_chosen_even_when_fastest(timings):
    # Dropout: FA4 and FA3 refuse it; cuDNN and flash-attn 2 run it.
    params = replace(THD, attention_dropout=0.1)
    timings.ms.update({FA4: 0.01, FA3: 0.02, CUDNN: 3.0, FA2: 2.0})
    chosen = _tuned(params)
    assert chosen.label == FA2 and sorted(timings.asked) == [FA2, CUDNN]
    use_flash, flash_version, use_fused = tuple(chosen)[:3]  # TE's tuple names the library that runs
    assert use_flash and not use_fused and str(flash_version) == ALL.flash_attn_2


def test_a_stored_choice_is_filtered_by_the_next_calls_reasons(timings):
    """A bucket's recorded winner (cuDNN) that a later call's scope refuses is never run: the
    fastest of what that call accepts, from the same measurements, runs (nothing re-timed)."""
    assert _tuned(THD).label == CUDNN
    asked = list(timings.asked)
    with backend_scope(allow=[FA4, FA2]):
        assert _tuned(THD).label == FA4 and timings.asked == asked


MASKS = [m for m in AttnMaskType if m is not AttnMaskType.ARBITRARY]


# Weighted toward what most backends run (repeated entries), so that most drawn calls have
# several candidates and a rule refusing one of them decides the outcome.
@settings(max_examples=150, deadline=None)
@given(mask=st.sampled_from(MASKS), left=st.sampled_from([-1, -1, 0, 8]), dropout=st.sampled_from([0.0, 0.0, 0.0, 0.1]),
       fmt=st.sampled_from(["thd", "thd", "bshd", "sbhd"]), gaps=st.booleans(), shared=st.sampled_from([True, True, False]),
       dims=st.sampled_from([(64, 64), (128, 128), (128, 128), (192, 128), (256, 256)]), grad=st.booleans(),
       softmax=st.sampled_from(["vanilla"] * 4 + ["off-by-one", "learnable"]),
       cc=st.sampled_from([(8, 0), (9, 0), (9, 0), (9, 0), (10, 0)]),
       bias=st.sampled_from(["no_bias"] * 4 + ["post_scale_bias", "alibi"]), sq=st.sampled_from([1, 64, 512, 512]),
       ms=st.lists(st.floats(0.01, 10.0), min_size=4, max_size=4))
def test_the_choice_is_always_an_accepting_backend(mask, left, dropout, fmt, gaps, shared, dims, grad, softmax, cc, bias,
                                                   sq, ms):
    """Over configurations and timings: the backend that runs accepts the call (no reason in
    selection's own report), and it is the fastest of those that accept it."""
    window = normalize_window(None if left < 0 else (left, 0 if mask.is_causal else left), mask)
    params = replace(THD, attn_mask_type=mask, window_size=window, attention_dropout=dropout, qkv_format=fmt,
                     qkv_layout="_".join([fmt] * 3), pad_between_seqs=gaps and fmt == "thd", shared_cu_seqlens=shared,
                     head_dim_qk=dims[0], head_dim_v=dims[1], requires_grad=grad, softmax_type=softmax, compute_capability=cc,
                     core_attention_bias_type=bias, max_seqlen_q=sq, has_padding_mask=mask.is_padding and fmt != "thd")
    table = dict(zip((FA4, FA3, CUDNN, FA2), ms))
    asked = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NVTE_ATTN_AUTOTUNE", "1")
        mp.setattr(autotune, "measure", lambda b, inp, training, how: asked.append(b) or table[backend_selection.backend_label(b)])
        autotune.forget()
        fixed = get_attention_backend(params, ALL)
        if fixed.backend is None:
            return
        chosen = autotune.tuned(fixed, params, _inp(), grad)
    accepting = [label for label, reasons in fixed.reasons if not reasons and label != "UnfusedDotProductAttention"]
    assert dict(chosen.reasons)[chosen.label] == (), f"{chosen.label} refuses this call:\n{chosen.report()}"
    assert all(dict(fixed.reasons)[backend_selection.backend_label(b)] == () for b in asked), "timed a refusing backend"
    if len(accepting) >= 2:
        assert chosen.label == min(accepting, key=table.__getitem__)
    else:
        assert chosen is fixed and not asked


# ------------------------------------------------------------------ when it is not consulted


def test_deterministic_mode_keeps_the_fixed_choice(timings, monkeypatch):
    _tuned(THD)  # records cuDNN for this bucket
    timings.asked.clear()
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert _tuned(THD).label == FA4
    finally:
        torch.use_deterministic_algorithms(was)
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # TE's deterministic switch
    assert _tuned(THD).label == FA4 and timings.asked == []
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")
    assert _tuned(THD).label == CUDNN and timings.asked == []  # the recorded choice again, not retimed


def test_off_forced_or_a_single_candidate_is_left_alone(timings, monkeypatch):
    monkeypatch.setenv("NVTE_ATTN_AUTOTUNE", "0")
    assert _tuned(THD).label == FA4
    monkeypatch.setenv("NVTE_ATTN_AUTOTUNE", "1")
    forced = dataclasses.replace(get_attention_backend(THD, ALL), forced=True)
    assert autotune.tuned(forced, THD, _inp(), True) is forced
    only_cudnn = replace(THD, qkv_format="bshd", qkv_layout="bshd_bshd_bshd", attn_mask_type=AttnMaskType.CAUSAL,
                         core_attention_bias_type="post_scale_bias", core_attention_bias_shape="1hss")
    assert _tuned(only_cudnn).label == CUDNN and timings.asked == []


def test_a_bad_mode_is_named(monkeypatch):
    monkeypatch.setenv("NVTE_ATTN_AUTOTUNE", "fast")
    with pytest.raises(ValueError, match="NVTE_ATTN_AUTOTUNE must be 0, 1, eager or gpu; got 'fast'"):
        autotune.mode()


# ------------------------------------------------------------------ buckets and the cache


def test_buckets_round_token_sequence_and_dense_counts_to_powers_of_two():
    cpu = torch.device("cpu")
    key = lambda params, rows=30000: json.loads(autotune.bucket(params, rows, cpu))  # noqa: E731
    base = key(THD)
    assert base["rows"] == 32768 and base["batch_size"] == 128 and base["max_seqlen_q"] is None  # THD max_seqlen left out
    assert key(THD, 16385) == base and key(THD, 32768) == base and key(THD, 32769) != base
    assert key(replace(THD, batch_size=65)) == base and key(replace(THD, batch_size=129)) != base
    assert key(replace(THD, max_seqlen_q=7, max_seqlen_kv=4096)) == base
    dense = replace(THD, qkv_format="bshd", qkv_layout="bshd_bshd_bshd", max_seqlen_q=1000, max_seqlen_kv=1000)
    assert key(dense)["max_seqlen_q"] == 1024 and key(replace(dense, max_seqlen_q=1024)) == key(dense)
    assert key(replace(dense, max_seqlen_q=1025)) != key(dense)
    for change in (dict(qkv_dtype=torch.float16), dict(head_dim_qk=128, head_dim_v=128), dict(num_heads=32),
                   dict(num_gqa_groups=2), dict(attn_mask_type=AttnMaskType.PADDING, window_size=(-1, -1)),
                   dict(qkv_format="bshd", qkv_layout="bshd_bshd_bshd"), dict(requires_grad=False), dict(is_training=False),
                   dict(pad_between_seqs=True), dict(softmax_type="learnable"), dict(compute_capability=(10, 0))):
        assert key(replace(THD, **change)) != base, change


def test_a_bucket_is_timed_once_and_its_choice_reused(timings, monkeypatch):
    assert _tuned(THD, rows=20000).label == CUDNN and len(timings.asked) == 4
    assert _tuned(replace(THD, batch_size=100), rows=30000).label == CUDNN and len(timings.asked) == 4  # same bucket
    _tuned(THD, rows=40000)
    assert len(timings.asked) == 8  # the next token bucket is timed on its own
    monkeypatch.setenv("NVTE_ATTN_AUTOTUNE", "gpu")
    _tuned(THD, rows=20000)
    assert len(timings.asked) == 12  # another timing mode: its own choice


def test_the_cache_file_carries_choices_to_another_process(timings, monkeypatch, tmp_path):
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("NVTE_ATTN_AUTOTUNE_CACHE", str(path))
    assert _tuned(THD).label == CUDNN
    data = json.loads(path.read_text())
    assert data["format"] == 1 and len(data["choices"]) == 1 and data["choices"][0]["ms"][CUDNN] == 1.0
    autotune.forget()  # as a new process: nothing recorded but the file
    timings.asked.clear()
    timings.ms[FA4] = 0.5  # would win if timed again
    assert _tuned(THD).label == CUDNN and timings.asked == []
    path.write_text("not json")
    autotune.forget()
    with pytest.raises(ValueError, match="NVTE_ATTN_AUTOTUNE_CACHE=.* is not a readable autotune cache"):
        _tuned(THD)


def test_the_fast_path_key_carries_the_sequence_bucket_only_while_on(monkeypatch):
    cu = torch.zeros(111, dtype=torch.int32)
    monkeypatch.delenv("NVTE_ATTN_AUTOTUNE", raising=False)
    assert autotune.key_part(cu) is None
    monkeypatch.setenv("NVTE_ATTN_AUTOTUNE", "1")
    assert autotune.key_part(cu) == ("eager", 128, False) and autotune.key_part(None) == ("eager", None, False)
    monkeypatch.setenv("NVTE_ATTN_AUTOTUNE", "gpu")  # a switch of timing mode misses the recipes of the other
    assert autotune.key_part(cu) == ("gpu", 128, False)


# ------------------------------------------------------------------ the module path


class _Ran:
    """What the FA4 and cuDNN stand-ins (``stand_ins/``) ran, by library and direction:
    ``fa4_fwd``, ``cudnn_bwd``..., FA4's first."""

    def __init__(self, fa4_lib, cudnn_lib) -> None:
        self._fa4, self._cudnn = fa4_lib, cudnn_lib

    @property
    def calls(self) -> list:
        return [f"fa4_{kind}" for kind, _ in self._fa4.calls] + [f"cudnn_{node.direction}" for node, _ in self._cudnn.runs]

    def clear(self) -> None:
        self._fa4.calls.clear()
        self._cudnn.runs.clear()


@pytest.fixture
def runnable_on_cpu(monkeypatch, fa4_lib, cudnn_lib):
    """FA4 and cuDNN declared runnable on the CPU (their stand-in libraries run), and
    deterministic mode off (the stand-in fixtures turn it on; it would keep autotune away)."""
    for backend in (FlashAttentionV4, FusedAttention):
        monkeypatch.setattr(backend, "SUPPORTED_DEVICES", frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(backend_selection, "installed_libraries", lambda: ALL)
    backend_selection._select.cache_clear()
    torch.use_deterministic_algorithms(False)
    yield _Ran(fa4_lib, cudnn_lib)
    backend_selection._select.cache_clear()


def _module_call(lengths_kv=None, **kwargs):
    p = make_thd([5, 3, 6], lengths_kv=lengths_kv, h=4, hg=2, d=8, dtype=torch.bfloat16)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal", **kwargs)
    return dpa, (p.q, p.k, p.v), p.kwargs(False, 6, 6 if lengths_kv is None else max(lengths_kv), shared=lengths_kv is None)


def test_the_module_runs_the_measured_backend_and_keeps_it(runnable_on_cpu, timings):
    dpa, qkv, kwargs = _module_call()
    for _ in range(2):
        dpa(*qkv, **kwargs).float().sum().backward()
    assert dpa.last_selection.label == CUDNN and "chosen by autotune" in dpa.last_selection.report()
    assert runnable_on_cpu.calls == ["cudnn_fwd", "cudnn_bwd"] * 2
    assert sorted(timings.asked) == sorted([FA4, CUDNN])  # timed on the first call only (fast path after)


def test_the_module_never_runs_a_refusing_backend(runnable_on_cpu, timings):
    # Top-left causal cross attention: FA4 aligns causal masks bottom-right only and refuses it.
    timings.ms.update({FA4: 0.01, CUDNN: 5.0})
    dpa, qkv, kwargs = _module_call(lengths_kv=[7, 2, 6])
    dpa(*qkv, **kwargs)
    assert dpa.last_selection.label == CUDNN and timings.asked == []  # one candidate: nothing to time
    assert set(runnable_on_cpu.calls) == {"cudnn_fwd"}


def _inputs_cudnn_gets(dpa, qkv, kwargs):
    """The prepared inputs of one ``dpa`` call forced onto cuDNN (its stand-in runs)."""
    with pytest.MonkeyPatch.context() as mp, backend_scope(force=FusedAttention):
        seen = spy_inputs(mp, FusedAttention)
        dpa(*qkv, **kwargs)
    return seen[-1]


def test_measure_times_detached_views_and_restores_the_rng(runnable_on_cpu):
    """The real measure() on the CPU: forward and backward of the candidate on views of the
    call's tensors; the caller's tensors get no gradient and the RNG state is unchanged."""
    dpa, qkv, kwargs = _module_call()
    inp = _inputs_cudnn_gets(dpa, qkv, kwargs)
    state = torch.get_rng_state()
    runnable_on_cpu.clear()
    ms = autotune.measure(FusedAttention, inp, True, "eager")
    assert ms > 0 and torch.equal(torch.get_rng_state(), state)
    assert all(t.grad is None for t in qkv)
    assert runnable_on_cpu.calls == ["cudnn_fwd", "cudnn_bwd"] * (1 + autotune.REPEATS)


def test_measure_times_the_backward_a_learnable_sink_alone_asks_for(runnable_on_cpu):
    """Selection counts the sink's requires_grad as wanting gradients; so does the timing: with
    q/k/v frozen and the learnable softmax_offset trainable, each timed step runs a backward,
    and the module's parameter gets no gradient from it."""
    dpa, qkv, kwargs = _module_call(softmax_type="learnable")
    frozen = [t.detach() for t in qkv]
    inp = _inputs_cudnn_gets(dpa, frozen, kwargs)
    assert inp.softmax_offset is dpa.softmax_offset and dpa.softmax_offset.requires_grad
    runnable_on_cpu.clear()
    autotune.measure(FusedAttention, inp, True, "eager")
    assert runnable_on_cpu.calls == ["cudnn_fwd", "cudnn_bwd"] * (1 + autotune.REPEATS)
    assert dpa.softmax_offset.grad is None


def test_the_cli_says_when_autotune_chooses(monkeypatch, capsys):
    """te-attention-backend: with NVTE_ATTN_AUTOTUNE on it names the candidates a call is timed
    among (the report above stays the fixed order); off, no such line."""
    from transformer_engine.pytorch.attention.dot_product_attention.selection.explain import main as explain_main

    monkeypatch.setenv("NVTE_ATTN_AUTOTUNE", "gpu")
    assert explain_main(["--assume-all-libraries", "--format", "thd", "--mask", "padding_causal"]) == 0
    out = capsys.readouterr().out
    assert f"NVTE_ATTN_AUTOTUNE=gpu: a call runs the fastest of ['{FA4}'" in out and f"'{CUDNN}'" in out
    monkeypatch.delenv("NVTE_ATTN_AUTOTUNE")
    assert explain_main(["--assume-all-libraries", "--format", "thd", "--mask", "padding_causal"]) == 0
    assert "NVTE_ATTN_AUTOTUNE" not in capsys.readouterr().out


def test_fp8_calls_are_not_timed(timings):
    """Timing an FP8 call would step its amax state; the fixed choice runs. (The selection is a
    high-precision call's, with two candidates, so only the FP8 rule keeps them untimed.)"""
    inp = types.SimpleNamespace(q=torch.empty(30000, 1, 1), fp8=object())
    selection = get_attention_backend(THD, ALL)
    assert autotune.tuned(selection, dataclasses.replace(THD, fp8=True), inp, True) is selection and timings.asked == []


@pytest.mark.parametrize("call", [["--fp8"], ["--kv-cache", "paged"]])
def test_the_cli_says_nothing_of_autotune_where_it_does_not_choose(monkeypatch, capsys, call):
    """FP8 calls and KV-cache steps are never timed: no autotune line for them."""
    from transformer_engine.pytorch.attention.dot_product_attention.selection.explain import main as explain_main

    monkeypatch.setenv("NVTE_ATTN_AUTOTUNE", "1")
    explain_main(["--assume-all-libraries", "--format", "thd", "--mask", "padding_causal"] + call)
    assert "NVTE_ATTN_AUTOTUNE" not in capsys.readouterr().out
