"""TE's attention test configurations (te_matrix.py) on the CPU: the unfused backend (bf16
cases in float64, fp16 cases in float32, shapes shrunk 16x; one case per configuration that
stays distinct at those sizes, :func:`te_matrix.cpu_cases`) against the float64 reference, and
the matrix itself. The GPU run of every case on FA4 and cuDNN is test_gpu_te_matrix.py."""

from __future__ import annotations

import pytest

from . import te_matrix as tm
from .te_matrix_run import refusal_reason, run_case

CASES = tm.all_cases()


@pytest.mark.parametrize("case", tm.cpu_cases(), ids=lambda c: c.id)
def test_cpu_unfused(case):
    r = run_case(case, "unfused", "cpu")
    assert r["status"] == "pass", r["detail"]


def test_recorded_matrix_covers_every_case():
    """Every case and GPU backend has a recorded H200 outcome (the GPU run's baseline)."""
    recorded = tm.recorded()
    missing = [(tm.BACKENDS[s][0], c.id) for s in tm.GPU_BACKENDS for c in CASES if (tm.BACKENDS[s][0], c.id) not in recorded]
    assert not missing, missing[:5]


def test_matrix_covers_te_configurations():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert {c.layout for c in CASES} == set(tm.DENSE_LAYOUTS + tm.THD_LAYOUTS)
    assert {(c.fmt, c.gaps) for c in CASES if c.fmt == "thd"} == {("thd", False), ("thd", True)}
    assert {c.mask for c in CASES} == {"no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
                                       "padding_causal_bottom_right"}
    assert {c.bias_shape for c in CASES if c.bias == "post_scale_bias"} == {"11ss", "1hss", "b1ss", "bhss", "111s"}
    assert {c.bias_shape for c in CASES if c.bias == "alibi"} == {"vanilla", "h", "bh"}
    assert {(192, 128), (64, 128), (128, 64), (256, 256), (1024, 1024)} <= {(c.dqk, c.dv) for c in CASES}
    assert {c.dtype for c in CASES} == {"fp16", "bf16"} and {c.grad for c in CASES} == {True, False}
    assert any(c.hg == 1 for c in CASES) and any(1 < c.hg < c.h for c in CASES) and any(c.sq != c.skv for c in CASES)
    packed = [c for c in CASES if c.packing]
    assert {c.declared for c in packed} == {True, False}
    for c in packed:  # packed layouts only where q/k/v (or k/v) have one shape, as TE skips them
        assert c.dqk == c.dv and (c.packing == "kv" or (c.h == c.hg and c.sq == c.skv))
    cpu = tm.cpu_cases()  # the CPU subset still spans every layout, mask, bias shape and dtype
    assert {c.layout for c in cpu} == {c.layout for c in CASES} and {c.mask for c in cpu} == {c.mask for c in CASES}
    assert {(c.bias, c.bias_shape) for c in cpu} == {(c.bias, c.bias_shape) for c in CASES}
    assert {(c.dtype, c.grad, c.checkpoint, c.gaps) for c in cpu} == {(c.dtype, c.grad, c.checkpoint, c.gaps) for c in CASES}


def test_refusal_reason_is_read_from_the_report():
    report = ("no attention backend supports this configuration:\nselected: none\n"
              "  FlashAttention v4: head_dim_v=64 != head_dim_qk=128 with gradients (supported: equal)\n"
              "  FusedAttention: NVTE_FUSED_ATTN=0 (supported: unset or 1 (switched off by the environment))")
    assert refusal_reason(report, "FlashAttention v4").startswith("head_dim_v=64")
    assert refusal_reason(report, "FlashAttention v3") is None
