"""The selection seam: ``backend_scope(allow=..., force=...)`` restricts or forces backends for a
``with`` block, restores the previous scope on exit (exceptions included), is per thread, and
is part of the selection and fast-path keys. Also: the GPU test helper fails when the backend it
was asked for is not the one that ran, and the old module paths forward assignments."""

from __future__ import annotations

import sys
import threading
from dataclasses import replace

import pytest
import torch

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backend_scope
from transformer_engine.pytorch.attention.dot_product_attention import AttentionParams, get_attention_backend
from transformer_engine.pytorch.attention.dot_product_attention.environment import BackendScope, current_scope
from transformer_engine.pytorch.attention.dot_product_attention.selection.libraries import InstalledLibraries
from transformer_engine.pytorch.attention.dot_product_attention.masks import AttnMaskType as M
from transformer_engine.pytorch.attention.dot_product_attention.selection.backend_selection import NoBackendError, require_backend

from .gpu_helpers import run_on

ALL = InstalledLibraries(flash_attn_2="2.7.4", flash_attn_3=None, flash_attn_4="4.0.0b36", cudnn_frontend="1.32.0")
H200_THD = AttentionParams(qkv_format="thd", attn_mask_type=M.PADDING_CAUSAL, window_size=(-1, 0), head_dim_qk=128,
                           head_dim_v=128)


def _qkv():
    return [torch.randn(2, 5, 2, 8) for _ in range(3)]


def test_allow_restricts_the_candidates_and_names_itself_in_the_reasons():
    assert get_attention_backend(H200_THD, ALL).label == "FlashAttention v4"
    with backend_scope(allow=["cudnn", "unfused"]):
        selection = get_attention_backend(H200_THD, ALL)
    assert selection.label == "FusedAttention"
    assert [str(r) for r in selection.reasons_for("FlashAttention v4")] == [
        "backend_scope=allow=['FusedAttention', 'UnfusedDotProductAttention'] "
        "(supported: an allow list containing 'FlashAttention v4')"]
    assert get_attention_backend(H200_THD, ALL).label == "FlashAttention v4"  # restored


def test_allow_with_nothing_fitting_raises_with_every_reason():
    params = replace(H200_THD, device_type="cpu", compute_capability=None)
    with backend_scope(allow=["fa4"]), pytest.raises(NoBackendError) as err:
        require_backend(params)
    text = str(err.value)
    assert "FlashAttention v4: " in text and "device=cpu (supported: cuda)" in text
    assert "UnfusedDotProductAttention: backend_scope=allow=['FlashAttention v4']" in text


def test_force_runs_the_named_backend_without_its_declaration():
    params = replace(H200_THD, device_type="cpu", compute_capability=None)
    with backend_scope(force="fa3"):
        selection = get_attention_backend(params, ALL)
    assert selection.label == "FlashAttention v3"
    # What it would have refused is still reported, and the others say why they did not run.
    assert "device=cpu (supported: cuda)" in "; ".join(map(str, selection.reasons_for("FlashAttention v3")))
    assert [r.field for r in selection.reasons_for("UnfusedDotProductAttention")] == ["backend_scope"]


def test_scopes_nest_and_restore_on_exit_and_on_error():
    assert current_scope() is None
    with backend_scope(force="unfused") as outer:
        assert current_scope() == outer == BackendScope(None, "UnfusedDotProductAttention")
        with pytest.raises(RuntimeError), backend_scope(allow=["cudnn"]):
            assert current_scope() == BackendScope(frozenset({"FusedAttention"}), None)
            raise RuntimeError("leave the block")
        assert current_scope() == outer
    assert current_scope() is None


def test_scope_is_per_thread():
    seen = []
    entered, release = threading.Event(), threading.Event()

    def other():
        entered.wait()
        seen.append(current_scope())
        release.set()

    worker = threading.Thread(target=other)
    worker.start()
    with backend_scope(allow=["fa4"]):
        entered.set()
        release.wait()
    worker.join()
    assert seen == [None]


@pytest.mark.parametrize("kwargs,message", [
    (dict(allow=["fa5"]), "allow names an unknown backend: got 'fa5'; accepted: a backend class, ['FlashAttention v2'"),
    (dict(force=3), "force names an unknown backend: got 3; accepted"),
    (dict(force=int), "force names an unknown backend: got <class 'int'>"),
])
def test_unknown_names_are_rejected_with_what_is_accepted(kwargs, message):
    with pytest.raises(ValueError) as err:
        backend_scope(**kwargs)
    assert message in str(err.value)


def test_the_fast_path_sees_the_scope():
    """Same module, same host facts: entering a scope must change the selection at once."""
    dpa = DotProductAttention(2, 8)
    q, k, v = _qkv()
    dpa(q, k, v)
    dpa(q, k, v)  # a fast-path hit
    assert dpa.last_selection.label == "UnfusedDotProductAttention"
    with backend_scope(allow=["cudnn"]), pytest.raises(NoBackendError, match="FusedAttention: .*device=cpu"):
        dpa(q, k, v)
    dpa(q, k, v)
    assert dpa.last_selection.label == "UnfusedDotProductAttention"


