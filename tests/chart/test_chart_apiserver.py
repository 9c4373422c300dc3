"""The chart against a real kube-apiserver (the `control_plane` fixture).

Every manifest of every values scenario must pass a server-side dry-run apply, with the
Prometheus-operator CRDs installed first (from the published Go module), and the operator's pod
template must meet the "restricted" Pod Security Standard as the apiserver's own PodSecurity
admission judges it. Then a real `helm install`, `helm upgrade` and `helm uninstall`.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.chart_values import SCENARIOS
from tests.fixtures.controlplane import ControlPlane
from tests.fixtures.helm_cli import FIELD_MANAGER, Helm, ensure_namespace
from tests.fixtures.waiting import wait_for

from .conftest import CHART, Chart, ChartTools, one

pytestmark = pytest.mark.controlplane

#: The release namespace here, and the namespaces the scenarios put objects in. Not grpo-system:
#: other tests of the session use that one, and this one enforces the restricted standard.
DRY_RUN_NAMESPACE = "grpo-chart-dry-run"
NAMESPACES = (DRY_RUN_NAMESPACE, "chart-team-a", "chart-team-b", "chart-monitoring")
PSS_WARNING = "would violate PodSecurity"


@pytest.fixture(scope="module")
def monitoring_crds(control_plane: ControlPlane, prometheus_operator_crds: list[Path]) -> list[str]:
    names = []
    for path in prometheus_operator_crds:
        # Server-side: these CRDs are too large for client-side apply's last-applied annotation.
        applied = control_plane.kubectl("apply", "--server-side", f"--field-manager={FIELD_MANAGER}",
                                        "-f", str(path), timeout=120)
        assert applied.returncode == 0, f"{path.name}: {applied.stderr}"
        names.append(yaml.safe_load(path.read_text())["metadata"]["name"])
    for name in names:
        conditions = control_plane.wait_established(name)
        assert conditions is None, f"{name} not Established: {conditions}"
    return names


@pytest.fixture(scope="module")
def cluster_ready(control_plane: ControlPlane, monitoring_crds: list[str]) -> ControlPlane:
    """Namespaces in place; the release namespace enforces (and warns on) the restricted standard."""
    restricted = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "warn", "audit")}
    for name in NAMESPACES:
        ensure_namespace(control_plane, name, restricted if name == DRY_RUN_NAMESPACE else None)
    return control_plane


def dry_run_apply(control_plane: ControlPlane, manifests: str) -> subprocess.CompletedProcess[str]:
    return control_plane.kubectl("apply", "--server-side", "--dry-run=server", "--force-conflicts",
                                 f"--field-manager={FIELD_MANAGER}", "-f", "-", input=manifests, timeout=120)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_rendered_manifest_passes_a_server_side_dry_run(chart: Chart, cluster_ready: ControlPlane,
                                                              scenario: str) -> None:
    manifests = chart.template_text(SCENARIOS[scenario], namespace=DRY_RUN_NAMESPACE)
    result = dry_run_apply(cluster_ready, manifests)
    assert result.returncode == 0, f"the apiserver refused the {scenario} manifests:\n{result.stderr}"
    applied = [line for line in result.stdout.splitlines() if "serverside-applied (server dry run)" in line]
    rendered = [d for d in yaml.safe_load_all(manifests) if d]
    assert len(applied) == len(rendered), result.stdout
    assert PSS_WARNING not in result.stderr, result.stderr


def test_operator_pod_meets_the_restricted_standard_and_the_check_can_fail(chart: Chart,
                                                                           cluster_ready: ControlPlane) -> None:
    deployment = one(chart.render(namespace=DRY_RUN_NAMESPACE), "Deployment")
    result = dry_run_apply(cluster_ready, json.dumps(deployment))
    assert result.returncode == 0, result.stderr
    assert PSS_WARNING not in result.stderr, result.stderr
    # The same Deployment without its hardening draws the apiserver's PodSecurity warning.
    weakened = copy.deepcopy(deployment)
    pod = weakened["spec"]["template"]["spec"]
    pod.pop("securityContext")
    pod["containers"][0].pop("securityContext")
    result = dry_run_apply(cluster_ready, json.dumps(weakened))
    assert PSS_WARNING in result.stderr, f"no PodSecurity warning for an unhardened pod:\n{result.stderr}"


def adopt_existing_crd(control_plane: ControlPlane, release: str, namespace: str) -> None:
    """Other tests in the session may have applied the same CRD; let this release adopt it (Helm ≥ 3.2)."""
    exists = control_plane.kubectl("get", "crd/grporuns.grpo.dev")
    if exists.returncode != 0:
        return
    for args in (("label", "--overwrite", "crd/grporuns.grpo.dev", "app.kubernetes.io/managed-by=Helm"),
                 ("annotate", "--overwrite", "crd/grporuns.grpo.dev", f"meta.helm.sh/release-name={release}",
                  f"meta.helm.sh/release-namespace={namespace}")):
        result = control_plane.kubectl(*args)
        assert result.returncode == 0, result.stderr


def test_helm_install_upgrade_and_uninstall_keep_the_crd(chart_tools: ChartTools, cluster_ready: ControlPlane,
                                                         grporun_crd: dict[str, Any], tmp_path: Path) -> None:
    # grporun_crd first: the session's own apply of the CRD happens before Helm takes it over.
    helm = Helm(chart_tools, cluster_ready, tmp_path)
    release, namespace = "grpo-e2e", "grpo-e2e"
    kubectl = cluster_ready.kubectl
    adopt_existing_crd(cluster_ready, release, namespace)
    monitoring = copy.deepcopy(SCENARIOS["monitoring-on"])
    installed = helm("install", release, str(CHART), "--namespace", namespace, "--create-namespace",
                     values=monitoring)
    assert installed.returncode == 0, installed.stderr
    try:
        crd = json.loads(kubectl("get", "crd/grporuns.grpo.dev", "-o", "json", check=True).stdout)
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert kubectl("-n", namespace, "get", "role/grpo-e2e-grpo-operator").returncode == 0
        assert kubectl("-n", namespace, "get", "prometheusrule/grpo-e2e-grpo-operator").returncode == 0
        deployment = json.loads(kubectl("-n", namespace, "get", "deployment/grpo-e2e-grpo-operator", "-o", "json",
                                        check=True).stdout)
        assert f"--namespace={namespace}" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]

        # Upgrade to cluster-wide watching: the Role goes, the ClusterRole takes the application rules.
        upgraded = helm("upgrade", release, str(CHART), "--namespace", namespace,
                        values={**monitoring, "watch": {"mode": "cluster"}})
        assert upgraded.returncode == 0, upgraded.stderr
        wait_for(lambda: kubectl("-n", namespace, "get", "role/grpo-e2e-grpo-operator").returncode != 0,
                 what="the namespaced Role to be removed by the upgrade")
        cluster_role = json.loads(kubectl("get", "clusterrole/grpo-e2e-grpo-operator", "-o", "json",
                                          check=True).stdout)
        assert "grporuns" in {r for rule in cluster_role["rules"] for r in rule["resources"]}
        deployment = json.loads(kubectl("-n", namespace, "get", "deployment/grpo-e2e-grpo-operator", "-o", "json",
                                        check=True).stdout)
        assert "--all-namespaces" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    finally:
        uninstalled = helm("uninstall", release, "--namespace", namespace)
    assert uninstalled.returncode == 0, uninstalled.stderr
    assert kubectl("get", "clusterrole/grpo-e2e-grpo-operator").returncode != 0
    assert kubectl("get", "crd/grporuns.grpo.dev").returncode == 0, "helm uninstall deleted the CRD"
