"""The quick start's promise about Python: the floor the README states is true for both of its
commands. CI runs them on that floor; this test fails if the README's number drifts below what
the pinned torch or the test extra's packages demand, or above the interpreter CI runs."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

README = Path(__file__).resolve().parents[3] / "README.md"


def _stated_floor() -> tuple:
    match = re.search(r"only Python (\d+)\.(\d+) or newer", README.read_text())
    assert match, "the README's quick start must state its Python floor as 'only Python X.Y or newer'"
    return int(match.group(1)), int(match.group(2))


def test_the_interpreter_meets_the_stated_floor():
    assert sys.version_info[:2] >= _stated_floor()


@pytest.mark.parametrize("package", ["torch", "megatron-core"])
def test_the_stated_floor_satisfies_what_the_commands_install(package):
    """The installed distribution's Requires-Python admits the stated floor."""
    try:
        requires = importlib.metadata.metadata(package)["Requires-Python"]
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{package} is not installed (the test extra installs it)")
    if not requires:
        return
    major, minor = _stated_floor()
    assert SpecifierSet(requires).contains(f"{major}.{minor}"), f"{package} needs Python {requires}; the README says {major}.{minor}"
