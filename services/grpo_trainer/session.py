"""The run's state while TRL trains: policy sync (an adapter, or whole weights), progress, metrics, checkpoints.

`SessionCallback` is a thin Hugging Face TrainerCallback; the decisions live in
`TrainingSession` so they read in one place:

- train begin: when resuming, publish the checkpoint's adapter (the model holds
  it now) so the server generates from it; on a warm start (spec.model.adapter) at step 0, publish the
  adapter the model was loaded with, so the first generations come from it;
- step begin/end: the step's wall time (`grpo_trainer_step_seconds`);
- step end: publish every `syncInterval` optimizer steps and at the last step. The
  adapter's bytes are taken at once (a cast and one copy to the host); writing,
  hashing, the load trigger and its confirmation run in the background while the
  next step trains. The next generation request waits for them (see transport/policy_sync.py), so
  this moves the sync off the step's critical path without changing which adapter
  generates which batch;
- log (every step): metrics and the progress file; before TRL logs a step, `step_log_metrics` adds the
  session's own measures (the step's wall time, the syncs completed since, the batch's staleness) to what it
  logs, so every tracker of `spec.trainer.reportTo` gets them with TRL's (transformers' integrations report
  what `Trainer.log` gets);
- save: wait for the sync of this step, then mark the checkpoint complete (it
  becomes resumable and names the adapter version served from it);
- train end: wait for the last sync.

With several trainer processes every rank has a session, but only rank 0 (`main`) publishes, writes
progress and logs; a checkpoint is marked complete once every rank has written its part. With a sharded
policy (FSDP) every rank takes part in each snapshot, since gathering the adapter's shards is a collective.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from grpo_api.protocol import TrainingProgress
from grpo_trainer.checkpoints import mark_complete
from grpo_trainer.metrics import TrainerMetrics
from grpo_trainer.progress import append_history, now, write_progress
from grpo_trainer.transport.adapter_files import peft_adapter
from grpo_trainer.transport.policy_sync import PolicySync, SyncOutcome

#: The session's per-step measures in the trainer's log (and so in every tracker), beside TRL's `reward`, `loss`...
STEP_SECONDS_KEY = "timing/step_seconds"
SYNC_SECONDS_KEY = "sync/seconds"
POLICY_VERSION_KEY = "sync/policy_version"
STALENESS_KEY = "staleness/steps"


class TrainingSession:
    def __init__(
        self,
        *,
        sync: PolicySync[Any, Any],
        metrics: TrainerMetrics,
        progress_file: Path,
        max_steps: int,
        sync_interval: int,
        attempt: int,
        main: bool = True,
        sharded: bool = False,
        warm_start: bool = False,
        publish_dtype: str = "float32",
        log: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.main = main
        self.sharded = sharded
        self.warm_start = warm_start
        self.sync = sync
        self.metrics = metrics
        self.progress_file = progress_file
        self.max_steps = max_steps
        self.sync_interval = sync_interval
        self.attempt = attempt
        self.publish_dtype = publish_dtype
        self.trainer: Any = None
        self.last_sync: SyncOutcome | None = None
        self.staleness: Callable[[], int | None] = lambda: None
        self._log = log
        self._clock = clock
        self._step_started: float | None = None
        self._last_step_seconds: float | None = None
        self._syncs_since_log: list[float] = []  # seconds of each sync completed since the last step's log
        self._last_reward: tuple[float | None, float | None] = (None, None)
        self._progress_lock = threading.Lock()  # the background sync writes progress too

    def bind(self, trainer: Any) -> None:
        self.trainer = trainer

    def current_step(self) -> int:
        return int(self.trainer.state.global_step) if self.trainer is not None else 0

    # ------------------------------------------------------------------------------------------ adapters

    def snapshot(self) -> Any:
        """The served policy as of now, in the serving dtype (the adapter's bytes, or the weights)."""
        return self.sync.take(self._model(), self.publish_dtype)

    def join_gather(self) -> None:
        """On a rank other than 0 of a sharded policy (FSDP): take part in gathering the adapter's shards (a
        collective) while rank 0 snapshots and publishes it; nothing is kept here."""
        if self.sharded:
            peft_adapter(self._model())

    def _model(self) -> Any:
        return self.trainer.accelerator.unwrap_model(self.trainer.model)

    def publish(self, step: int, reason: str) -> SyncOutcome:
        """Publish the current policy and make it active before returning."""
        result = self.sync.sync(self.snapshot(), step)
        self._published(result, step, reason)
        return result

    def publish_in_background(self, step: int, reason: str) -> None:
        """Take the policy's state now; publish and activate it while training goes on."""
        started = time.monotonic()
        snapshot = self.snapshot()
        taken = time.monotonic() - started
        self.metrics.sync_snapshot_seconds.observe(taken)
        note = f"in the background after a {taken * 1000:.0f} ms snapshot"
        self.sync.start(snapshot, step, done=lambda result: self._published(result, step, reason, note))

    def _published(self, result: SyncOutcome, step: int, reason: str, note: str = "blocking") -> None:
        self.last_sync = result
        with self._progress_lock:
            self._syncs_since_log.append(result.seconds)
        self._log(self.sync.describe(result, step, reason, note))
        self.write_progress(step, done=False)

    # ------------------------------------------------------------------------------------------- events

    def on_train_begin(self, state: TrainerState) -> None:
        publishes = state.global_step > 0 or self.warm_start
        if not self.main:
            if publishes:
                self.join_gather()
            return
        if state.global_step > 0:
            self.publish(state.global_step, f"resumed from checkpoint-{state.global_step}")
        elif self.warm_start:
            self.publish(0, "warm start from spec.model.adapter")
        self.metrics.step.set(state.global_step)
        self.write_progress(state.global_step, done=False)

    def on_step_begin(self) -> None:
        self._step_started = self._clock()

    def on_step_end(self, state: TrainerState) -> None:
        step = state.global_step
        self.metrics.step.set(step)
        if self._step_started is not None:
            self._last_step_seconds = self._clock() - self._step_started
            self.metrics.step_seconds.observe(self._last_step_seconds)
            self._step_started = None
        if step % self.sync_interval == 0 or step >= self.max_steps:
            if self.main:
                self.publish_in_background(step, "sync")
            else:
                self.join_gather()

    def on_log(self, state: TrainerState, logs: dict[str, Any]) -> None:
        self.metrics.observe_trl_logs(logs)
        if "reward" not in logs or not self.main:
            return  # the end-of-training summary, not a step
        reward, std = _number(logs.get("reward")), _number(logs.get("reward_std"))
        self._last_reward = (reward, std)
        append_history(self.progress_file, self.write_progress(state.global_step, done=False))
        version = self.sync.active.version if self.sync.active else None
        staleness = self.staleness()
        self._log(
            f"step {state.global_step}/{self.max_steps} reward {_fmt(reward)} std {_fmt(std)} "
            f"loss {_fmt(_number(logs.get('loss')))} entropy {_fmt(_number(logs.get('entropy')))} "
            f"is-ratio {_is_ratio(logs)} drift {_fmt(_number(logs.get('sampling/sampling_logp_difference/mean')))} "
            f"{self.sync.kind} v{version} staleness {staleness} attempt {self.attempt}"
        )

    def step_log_metrics(self) -> dict[str, float]:
        """What the session measured since the last step's log, under the names the trackers show: the step's wall
        time, the mean time of the syncs completed since (none: no key), the active policy version and the staleness
        in steps of the batch trained on. Rank 0 alone publishes, so the others add nothing."""
        if not self.main:
            return {}
        with self._progress_lock:
            syncs, self._syncs_since_log = self._syncs_since_log, []
        measured: dict[str, float | None] = {
            STEP_SECONDS_KEY: self._last_step_seconds,
            SYNC_SECONDS_KEY: sum(syncs) / len(syncs) if syncs else None,
            POLICY_VERSION_KEY: float(self.sync.active.version) if self.sync.active else None,
            STALENESS_KEY: _number(self.staleness()),
        }
        return {key: value for key, value in measured.items() if value is not None}

    def on_save(self, state: TrainerState, output_dir: str) -> None:
        self.sync.wait()  # the checkpoint names the version published from it
        if self.trainer is not None and self.trainer.accelerator.num_processes > 1:
            self.trainer.accelerator.wait_for_everyone()  # every rank has written its part (RNG states)
        if not self.main:
            return
        checkpoint = Path(output_dir) / f"checkpoint-{state.global_step}"
        version = self.sync.active.version if self.sync.active else None
        mark_complete(checkpoint, step=state.global_step, attempt=self.attempt, adapter_version=version)
        self.metrics.checkpoint_step.set(state.global_step)
        self._log(f"checkpoint {checkpoint} complete (step {state.global_step})")

    def on_train_end(self) -> None:
        self.sync.wait()
        if self.main and self.trainer is not None:
            note = self.sync.publish_final(self._model(), self.publish_dtype, self.current_step())
            if note:
                self._log(note)

    def write_progress(self, step: int, *, done: bool) -> TrainingProgress:
        """The progress record; rank 0 writes it to the progress file."""
        reward, std = self._last_reward
        progress = TrainingProgress(
            step=step,
            max_steps=self.max_steps,
            reward_mean=reward,
            reward_std=std,
            adapter_version=self.sync.active.version if self.sync.active else None,
            sync_seconds=self.last_sync.seconds if self.last_sync else None,
            attempt=self.attempt,
            lagging_replicas=self.sync.lagging_replicas(),
            done=done,
            updated_at=now(),
        )
        if self.main:
            with self._progress_lock:
                write_progress(self.progress_file, progress)
        return progress

    def finish(self) -> TrainingProgress:
        self.sync.wait()
        step = self.current_step()
        return self.write_progress(step, done=step >= self.max_steps)


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not math.isnan(value):
        return float(value)
    return None


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _is_ratio(logs: dict[str, Any]) -> str:
    """The importance-sampling ratio's min/mean/max of the step (n/a without the correction): a mean far under 1
    says that many tokens were masked or down-weighted, the first sign of samples too stale for the rate."""
    values = [_number(logs.get(f"sampling/importance_sampling_ratio/{k}")) for k in ("min", "mean", "max")]
    if any(v is None for v in values):
        return "n/a"
    return "/".join(f"{v:.3g}" for v in values if v is not None)


class SessionCallback(TrainerCallback):
    """Forwards the Trainer's events to the session."""

    def __init__(self, session: TrainingSession) -> None:
        self.session = session

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.session.on_train_begin(state)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.session.on_step_begin()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.session.on_step_end(state)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.session.on_log(state, logs or {})

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.session.on_save(state, str(args.output_dir))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.session.on_train_end()
