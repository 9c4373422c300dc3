"""The shipped dashboards and alerts against real data: a real Prometheus scraped the operator, server
and trainer pods of this session's runs through Kubernetes service discovery (the `prometheus`
fixture). Runs after the example run and the faults, so failure and restart counters have data too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import NAMESPACE, RELEASE_NAMESPACE, REPO, Prometheus

DASHBOARDS = sorted((REPO / "charts" / "grpo-operator" / "dashboards").glob("*.json"))
EXAMPLE_RUN = "tiny-cpu"
#: vLLM's own series come only from the vllm engine (GPU); the node runs the transformers engine.
#: tests/chart/test_observability.py checks those names against vLLM's source instead.
GPU_ONLY = "vllm:"


def panel_queries(path: Path) -> list[tuple[str, str]]:
    dashboard = json.loads(path.read_text())
    found, panels = [], list(dashboard["panels"])
    while panels:
        panel = panels.pop()
        panels.extend(panel.get("panels", []))
        found += [(panel.get("title", ""), target["expr"]) for target in panel.get("targets", [])]
    return found


def concrete(expr: str) -> str:
    """The query as Grafana sends it, for this session's runs."""
    for variable, value in {"$__rate_interval": "1m", "$__interval": "10s", "$__range": "1h",
                            "$namespace": f"{NAMESPACE}|{RELEASE_NAMESPACE}", "$grporun": ".+"}.items():
        expr = expr.replace(variable, value)
    return expr


def session_window(prometheus: Prometheus) -> tuple[float, float]:
    if EXAMPLE_RUN not in prometheus.windows:
        pytest.fail("the example run did not record its time window (test_example_run.py must run first)")
    return prometheus.windows[EXAMPLE_RUN][0] - 30, time.time()


def test_prometheus_scraped_operator_server_and_trainer_pods(prometheus: Prometheus) -> None:
    start, end = prometheus.windows.get(EXAMPLE_RUN, (time.time() - 600, time.time()))
    for job in ("grpo-operator", "grpo-server", "grpo-trainer"):
        series = prometheus.query_range(f'max_over_time(up{{job="{job}"}}[1m]) == 1', start, end)
        assert series, f"no {job} pod was scraped during the example run"


@pytest.mark.parametrize("dashboard", DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def test_every_dashboard_query_returns_data_for_the_session_runs(prometheus: Prometheus, dashboard: Path) -> None:
    start, end = session_window(prometheus)
    empty = [f"{title}: {expr}" for title, expr in panel_queries(dashboard)
             if GPU_ONLY not in expr and not prometheus.query_range(concrete(expr), start, end, step=5)]
    assert not empty, "panel queries with no data for this session's runs:\n" + "\n".join(empty)


#: Rules whose condition is a normal, passing state, made an alert only by its `for` (15m): "the run is in
#: StartingServer" holds while any server loads its model, and "the engine is not ready" holds for a scrape
#: that lands while the engine loads (the server answers /metrics from its first second) or while it shuts
#: down at the run's end (CI caught one such scrape). Every other rule must not even match.
PENDING_BY_DESIGN = {"GRPORunWaitingForServer", "GRPOServerNotReady"}


def test_no_alert_fires_for_the_healthy_run(prometheus: Prometheus) -> None:
    """The example run trained without a fault: no rule fires for it, nor any run-independent rule
    (operator down) during it, and no rule but the one above even starts to match (pending). The rules
    are the chart's, with its default values."""
    start, end = prometheus.windows[EXAMPLE_RUN]
    alerts = [a["metric"] for a in prometheus.query_range("ALERTS", start, end + 10)
              if a["metric"].get("grporun") in (EXAMPLE_RUN, None)]
    firing = [a for a in alerts if a["alertstate"] == "firing"]
    assert not firing, f"alerts fired during the healthy run: {firing}"
    pending = [a for a in alerts if a["alertname"] not in PENDING_BY_DESIGN]
    assert not pending, f"rules matched during the healthy run: {pending}"
    rules = prometheus.api("rules", type="alert")["groups"]
    assert sum(len(g["rules"]) for g in rules) >= 8, rules   # the chart's rules are loaded and evaluated
    assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules
