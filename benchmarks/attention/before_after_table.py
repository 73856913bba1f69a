"""A markdown table of ``host_before_after.sh``'s logs: per case, the median over runs of each
path's host us and graph-replayed ms, before and after, and after / before.

    python benchmarks/attention/before_after_table.py OUT_DIR [--path DPA]
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\[small\] (?P<case>[^:]+): (?P<rest>.*)$")
PATH = re.compile(r"(?P<name>\w+): host (?P<host>[\d.]+) us, eager (?P<eager>[\d.]+) ms, graphed (?P<graph>[\d.]+) ms")


def read(out: Path, side: str, path: str) -> dict:
    """{case: {"host": [us...], "graph": [ms...]}} over every run's log of one side."""
    found = defaultdict(lambda: defaultdict(list))
    for log in sorted(out.glob(f"host_{side}_*.log")):
        for line in log.read_text().splitlines():
            m = LINE.match(line)
            for p in PATH.finditer(m["rest"]) if m else ():
                if p["name"] == path:
                    found[m["case"]]["host"].append(float(p["host"]))
                    found[m["case"]]["graph"].append(float(p["graph"]))
    return found


def table(out: Path, path: str) -> str:
    before, after = read(out, "before", path), read(out, "after", path)
    rows = ["| case | host us before | after | after/before | graph ms before | after | after/before |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for case in before:
        if case not in after:
            continue
        cells = []
        for what in ("host", "graph"):
            b, a = statistics.median(before[case][what]), statistics.median(after[case][what])
            cells += [f"{b:.3g}", f"{a:.3g}", f"**{a / b:.3f}**"]
        rows.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--path", default="DPA")
    args = ap.parse_args()
    print(table(args.out, args.path))


if __name__ == "__main__":
    main()
