"""`examples/grpo-run.yaml` as a single-GPU workstation runs it: `grpo run -f` on the device (issue 29).

The example is a cluster spec (a hub model and dataset, a ConfigMap of reward code, a GPU each for server
and trainer, ReadWriteMany storage). Only what the device cannot have is swapped, and every swap is printed
and written beside the results (`example-swaps.txt`), so the run is the example's own settings otherwise:
batch, LoRA, completion length, loss, importance sampling, prefetch, gradient checkpointing.

    python bench/gpu/example_run.py --model /tmp/m15 --dataset /tmp/m15-prompts.jsonl --steps 20 --out $OUT

Writes `example-local.yaml` (the file run), `example-swaps.txt`, the run directory's `status.json`,
`summary` and logs under `--out`, and `example_run.json` (step times from the progress history, the reward
curve, the exit code).
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "grpo-run.yaml"


def swapped(example: dict[str, Any], *, model: Path, dataset: Path, steps: int, gpu_share: float,
            target: tuple[int, int]) -> tuple[dict[str, Any], list[str]]:
    """The example with what one offline GPU machine lacks swapped, and a line per swap."""
    doc = copy.deepcopy(example)
    spec = doc["spec"]
    swaps: list[str] = []

    def swap(path: str, old: Any, new: Any) -> None:
        swaps.append(f"{path}: {json.dumps(old)} -> {json.dumps(new)}")

    swap("metadata.namespace", doc["metadata"].pop("namespace", None), None)
    old_model = {k: spec["model"].pop(k) for k in ("source", "hub") if k in spec["model"]}
    spec["model"].update({"name": "qwen2.5-1.5b-learn", "path": str(model)})
    swap("spec.model (no hub here: the 1.5B-shaped preset of `grpo make-model`)", old_model,
         {"name": spec["model"]["name"], "path": str(model)})
    old_dataset = {k: spec["dataset"].pop(k) for k in ("source", "path", "promptField") if k in spec["dataset"]}
    spec["dataset"]["path"] = str(dataset)
    swap("spec.dataset (no hub: the preset's prompts, `grpo make-dataset`)", old_dataset, {"path": str(dataset)})
    old_rewards = spec["rewards"]
    spec["rewards"] = [{"function": "token_fraction", "args": {"low": target[0], "high": target[1]}, "weight": 1.0},
                       *[r for r in old_rewards if r["function"] == "regex_match"]]
    swap("spec.rewards[0] (GSM8K answers mean nothing to a random-weight model: the preset's target-token share)",
         old_rewards[0], spec["rewards"][0])
    swap("spec.rewardCode (a ConfigMap exists only on a cluster; nothing left uses it)", spec.pop("rewardCode"), None)
    old_share = spec["server"].get("gpuMemoryUtilization")
    spec["server"]["gpuMemoryUtilization"] = gpu_share
    swap("spec.server.gpuMemoryUtilization (server and trainer share the one GPU)", old_share, gpu_share)
    old_steps = spec["trainer"]["maxSteps"]
    spec["trainer"]["maxSteps"] = steps
    swap("spec.trainer.maxSteps (device time)", old_steps, steps)
    swap("spec.storage (the run directory plays the run's volume)", spec.pop("storage"), None)
    swap("spec.scheduling (no nodes to choose from)", spec.pop("scheduling"), None)
    return doc, swaps


def step_gaps(rows: list[dict[str, Any]]) -> list[float]:
    times = [dt.datetime.fromisoformat(r["updated_at"]) for r in rows]
    return [(b - a).total_seconds() for a, b in itertools.pairwise(times)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gpu-share", type=float, default=0.45)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=int, default=540)
    args = parser.parse_args()

    sys.path.insert(0, str(REPO / "services"))
    sys.path.insert(0, str(REPO / "bench"))
    from grpo_step import history

    from grpo_testmodels import target_token_ids

    args.out.mkdir(parents=True, exist_ok=True)
    doc, swaps = swapped(yaml.safe_load(EXAMPLE.read_text()), model=args.model, dataset=args.dataset,
                         steps=args.steps, gpu_share=args.gpu_share, target=target_token_ids(args.model))
    run_file = args.out / "example-local.yaml"
    run_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    (args.out / "example-swaps.txt").write_text("\n".join(swaps) + "\n")
    print("swapped from examples/grpo-run.yaml:\n  " + "\n  ".join(swaps), flush=True)

    run_dir = Path("/tmp/example-run")
    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "grpo_cli.main", "run", "-f", str(run_file), "--run-dir",
                               str(run_dir), "--fresh", "--no-live"], timeout=args.timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = 124
    wall = time.monotonic() - started
    for name in ("status.json", "summary.txt", "summary.md", "reward.png"):
        if (run_dir / name).is_file():
            shutil.copy(run_dir / name, args.out / f"example-{name}")
    logs = run_dir / "logs"
    if logs.is_dir():
        shutil.copytree(logs, args.out / "example-logs", dirs_exist_ok=True)
    rows = history(run_dir / "progress" / f"{doc['metadata']['name']}.history.jsonl")
    gaps = step_gaps(rows)[1:]  # the first gap pays for compilation and warm-up
    result = {
        "exit_code": code, "wall_s": round(wall, 1), "steps": len(rows),
        "reward": [r.get("reward_mean") for r in rows],
        "sync_s": [r.get("sync_seconds") for r in rows],
        "median_step_s": round(statistics.median(gaps), 3) if gaps else None,
        "mean_step_s": round(statistics.fmean(gaps), 3) if gaps else None,
        "swaps": swaps,
    }
    (args.out / "example_run.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "swaps"}), flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
