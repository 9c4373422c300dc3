"""Print each run of grpo_step.py / trl_async.py JSON files as one block: step times beside the reward curve.

    python bench/gpu/curves.py $OUT/*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _fmt(values: list[Any] | None, digits: int = 2) -> str:
    if not values:
        return "-"
    return " ".join("-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v) for v in values)


def main(paths: list[str]) -> None:
    for path in paths:
        doc = json.loads(Path(path).read_text())
        for mode, run in doc.get("runs", {}).items():
            if not isinstance(run, dict):
                continue
            median, mean = (_fmt([run.get(k)], 3) for k in ("step_s_median", "step_s_mean"))
            error = f", error {run['error']}" if run.get("error") else ""
            print(f"== {Path(path).stem} [{mode}] exit {run.get('exit_code')} median {median} s, mean {mean} s{error}")
            print(f"   reward    {_fmt(run.get('reward'))}")
            print(f"   entropy   {_fmt(run.get('entropy'))}")
            if run.get("drift") is not None:
                print(f"   drift     {_fmt(run.get('drift'))}  ({run.get('drift_discards')} batches generated again)")
                print(f"   staleness {_fmt(run.get('staleness'))}")
            if run.get("sync_s"):
                print(f"   sync s    {_fmt(run.get('sync_s'))}")


if __name__ == "__main__":
    main(sys.argv[1:])
