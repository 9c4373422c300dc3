"""Prometheus metrics of the trainer, served on `/metrics`.

Every exported family name is listed in METRIC_NAMES (the Helm dashboards and
alert rules are checked against it). Counters are listed with the `_total`
suffix they are exposed with; histograms by their base name (the series are
`<name>_bucket`, `<name>_sum`, `<name>_count`).
"""

from __future__ import annotations

import os
from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from grpo_api.protocol import ADAPTER_REFUSALS
from grpo_trainer.errors import TrainingFailed

#: Overrides spec.trainer.metricsPort; "0" disables the endpoint (tests run several trainers at once).
ENV_METRICS_PORT = "GRPO_TRAINER_METRICS_PORT"

METRIC_NAMES: tuple[str, ...] = (
    "grpo_trainer_step",
    "grpo_trainer_max_steps",
    "grpo_trainer_step_seconds",
    "grpo_trainer_reward_mean",
    "grpo_trainer_reward_std",
    "grpo_trainer_reward_function_mean",
    "grpo_trainer_reward_function_std",
    "grpo_trainer_loss",
    "grpo_trainer_kl",
    "grpo_trainer_clip_ratio",
    "grpo_trainer_entropy",
    "grpo_trainer_learning_rate",
    "grpo_trainer_grad_norm",
    "grpo_trainer_completion_length_mean",
    "grpo_trainer_completion_clipped_ratio",
    "grpo_trainer_importance_sampling_ratio",
    "grpo_trainer_sampling_logp_difference",
    "grpo_trainer_generation_seconds",
    "grpo_trainer_generation_tokens_per_second",
    "grpo_trainer_generated_tokens_total",
    "grpo_trainer_generation_retries_total",
    "grpo_trainer_discarded_batches_total",
    "grpo_trainer_server_restarts_total",
    "grpo_trainer_server_replicas",
    "grpo_trainer_server_replicas_ready",
    "grpo_trainer_server_replica_lagging_since_seconds",
    "grpo_trainer_staleness_steps",
    "grpo_trainer_staleness_bound_steps",
    "grpo_trainer_staleness_versions",
    "grpo_trainer_staleness_bound_versions",
    "grpo_trainer_sync_seconds",
    "grpo_trainer_sync_wait_seconds",
    "grpo_trainer_sync_snapshot_seconds",
    "grpo_trainer_sync_last_bytes",
    "grpo_trainer_sync_bytes_total",
    "grpo_trainer_syncs_total",
    "grpo_trainer_sync_failures_total",
    "grpo_trainer_adapter_version",
    "grpo_trainer_checkpoint_step",
)

#: TRL log key -> (gauge attribute, label value or None).
_TRL_LOG_GAUGES: dict[str, tuple[str, str | None]] = {
    "reward": ("reward_mean", None),
    "reward_std": ("reward_std", None),
    "loss": ("loss", None),
    "kl": ("kl", None),
    "entropy": ("entropy", None),
    "learning_rate": ("learning_rate", None),
    "grad_norm": ("grad_norm", None),
    "completions/mean_length": ("completion_length_mean", None),
    "completions/clipped_ratio": ("completion_clipped_ratio", None),
    "clip_ratio/low_mean": ("clip_ratio", "low_mean"),
    "clip_ratio/high_mean": ("clip_ratio", "high_mean"),
    "clip_ratio/region_mean": ("clip_ratio", "region_mean"),
    "sampling/importance_sampling_ratio/min": ("importance_sampling_ratio", "min"),
    "sampling/importance_sampling_ratio/mean": ("importance_sampling_ratio", "mean"),
    "sampling/importance_sampling_ratio/max": ("importance_sampling_ratio", "max"),
    "sampling/sampling_logp_difference/mean": ("sampling_logp_difference", "mean"),
    "sampling/sampling_logp_difference/max": ("sampling_logp_difference", "max"),
}

#: Why a generated batch may be thrown away (GenerationClient.verdict).
#: policy_drift: a stale batch whose sampler is farther from the training policy than
#: importanceSampling.maxDrift (DriftGuard), generated again from the current policy.
DiscardReason = Literal["server_restarted", "unknown_adapter", "stale_adapter", "policy_drift"]
DISCARD_REASONS: tuple[str, ...] = get_args(DiscardReason)
#: Why an adapter sync attempt may fail: the server's refusals, or no confirmation, or no answer.
SYNC_FAILURE_REASONS = (*ADAPTER_REFUSALS, "unconfirmed", "unreachable")
_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_STEP_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
#: One optimizer step: under a second for the tiny CPU model, up to many minutes for long completions.
_STEP_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)


