"""GRPO step time: our server mode (vLLM server + async prefetch + LoRA sync) vs TRL colocate with sleep mode.

Same model, data, batch, generations, completion length, steps and seed; one GPU
shared by server and trainer in our mode. Both runs write the trainer's progress
history (one line per step); step time is the median gap between consecutive
steps after the first (which pays for compilation and warm-up), and the mean of
the same gaps (with prefetch, the first steps train on batches generated before
training began, so the mean is the throughput figure).

    python bench/grpo_step.py --model M --dataset D --steps 8 --out $OUT/grpo_step.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

from workload import dump, figure, machine

from grpo_testmodels import target_token_ids

#: The learning workload (the defaults): the demo reward (share of completion tokens in a 1/8 id range; a
#: random policy scores ~0.125) rose from 0.13 to 1.0 within 5 steps on the qwen2.5-1.5b-learn preset with
#: LoRA r32, 8 prompts x 8 completions of 64 tokens, for TRL colocate and for ours alike (H200, issue 28). At
#: 256 tokens and 1e-3, and at 1e-5 (rounds 1-4), no reward moved in 20 steps (BENCHMARKS.md); at 256 tokens and
#: 2e-2 (LONG_COMPLETION_LENGTH, `--completion-length 256`) both rose to 1.0 within 10 steps (2026-12-04).
LEARNING_RATE = 2e-2
COMPLETION_LENGTH = 64
#: The long shape that learns at LEARNING_RATE too (BENCHMARKS.md, the second lease of 2026-12-04).
LONG_COMPLETION_LENGTH = 256
BATCH = 64
STEPS = 20


def run_doc(name: str, model: Path, dataset: Path, steps: int, mode: str, logprobs_source: str, *,
            completion_length: int = COMPLETION_LENGTH, batch: int = BATCH, grad_accum: int = 1,
            prefetch_depth: int | None = 1, engine_args: dict[str, Any] | None = None,
            server_env: dict[str, str] | None = None, replicas: int = 1,
            learning_rate: float = LEARNING_RATE, tuning: str = "lora", sync: str = "adapter",
            importance_sampling: str | None = None, max_drift: float | None = None) -> dict[str, Any]:
    """The run; `prefetch_depth` None leaves asyncPrefetch and prefetchDepth to the spec's defaults."""
    lo, hi = target_token_ids(model)
    trainer = {
        "lora": {"r": 32, "alpha": 64, "targetModules": ["all-linear"]},
        "numGenerations": 8, "perDeviceBatchSize": batch, "gradientAccumulationSteps": grad_accum,
        "maxCompletionLength": completion_length,
        "learningRate": learning_rate, "maxSteps": steps, "syncInterval": 1, "checkpointInterval": 1000,
        "seed": 0, "generationTimeoutSeconds": 300,
    }
    if importance_sampling == "off":
        trainer["importanceSampling"] = {"enabled": False}
    elif importance_sampling is not None:  # mask | truncate: spec.trainer.importanceSampling.mode
        trainer["importanceSampling"] = {"mode": importance_sampling}
    if max_drift is not None and importance_sampling != "off":
        trainer.setdefault("importanceSampling", {})["maxDrift"] = max_drift
    if tuning == "full":  # every weight trains; ours pushes them into the server (CUDA IPC on one GPU)
        trainer["tuning"] = "full"
        del trainer["lora"]
    elif sync == "merged" and mode == "server":  # LoRA trained, merged weights pushed (ours only: TRL merges anyway)
        trainer["sync"] = "merged"
    spec: dict[str, Any] = {
        "model": {"name": "bench-1.5b", "path": str(model), "dtype": "bfloat16"},
        "dataset": {"path": str(dataset)},
        "rewards": [{"function": "token_fraction", "args": {"low": lo, "high": hi}}],
        "mode": mode,
        "trainer": trainer,
        "runPolicy": {"backoffLimit": 0, "serverReadyTimeoutSeconds": 600},
    }
    if mode == "server":
        if prefetch_depth is not None:
            trainer.update({"asyncPrefetch": True, "prefetchDepth": prefetch_depth})
        # The server's share of the GPU (0.45) is split between its replicas.
        spec["server"] = {"engine": "vllm", "gpuMemoryUtilization": round(0.45 / replicas, 4), "replicas": replicas,
                          "maxModelLen": 2048, "maxLoras": 4,
                          "maxLoraRank": 32, "dtype": "bfloat16", "logprobsSource": logprobs_source,
                          "extraEngineArgs": engine_args or {},
                          "env": [{"name": k, "value": v} for k, v in (server_env or {}).items()]}
    return {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun", "metadata": {"name": name}, "spec": spec}


def reward_summary(rewards: list[float | None]) -> dict[str, float | None]:
    """The reward curve in three numbers: mean of the first and last three logged steps, and their gain."""
    values = [r for r in rewards if r is not None]
    if len(values) < 2:
        return {"first3": None, "last3": None, "gain": None}
    first, last = statistics.fmean(values[:3]), statistics.fmean(values[-3:])
    return {"first3": first, "last3": last, "gain": last - first}


SNAPSHOT_MS = re.compile(r"s in the background after a (\d+) ms snapshot")


def snapshot_ms(log: Path) -> list[int]:
    """What the training loop blocked for at each sync: the snapshot (the rest runs in the background)."""
    return [int(m) for m in SNAPSHOT_MS.findall(log.read_text(errors="replace"))] if log.is_file() else []


STEP_LINE = re.compile(r"^step (\d+)/\d+ reward \S+ std \S+ loss \S+ entropy (\S+) is-ratio (\S+) drift (\S+) "
                       r".* staleness (\S+)", re.M)


def step_diagnostics(log: Path | None) -> dict[str, list[Any]]:
    """Per step of our trainer's log: the policy's entropy, the importance-sampling ratio (min/mean/max) and the
    batch's staleness: a collapse shows as entropy falling while the reward does not rise."""
    if log is None or not log.is_file():
        return {}
    text = log.read_text(errors="replace")
    rows = STEP_LINE.findall(text)
    return {"entropy": [None if e == "n/a" else float(e) for _, e, _, _, _ in rows],
            "is_ratio": [r for _, _, r, _, _ in rows],
            "drift": [None if d == "n/a" else float(d) for _, _, _, d, _ in rows],
            "staleness": [None if s == "None" else int(s) for _, _, _, _, s in rows],
            "drift_discards": text.count("discarded a generated batch (policy_drift")}


def history(path: Path) -> list[dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]


def step_seconds(rows: list[dict[str, Any]]) -> list[float]:
    times = [dt.datetime.fromisoformat(r["updated_at"]) for r in rows]
    return [(b - a).total_seconds() for a, b in itertools.pairwise(times)]


#: How long a run stopped at the deadline has to end after SIGTERM before its process group is killed.
STOP_GRACE_SECONDS = 15.0


def run_until(argv: list[str], log: Any, env: dict[str, str], seconds: float | None) -> int | str:
    """Run one system to its end, or until `seconds`: then SIGTERM (`grpo run` stops its processes), then SIGKILL
    to its process group. The exit code, or what stopped it: the steps it logged are reported either way (a
    device call's limit used to kill this script while a finished run shut down, losing the whole summary)."""
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return f"stopped at the deadline ({seconds:.0f} s left for it)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--work", type=Path, default=Path("/tmp/grpo-step"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", choices=["server", "colocate"], default=None)
    parser.add_argument("--logprobs-source", choices=["sampler", "auto"], default="sampler",
                        help="spec.server.logprobsSource of our run (server mode)")
    parser.add_argument("--completion-length", type=int, default=COMPLETION_LENGTH, help="maxCompletionLength")
    parser.add_argument("--prefetch-depth", type=int, default=1,
                        help="prefetchDepth of our run (server mode, asyncPrefetch on); 0: the spec's defaults "
                        "for both (what a user gets)")
    parser.add_argument("--tuning", choices=["lora", "full"], default="lora",
                        help="trainer.tuning of both runs: full trains every weight (ours: pushed by vLLM's "
                        "weight transfer, ipc on one GPU; TRL colocate: its own in-process sync)")
    parser.add_argument("--sync", choices=["adapter", "merged"], default="adapter",
                        help="trainer.sync of our LoRA run: merged pushes the merged target modules (ipc on one GPU)")
    parser.add_argument("--learning-rate", type=float, default=LEARNING_RATE,
                        help="learningRate of both runs (1e-5 reproduces rounds 1-4, whose rewards stayed flat)")
    parser.add_argument("--batch", type=int, default=BATCH, help="perDeviceBatchSize (completions per micro-batch)")
    parser.add_argument("--importance-sampling", choices=["mask", "truncate", "off"], default=None,
                        help="our run's spec.trainer.importanceSampling (mode, or off); default: the spec's")
    parser.add_argument("--max-drift", type=float, default=None,
                        help="our run's spec.trainer.importanceSampling.maxDrift (100: train on every stale batch)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="spec.server.replicas of our run; the server's 0.45 of the GPU is split between them")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="gradientAccumulationSteps; batch x grad-accum completions per step, 8 per prompt")
    parser.add_argument("--engine-args", type=json.loads, default={},
                        help="JSON object: spec.server.extraEngineArgs of our run, "
                        "e.g. '{\"specialize_active_lora\": true}'")
    parser.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                        help="spec.server.env of our run (repeatable), e.g. VLLM_LORA_ENABLE_DUAL_STREAM=1")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="seconds for the whole benchmark: a run still going then is stopped and its steps so "
                        "far are still reported (set it below the limit of whatever may kill this script)")
    args = parser.parse_args()
    started = time.monotonic()
    server_env = dict(item.split("=", 1) for item in args.server_env)
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29561"}
    for mode in ("server", "colocate"):
        if args.only and mode != args.only:
            continue
        name = f"bench-{mode}"
        run_file = args.work / f"{name}.yaml"
        doc = run_doc(name, args.model, args.dataset, args.steps, mode, args.logprobs_source,
                      completion_length=args.completion_length, batch=args.batch, grad_accum=args.grad_accum,
                      prefetch_depth=args.prefetch_depth or None, engine_args=args.engine_args,
                      server_env=server_env, replicas=args.replicas, learning_rate=args.learning_rate,
                      tuning=args.tuning, sync=args.sync, importance_sampling=args.importance_sampling,
                      max_drift=args.max_drift)
        run_file.write_text(yaml.safe_dump(doc))
        run_dir = args.work / name
        log = (args.work / f"{name}.log").open("wb")
        if mode == "server":
            argv = [sys.executable, "-m", "grpo_cli.main", "run", "-f", str(run_file), "--run-dir", str(run_dir),
                    "--fresh", "--no-live"]
        else:  # colocate: the trainer alone, vLLM in-process with sleep mode (TRL's own path)
            argv = [sys.executable, "-m", "grpo_cli.main", "train", "--config", str(run_file)]
        # the baseline trains as TRL does: its own no-grad scoring forward (not the ratio from the training
        # forward) and PEFT's casts of each adapted layer's input
        run_env = env if mode == "server" else {**env, "GRPO_TRAINER_OLD_LOGPS": "forward",
                                                "GRPO_TRAINER_ADAPTER_INPUT_CASTS": "keep"}
        t0 = time.perf_counter()
        left = None if args.deadline_s is None else max(1.0, args.deadline_s - (time.monotonic() - started))
        code = run_until(argv, log, run_env, left)
        wall = time.perf_counter() - t0
        progress_dir = (run_dir if mode == "server" else args.work / ".grpo" / name) / "progress"
        rows = history(progress_dir / f"{name}.history.jsonl")
        gaps = step_seconds(rows)
        depth = max(args.prefetch_depth, 1) if mode == "server" else 1
        timed = gaps[1:] or gaps  # the first gap pays for compilation and warm-up, when there are others
        results[mode] = {
            "exit_code": code, "wall_s": wall, "steps_logged": len(rows),
            "step_s_median": statistics.median(timed) if timed else None,
            # with prefetch the first steps take batches generated before training began: the mean of the
            # same gaps is the throughput figure, the median the typical step
            "step_s_mean": statistics.fmean(timed) if timed else None,
            # steps whose batch came from a trained adapter: gap i is step i + 2, and with prefetch depth d
            # (colocate: none ahead, d = 1) steps up to d + 1 train on batches of the base model
            "step_s_steady_mean": statistics.fmean(steady) if (steady := gaps[depth:]) else None,
            "step_s": gaps, "reward": (rewards := [r.get("reward_mean") for r in rows]),
            "reward_summary": reward_summary(rewards),
            "sync_s": [r.get("sync_seconds") for r in rows],
            **step_diagnostics(run_dir / "logs" / "trainer-attempt-1.log" if mode == "server" else None),
            "snapshot_ms": snapshot_ms(run_dir / "logs" / "trainer-attempt-1.log" if mode == "server"
                                       else args.work / f"{name}.log"),
        }
        print(mode, json.dumps(results[mode]), flush=True)
    figures = []
    ours, trl = results.get("server", {}), results.get("colocate", {})
    if ours.get("step_s_median") and trl.get("step_s_median"):
        figures.append(figure("GRPO step time, ours (server mode, prefetch, LoRA sync)", ours["step_s_median"], "s",
                              baseline="TRL 1.16 colocate + sleep mode", baseline_value=trl["step_s_median"],
                              target="≥ 1.3× faster", higher_is_better=False))
        figures.append(figure("GRPO step time (mean), ours", ours["step_s_mean"], "s",
                              baseline="TRL 1.16 colocate + sleep mode (mean)", baseline_value=trl["step_s_mean"],
                              target="≥ 1.3× faster", higher_is_better=False))
        if ours.get("step_s_steady_mean") and trl.get("step_s_steady_mean"):
            figures.append(figure("GRPO step time (steps on a trained adapter's batch, mean), ours",
                                  ours["step_s_steady_mean"], "s", baseline="TRL 1.16 colocate + sleep mode",
                                  baseline_value=trl["step_s_steady_mean"], target="≥ 1.5× faster",
                                  higher_is_better=False))
        if ours["reward_summary"]["gain"] is not None and trl["reward_summary"]["gain"] is not None:
            figures.append(figure("reward gain, first 3 to last 3 steps, ours", ours["reward_summary"]["gain"], "",
                                  baseline="TRL 1.16 colocate + sleep mode",
                                  baseline_value=trl["reward_summary"]["gain"], target="equal or better",
                                  higher_is_better=True))
    dump(args.out, {
        "benchmark": "GRPO step time vs TRL colocate",
        "command": f"python bench/grpo_step.py --model {args.model} --dataset {args.dataset} --steps {args.steps} "
                   f"--completion-length {args.completion_length} --batch {args.batch} --grad-accum {args.grad_accum} "
                   f"--logprobs-source {args.logprobs_source} --prefetch-depth {args.prefetch_depth} "
                   f"--replicas {args.replicas} --learning-rate {args.learning_rate} --tuning {args.tuning} "
                   f"--sync {args.sync} "
                   + (f"--importance-sampling {args.importance_sampling} " if args.importance_sampling else "")
                   + (f"--max-drift {args.max_drift} " if args.max_drift is not None else "")
                   + (f"--engine-args '{json.dumps(args.engine_args)}' " if args.engine_args else "")
                   + "".join(f"--server-env {item} " for item in args.server_env)
                   + "--out $OUT/grpo_step.json",
        "workload": {"completion_length": args.completion_length, "completions_per_step": args.batch * args.grad_accum,
                     "micro_batch": args.batch, "steps": args.steps, "logprobs_source": args.logprobs_source,
                     "prefetch_depth": args.prefetch_depth, "engine_args": args.engine_args,
                     "replicas": args.replicas, "learning_rate": args.learning_rate, "tuning": args.tuning,
                     "sync": args.sync, "importance_sampling": args.importance_sampling, "max_drift": args.max_drift,
                     "server_env": server_env},
        "machine": machine(), "date": dt.date.today().isoformat(), "runs": results, "figures": figures,
        "notes": ["reward per step (ours): " + json.dumps(ours.get("reward")),
                  "reward per step (TRL colocate): " + json.dumps(trl.get("reward"))],
    })


if __name__ == "__main__":
    main()
