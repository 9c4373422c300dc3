"""Every metric the dashboards and alerts name is in the /metrics of a running component:
a `grpo serve` process (transformers engine, tiny model), a `grpo train` process training against
it, and a `grpo operator` process against the real control plane.

vLLM's own `vllm:` metrics come only from the vllm engine (GPU); test_observability.py checks
those names against vLLM's source list instead.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from tests.fixtures.chart_values import SCENARIOS
from tests.fixtures.controlplane import ControlPlane
from tests.fixtures.metric_queries import dashboard_queries, metric_names, variable_metrics
from tests.fixtures.processes import end_process_group
from tests.fixtures.server import RunningServer, free_port
from tests.fixtures.waiting import wait_for

from .conftest import CHART, Chart, prometheus_rules_file

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def exposed_series(text: str) -> set[str]:
    """Series names a /metrics page can produce: every sample's name, and for each declared family
    (`# TYPE`) the names its type implies, since a labelled family shows no sample until used."""
    names = set()
    for line in text.splitlines():
        declared = re.match(r"# TYPE (\S+) (\w+)", line)
        if declared:
            name, kind = declared.groups()
            names |= {name} | {name + suffix for suffix in SUFFIXES.get(kind, ())}
        elif line and not line.startswith("#"):
            sample = re.match(r"[A-Za-z_:][\w:]*", line)
            assert sample, f"unparseable /metrics line {line!r}"
            names.add(sample.group(0))
    return names


def test_exposed_series_reads_declared_families_and_samples() -> None:
    text = ("# HELP a_total h\n# TYPE a_total counter\n# TYPE b histogram\nb_bucket{le=\"1\"} 0\n"
            "# TYPE c gauge\nc{x=\"1\"} 2\nd_created 1\n")
    assert exposed_series(text) == {"a_total", "b", "b_bucket", "b_sum", "b_count", "c", "d_created"}


@pytest.fixture(scope="module")
def used_metrics(chart: Chart, tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every metric name any dashboard query, dashboard variable or alert expression uses."""
    used: set[str] = set()
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        used |= set().union(*(metric_names(q) for q in dashboard_queries(dashboard))) | variable_metrics(dashboard)
    rules = yaml.safe_load(prometheus_rules_file(chart.render(SCENARIOS["monitoring-on"]),
                                                 tmp_path_factory.mktemp("scrape-rules")).read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            used |= metric_names(rule["expr"])
    return used


def missing(used: set[str], prefix: str, exposed: set[str]) -> list[str]:
    wanted = {name for name in used if name.startswith(prefix)}
    assert wanted, f"no dashboard or alert uses a {prefix} metric"
    return sorted(wanted - exposed)


@pytest.mark.slow
def test_server_metrics_used_by_dashboards_and_alerts_are_served(used_metrics: set[str],
                                                                 tiny_server: RunningServer) -> None:
    response = httpx.get(f"{tiny_server.url}/metrics", timeout=10)
    assert response.status_code == 200
    absent = missing(used_metrics, "grpo_server_", exposed_series(response.text))
    assert not absent, f"a running server does not export {absent}"


@pytest.mark.slow
def test_trainer_metrics_used_by_dashboards_and_alerts_are_served(used_metrics: set[str],
                                                                  tiny_server: RunningServer,
                                                                  tiny_model_dir: Path, tiny_dataset: Path,
                                                                  tmp_path: Path) -> None:
    from tests.fixtures.trainer_runs import clear_adapter, grpo_train, token_fraction, trainer_config

    clear_adapter(tiny_server)
    _, config = trainer_config(tiny_server, tmp_path, dataset=tiny_dataset, rewards=[token_fraction(tiny_model_dir)],
                               trainer={"maxSteps": 40, "syncInterval": 1, "checkpointInterval": 40})
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "GRPO_TRAINER_METRICS_PORT": str(port)}
    log = (tmp_path / "trainer.log").open("wb")
    proc = subprocess.Popen(grpo_train(config), stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)

    def scrape_after_a_step() -> str | None:
        if proc.poll() is not None:
            pytest.fail(f"the trainer exited with {proc.returncode} before a scrape:\n"
                        + (tmp_path / "trainer.log").read_text()[-4000:])
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        except httpx.HTTPError:
            return None
        step = re.search(r"^grpo_trainer_step (\S+)$", text, re.M)
        return text if step and float(step.group(1)) >= 1 else None

    try:
        text = wait_for(scrape_after_a_step, timeout=240, interval=0.2, what="a trainer step on /metrics")
    finally:
        end_process_group(proc, timeout=30)
        log.close()
    absent = missing(used_metrics, "grpo_trainer_", exposed_series(text))
    assert not absent, f"a running trainer does not export {absent}"


@pytest.mark.controlplane
def test_operator_metrics_used_by_dashboards_and_alerts_are_served(used_metrics: set[str],
                                                                   control_plane: ControlPlane,
                                                                   grporun_crd: dict[str, object],
                                                                   namespace: str, tmp_path: Path) -> None:
    metrics_port, liveness_port = free_port(), free_port()
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig), "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "operator.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "grpo_cli.main", "operator", "--namespace", namespace,
             "--metrics-port", str(metrics_port), "--liveness-port", str(liveness_port)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )

    def scrape() -> str | None:
        if proc.poll() is not None:
            pytest.fail(f"the operator exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            response = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    try:
        text = wait_for(scrape, timeout=60, what="the operator's /metrics")
        liveness = httpx.get(f"http://127.0.0.1:{liveness_port}/healthz", timeout=5)
        assert liveness.status_code == 200, liveness.text  # what the chart's livenessProbe asks
    finally:
        end_process_group(proc)
    absent = missing(used_metrics, "grpo_operator_", exposed_series(text))
    assert not absent, f"a running operator does not export {absent}"


def test_every_used_metric_belongs_to_a_scraped_component_or_vllm(used_metrics: set[str]) -> None:
    others = sorted(n for n in used_metrics
                    if not n.startswith(("grpo_server_", "grpo_trainer_", "grpo_operator_", "vllm:")) and n != "up")
    assert not others, f"dashboards or alerts use metrics no test scrapes: {others}"

