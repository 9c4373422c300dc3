"""Server replicas and trainer processes on CPU: step time and reward curve of `grpo run` on the tiny model.

The learning check's workload (4 prompts × 8 completions of 12 tokens a step, LoRA r8, lr 3e-2
constant, 20 steps, token_fraction reward) under `grpo run` with the transformers engine, for each
shape in turn: 1 replica and 1 trainer process (the baseline), 2 replicas, 2 replicas and 2 trainer
processes (torchrun, gloo). Step time is the median and mean gap between consecutive steps of the
trainer's history after the first (which pays for warm-up); the reward curve is every step's mean.

    .venv/bin/python bench/replicas_cpu.py --out bench/results/2026-12-02-scale-out/replicas_cpu.json

On a 2-core machine the replicas share the cores with the trainer: this shows that the code paths
learn as one server does and what they cost here, not the speed-up of separate GPUs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from workload import dump, figure, machine  # noqa: E402

from grpo_testmodels import make_dataset, make_model, target_token_ids  # noqa: E402

SHAPES = ((1, 1), (2, 1), (2, 2))  # (server replicas, trainer processes)


def run_doc(name: str, model: Path, dataset: Path, replicas: int, procs: int, steps: int) -> dict[str, Any]:
    lo, hi = target_token_ids(model)
    return {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun", "metadata": {"name": name}, "spec": {
        "model": {"name": "tiny", "path": str(model)},
        "dataset": {"path": str(dataset)},
        "rewards": [{"function": "token_fraction", "args": {"low": lo, "high": hi}}],
        "server": {"engine": "transformers", "maxLoraRank": 8, "replicas": replicas},
        "trainer": {"lora": {"r": 8, "alpha": 16}, "numGenerations": 8, "perDeviceBatchSize": 32 // procs,
                    "numProcPerNode": procs, "maxCompletionLength": 12, "learningRate": 3e-2,
                    "lrScheduler": "constant", "maxSteps": steps, "syncInterval": 1, "checkpointInterval": steps,
                    "seed": 0},
        "runPolicy": {"backoffLimit": 0, "serverReadyTimeoutSeconds": 300},
    }}


def measure(work: Path, model: Path, dataset: Path, replicas: int, procs: int, steps: int) -> dict[str, Any]:
    name = f"r{replicas}-p{procs}"
    run_file = work / f"{name}.yaml"
    run_file.write_text(yaml.safe_dump(run_doc(name, model, dataset, replicas, procs, steps)))
    run_dir = work / name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    code = subprocess.run([sys.executable, "-m", "grpo_cli.main", "run", "-f", str(run_file), "--run-dir",
                           str(run_dir), "--fresh", "--no-live"], env=env, cwd=REPO, capture_output=True,
                          check=False).returncode
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (run_dir / "progress" / f"{name}.history.jsonl").read_text().splitlines()]
    rows = sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])
    times = [dt.datetime.fromisoformat(r["updated_at"]) for r in rows]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(times)][1:]
    rewards = [r["reward_mean"] for r in rows]
    return {"replicas": replicas, "trainer_processes": procs, "exit_code": code, "wall_s": round(wall, 2),
            "steps": len(rows), "step_s_median": round(statistics.median(gaps), 3),
            "step_s_mean": round(statistics.fmean(gaps), 3),
            "reward_first5": round(statistics.fmean(rewards[:5]), 4),
            "reward_last5": round(statistics.fmean(rewards[-5:]), 4), "reward": [round(r, 4) for r in rewards]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="grpo-replicas-") as tmp:
        work = Path(tmp)
        model = make_model(work / "tiny-model", preset="tiny", seed=0)
        dataset = make_dataset(work / "prompts.jsonl", model)
        runs = [measure(work, model, dataset, r, p, args.steps) for r, p in SHAPES]
    for run in runs:
        print(json.dumps(run), flush=True)
    base = runs[0]
    figures = [
        figure(f"step time, {r['replicas']} replicas × {r['trainer_processes']} trainer processes (median)",
               r["step_s_median"], "s", baseline="1 replica × 1 process", baseline_value=base["step_s_median"],
               higher_is_better=False)
        for r in runs[1:]
    ]
    dump(args.out, {
        "benchmark": "server replicas and trainer processes on CPU (grpo run, tiny model)",
        "command": f"python bench/replicas_cpu.py --steps {args.steps} --out {args.out}",
        "machine": machine(), "date": dt.date.today().isoformat(), "runs": runs, "figures": figures,
    })


if __name__ == "__main__":
    main()
