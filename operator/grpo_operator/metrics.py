"""The operator's Prometheus metrics (served on its own /metrics port; kopf has none).

Every exposed family name is listed in METRIC_NAMES, which the chart's alert rules and
dashboards are checked against.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RUNS = Gauge("grpo_operator_runs", "GRPORuns this operator reconciles, by phase.", ["phase"])
RECONCILE_DURATION = Histogram(
    "grpo_operator_reconcile_duration_seconds",
    "Time of one reconcile of one run (observe, decide, act, write status).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
RECONCILE_ERRORS = Counter(
    "grpo_operator_reconcile_errors", "Reconciles that failed, by kind of error.", ["error"]
)
SERVER_READY_LATENCY = Histogram(
    "grpo_operator_server_ready_latency_seconds",
    "From the attempt's server pod being created to its health check passing with a fresh boot id.",
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 2400),
)
ATTEMPTS = Counter("grpo_operator_attempts", "Attempts started (each with a fresh server).")
FAILURES = Counter("grpo_operator_failures", "Failed attempts and failed runs, by reason.", ["reason"])
API_REQUESTS = Counter(
    "grpo_operator_api_requests",
    "Kubernetes API requests made by the reconciler, by verb and kind.",
    ["verb", "kind"],
)
LAST_RECONCILE = Gauge(
    "grpo_operator_last_reconcile_timestamp_seconds", "Unix time the latest reconcile of any run finished."
)

METRIC_NAMES: tuple[str, ...] = (
    "grpo_operator_runs",
    "grpo_operator_reconcile_duration_seconds",
    "grpo_operator_reconcile_errors_total",
    "grpo_operator_server_ready_latency_seconds",
    "grpo_operator_attempts_total",
    "grpo_operator_failures_total",
    "grpo_operator_api_requests_total",
    "grpo_operator_last_reconcile_timestamp_seconds",
)


def set_runs_by_phase(phases: dict[str, str]) -> None:
    """Set the per-phase gauge from the phase of every known run (uid -> phase)."""
    counts: dict[str, int] = {}
    for phase in phases.values():
        counts[phase] = counts.get(phase, 0) + 1
    for phase in ("Pending", "StartingServer", "Training", "Suspended", "Succeeded", "Failed"):
        RUNS.labels(phase=phase).set(counts.get(phase, 0))
