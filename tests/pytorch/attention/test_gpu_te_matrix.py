"""TE's attention test configurations (te_matrix.py) on the GPU: every case runs on
FlashAttention v4 and on FusedAttention in worker processes (te_matrix_driver.py), started once
for the groups that the selected tests need, so a crash that poisons one process cannot hide the
other cases; each test then reads its case's result: it passes when the backend ran and matched
the float64 reference, or when selection refused the case with the backend's own reason. A case
that passed in the recorded H200 run (te_matrix_expected.json) must keep passing.

    python -m pytest -q tests/pytorch/attention/test_gpu_te_matrix.py   # TE_MATRIX_JOBS=8 workers
"""

from __future__ import annotations

import json
import os

import pytest

from . import te_matrix as tm
from .te_matrix_driver import drive, drive_group, summary

pytestmark = pytest.mark.gpu
CASES = tm.all_cases()
RECORDED = tm.recorded()
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
    results = drive("cuda", tm.GPU_BACKENDS, jobs=int(os.environ.get("TE_MATRIX_JOBS", "8")), only_groups=needed)
    if os.environ.get("TE_MATRIX_OUT"):
        with open(os.environ["TE_MATRIX_OUT"], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    print("\n" + summary(results))
    return {(r["backend"], r["id"]): r for r in results}


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


def test_only_the_selected_groups_run(request):
    """The GPU fixture starts workers for the groups of the selected tests only (-k subsets stay cheap)."""
    # Only this file's test_gpu: other files collected in the same session have their own.
    here = [i for i in request.session.items if getattr(i, "originalname", None) == "test_gpu"
            and getattr(getattr(i, "module", None), "__name__", None) == __name__]
    if not here:
        pytest.skip("no GPU test of this file is selected")
    assert needed_groups(here[:1]) == {_GROUP[(here[0].callspec.params["short"], here[0].callspec.params["case"].id)]}
    assert needed_groups(here) <= set(tm.groups(tm.GPU_BACKENDS))


def test_worker_processes_survive_a_crash(monkeypatch):
    """A worker that dies in a case (as a poisoned CUDA context would) costs that case only: the
    driver records it as failed and a fresh worker runs the rest. (The workers run the unfused
    backend on the CPU here: the driver is what is tested.)"""
    group = "unfused:mask:0"
    cases = tm.groups(["unfused"], ["mask"])[group][:4]
    monkeypatch.setattr(tm, "GROUP_SIZE", 4)
    monkeypatch.setenv("TE_MATRIX_CRASH_AT", cases[1].id)
    monkeypatch.setenv("TE_MATRIX_GROUP_SIZE", "4")
    results = drive_group(group, "cpu", len(cases))
    assert [r["index"] for r in results] == [0, 1, 2, 3]
    assert [r["status"] for r in results] == ["pass", "fail", "pass", "pass"]
    assert "worker died (rc 134)" in results[1]["detail"]
