"""Alerts and dashboards: promtool checks and unit tests, and every metric they name is one the
components really export (their METRIC_NAMES, and the /metrics of running processes)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from grpo_operator import metrics as operator_metrics
from grpo_operator.metrics import METRIC_NAMES as OPERATOR_METRICS
from grpo_server.metrics import METRIC_NAMES as SERVER_METRICS
from grpo_trainer.metrics import METRIC_NAMES as TRAINER_METRICS
from tests.fixtures.chart_values import SCENARIOS
from tests.fixtures.metric_queries import concrete, dashboard_queries, metric_names, variable_metrics

from .conftest import (
    CHART,
    RELEASE,
    RELEASE_NAMESPACE,
    REPO,
    Chart,
    ChartTools,
    Yaml12Loader,
    one,
    prometheus_rules_file,
)

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
ALERTS_TEST = Path(__file__).with_name("alerts-test.yaml")
RUNBOOKS = REPO / "docs" / "runbooks.md"
HELM_DOCS = REPO / "docs" / "helm.md"

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


def test_stall_alert_without_its_first_step_term_fails_the_slow_first_step_case(chart_tools: ChartTools,
                                                                              rules_file: Path) -> None:
    """The rule before the fix (no `grpo_trainer_step_seconds_count > 0` term) fired on a healthy run still on
    its first step: the promtool cases catch that."""
    rules = yaml.safe_load(rules_file.read_text())
    stalled = next(r for g in rules["groups"] for r in g["rules"] if r["alert"] == "GRPORewardStalled")
    term = re.search(r"\n\s*grpo_trainer_step_seconds_count\{[^}]*\} > 0\n\s*and", stalled["expr"])
    assert term, stalled["expr"]
    stalled["expr"] = stalled["expr"].replace(term.group(0), "")
    old = rules_file.with_name("old-stall-rules.yaml")
    old.write_text(yaml.safe_dump(rules, sort_keys=False))
    tests = yaml.safe_load(ALERTS_TEST.read_text())
    tests["rule_files"] = [str(old)]
    test_file = rules_file.with_name("old-stall-test.yaml")
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run([str(chart_tools.promtool), "test", "rules", str(test_file)],
                            capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "first-slow" in output and "resumed-slow" in output, output


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
                "runbook_url": f"{default_runbook_base_url()}#grporewardnan",
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


# ----------------------------------------------------------------------------------------- runbooks


def default_runbook_base_url() -> str:
    url: str = yaml.safe_load((CHART / "values.yaml").read_text())["prometheusRule"]["runbookBaseUrl"]
    return url


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def runbook_sections() -> dict[str, str]:
    """docs/runbooks.md's level-2 sections: anchor -> text."""
    parts = re.split(r"^## (.+)$", RUNBOOKS.read_text(), flags=re.M)
    return {github_anchor(heading): body for heading, body in zip(parts[1::2], parts[2::2], strict=True)}


def test_every_alert_links_to_its_section_of_the_runbooks(rules_file: Path) -> None:
    rules = [r for g in yaml.safe_load(rules_file.read_text())["groups"] for r in g["rules"]]
    base, sections = default_runbook_base_url(), runbook_sections()
    assert base.endswith("/docs/runbooks.md"), base
    for rule in rules:
        url = rule["annotations"].get("runbook_url")
        assert url, f"{rule['alert']} has no runbook_url"
        page, _, anchor = url.partition("#")
        assert page == base and anchor == rule["alert"].lower(), f"{rule['alert']}: {url}"
        assert anchor in sections, f"docs/runbooks.md has no section #{anchor} for {rule['alert']}"


def test_every_runbook_says_what_it_means_how_to_look_and_what_to_do(rules_file: Path) -> None:
    alerts = {r["alert"].lower() for g in yaml.safe_load(rules_file.read_text())["groups"] for r in g["rules"]}
    sections = runbook_sections()
    assert set(sections) == alerts, "docs/runbooks.md has one section per alert, and only those"
    for anchor, body in sections.items():
        for part in ("**What it means.**", "**How to look.**", "**What to do"):
            assert part in body, f"#{anchor} lacks {part}"
        commands = re.findall(r"^kubectl .*$", body, re.M)
        assert commands, f"#{anchor} shows no kubectl command"
        assert any(re.search(r"grpo\.dev/run=RUN|app\.kubernetes\.io/name=grpo-operator", c) for c in commands), (
            f"#{anchor}: no command selects by the project's labels"
        )
    text = RUNBOOKS.read_text()
    for link in re.findall(r"\]\(#([^)]+)\)", text):
        assert link in sections, f"docs/runbooks.md links to a missing section #{link}"


