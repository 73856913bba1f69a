"""TE's attention test configurations (te_matrix.py) as tests.

CPU: every case runs in this process on the unfused backend (bf16 cases in float64, fp16 cases
in float32, shapes shrunk 16x) against the float64 reference. CUDA (marked ``gpu``): every case
runs on FlashAttention v4 and on FusedAttention in worker processes, started once for the groups
that the selected tests need, so a crash that poisons one process cannot hide the other cases;
each test then reads its case's result: it passes when the backend ran and matched, or when
selection refused the case with the backend's own reason.

    python -m pytest -q tests/pytorch/attention/test_te_matrix.py -m gpu   # TE_MATRIX_JOBS=8 workers
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from . import te_matrix as tm
from .reference import allowed_matrix

CASES = tm.all_cases()

# Known library bugs, each a strict xfail so that its fix shows up as XPASS: {case id: reason}.
CPU_XFAIL: dict = {}


def _cpu_param(c: tm.Case):
    marks = [pytest.mark.xfail(strict=True, reason=CPU_XFAIL[c.id])] if c.id in CPU_XFAIL else []
    return pytest.param(c, id=c.id, marks=marks)


@pytest.mark.parametrize("case", [_cpu_param(c) for c in CASES])
def test_cpu_unfused(case):
    r = tm.run_case(case, "unfused", "cpu")
    assert r["status"] == "pass", r["detail"]


# ------------------------------------------------------------------------------- the GPU matrix

_GROUP = {(short, c.id): g for g, cs in tm.groups(tm.GPU_BACKENDS).items() for c in cs for short in [g.split(":")[0]]}


def needed_groups(items) -> set:
    """The worker groups that the selected GPU tests of this file read."""
    needed = set()
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is not None and getattr(getattr(item, "module", None), "__name__", None) == __name__ and "short" in spec.params:
            needed.add(_GROUP[(spec.params["short"], spec.params["case"].id)])
    return needed


@pytest.fixture(scope="session")
def gpu_results(request):
    """Runs the worker processes once, for every group that a selected test of this file needs."""
    needed = needed_groups(request.session.items)
    results = tm.drive("cuda", tm.GPU_BACKENDS, jobs=int(os.environ.get("TE_MATRIX_JOBS", "8")), only_groups=needed)
    if os.environ.get("TE_MATRIX_OUT"):
        with open(os.environ["TE_MATRIX_OUT"], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    print("\n" + tm.summary(results))
    return {(r["backend"], r["id"]): r for r in results}


def _recorded() -> dict:
    """The last H200 run (``te_matrix_expected.json`` beside this file, written from that run's
    jsonl): {(backend label, case id): status}. A case that passed there must keep passing: a
    declaration that starts refusing it (or a backend that starts failing it) is a regression."""
    path = os.path.join(os.path.dirname(__file__), "te_matrix_expected.json")
    with open(path) as f:
        outcomes = json.load(f)["outcomes"]
    return {(label, case_id): status for label, by_status in outcomes.items() for status, ids in by_status.items()
            for case_id in ids}


RECORDED = _recorded()


@pytest.mark.gpu
@pytest.mark.parametrize("short", tm.GPU_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gpu(gpu_results, short, case):
    label = tm.BACKENDS[short][0]
    r = gpu_results[(label, case.id)]
    if r["status"] == "skip":
        pytest.skip(r["detail"])
    assert r["status"] in ("pass", "refused"), r["detail"]
    assert r["detail"] if r["status"] == "refused" else True, "a refusal must name the backend's reason"
    if RECORDED.get((label, case.id)) == "pass":
        assert r["status"] == "pass", f"passed in the recorded H200 run, now {r['status']}: {r['detail']}"


def test_recorded_matrix_covers_every_case():
    """Every case and GPU backend has a recorded H200 outcome (the baseline above)."""
    missing = [(tm.BACKENDS[s][0], c.id) for s in tm.GPU_BACKENDS for c in CASES if (tm.BACKENDS[s][0], c.id) not in RECORDED]
    assert not missing, missing[:5]


# ------------------------------------------------------------------------------- the matrix itself


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


@pytest.mark.parametrize("mask", ["no_mask", "causal", "causal_bottom_right", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("n,m", [(5, 5), (3, 7), (7, 3), (1, 6)])
@pytest.mark.parametrize("window", [None, (2, 0), (1, 2), (0, 0)])
def test_vectorized_mask_matches_the_longhand_reference(mask, n, m, window):
    if "causal" in mask and window is not None and window[1] != 0:
        window = (window[0], 0)
    assert torch.equal(tm.allowed(n, m, mask, window), allowed_matrix(n, m, mask, window))


def test_standard_alibi_slopes():
    assert torch.allclose(tm.standard_slopes(8), torch.tensor([2.0 ** -i for i in range(1, 9)], dtype=torch.float64))
    twelve = tm.standard_slopes(12)
    assert torch.allclose(twelve[:8], tm.standard_slopes(8))
    assert torch.allclose(twelve[8:], torch.tensor([2.0 ** (-0.5 - i) for i in range(4)], dtype=torch.float64))


def test_alibi_alignment_rule():
    slopes = torch.tensor([1.0], dtype=torch.float64)
    # 3 queries, 2 keys: top-left -> |j - i|; bottom-right -> |j - i + 1|
    assert tm.alibi_bias(3, 2, "causal", slopes)[0].tolist() == [[0, -1], [-1, 0], [-2, -1]]
    assert tm.alibi_bias(3, 2, "causal_bottom_right", slopes)[0].tolist() == [[-1, -2], [0, -1], [-1, 0]]


def test_refusal_reason_is_read_from_the_report():
    report = ("no attention backend supports this configuration:\nselected: none\n"
              "  FlashAttention v4: head_dim_v=64 != head_dim_qk=128 with gradients (supported: equal)\n"
              "  FusedAttention: NVTE_FUSED_ATTN=0 (supported: unset or 1 (switched off by the environment))")
    assert tm.refusal_reason(report, "FlashAttention v4").startswith("head_dim_v=64")
    assert tm.refusal_reason(report, "FlashAttention v3") is None


def test_worker_processes_survive_a_crash(monkeypatch):
    """A worker that dies in a case (as a poisoned CUDA context would) costs that case only: the
    driver records it as failed and a fresh worker runs the rest."""
    group = "unfused:mask:0"
    cases = tm.groups(["unfused"], ["mask"])[group][:4]
    monkeypatch.setattr(tm, "GROUP_SIZE", 4)
    monkeypatch.setenv("TE_MATRIX_CRASH_AT", cases[1].id)
    monkeypatch.setenv("TE_MATRIX_GROUP_SIZE", "4")
    results = tm.drive_group(group, "cpu", len(cases))
    assert [r["index"] for r in results] == [0, 1, 2, 3]
    assert [r["status"] for r in results] == ["pass", "fail", "pass", "pass"]
    assert "worker died (rc 134)" in results[1]["detail"]


def test_only_the_selected_groups_run(request):
    """The GPU fixture starts workers for the groups of the selected tests only (-k subsets stay cheap)."""
    # Only this file's test_gpu: other files collected in the same session have their own.
    here = [i for i in request.session.items if getattr(i, "originalname", None) == "test_gpu"
            and getattr(getattr(i, "module", None), "__name__", None) == __name__]
    if not here:
        pytest.skip("no GPU test of this file is selected")
    assert needed_groups(here[:1]) == {_GROUP[(here[0].callspec.params["short"], here[0].callspec.params["case"].id)]}
    assert needed_groups(here) <= set(tm.groups(tm.GPU_BACKENDS))
