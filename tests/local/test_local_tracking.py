"""`spec.trainer.reportTo` on `grpo run`: one tiny run with two trainer processes reports to a real MLflow tracking
server (`mlflow server`, started here), to W&B in offline mode and to TensorBoard, each through transformers' own
integration, and rank 0 alone reports."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.local_runs import grpo_run, run_file
from tests.fixtures.mlflow_server import metric_history, mlflow_server, runs_of

pytestmark = pytest.mark.slow

EXPERIMENT = "grpo-local-tracking"
STEPS = 3
#: Every step's measures the trackers must get: TRL's reward and loss, and the session's own.
PER_STEP = ("reward", "loss", "timing/step_seconds", "staleness/steps")


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
                tiny_dataset: Path) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("tracking")
    with mlflow_server(tmp / "mlflow") as url:
        env = [{"name": "MLFLOW_TRACKING_URI", "value": url}, {"name": "MLFLOW_EXPERIMENT_NAME", "value": EXPERIMENT},
               {"name": "WANDB_MODE", "value": "offline"}, {"name": "WANDB_PROJECT", "value": "grpo-local"},
               {"name": "WANDB_SILENT", "value": "true"}]
        path = run_file(tmp, tiny_model_dir, tiny_dataset, maxSteps=STEPS, numProcPerNode=2,
                        reportTo=["tensorboard", "mlflow", "wandb"], env=env)
        run_dir = tmp / "run"
        proc = grpo_run(path, run_dir)
        try:
            out, _ = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, out
        yield {"url": url, "run_dir": run_dir, "runs": runs_of(url, EXPERIMENT)}


def test_the_mlflow_server_gets_one_run_with_its_settings_and_every_steps_metrics(tracked_run: dict[str, Any]) -> None:
    runs = tracked_run["runs"]
    assert len(runs) == 1, f"rank 0 alone reports: {[r['info'] for r in runs]}"
    run = runs[0]
    assert run["info"]["status"] == "FINISHED", run["info"]
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["max_steps"] == str(STEPS) and params["num_generations"] == "4", sorted(params)
    assert params["loss_type"] == "dapo" and params["learning_rate"] == "0.03", sorted(params)
    for key in PER_STEP:
        steps = sorted(m["step"] for m in metric_history(tracked_run["url"], run["info"]["run_id"], key))
        assert steps == list(range(1, STEPS + 1)), f"{key}: {steps}"
    syncs = metric_history(tracked_run["url"], run["info"]["run_id"], "sync/seconds")
    # the sync of a step completes while the next one trains: steps 2.. have one to report
    assert {m["step"] for m in syncs} >= set(range(2, STEPS + 1)), syncs
    assert all(m["value"] > 0 for m in syncs), syncs


def test_wandb_offline_writes_its_run_files_in_the_run_directory(tracked_run: dict[str, Any]) -> None:
    wandb_dir = tracked_run["run_dir"] / "tracking" / "local-test" / "wandb"
    offline = [p for p in wandb_dir.glob("offline-run-*") if p.is_dir()]
    assert len(offline) == 1, f"rank 0 alone reports: {sorted(p.name for p in wandb_dir.iterdir())}"
    (records,) = offline[0].glob("run-*.wandb")  # what `wandb sync` sends: W&B's record log of the run
    # W&B 0.31 reads it back only in its Go core; the history records hold each key as it was logged
    data = records.read_bytes()
    for key in PER_STEP:
        assert f"train/{key}".encode() in data, key


def scalar_steps(event_file: Path) -> dict[str, list[int]]:
    """tag -> steps of a TensorBoard event file (TFRecords: length, its CRC, an Event message, its CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    data, at, tags = event_file.read_bytes(), 0, {}
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        event = Event.FromString(data[at + 12:at + 12 + length])
        at += 12 + length + 4
        for value in event.summary.value:
            tags.setdefault(value.tag, []).append(event.step)
    return tags


def test_tensorboard_event_files_are_written_in_the_run_directory(tracked_run: dict[str, Any]) -> None:
    events = list((tracked_run["run_dir"] / "tracking" / "local-test" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1, f"rank 0 alone reports: {events}"
    tags = scalar_steps(events[0])
    for key in PER_STEP:
        assert tags.get(f"train/{key}") == list(range(1, STEPS + 1)), (key, sorted(tags))