def test_runbook_base_url_is_a_value(chart: Chart, tmp_path: Path) -> None:
    values = {**SCENARIOS["monitoring-on"],
              "prometheusRule": {"enabled": True, "runbookBaseUrl": "https://wiki.example.com/ops/grpo-runbooks"}}
    rules = yaml.safe_load(prometheus_rules_file(chart.render(values), tmp_path).read_text())
    urls = [r["annotations"]["runbook_url"] for g in rules["groups"] for r in g["rules"]]
    assert len(urls) == 8
    assert all(re.fullmatch(r"https://wiki\.example\.com/ops/grpo-runbooks#grpo[a-z]+", u) for u in urls), urls
    refused = chart.helm("template", RELEASE, str(CHART),
                         values={"prometheusRule": {"enabled": True, "runbookBaseUrl": "https://x.example/r.md#top"}})
    assert refused.returncode != 0 and "runbookBaseUrl" in refused.stderr, refused.stderr


# ------------------------------------------------------------------------ dashboard variable filters

#: The dashboard variables a query must follow, with the label each one selects on.
SELECTION_VARIABLES = ("namespace", "grporun")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def selectors(expr: str) -> list[tuple[str, dict[str, tuple[str, str]]]]:
    """Every series selector of a PromQL expression: the metric and its label matchers (label -> (op, value))."""
    found = []
    for name in sorted(metric_names(expr)):
        for match in re.finditer(rf"(?<![\w:.$]){re.escape(name)}(?![\w:])\s*(\{{[^{{}}]*\}})?", expr):
            block = match.group(1) or ""
            found.append((name, {label: (op, value) for label, op, value in _MATCHER.findall(block)}))
    return found


def has_run_label(name: str) -> bool:
    """Whether a metric's series carry `grporun`: every server, trainer and vLLM series (the PodMonitors add
    it), and the operator's per-run families (their own label)."""
    if not name.startswith("grpo_operator_"):
        return True
    base = re.sub(r"_(total|bucket|sum|count)$", "", name)
    families = [m for m in vars(operator_metrics).values()
                if getattr(m, "_name", None) in (name, base) and hasattr(m, "_labelnames")]
    assert families, f"{name} is not an operator metric family"
    return all("grporun" in m._labelnames for m in families)


def selection_problems(expr: str, variables: set[str]) -> list[str]:
    """Why a query does not follow the dashboard's namespace/run variables (empty: it does)."""
    problems = []
    for name, matchers in selectors(expr):
        for variable in SELECTION_VARIABLES:
            if variable in variables and matchers.get(variable) != ("=~", f"${variable}"):
                problems.append(f'{name} does not filter {variable}=~"${variable}"')
        if "grporun" in matchers and not has_run_label(name):
            problems.append(f"{name} has no grporun label: a run selection leaves it empty")
    return problems


