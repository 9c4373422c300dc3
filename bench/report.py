"""Turn benchmark JSON results (bench/results/*.json) into the tables of BENCHMARKS.md.

Every benchmark writes one JSON document:

    {"benchmark": "generation", "command": "...", "machine": "...", "date": "...",
     "figures": [{"name": ..., "value": ..., "unit": ..., "baseline": ..., "baseline_value": ...,
                  "ratio": ..., "target": ...}], "notes": [...]}

Usage: python bench/report.py bench/results/*.json > /tmp/tables.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _num(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def table(doc: dict[str, Any]) -> str:
    lines = [
        f"### {doc['benchmark']}",
        "",
        f"- command: `{doc['command']}`",
        f"- machine: {doc.get('machine', '?')}; date: {doc.get('date', '?')}",
        "",
        "| figure | value | unit | baseline (same run) | baseline value | ratio | target |",
        "| --- | ---: | --- | --- | ---: | ---: | --- |",
    ]
    for f in doc["figures"]:
        lines.append(
            f"| {f['name']} | {_num(f.get('value'))} | {f.get('unit', '')} | {f.get('baseline') or '–'} | "
            f"{_num(f.get('baseline_value'))} | {_num(f.get('ratio'))} | {f.get('target') or '–'} |"
        )
    for note in doc.get("notes", []):
        lines.append(f"\n{note}")
    return "\n".join(lines) + "\n"


def main(paths: list[str]) -> None:
    for path in sorted(paths):
        print(table(json.loads(Path(path).read_text())))


if __name__ == "__main__":
    main(sys.argv[1:])
