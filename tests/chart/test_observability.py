"""Alerts and dashboards: promtool checks and unit tests, and every metric they name is one the
components really export (their METRIC_NAMES, and the /metrics of running processes)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from grpo_operator.metrics import METRIC_NAMES as OPERATOR_METRICS
from grpo_server.metrics import METRIC_NAMES as SERVER_METRICS
from grpo_trainer.metrics import METRIC_NAMES as TRAINER_METRICS

from .conftest import CHART, Chart, ChartTools, one, prometheus_rules_file
from .test_chart_render import SCENARIOS

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
ALERTS_TEST = Path(__file__).with_name("alerts-test.yaml")

#: vLLM 0.26.0's metric families (vllm/v1/metrics/loggers.py, PrometheusStatLogger), as exposed:
#: counters with `_total`. Only the vllm engine exports them; the CPU tests run the transformers
#: engine, so these are checked against this list, taken from the vLLM source.
VLLM_METRICS = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_waiting_by_reason",
    "vllm:engine_sleep_state", "vllm:kv_cache_usage_perc", "vllm:lora_requests_info", "vllm:cache_config_info",
    "vllm:corrupted_requests_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
    "vllm:mm_cache_queries_total", "vllm:mm_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:prompt_tokens_by_source_total", "vllm:prompt_tokens_cached_total",
    "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:iteration_tokens_total",
    "vllm:request_max_num_generation_tokens", "vllm:request_params_n", "vllm:request_params_max_tokens",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
)
#: Series Prometheus itself makes for every target (only the alerts use `up`).
PROMETHEUS_SERIES = ("up",)
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# ------------------------------------------------------------------------------ PromQL metric names

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan", "atan2"}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?")
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def concrete(expr: str) -> str:
    """A Grafana query with its built-in variables replaced, so that Prometheus's parser takes it."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (promtool has checked its syntax separately)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', concrete(expr))  # strings
    names: set[str] = set()
    text = re.sub(r"\{[^{}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\[\]]*\]", " ", text)  # ranges and subqueries
    text = _GROUPING.sub(" ", text)
    for match in _IDENTIFIER.finditer(text):
        name, call = match.group(1), match.group(2)
        if call is None and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


def test_metric_name_extraction_finds_selectors_and_skips_functions_labels_and_keywords() -> None:
    expr = ('histogram_quantile(0.95, sum by (namespace, le) (rate(grpo_x_bucket{job="a", le=~"1|2"}[5m])))'
            ' / on (namespace) group_left max without (pod) (vllm:kv_cache_usage_perc offset 5m)'
            ' > bool 0 and time() - grpo_y unless absent(up{job="z"})')
    assert metric_names(expr) == {"grpo_x_bucket", "vllm:kv_cache_usage_perc", "grpo_y", "up"}
    assert metric_names('sum(increase(grpo_a_total[$__rate_interval])) or vector(0)') == {"grpo_a_total"}


def declared(name: str) -> bool:
    """Declared by a component: listed in a METRIC_NAMES (or vLLM's), or a histogram series of one."""
    families = set(OPERATOR_METRICS) | set(SERVER_METRICS) | set(TRAINER_METRICS) | set(VLLM_METRICS)
    if name in families:
        return True
    return any(name.endswith(s) and name.removesuffix(s) in families for s in HISTOGRAM_SUFFIXES)


# ---------------------------------------------------------------------------------------- dashboards


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    queries = []
    panels = list(dashboard["panels"])
    while panels:
        panel = panels.pop()
        panels.extend(panel.get("panels", []))
        queries += [t["expr"] for t in panel.get("targets", [])]
    return queries


def variable_metrics(dashboard: dict[str, Any]) -> set[str]:
    """Metrics of the template variables' label_values(METRIC{...}, label) queries."""
    names = set()
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
            assert match, f"{dashboard['uid']}: variable {variable['name']} query {query!r}"
            names |= metric_names(match.group(1))
    return names


@pytest.fixture(scope="module", params=[p.name for p in DASHBOARDS])
def dashboard(request: pytest.FixtureRequest) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CHART / "dashboards" / request.param).read_text())
    return data