def panel_targets(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every target of every panel, rows' nested panels included."""
    found, panels = [], list(dashboard["panels"])
    while panels:
        panel = panels.pop()
        panels.extend(panel.get("panels", []))
        found += [(panel.get("title", ""), t.get("refId", ""), t["expr"]) for t in panel.get("targets", [])]
    return found


def test_selection_check_flags_queries_that_ignore_the_variables() -> None:
    both = {"namespace", "grporun"}
    assert selection_problems('sum by (phase) (grpo_operator_runs{job="grpo-operator"})', both) == [
        'grpo_operator_runs does not filter namespace=~"$namespace"',
        'grpo_operator_runs does not filter grporun=~"$grporun"',
    ]
    assert selection_problems('grpo_operator_runs{namespace=~"$namespace", grporun=~"$grporun"}', both) == [
        "grpo_operator_runs has no grporun label: a run selection leaves it empty"]
    assert selection_problems('max(grpo_trainer_step{namespace=~"$namespace"}) / max(grpo_trainer_max_steps)',
                              {"namespace"}) == ['grpo_trainer_max_steps does not filter namespace=~"$namespace"']
    good = ('histogram_quantile(0.9, sum by (le) (rate(grpo_trainer_step_seconds_bucket{namespace=~"$namespace", '
            'grporun=~"$grporun"}[$__rate_interval]))) / on () group_left max(grpo_operator_run_attempt'
            '{job="grpo-operator", grporun=~"$grporun", namespace=~"$namespace"})')
    assert selection_problems(good, both) == []


def test_every_panel_query_follows_the_namespace_and_run_variables(dashboard: dict[str, Any]) -> None:
    """A per-run query that ignores the dashboard's selection shows other namespaces' runs next to the chosen
    ones; in a run dashboard, an operator-wide series (no run label) cannot follow the run selection at all."""
    variables = {v["name"] for v in dashboard["templating"]["list"]} & set(SELECTION_VARIABLES)
    assert "namespace" in variables, f"{dashboard['uid']} has no namespace variable"
    problems = [f"{title!r} {ref}: {problem}" for title, ref, expr in panel_targets(dashboard)
                for problem in selection_problems(expr, variables)]
    assert not problems, f"{dashboard['uid']}:\n" + "\n".join(problems)


# ------------------------------------------------------------------- kube-prometheus-stack selection

#: What kube-prometheus-stack's Prometheus selects monitors and rules by (its *SelectorNilUsesHelmValues
#: default), for a kube-prometheus-stack release called kube-prometheus-stack.
KUBE_PROMETHEUS_STACK_SELECTOR = {"release": "kube-prometheus-stack"}
MONITORING_KINDS = ("ServiceMonitor", "PodMonitor", "PrometheusRule")


def documented_kube_prometheus_stack_flags() -> list[str]:
    """The --set/--set-string flags of docs/helm.md's kube-prometheus-stack install command."""
    section = HELM_DOCS.read_text().split("### Monitoring with kube-prometheus-stack", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "docs/helm.md: no command in the kube-prometheus-stack section"
    argv = shlex.split(block.group(1).replace("\\\n", " "))
    assert argv[:2] == ["helm", "install"], argv
    flags = []
    for i, arg in enumerate(argv):
        if arg in ("--set", "--set-string"):
            flags += [arg, argv[i + 1]]
    return flags


def test_documented_kube_prometheus_stack_install_makes_every_monitoring_object_selectable(chart: Chart) -> None:
    result = chart.helm("template", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
                        *documented_kube_prometheus_stack_flags())
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.load_all(result.stdout, Loader=Yaml12Loader) if d]
    monitoring = [d for d in docs if d["kind"] in MONITORING_KINDS]
    assert sorted(d["kind"] for d in monitoring) == ["PodMonitor", "PodMonitor", "PrometheusRule", "ServiceMonitor"]
    for obj in monitoring:
        labels = obj["metadata"].get("labels", {})
        unmatched = {k: v for k, v in KUBE_PROMETHEUS_STACK_SELECTOR.items() if labels.get(k) != v}
        assert not unmatched, (f"{obj['kind']} {obj['metadata']['name']} does not match kube-prometheus-stack's "
                               f"selector {KUBE_PROMETHEUS_STACK_SELECTOR}: its labels are {labels}")
    dashboards = [d for d in docs if d["kind"] == "ConfigMap" and "grafana_dashboard" in d["metadata"]["labels"]]
    assert dashboards and all(d["metadata"]["labels"]["grafana_dashboard"] == "1" for d in dashboards)


def test_each_monitoring_object_takes_its_own_extra_labels(chart: Chart) -> None:
    values = {
        "metrics": {"operator": {"serviceMonitor": {"enabled": True, "labels": {"team": "operator"}}},
                    "servers": {"podMonitor": {"enabled": True, "labels": {"team": "servers"}}},
                    "trainers": {"podMonitor": {"enabled": True, "labels": {"team": "trainers"}}}},
        "prometheusRule": {"enabled": True, "labels": {"team": "rules", "role": "alert-rules"}},
    }
    docs = chart.render(values)
    fullname = f"{RELEASE}-grpo-operator"
    expected = {("ServiceMonitor", fullname): {"team": "operator"},
                ("PodMonitor", f"{fullname}-servers"): {"team": "servers"},
                ("PodMonitor", f"{fullname}-trainers"): {"team": "trainers"},
                ("PrometheusRule", fullname): {"team": "rules", "role": "alert-rules"}}
    rendered = {(d["kind"], d["metadata"]["name"]): d["metadata"]["labels"]
                for d in docs if d["kind"] in MONITORING_KINDS}
    assert set(rendered) == set(expected)
    for key, extra in expected.items():
        assert rendered[key].items() >= extra.items(), f"{key}: {rendered[key]}"
        assert rendered[key]["app.kubernetes.io/instance"] == RELEASE  # the chart's own labels stay