class TrainerMetrics:
    """The trainer's metric families, in a registry of their own (one per run, so tests can run several)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.step = Gauge("grpo_trainer_step", "Optimizer steps completed.", registry=r)
        self.max_steps = Gauge("grpo_trainer_max_steps", "Optimizer steps to train.", registry=r)
        self.step_seconds = Histogram(
            "grpo_trainer_step_seconds",
            "Wall time of one optimizer step: generation (or waiting for a prefetched batch), rewards, "
            "forward, backward and update.",
            buckets=_STEP_SECONDS_BUCKETS, registry=r,
        )
        self.reward_mean = Gauge("grpo_trainer_reward_mean", "Mean total reward of the latest step.", registry=r)
        self.reward_std = Gauge("grpo_trainer_reward_std", "Std of the total reward of the latest step.", registry=r)
        self.reward_function_mean = Gauge(
            "grpo_trainer_reward_function_mean", "Mean reward of one function.", ["function"], registry=r
        )
        self.reward_function_std = Gauge(
            "grpo_trainer_reward_function_std", "Std of the reward of one function.", ["function"], registry=r
        )
        self.loss = Gauge("grpo_trainer_loss", "Training loss of the latest step.", registry=r)
        self.kl = Gauge("grpo_trainer_kl", "KL to the base model (logged when beta > 0).", registry=r)
        self.clip_ratio = Gauge(
            "grpo_trainer_clip_ratio", "Share of tokens whose PPO ratio was clipped.", ["region"], registry=r
        )
        self.entropy = Gauge("grpo_trainer_entropy", "Mean token entropy of the policy.", registry=r)
        self.learning_rate = Gauge("grpo_trainer_learning_rate", "Current learning rate.", registry=r)
        self.grad_norm = Gauge("grpo_trainer_grad_norm", "Gradient norm of the latest step.", registry=r)
        self.completion_length_mean = Gauge(
            "grpo_trainer_completion_length_mean", "Mean completion length in tokens.", registry=r
        )
        self.completion_clipped_ratio = Gauge(
            "grpo_trainer_completion_clipped_ratio", "Share of completions cut at max length.", registry=r
        )
        self.importance_sampling_ratio = Gauge(
            "grpo_trainer_importance_sampling_ratio",
            "Trainer/server importance-sampling ratio statistics.",
            ["stat"],
            registry=r,
        )
        self.sampling_logp_difference = Gauge(
            "grpo_trainer_sampling_logp_difference",
            "Difference between trainer and server token log-probabilities.",
            ["stat"],
            registry=r,
        )
        self.generation_seconds = Histogram(
            "grpo_trainer_generation_seconds", "Latency of one generation request.", buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.generation_tokens_per_second = Gauge(
            "grpo_trainer_generation_tokens_per_second", "Completion tokens per second of the latest batch.",
            registry=r,
        )
        self.generated_tokens = Counter(
            "grpo_trainer_generated_tokens", "Completion tokens received from the server.", registry=r
        )
        self.generation_retries = Counter(
            "grpo_trainer_generation_retries", "Generation requests retried after an error.", registry=r
        )
        self.discarded_batches = Counter(
            "grpo_trainer_discarded_batches",
            "Generated batches thrown away before reaching the loss.",
            ["reason"],
            registry=r,
        )
        # Reasons known in advance start at 0, so dashboards show zero rather than no data.
        for reason in DISCARD_REASONS:
            self.discarded_batches.labels(reason)
        self.server_restarts = Counter(
            "grpo_trainer_server_restarts", "New server boot ids seen during training.", registry=r
        )
        self.server_replicas = Gauge(
            "grpo_trainer_server_replicas", "Server replicas the trainer found (discovery).", registry=r
        )
        self.server_replicas_ready = Gauge(
            "grpo_trainer_server_replicas_ready",
            "Server replicas that served the current policy at the latest batch.", registry=r,
        )
        self.server_replica_lagging_since = Gauge(
            "grpo_trainer_server_replica_lagging_since_seconds",
            "Unix time since which a server replica has not served the current policy (hung, unreachable, "
            "restarted, or a sync or request it has not answered): it gets no work until it does. No series "
            "while it does.", ["replica"], registry=r,
        )
        self.staleness_steps = Histogram(
            "grpo_trainer_staleness_steps",
            "Policy steps between the adapter that generated a batch and the step training on it.",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.staleness_versions = Histogram(
            "grpo_trainer_staleness_versions",
            "Adapter versions published between the one that generated a batch and the step training on it.",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.staleness_bound_versions = Gauge(
            "grpo_trainer_staleness_bound_versions",
            "Largest age of a batch's policy accepted, in versions (trainer.maxStaleness, else what syncInterval "
            "and prefetchDepth produce).",
            registry=r,
        )
        self.staleness_bound_steps = Gauge(
            "grpo_trainer_staleness_bound_steps", "Largest staleness accepted (syncInterval + prefetchDepth).",
            registry=r,
        )
        self.sync_seconds = Histogram(
            "grpo_trainer_sync_seconds", "Latency of one adapter sync (save, publish, load, confirm).",
            buckets=_SECONDS_BUCKETS, registry=r,
        )
        self.sync_wait_seconds = Histogram(
            "grpo_trainer_sync_wait_seconds",
            "Time a step or a generation request waited for a background adapter sync to finish.",
            buckets=_SECONDS_BUCKETS, registry=r,
        )
        self.sync_snapshot_seconds = Histogram(
            "grpo_trainer_sync_snapshot_seconds",
            "Time the training loop spent taking the adapter's bytes for a background sync.",
            buckets=_SECONDS_BUCKETS, registry=r,
        )
        self.sync_last_bytes = Gauge(
            "grpo_trainer_sync_last_bytes", "Size of the latest published adapter.", registry=r
        )
        self.sync_bytes_total = Counter(
            "grpo_trainer_sync_bytes", "Bytes of adapters published.", registry=r
        )
        self.syncs = Counter("grpo_trainer_syncs", "Adapter versions made active on the server.", registry=r)
        self.sync_failures = Counter(
            "grpo_trainer_sync_failures", "Failed adapter load triggers.", ["reason"], registry=r
        )
        for reason in SYNC_FAILURE_REASONS:
            self.sync_failures.labels(reason)
        self.adapter_version = Gauge(
            "grpo_trainer_adapter_version", "Latest adapter version active on the server.", registry=r
        )
        self.checkpoint_step = Gauge(
            "grpo_trainer_checkpoint_step", "Step of the latest complete checkpoint.", registry=r
        )

    def observe_trl_logs(self, logs: dict[str, float | None]) -> None:
        """Copy one TRL log record (reward, loss, kl, clip and IS statistics, ...) into the gauges.

        NaN is copied too: a NaN reward or loss is what the chart's GRPORewardNaN alert looks for
        (Prometheus stores NaN samples; `x != x` selects them).
        """
        for key, value in logs.items():
            if value is None or not isinstance(value, int | float):
                continue
            if key in _TRL_LOG_GAUGES:
                attr, label = _TRL_LOG_GAUGES[key]
                gauge: Gauge = getattr(self, attr)
                (gauge.labels(label) if label else gauge).set(value)
            elif key.startswith("rewards/") and key.count("/") >= 2:
                name, stat = key[len("rewards/"):].rsplit("/", 1)
                if stat == "mean":
                    self.reward_function_mean.labels(name).set(value)
                elif stat == "std":
                    self.reward_function_std.labels(name).set(value)

    def serve(self, port: int) -> None:
        """Serve /metrics on port (0: do not serve)."""
        if port <= 0:
            return
        try:
            start_http_server(port, registry=self.registry)
        except OSError as exc:
            raise TrainingFailed(
                f"cannot serve /metrics on port {port} (spec.trainer.metricsPort, or ${ENV_METRICS_PORT}): {exc}"
            ) from exc


def metrics_port(spec_port: int) -> int:
    """The port to serve on: $GRPO_TRAINER_METRICS_PORT if set, else the spec's."""
    raw = os.environ.get(ENV_METRICS_PORT)
    if raw is None or raw == "":
        return spec_port
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"${ENV_METRICS_PORT} must be a port number or 0, got {raw!r}") from exc
