"""charts/grpo-operator rendered by the real helm: lint, schema, and what each object must say.

The objects are also sent to a real kube-apiserver in test_chart_apiserver.py; here we check the
choices the apiserver cannot judge (watch mode, RBAC scope, selectors matching the operator's pods).
"""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

import pytest
import yaml

from grpo_api.models import GRPORun
from grpo_operator import builders
from grpo_operator.rbac import render_rbac
from tests.fixtures.chart_values import SCENARIOS

from . import sync
from .conftest import CHART, RELEASE, RELEASE_NAMESPACE, REPO, Chart, find, one

FULLNAME = f"{RELEASE}-grpo-operator"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]

MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def sample_run(namespace: str = "chart-team-a") -> GRPORun:
    return GRPORun.model_validate({
        "apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun",
        "metadata": {"name": "demo", "namespace": namespace, "uid": "0b5e5a1e-0000-4000-8000-000000000001"},
        "spec": {"model": {"name": "/models/tiny"}, "dataset": {"path": "/data/prompts.jsonl"},
                 "rewards": [{"function": "exact_match"}]},
    })


def pod_template(obj: dict[str, Any]) -> dict[str, Any]:
    template: dict[str, Any] = obj["spec"]["template"]
    return template


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


# ---------------------------------------------------------------------------------------- lint, schema


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_helm_lint_strict_passes(chart: Chart, scenario: str) -> None:
    result = chart.lint(SCENARIOS[scenario])
    assert result.returncode == 0, f"helm lint --strict ({scenario}):\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize(("values", "field"), [
    ({"watch": {"mode": "everywhere"}}, "watch.mode"),
    ({"operator": {"metricsPort": 70000}}, "operator.metricsPort"),
    ({"crds": {"instal": True}}, "instal"),
    ({"image": {"pullPolicy": "Sometimes"}}, "image.pullPolicy"),
    ({"watch": {"namespaces": ["Not_A_Namespace"]}}, "watch.namespaces"),
    ({"prometheusRule": {"for": {"serverNotReady": "fifteen minutes"}}}, "prometheusRule.for.serverNotReady"),
    ({"networkPolicy": {"scrapers": {"enabled": True, "podSelector": {"app name": "x"}}}},
     "networkPolicy.scrapers.podSelector"),
    ({"networkPolicy": {"namespaces": ["chart-team-a"]}}, "namespaces"),
])
def test_schema_refuses_bad_values_naming_the_field(chart: Chart, values: dict[str, Any], field: str) -> None:
    result = chart.helm("template", RELEASE, str(CHART), values=values)
    assert result.returncode != 0, f"helm template accepted {values}"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    assert field.split(".")[-1] in result.stderr, f"the error does not name {field}:\n{result.stderr}"


def test_service_account_name_is_required_when_not_created(chart: Chart) -> None:
    result = chart.helm("template", RELEASE, str(CHART), values={"serviceAccount": {"create": False}})
    assert result.returncode != 0
    assert "serviceAccount.name is required" in result.stderr


# ------------------------------------------------------------------------------------------ deployment


def test_operator_deployment_is_one_recreated_hardened_pod(chart: Chart) -> None:
    docs = chart.render()
    deployment = one(docs, "Deployment", FULLNAME)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = pod_template(deployment)["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["livenessProbe"]["httpGet"]["port"] == "liveness"
    assert f"--liveness-port={ports['liveness']}" in container["args"]
    assert f"--metrics-port={ports['metrics']}" in container["args"]
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]


def test_operator_image_defaults_to_the_package_version(chart: Chart) -> None:
    chart_yaml = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart_yaml["appVersion"] == VERSION == chart_yaml["version"]
    (container,) = pod_template(one(chart.render(), "Deployment"))["spec"]["containers"]
    assert container["image"] == f"ghcr.io/grpo-dev/grpo-operator:{VERSION}"
    # The same registry and version as the run images the operator gives runs that name none.
    params = operator_params(chart.render())
    assert (params["server_image"], params["trainer_image"]) == (
        f"ghcr.io/grpo-dev/grpo-server:{VERSION}", f"ghcr.io/grpo-dev/grpo-trainer:{VERSION}"
    )


