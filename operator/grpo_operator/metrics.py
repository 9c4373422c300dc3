"""The operator's Prometheus metrics (served on its own /metrics port; kopf has none).

Every exposed family name is listed in METRIC_NAMES, which the chart's alert rules and
dashboards are checked against.

Per-run families carry `namespace` (the run's) and `grporun` (its name), the labels the chart's
PodMonitors give the run's server and trainer series, so operator and run series join on them.
The operator's own scrape target also has a `namespace` (the operator's): scrape it with
`honor_labels: true` (the chart's ServiceMonitor does) so the run's namespace wins. A run's
series go when the run is deleted.

Counters with a fixed set of label values start at 0 for every value, so that a healthy operator's
dashboards show zero failures rather than no data, and `increase()` sees the first failure.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from grpo_api import reasons
from grpo_api.models import Phase

RUNS = Gauge("grpo_operator_runs", "GRPORuns this operator reconciles, by phase.", ["phase"])
RECONCILE_DURATION = Histogram(
    "grpo_operator_reconcile_duration_seconds",
    "Time of one reconcile of one run (observe, decide, act, write status).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
RECONCILE_ERRORS = Counter(
    "grpo_operator_reconcile_errors", "Reconciles that failed, by kind of error.", ["error"]
)
#: Kinds of reconcile error known in advance (API answers add api_<status>).
RECONCILE_ERROR_KINDS = ("api_unreachable",)
#: Reasons that count as a failed attempt or run (the one table: `grpo_api.reasons`).
FAILURE_REASONS = reasons.FAILURE_REASONS
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
for _kind in RECONCILE_ERROR_KINDS:
    RECONCILE_ERRORS.labels(error=_kind)
for _reason in sorted(FAILURE_REASONS):
    FAILURES.labels(reason=_reason)
RUN_LABELS = ("namespace", "grporun")
RUN_PHASE = Gauge(
    "grpo_operator_run_phase",
    "1 for the phase each run is in (a run has no series for its other phases).",
    [*RUN_LABELS, "phase"],
)
RUN_ATTEMPT = Gauge(
    "grpo_operator_run_attempt", "The attempt each run is on (0 before its first).", list(RUN_LABELS)
)
RUN_FAILURES = Counter(
    "grpo_operator_run_failures",
    "Failed attempts and failed runs of each run, by reason.",
    [*RUN_LABELS, "reason"],
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
    "grpo_operator_run_phase",
    "grpo_operator_run_attempt",
    "grpo_operator_run_failures_total",
)


def set_runs_by_phase(phases: dict[str, str]) -> None:
    """Set the per-phase gauge from the phase of every known run (uid -> phase)."""
    counts: dict[str, int] = {}
    for phase in phases.values():
        counts[phase] = counts.get(phase, 0) + 1
    for phase in Phase:
        RUNS.labels(phase=phase.value).set(counts.get(phase.value, 0))


def set_run(namespace: str, run: str, phase: str, attempt: int) -> None:
    """Record a run's phase and attempt; the run keeps exactly one phase series."""
    for other in Phase:
        if other.value != phase:
            RUN_PHASE.remove(namespace, run, other.value)
    RUN_PHASE.labels(namespace=namespace, grporun=run, phase=phase).set(1)
    RUN_ATTEMPT.labels(namespace=namespace, grporun=run).set(attempt)
    for reason in FAILURE_REASONS:
        RUN_FAILURES.labels(namespace=namespace, grporun=run, reason=reason)


def count_run_failure(namespace: str, run: str, reason: str) -> None:
    FAILURES.labels(reason=reason).inc()
    RUN_FAILURES.labels(namespace=namespace, grporun=run, reason=reason).inc()


def forget_run(namespace: str, run: str) -> None:
    """Drop every series of a deleted run."""
    labels = {"namespace": namespace, "grporun": run}
    for family in (RUN_PHASE, RUN_ATTEMPT, RUN_FAILURES):
        family.remove_by_labels(labels)
