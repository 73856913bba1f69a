"""Every attention test file must be run by qa/L0_pytorch_unittest/test.sh (upstream once
shipped a test file that its QA script silently skipped)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_every_test_file_is_listed_in_the_qa_script():
    script = (ROOT / "qa" / "L0_pytorch_unittest" / "test.sh").read_text()
    listed = set(re.findall(r"^run_file (\S+)", script, flags=re.M))
    present = {p.name for p in (ROOT / "tests" / "pytorch" / "attention").glob("test_*.py")}
    assert present - listed == set(), f"test files not run by test.sh: {sorted(present - listed)}"
    assert listed - present == set(), f"test.sh runs files that do not exist: {sorted(listed - present)}"