def operator_params(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The `grpo operator` parameters the chart's Deployment passes."""
    from grpo_operator.cli import operator

    (container,) = pod_template(one(docs, "Deployment"))["spec"]["containers"]
    return dict(operator.make_context("operator", list(container["args"])).params)


def test_run_images_come_from_one_place_in_the_values(chart: Chart) -> None:
    """A private registry is one setting: every run that names no image gets these."""
    params = operator_params(chart.render({"runImages": {"server": "registry.corp/grpo/server:1.2",
                                                          "trainer": "registry.corp/grpo/trainer:1.2"}}))
    assert (params["server_image"], params["trainer_image"]) == (
        "registry.corp/grpo/server:1.2", "registry.corp/grpo/trainer:1.2"
    )


def test_operator_runs_as_the_image_user(chart: Chart) -> None:
    user = [line for line in (REPO / "Dockerfile.operator").read_text().splitlines() if line.startswith("USER")]
    uid, gid = user[-1].split()[1].split(":")
    pod = pod_template(one(chart.render(), "Deployment"))["spec"]
    assert (str(pod["securityContext"]["runAsUser"]), str(pod["securityContext"]["runAsGroup"])) == (uid, gid)


def test_namespaced_mode_watches_the_release_namespace_by_default(chart: Chart) -> None:
    (container,) = pod_template(one(chart.render(), "Deployment"))["spec"]["containers"]
    assert f"--namespace={RELEASE_NAMESPACE}" in container["args"]
    assert "--all-namespaces" not in container["args"]


def test_namespaced_mode_watches_the_listed_namespaces(chart: Chart) -> None:
    docs = chart.render(SCENARIOS["namespaced-two-namespaces"])
    (container,) = pod_template(one(docs, "Deployment"))["spec"]["containers"]
    assert [a for a in container["args"] if a.startswith("--namespace")] == ["--namespace=chart-team-a",
                                                                                "--namespace=chart-team-b"]


@pytest.mark.parametrize("scenario", ["defaults", "namespaced-two-namespaces", "cluster-wide"])
def test_operator_args_are_accepted_by_the_grpo_operator_command(chart: Chart, scenario: str) -> None:
    from grpo_operator.cli import operator

    (container,) = pod_template(one(chart.render(SCENARIOS[scenario]), "Deployment"))["spec"]["containers"]
    params = operator.make_context("operator", list(container["args"])).params
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (params["liveness_port"], params["metrics_port"]) == (ports["liveness"], ports["metrics"])
    watch = SCENARIOS[scenario].get("watch", {})
    if watch.get("mode") == "cluster":
        assert params["all_namespaces"] and not params["namespaces"]
    else:
        assert params["namespaces"] == tuple(watch.get("namespaces") or [RELEASE_NAMESPACE])
        assert not params["all_namespaces"]
    assert params["standalone"], "one replica runs without kopf peering"


def test_kueue_is_one_switch_the_operators_flag_its_rbac_and_its_admission_bound(chart: Chart) -> None:
    """Off by default (no Kueue rights at all); on, the operator runs with --kueue, may read and write Workloads
    and read what its runs' labels name, and the admission policy bounds its Workload writes as its other children."""
    off = chart.render()
    assert not operator_params(off)["kueue"]
    granted = {res for r in find(off, "Role") + find(off, "ClusterRole") if not user_role(r)
               for rule in r["rules"] for res in rule["resources"]}
    assert not {res for res in granted if res.startswith(("workload", "localqueue", "resourceflavor"))}
    on = chart.render(SCENARIOS["kueue-namespaced"])
    assert operator_params(on)["kueue"]
    roles = {res: rule["verbs"] for r in find(on, "Role") for rule in r["rules"] for res in rule["resources"]}
    assert (roles["workloads"], roles["workloads/status"], roles["localqueues"]) == (
        ["get", "create", "patch"], ["patch"], ["get"])
    (cluster_role,) = [r for r in find(on, "ClusterRole") if not user_role(r)]
    cluster = {res: rule["verbs"] for rule in cluster_role["rules"] for res in rule["resources"]}
    assert cluster["workloadpriorityclasses"] == cluster["resourceflavors"] == ["get"]
    policy = next(p for p in find(on, "ValidatingAdmissionPolicy") if p["metadata"]["name"].endswith("-children"))
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    assert {"apiGroups": ["kueue.x-k8s.io"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE", "DELETE"],
            "resources": ["workloads", "workloads/status"]} in rules


def test_cluster_mode_watches_all_namespaces(chart: Chart) -> None:
    (container,) = pod_template(one(chart.render({"watch": {"mode": "cluster"}}), "Deployment"))["spec"]["containers"]
    assert "--all-namespaces" in container["args"]
    assert not [a for a in container["args"] if a.startswith("--namespace")]


# ----------------------------------------------------------------------------------------------- CRD


def crd_file() -> dict[str, Any]:
    crd: dict[str, Any] = yaml.safe_load((REPO / "crds" / "grpo.dev_grporuns.yaml").read_text())
    return crd


def test_chart_crd_copy_is_identical_to_the_generated_crd() -> None:
    copy = CHART / "files" / "crds" / "grpo.dev_grporuns.yaml"
    assert copy.read_bytes() == sync.CRD_SOURCE.read_bytes(), (
        "charts/grpo-operator/files/crds/ is stale: run `.venv/bin/python -m tests.chart.sync`"
    )


def test_rendered_crd_is_the_generated_crd_kept_on_uninstall(chart: Chart) -> None:
    rendered = one(chart.render(), "CustomResourceDefinition")
    expected = crd_file()
    assert rendered["spec"] == expected["spec"]
    assert rendered["metadata"]["name"] == expected["metadata"]["name"]
    assert rendered["metadata"]["labels"].items() >= expected["metadata"]["labels"].items()
    assert rendered["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_crd_is_not_rendered_when_install_is_off(chart: Chart) -> None:
    assert not find(chart.render({"crds": {"install": False}}), "CustomResourceDefinition")


def test_crd_keep_annotation_can_be_turned_off(chart: Chart) -> None:
    rendered = one(chart.render({"crds": {"keep": False}}), "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in (rendered["metadata"].get("annotations") or {})


# ---------------------------------------------------------------------------------------------- RBAC


RBAC_KINDS = {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


def user_role(obj: dict[str, Any]) -> bool:
    """The ClusterRoles for users (templates/user-roles.yaml, tests/chart/test_user_roles.py), not the operator's."""
    return bool(obj["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "user-roles")


def rbac_essence(obj: dict[str, Any]) -> dict[str, Any]:
    """What grants permissions: kind, name, namespace, rules, roleRef, subjects (not labels)."""
    keep = {"kind": obj["kind"], "name": obj["metadata"]["name"], "namespace": obj["metadata"].get("namespace")}
    return {**keep, **{k: obj[k] for k in ("rules", "roleRef", "subjects") if k in obj}}


def test_chart_generated_files_are_up_to_date() -> None:
    stale = [str(p.relative_to(REPO)) for p in sync.stale_files()]
    assert not stale, f"{stale} are stale: run `.venv/bin/python -m tests.chart.sync`"


@pytest.mark.parametrize("scenario", ["defaults", "namespaced-two-namespaces", "cluster-wide", "kueue-namespaced",
                                      "kueue-cluster-wide"])
def test_rendered_rbac_is_exactly_what_rbac_py_renders(chart: Chart, scenario: str) -> None:
    values = SCENARIOS[scenario]
    watch = values.get("watch", {})
    namespaces = None if watch.get("mode") == "cluster" else (watch.get("namespaces") or [RELEASE_NAMESPACE])
    kueue = bool(values.get("kueue", {}).get("enabled"))
    expected = render_rbac(FULLNAME, FULLNAME, RELEASE_NAMESPACE, namespaces, kueue=kueue)
    rendered = [d for d in chart.render(values) if d["kind"] in RBAC_KINDS and not user_role(d)]

    def key(essence: dict[str, Any]) -> tuple[str, str, str]:
        return essence["kind"], essence["namespace"] or "", essence["name"]

    assert sorted(map(rbac_essence, rendered), key=key) == sorted(map(rbac_essence, expected), key=key)


def test_namespaced_mode_grants_namespaced_rules_only_in_watched_namespaces(chart: Chart) -> None:
    docs = chart.render(SCENARIOS["namespaced-two-namespaces"])
    roles = find(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["chart-team-a", "chart-team-b"]
    bindings = find(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["chart-team-a", "chart-team-b"]
    for binding in bindings:
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": FULLNAME}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": RELEASE_NAMESPACE}]
    namespaced_resources = {res for role in roles for rule in role["rules"] for res in rule["resources"]}
    for cluster_role in [r for r in find(docs, "ClusterRole") if not user_role(r)]:
        granted = {res for rule in cluster_role["rules"] for res in rule["resources"]}
        assert not granted & namespaced_resources, f"ClusterRole grants {granted & namespaced_resources}"


def test_cluster_mode_uses_one_cluster_role_and_no_roles(chart: Chart) -> None:
    docs = chart.render({"watch": {"mode": "cluster"}})
    assert not find(docs, "Role") and not find(docs, "RoleBinding")
    binding = one(docs, "ClusterRoleBinding")
    (cluster_role,) = [r for r in find(docs, "ClusterRole") if not user_role(r)]
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    assert binding["subjects"][0]["namespace"] == RELEASE_NAMESPACE


def test_no_rbac_objects_when_rbac_create_is_off(chart: Chart) -> None:
    docs = chart.render(SCENARIOS["everything-off"])
    for kind in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "ServiceAccount"):
        assert not find(docs, kind), kind
    assert pod_template(one(docs, "Deployment"))["spec"]["serviceAccountName"] == "existing-operator"


# ------------------------------------------------------------------------------------------ monitoring


def test_monitoring_objects_are_off_by_default(chart: Chart) -> None:
    docs = chart.render()
    assert not [d for d in docs if d["kind"] in MONITORING_KINDS]
    assert not [d for d in find(docs, "ConfigMap") if "grafana_dashboard" in d["metadata"].get("labels", {})]


def test_operator_service_monitor_scrapes_the_metrics_port(chart: Chart) -> None:
    docs = chart.render(SCENARIOS["monitoring-on"])
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service", f"{FULLNAME}-metrics")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    assert matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    # The per-run series' own `namespace` (the run's) must win over the target's (the operator's).
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
    deployment = one(docs, "Deployment")
    assert matches(service["spec"]["selector"], pod_template(deployment)["metadata"]["labels"])


@pytest.mark.parametrize("component", ["servers", "trainers"])
def test_pod_monitors_select_the_pods_the_operator_builds(chart: Chart, component: str) -> None:
    run = sample_run()
    if component == "servers":
        pod = pod_template(builders.build_server_deployment(run, attempt=1, replicas=1))
    else:
        pod = pod_template(builders.build_trainer_job(run, attempt=1))
    port_names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    monitor = one(chart.render(SCENARIOS["monitoring-on"]), "PodMonitor", f"{FULLNAME}-{component}")
    assert matches(monitor["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] in port_names
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [RELEASE_NAMESPACE]}
    # The run label the relabeling copies into `grporun` is the one the builders set.
    relabel = monitor["spec"]["podMetricsEndpoints"][0]["relabelings"][1]
    label = relabel["sourceLabels"][0].removeprefix("__meta_kubernetes_pod_label_")
    sanitized = {re.sub(r"[^A-Za-z0-9_]", "_", k): v for k, v in pod["metadata"]["labels"].items()}
    assert sanitized[label] == run.metadata.name


def test_the_trainer_pod_monitor_scrapes_rank_0_only_of_a_trainer_of_several_pods(chart: Chart) -> None:
    """Only rank 0 serves /metrics: the other pods of an indexed trainer Job (completion index ≥ 1) are dropped;
    a one-pod trainer (no index label: the empty string) and index 0 stay. Prometheus anchors the regex."""
    monitor = one(chart.render(SCENARIOS["monitoring-on"]), "PodMonitor", f"{FULLNAME}-trainers")
    (drop,) = [r for r in monitor["spec"]["podMetricsEndpoints"][0]["relabelings"] if r["action"] == "drop"]
    assert drop["sourceLabels"] == ["__meta_kubernetes_pod_label_batch_kubernetes_io_job_completion_index"]
    dropped = [v for v in ("", "0", "1", "2", "10") if re.fullmatch(drop["regex"], v)]
    assert dropped == ["1", "2", "10"]
    servers = one(chart.render(SCENARIOS["monitoring-on"]), "PodMonitor", f"{FULLNAME}-servers")
    assert all(r["action"] != "drop" for r in servers["spec"]["podMetricsEndpoints"][0]["relabelings"])


def test_pod_monitors_look_in_every_namespace_in_cluster_mode(chart: Chart) -> None:
    for monitor in find(chart.render(SCENARIOS["monitoring-on-cluster-wide"]), "PodMonitor"):
        assert monitor["spec"]["namespaceSelector"] == {"any": True}


def test_dashboards_are_config_maps_for_the_grafana_sidecar(chart: Chart) -> None:
    docs = chart.render(SCENARIOS["monitoring-on-cluster-wide"])
    maps = [d for d in find(docs, "ConfigMap") if d["metadata"]["labels"].get("grafana_dashboard") == "1"]
    files = sorted(p.stem for p in (CHART / "dashboards").glob("*.json"))
    assert len(files) >= 3
    assert sorted(key.removesuffix(".json") for m in maps for key in m["data"]) == files
    assert {m["metadata"]["namespace"] for m in maps} == {"chart-monitoring"}


# -------------------------------------------------------------------------------------- network policy


def run_network_policy(container: dict[str, Any], run: GRPORun) -> dict[str, Any] | None:
    """The NetworkPolicy the operator, started with the chart's args, builds for a run (None: none)."""
    from grpo_operator.cli import operator

    params = operator.make_context("operator", list(container["args"])).params
    if not params["network_policy"]:
        return None
    ingress = builders.ServerIngress(
        operator_pods=params["operator_pod_selector"], operator_namespaces=params["operator_namespace_selector"],
        scraper_namespaces=params["scraper_namespace_selector"], scraper_pods=params["scraper_pod_selector"])
    return builders.build_network_policy(run, ingress)


def test_chart_makes_no_namespace_wide_network_policy(chart: Chart) -> None:
    """NetworkPolicies add up: a namespace-wide one admitting every trainer would undo the per-run ones."""
    for scenario in ("defaults", "namespaced-two-namespaces", "cluster-wide"):
        assert not find(chart.render(SCENARIOS[scenario]), "NetworkPolicy"), scenario


def test_run_network_policy_admits_the_runs_trainer_this_operator_and_the_scrapers(chart: Chart) -> None:
    run = sample_run(RELEASE_NAMESPACE)
    server_pod = pod_template(builders.build_server_deployment(run, attempt=1, replicas=1))
    trainer_pod = pod_template(builders.build_trainer_job(run, attempt=1))
    docs = chart.render()
    operator_pod = pod_template(one(docs, "Deployment"))
    (container,) = operator_pod["spec"]["containers"]
    policy = run_network_policy(container, run)
    assert policy is not None
    assert policy["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert matches(policy["spec"]["podSelector"]["matchLabels"], server_pod["metadata"]["labels"])
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": run.spec.effective_server.port}]
    trainers, operator, scrapers = rule["from"]
    assert matches(trainers["podSelector"]["matchLabels"], trainer_pod["metadata"]["labels"])
    assert operator["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": RELEASE_NAMESPACE}}
    assert operator["podSelector"] == one(docs, "Deployment")["spec"]["selector"], "the chart's selectorLabels"
    assert matches(operator["podSelector"]["matchLabels"], operator_pod["metadata"]["labels"])
    # Another release's operator (other instance label) is not admitted.
    other = {**operator_pod["metadata"]["labels"], "app.kubernetes.io/instance": "other"}
    assert not matches(operator["podSelector"]["matchLabels"], other)
    scraper_values = yaml.safe_load((CHART / "values.yaml").read_text())["networkPolicy"]["scrapers"]
    assert scrapers == {"namespaceSelector": {}, "podSelector": {"matchLabels": scraper_values["podSelector"]}}


def test_run_network_policy_scrapers_follow_the_values(chart: Chart) -> None:
    run = sample_run(RELEASE_NAMESPACE)
    (container,) = pod_template(one(chart.render(SCENARIOS["cluster-wide"]), "Deployment"))["spec"]["containers"]
    policy = run_network_policy(container, run)
    assert policy is not None
    assert policy["spec"]["ingress"][0]["from"][2] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}, "podSelector": {}}
    (container,) = pod_template(one(chart.render({"networkPolicy": {"scrapers": {"enabled": False}}}),
                                    "Deployment"))["spec"]["containers"]
    policy = run_network_policy(container, run)
    assert policy is not None and len(policy["spec"]["ingress"][0]["from"]) == 2, "no scraper peer"


def test_network_policy_off_tells_the_operator_to_make_none(chart: Chart) -> None:
    (container,) = pod_template(one(chart.render(SCENARIOS["everything-off"]), "Deployment"))["spec"]["containers"]
    assert "--no-network-policy" in container["args"]
    assert run_network_policy(container, sample_run(RELEASE_NAMESPACE)) is None


def test_every_value_is_in_the_schema_and_the_docs() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    docs = (REPO / "docs" / "helm.md").read_text()
    for key, value in values.items():
        assert key in schema["properties"], f"values.yaml {key} is not in values.schema.json"
        assert f"`{key}" in docs, f"docs/helm.md does not document {key}"
        if isinstance(value, dict) and schema["properties"][key].get("additionalProperties") is False:
            for sub in value:
                assert sub in schema["properties"][key]["properties"], f"{key}.{sub} is not in the schema"