# ------------------------------------------------------- a forced backend without its library

MISSING = [  # (force, the module blocked, what the message must say)
    ("fa4", "flash_attn.cute.interface", "backend_scope(force='FlashAttention v4') ran FlashAttention v4, which needs "
     "flash-attn-4; it is not installed (import of 'flash_attn.cute.interface' failed). Install it (pip install -e "
     "\".[fa4]\" in this repository, or pip install flash-attn-4==4.0.0b36)"),
    ("cudnn", "cudnn", "backend_scope(force='FusedAttention') ran FusedAttention, which needs nvidia-cudnn-frontend; it "
     "is not installed (import of 'cudnn' failed). Install it (pip install -e \".[cudnn]\" in this repository"),
    ("fa3", "flash_attn_interface", "which needs flash_attn_interface (FA3, the hopper build of flash-attention); it is "
     "not installed (import of 'flash_attn_interface' failed). Install it (no wheel exists: build and install "
     "flash-attention's hopper/ directory)"),
    ("fa2", "flash_attn", "which needs flash-attn (2.x); it is not installed (import of 'flash_attn' failed). Install it "
     "(pip install -e \".[fa2]\" in this repository"),
]


@pytest.mark.parametrize("force,module,message", MISSING, ids=[m[0] for m in MISSING])
def test_a_forced_backend_without_its_library_names_backend_package_and_install(force, module, message, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # an import of it fails, whatever is installed
    from transformer_engine.pytorch.attention.dot_product_attention.selection.backend_selection import BackendLibraryMissing

    dpa = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal")
    q, k, v = (t.to(torch.bfloat16) for t in _qkv())
    with pytest.raises(BackendLibraryMissing) as err, backend_scope(force=force):
        dpa(q, k, v)
    assert message in str(err.value)
    assert isinstance(err.value, ModuleNotFoundError) and err.value.name == module
    assert isinstance(err.value.__cause__, ModuleNotFoundError)
    assert current_scope() is None


def test_install_hints_name_setup_pys_extras_and_pins():
    from build_tools.utils import OPTIONAL_DEPENDENCIES
    from transformer_engine.pytorch.attention.dot_product_attention.selection.libraries import LIBRARY_INSTALLS

    for field, extra in (("flash_attn_2", "fa2"), ("flash_attn_4", "fa4"), ("cudnn_frontend", "cudnn")):
        (pin,) = OPTIONAL_DEPENDENCIES[extra]
        assert f'pip install -e ".[{extra}]"' in LIBRARY_INSTALLS[field].pip and pin in LIBRARY_INSTALLS[field].pip


def test_other_missing_modules_pass_through_unchanged(monkeypatch):
    """A dependency of the library, or a module the block imports itself, is not the forced
    backend's library being absent: the original error leaves the block."""
    with pytest.raises(ModuleNotFoundError) as err, backend_scope(force="fa4"):
        raise ModuleNotFoundError("No module named 'cutlass'", name="cutlass")
    assert type(err.value) is ModuleNotFoundError
    with pytest.raises(ModuleNotFoundError) as err, backend_scope(allow=["fa4", "unfused"]):
        raise ModuleNotFoundError("No module named 'flash_attn'", name="flash_attn")
    assert type(err.value) is ModuleNotFoundError


# ---------------------------------------------------------------------------------- run_on


def test_run_on_fails_when_the_backend_refuses():
    dpa = DotProductAttention(2, 8)
    with pytest.raises(pytest.fail.Exception, match="FusedAttention refused a configuration this test expects it to run"):
        run_on("FusedAttention", dpa, *_qkv())


def test_run_on_skips_only_an_expected_refusal():
    dpa = DotProductAttention(2, 8)
    with pytest.raises(pytest.skip.Exception, match="as expected"):
        run_on("FusedAttention", dpa, *_qkv(), expect_refusal="device=cpu")
    with pytest.raises(pytest.fail.Exception, match="refused, but not for 'attention_mask='"):
        run_on("FusedAttention", dpa, *_qkv(), expect_refusal="attention_mask=")


def test_run_on_fails_when_an_expected_refusal_does_not_happen():
    dpa = DotProductAttention(2, 8)
    with pytest.raises(pytest.fail.Exception, match="ran a configuration the test expected it to refuse"):
        run_on("unfused", dpa, *_qkv(), expect_refusal="device=cpu")


def test_run_on_runs_the_named_backend():
    dpa = DotProductAttention(2, 8)
    q, k, v = _qkv()
    torch.testing.assert_close(run_on("unfused", dpa, q, k, v), dpa(q, k, v))
    assert dpa.last_selection.label == "UnfusedDotProductAttention"