def test_dashboards_cover_runs_server_and_operator() -> None:
    assert {p.stem for p in DASHBOARDS} == {"runs-overview", "server", "operator"}
    uids = [json.loads(p.read_text())["uid"] for p in DASHBOARDS]
    assert len(set(uids)) == len(uids)


def test_dashboard_is_a_grafana_dashboard_on_a_prometheus_datasource_variable(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] and dashboard["title"].startswith("GRPO / ")
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = set()
    for panel in dashboard["panels"]:
        assert panel["id"] not in ids
        ids.add(panel["id"])
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], f"{dashboard['uid']}: panel {panel['title']!r} has no query"
    assert len(dashboard_queries(dashboard)) >= 8


def test_dashboard_queries_name_only_exported_metrics(dashboard: dict[str, Any]) -> None:
    used = set().union(*(metric_names(q) for q in dashboard_queries(dashboard))) | variable_metrics(dashboard)
    unknown = sorted(name for name in used if not declared(name))
    assert not unknown, f"{dashboard['uid']} queries metrics no component exports: {unknown}"


def test_dashboards_use_every_family_the_issue_asks_for() -> None:
    used = set()
    for path in DASHBOARDS:
        used |= set().union(*(metric_names(q) for q in dashboard_queries(json.loads(path.read_text()))))
    wanted = {
        "grpo_operator_runs", "grpo_trainer_step", "grpo_trainer_reward_mean", "grpo_trainer_kl", "grpo_trainer_loss",
        "grpo_trainer_sync_seconds_bucket", "grpo_trainer_staleness_steps_bucket", "grpo_operator_attempts_total",
        "grpo_server_generation_tokens_total", "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting",
        "vllm:time_to_first_token_seconds_bucket", "grpo_server_adapter_loads_total",
        "grpo_operator_reconcile_duration_seconds_count", "grpo_operator_reconcile_duration_seconds_bucket",
        "grpo_operator_reconcile_errors_total",
        # Per-run operator series: phase, attempts and failures of each run by name.
        "grpo_operator_run_phase", "grpo_operator_run_attempt", "grpo_operator_run_failures_total",
    }
    assert not wanted - used, f"no panel shows {sorted(wanted - used)}"


def test_dashboard_queries_parse_with_promtool(chart_tools: ChartTools, tmp_path: Path) -> None:
    rules = []
    for path in DASHBOARDS:
        for i, query in enumerate(dashboard_queries(json.loads(path.read_text()))):
            rules.append({"record": f"dashboard:{path.stem.replace('-', '_')}:{i}",
                          "expr": concrete(query).replace("$namespace", ".*").replace("$grporun", ".*")})
    rules_file = tmp_path / "dashboard-queries.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run([str(chart_tools.promtool), "check", "rules", str(rules_file)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"promtool refused a dashboard query:\n{result.stdout}{result.stderr}"


# -------------------------------------------------------------------------------------------- alerts


