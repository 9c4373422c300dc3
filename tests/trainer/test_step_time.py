"""grpo_trainer_step_seconds: the wall time of each optimizer step, observed where the step gauge is set."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from transformers import TrainerControl, TrainerState, TrainingArguments

from grpo_trainer.metrics import METRIC_NAMES, TrainerMetrics
from grpo_trainer.session import SessionCallback, TrainingSession


class FakeSync:
    """What the session asks of AdapterSync when no adapter is published."""

    active = None
    kind = "adapter"

    def wait(self) -> None:
        pass

    def publish_final(self, model: object, dtype: str, step: int) -> None:
        return None

    def lagging_replicas(self) -> list[object]:
        return []

    def describe(self, result: object, step: int, reason: str, note: str) -> str:
        return f"published at step {step}"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def session(tmp_path: Path, clock: Callable[[], float] | None = None, max_steps: int = 100) -> TrainingSession:
    return TrainingSession(sync=FakeSync(), metrics=TrainerMetrics(),  # type: ignore[arg-type]
                           progress_file=tmp_path / "progress.json", max_steps=max_steps, sync_interval=1000,
                           attempt=1, log=lambda _: None, clock=clock or FakeClock())


def histogram(metrics: TrainerMetrics) -> dict[str, float]:
    """The grpo_trainer_step_seconds samples as exposed on /metrics: count, sum and each bucket."""
    text = generate_latest(metrics.registry).decode()
    samples = {}
    for match in re.finditer(r'^grpo_trainer_step_seconds_(count|sum|bucket)(?:\{le="([^"]+)"\})? (\S+)$', text, re.M):
        kind, le, value = match.groups()
        samples[f"le={le}" if kind == "bucket" else kind] = float(value)
    return samples


def test_step_seconds_is_a_declared_histogram() -> None:
    assert "grpo_trainer_step_seconds" in METRIC_NAMES
    (family,) = [m for m in TrainerMetrics().registry.collect() if m.name == "grpo_trainer_step_seconds"]
    assert family.type == "histogram"


def test_each_step_is_observed_once_with_its_wall_time(tmp_path: Path) -> None:
    clock = FakeClock()
    s = session(tmp_path, clock)
    callback = SessionCallback(s)
    args, control, state = TrainingArguments(output_dir=str(tmp_path), report_to=[]), TrainerControl(), TrainerState()
    for step, seconds in enumerate((42.0, 3.0, 7.5), start=1):
        callback.on_step_begin(args, state, control)
        clock.now += seconds
        state.global_step = step
        callback.on_step_end(args, state, control)
        clock.now += 100.0  # logging and checkpoints between steps are not the step's time
    samples = histogram(s.metrics)
    assert samples["count"] == 3
    assert samples["sum"] == pytest.approx(52.5)
    assert (samples["le=5.0"], samples["le=10.0"], samples["le=60.0"], samples["le=+Inf"]) == (1, 2, 3, 3)
    assert s.metrics.step._value.get() == 3  # the step gauge is set in the same place


def test_a_step_end_without_a_begin_observes_nothing(tmp_path: Path) -> None:
    """A resumed Trainer may report a step end first: no made-up duration."""
    s = session(tmp_path)
    state = TrainerState()
    state.global_step = 1
    s.on_step_end(state)
    assert histogram(s.metrics)["count"] == 0


@pytest.mark.slow
def test_the_hugging_face_trainer_loop_observes_one_duration_per_optimizer_step(tmp_path: Path) -> None:
    """The real Trainer calls on_step_begin once per optimizer step, also with gradient accumulation."""
    import torch
    from torch import nn
    from transformers import Trainer

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
            return {"loss": ((self.linear(x).squeeze(-1) - y) ** 2).mean()}

    data = [{"x": torch.tensor([float(i), 1.0]), "y": torch.tensor(float(i % 3))} for i in range(16)]
    s = session(tmp_path, time.monotonic)  # real wall time
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, gradient_accumulation_steps=2,
                             per_device_train_batch_size=2, report_to=[], use_cpu=True, save_strategy="no",
                             logging_steps=1, disable_tqdm=True)
    trainer = Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[SessionCallback(s)])
    s.bind(trainer)
    trainer.train()
    samples = histogram(s.metrics)
    assert samples["count"] == 3
    assert samples["sum"] > 0


@pytest.mark.parametrize(("main", "sharded", "gathers"), [(False, True, 3), (False, False, 0)])
def test_other_ranks_join_the_gather_of_a_sharded_adapter_at_each_sync_and_publish_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, main: bool, sharded: bool, gathers: int,
) -> None:
    """FSDP: gathering the adapter's shards is a collective, so a rank other than 0 joins it when rank 0
    snapshots (resume and every sync), and publishes nothing; with DDP it does nothing there."""
    import grpo_trainer.session as session_module

    calls: list[object] = []
    monkeypatch.setattr(session_module, "peft_adapter", lambda model: calls.append(model))
    s = TrainingSession(sync=FakeSync(), metrics=TrainerMetrics(),  # type: ignore[arg-type]
                        progress_file=tmp_path / "progress.json", max_steps=3, sync_interval=2, attempt=1,
                        main=main, sharded=sharded, log=lambda _: None, clock=FakeClock())

    class Accelerator:
        def unwrap_model(self, model: object) -> object:
            return model

    class Trainer:
        accelerator = Accelerator()
        model = "the model"

    s.bind(Trainer())
    state = TrainerState()
    state.global_step = 1  # resumed
    s.on_train_begin(state)
    for step in (2, 3):  # step 2: syncInterval; step 3: the last step
        state.global_step = step
        s.on_step_end(state)
    assert calls == ["the model"] * gathers  # resume, step 2, step 3
    assert not (tmp_path / "progress.json").exists()


class Outcome:
    def __init__(self, version: int, seconds: float) -> None:
        self.version, self.seconds, self.attempts = version, seconds, 1


def test_each_steps_log_carries_its_wall_time_the_syncs_since_and_the_staleness(tmp_path: Path) -> None:
    """What the trackers of spec.trainer.reportTo get beside TRL's metrics (ServerGRPOTrainer.log adds it)."""
    from grpo_trainer.session import POLICY_VERSION_KEY, STALENESS_KEY, STEP_SECONDS_KEY, SYNC_SECONDS_KEY

    clock = FakeClock()
    s = session(tmp_path, clock)
    s.staleness = lambda: 1
    s.on_step_begin()
    clock.now += 4.0
    s.on_step_end(TrainerState(global_step=1))
    assert s.step_log_metrics() == {STEP_SECONDS_KEY: 4.0, STALENESS_KEY: 1.0}, "no sync completed yet"
    s._published(Outcome(1, 0.5), 1, "sync")
    s._published(Outcome(2, 1.5), 2, "sync")
    s.sync.active = Outcome(2, 1.5)  # type: ignore[misc]
    assert s.step_log_metrics() == {STEP_SECONDS_KEY: 4.0, SYNC_SECONDS_KEY: 1.0, POLICY_VERSION_KEY: 2.0,
                                    STALENESS_KEY: 1.0}
    assert SYNC_SECONDS_KEY not in s.step_log_metrics(), "each sync is reported once"
    s.main = False
    assert s.step_log_metrics() == {}, "rank 0 alone reports"
