"""The chart's ClusterRoles for users, aggregated into Kubernetes' built-in view, edit and admin roles.

Rendered: what each role grants and that `rbac.aggregateToDefaultRoles` (and `rbac.create`) turn them
off. Against the real control plane: `helm install`, kube-controller-manager's clusterrole-aggregation
controller folds them into view/edit/admin, and users bound to those roles in a namespace get exactly
what they should, asked as those users (`kubectl --as`).
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.controlplane import CONTROLLERS, ControlPlane
from tests.fixtures.helm_cli import Helm
from tests.fixtures.processes import end_process_group
from tests.fixtures.waiting import wait_for

from .conftest import CHART, Chart, ChartTools, find

FULLNAME = "grpo-grpo-operator"
AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"
READ = {"get", "list", "watch"}
WRITE = {"create", "update", "patch", "delete", "deletecollection"}
AGGREGATION_CONTROLLER = "clusterrole-aggregation-controller"


def user_roles(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in find(docs, "ClusterRole")
            if any(k.startswith(AGGREGATE) for k in d["metadata"]["labels"])}


def grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every rule."""
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


# -------------------------------------------------------------------------------------------- rendered


def test_view_reads_runs_and_edit_and_admin_also_write_them(chart: Chart) -> None:
    roles = user_roles(chart.render())
    assert set(roles) == {f"{FULLNAME}-view", f"{FULLNAME}-edit"}
    view, edit = roles[f"{FULLNAME}-view"], roles[f"{FULLNAME}-edit"]
    aggregates = {name: {k.removeprefix(AGGREGATE) for k, v in role["metadata"]["labels"].items()
                         if k.startswith(AGGREGATE) and v == "true"} for name, role in roles.items()}
    assert aggregates == {f"{FULLNAME}-view": {"view"}, f"{FULLNAME}-edit": {"edit", "admin"}}
    readable = {(g, r, v) for g in ["grpo.dev"] for r in ("grporuns", "grporuns/status") for v in READ}
    assert grants(view) == readable
    assert grants(edit) == readable | {("grpo.dev", "grporuns", v) for v in WRITE}
    assert not [g for g in grants(edit) if g[1] == "grporuns/status" and g[2] in WRITE], "status is the operator's"


@pytest.mark.parametrize("values", [{"rbac": {"aggregateToDefaultRoles": False}},
                                    {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "x"}}])
def test_user_roles_can_be_turned_off(chart: Chart, values: dict[str, Any]) -> None:
    assert not user_roles(chart.render(values))


def test_schema_knows_the_switch(chart: Chart) -> None:
    refused = chart.helm("template", "grpo", str(CHART), values={"rbac": {"aggregateToDefaultRoles": "yes"}})
    assert refused.returncode != 0 and "aggregateToDefaultRoles" in refused.stderr, refused.stderr


# ------------------------------------------------------------------------------ the real control plane


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, context=ssl._create_unverified_context(), timeout=2) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