@pytest.fixture(scope="module")
def rules_file(chart: Chart, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prometheus_rules_file(chart.render(SCENARIOS["monitoring-on"]), tmp_path_factory.mktemp("rules"))


def test_alerts_cover_the_failures_the_issue_names(rules_file: Path) -> None:
    alerts = {r["alert"] for g in yaml.safe_load(rules_file.read_text())["groups"] for r in g["rules"]}
    assert alerts == {"GRPOOperatorDown", "GRPORunFailed", "GRPORunWaitingForServer", "GRPOServerNotReady",
                      "GRPOAdapterSyncFailing", "GRPORewardNaN", "GRPORewardStalled", "GRPOStalenessAboveBound"}


def test_alert_rules_pass_promtool_check(chart_tools: ChartTools, rules_file: Path) -> None:
    result = subprocess.run([str(chart_tools.promtool), "check", "rules", str(rules_file)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"promtool check rules:\n{result.stdout}{result.stderr}"
    assert "SUCCESS: 8 rules found" in result.stdout, result.stdout


def test_alert_rules_pass_their_promtool_unit_tests(chart_tools: ChartTools, rules_file: Path) -> None:
    tests = yaml.safe_load(ALERTS_TEST.read_text())
    tests["rule_files"] = [str(rules_file)]
    tested = {case["alertname"] for group in tests["tests"] for case in group["alert_rule_test"]}
    rendered = {r["alert"] for g in yaml.safe_load(rules_file.read_text())["groups"] for r in g["rules"]}
    assert tested == rendered, f"alerts without a promtool test: {sorted(rendered - tested)}"
    test_file = rules_file.with_name("alerts-test.yaml")
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run([str(chart_tools.promtool), "test", "rules", str(test_file)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"promtool test rules:\n{result.stdout}{result.stderr}"


def test_promtool_unit_tests_fail_when_an_alert_misbehaves(chart_tools: ChartTools, rules_file: Path) -> None:
    """The unit tests have teeth: an alert with its threshold flipped fails them."""
    rules = yaml.safe_load(rules_file.read_text())
    stalled = next(r for g in rules["groups"] for r in g["rules"] if r["alert"] == "GRPORewardStalled")
    stalled["expr"] = stalled["expr"].replace("== 0", "> 0")
    broken = rules_file.with_name("broken-rules.yaml")
    broken.write_text(yaml.safe_dump(rules, sort_keys=False))
    tests = yaml.safe_load(ALERTS_TEST.read_text())
    tests["rule_files"] = [str(broken)]
    test_file = rules_file.with_name("broken-test.yaml")
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run([str(chart_tools.promtool), "test", "rules", str(test_file)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "GRPORewardStalled" in result.stdout + result.stderr


def test_alerts_about_a_run_name_the_run(rules_file: Path) -> None:
    rules = [r for g in yaml.safe_load(rules_file.read_text())["groups"] for r in g["rules"]]
    for rule in rules:
        if rule["alert"] == "GRPOOperatorDown":
            continue
        # The promtool tests check that the `grporun` label reaches the alert.
        assert "$labels.grporun" in rule["annotations"]["summary"], rule["alert"]


def test_a_nan_reward_the_trainer_exports_fires_the_nan_alert(chart_tools: ChartTools, rules_file: Path) -> None:
    """From the trainer's /metrics text to the alert: the NaN must survive the export."""
    from prometheus_client import generate_latest

    from grpo_trainer.metrics import TrainerMetrics

    exported = TrainerMetrics()
    exported.observe_trl_logs({"reward": float("nan"), "loss": 0.25})
    text = generate_latest(exported.registry).decode()
    # The sample values exactly as Prometheus would read them off the trainer's /metrics page.
    reward = re.search(r"^grpo_trainer_reward_mean (\S+)$", text, re.M)
    loss = re.search(r"^grpo_trainer_loss (\S+)$", text, re.M)
    assert reward and loss, text
    assert (reward.group(1), loss.group(1)) == ("NaN", "0.25")
    labels = 'job="grpo-trainer", namespace="team-a", grporun="exported"'
    tests = {"rule_files": [str(rules_file)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": f"grpo_trainer_{name}{{{labels}}}", "values": " ".join([value.group(1)] * 11)}
                         for name, value in (("reward_mean", reward), ("loss", loss))],
        "alert_rule_test": [{"eval_time": "5m", "alertname": "GRPORewardNaN", "exp_alerts": [{
            "exp_labels": {"severity": "critical", "job": "grpo-trainer", "namespace": "team-a", "grporun": "exported"},
            "exp_annotations": {
                "summary": "GRPORun team-a/exported reports a NaN reward or loss.",
                "description": "A NaN reward or loss poisons the update; check the reward functions and the "
                               "learning rate."}}]}],
    }]}
    test_file = rules_file.with_name("nan-export-test.yaml")
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run([str(chart_tools.promtool), "test", "rules", str(test_file)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"promtool test rules:\n{result.stdout}{result.stderr}"


def test_alert_rules_name_only_exported_metrics(rules_file: Path) -> None:
    rendered = yaml.safe_load(rules_file.read_text())
    used = set().union(*(metric_names(r["expr"]) for g in rendered["groups"] for r in g["rules"]))
    unknown = sorted(n for n in used if not declared(n) and n not in PROMETHEUS_SERIES)
    assert not unknown, f"alerts query metrics no component exports: {unknown}"


def test_prometheus_rule_keeps_its_labels_for_rule_selection(chart: Chart) -> None:
    rule = one(chart.render(SCENARIOS["monitoring-on"]), "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus"