@pytest.fixture(scope="module")
def role_aggregation(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The clusterrole-aggregation controller. The session's kube-controller-manager runs only the controllers
    the operator's objects need; when it lacks this one, a second kube-controller-manager runs just it."""
    if AGGREGATION_CONTROLLER in CONTROLLERS:
        yield
        return
    workdir = tmp_path_factory.mktemp("aggregation")
    port = _free_port()
    log = workdir / "kube-controller-manager.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(control_plane.bin_dir / "kube-controller-manager"), f"--kubeconfig={control_plane.kubeconfig}",
             f"--authentication-kubeconfig={control_plane.kubeconfig}",
             f"--authorization-kubeconfig={control_plane.kubeconfig}",
             "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={port}",
             f"--cert-dir={workdir / 'pki'}", f"--controllers={AGGREGATION_CONTROLLER}", "--profiling=false"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while not _healthy(f"https://127.0.0.1:{port}/healthz"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"kube-controller-manager ({AGGREGATION_CONTROLLER}) did not start:\n"
                            + log.read_text(errors="replace")[-3000:])
            time.sleep(0.2)
        yield
    finally:
        end_process_group(proc, timeout=10)


def run_manifest(namespace: str) -> str:
    return json.dumps({
        "apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun",
        "metadata": {"name": "users-run", "namespace": namespace},
        "spec": {"model": {"name": "/models/tiny"}, "dataset": {"path": "/data/prompts.jsonl"},
                 "rewards": [{"function": "exact_match"}]},
    })


def rules_of(control_plane: ControlPlane, role: str) -> set[tuple[str, str, str]]:
    got = control_plane.kubectl("get", f"clusterrole/{role}", "-o", "json", check=True)
    return grants({"rules": json.loads(got.stdout).get("rules") or []})


def can_i(control_plane: ControlPlane, user: str, verb: str, resource: str, namespace: str,
          subresource: str | None = None) -> bool:
    """`kubectl auth can-i` as the user (a subresource goes in its own flag: RESOURCE/NAME names an object)."""
    extra = [f"--subresource={subresource}"] if subresource else []
    result = control_plane.kubectl("auth", "can-i", verb, resource, *extra, "-n", namespace, f"--as={user}")
    assert result.stdout.strip() in ("yes", "no"), result.stdout + result.stderr
    return result.stdout.strip() == "yes"


def test_users_bound_to_view_edit_and_admin_get_their_rights_on_grporuns(
    chart_tools: ChartTools, control_plane: ControlPlane, grporun_crd: dict[str, Any], role_aggregation: None,
    tmp_path: Path,
) -> None:
    kubectl = control_plane.kubectl
    namespace = f"users-{uuid.uuid4().hex[:8]}"
    release = "grpo-users"
    roles = {f"{release}-grpo-operator-view", f"{release}-grpo-operator-edit"}
    helm = Helm(chart_tools, control_plane, tmp_path)
    # The session applied the CRD already (grporun_crd): this release leaves it alone.
    installed = helm("install", release, str(CHART), "--namespace", namespace, "--create-namespace",
                     values={"crds": {"install": False}})
    assert installed.returncode == 0, installed.stderr
    try:
        for role in roles:
            assert kubectl("get", f"clusterrole/{role}").returncode == 0, f"helm install made no {role}"
        create = ("grpo.dev", "grporuns", "create")
        wait_for(lambda: create in rules_of(control_plane, "edit") and create in rules_of(control_plane, "admin")
                 and ("grpo.dev", "grporuns", "list") in rules_of(control_plane, "view"),
                 timeout=60, what="the aggregation controller to fold the chart's roles into view, edit and admin")
        assert create not in rules_of(control_plane, "view")

        for user, role in (("alice", "edit"), ("bob", "view"), ("carol", "admin")):
            bound = kubectl("-n", namespace, "create", "rolebinding", f"{user}-{role}", f"--clusterrole={role}",
                            f"--user={user}")
            assert bound.returncode == 0, bound.stderr

        def create_run(user: str) -> subprocess.CompletedProcess[str]:
            return kubectl("-n", namespace, "create", "--dry-run=server", "-f", "-", f"--as={user}",
                           input=run_manifest(namespace))

        # edit (and admin): create a run (server-side dry run: the apiserver authorizes and admits it).
        for user in ("alice", "carol"):
            created = create_run(user)
            assert created.returncode == 0, f"{user}: {created.stderr}"
            assert "created (server dry run)" in created.stdout, created.stdout
        # view: list, not create.
        listed = kubectl("-n", namespace, "get", "grporuns", "--as=bob")
        assert listed.returncode == 0, listed.stderr
        refused = create_run("bob")
        assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr
        # Someone bound to nothing can do neither: the rights come from the bindings.
        assert kubectl("-n", namespace, "get", "grporuns", "--as=mallory").returncode != 0
        assert "forbidden" in create_run("mallory").stderr.lower()

        for verb in sorted(WRITE):
            assert can_i(control_plane, "alice", verb, "grporuns.grpo.dev", namespace), verb
            assert not can_i(control_plane, "bob", verb, "grporuns.grpo.dev", namespace), verb
        for verb in sorted(READ):
            assert can_i(control_plane, "bob", verb, "grporuns.grpo.dev", namespace, "status"), verb
        # The status is the operator's: no user role may write it.
        for user in ("alice", "carol"):
            for verb in ("update", "patch"):
                assert not can_i(control_plane, user, verb, "grporuns.grpo.dev", namespace, "status"), user
        # Only in the namespace of the binding.
        assert not can_i(control_plane, "alice", "create", "grporuns.grpo.dev", "default")

        # Turned off, the roles go, and the aggregation takes their rules out of view, edit and admin.
        upgraded = helm("upgrade", release, str(CHART), "--namespace", namespace,
                        values={"crds": {"install": False}, "rbac": {"aggregateToDefaultRoles": False}})
        assert upgraded.returncode == 0, upgraded.stderr
        for role in roles:
            assert kubectl("get", f"clusterrole/{role}").returncode != 0, f"{role} survived the upgrade"
        wait_for(lambda: not can_i(control_plane, "alice", "create", "grporuns.grpo.dev", namespace)
                 and not can_i(control_plane, "bob", "list", "grporuns.grpo.dev", namespace),
                 timeout=60, what="view and edit to lose the GRPORun rules")
    finally:
        uninstalled = helm("uninstall", release, "--namespace", namespace, "--wait")
        kubectl("delete", "namespace", namespace, "--wait=false")
    assert uninstalled.returncode == 0, uninstalled.stderr
    assert kubectl("get", "crd/grporuns.grpo.dev").returncode == 0
