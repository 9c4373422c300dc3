"""The chart's ValidatingAdmissionPolicies against a real kube-apiserver: the operator's reach is
bounded by admission, not by trust.

For each watch mode the chart is `helm install`ed for real, then requests are sent as the operator's
ServiceAccount (impersonated: `kubectl --as`, or the operator's own KubeClient with an
Impersonate-User header). What its RBAC allows but no run needs (patching a bystander's image,
deleting a bystander's Service, a Job under another ServiceAccount, a ServiceAccount token, a
NetworkPolicy no run owns, ...) must be refused by the policy, each with its own message and status
(an RBAC refusal would not name the policy, so it cannot pass for one). What the operator really does
(the objects of grpo_operator.builders for a GRPORun in the namespace: create, create again, patch,
delete, as reconcile.py sends them) must pass.
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from grpo_api.models import GRPORun
from grpo_operator import builders
from tests.fixtures.controlplane import ControlPlane
from tests.fixtures.helm_cli import Helm, ensure_namespace
from tests.fixtures.waiting import wait_for

from .conftest import CHART, RELEASE, Chart, ChartTools

pytestmark = pytest.mark.controlplane

POLICY_ACTIVE_TIMEOUT_S = 90
FIELD_MANAGER = "grpo-admission-tests"
RUN = "vap-run"
REWARD_MODULE = "def fn(completions, **kwargs):\n    return [0.0] * len(completions)\n"


@dataclass(frozen=True)
class Install:
    """One release of the chart: its values, where its runs live, who its operator is."""

    mode: str
    release: str
    namespace: str
    run_namespace: str
    #: A namespace no binding of this release covers (namespaced mode), else None.
    unwatched_namespace: str | None
    run_service_accounts: tuple[str, ...]

    @property
    def fullname(self) -> str:
        return f"{self.release}-grpo-operator"

    @property
    def operator(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.fullname}"

    @property
    def values(self) -> dict[str, Any]:
        watch: dict[str, Any] = {"mode": self.mode}
        if self.mode == "namespaced":
            watch["namespaces"] = [self.run_namespace]
        return {
            "watch": watch,
            # The session applies the CRD itself (grporun_crd); another release may own it.
            "crds": {"install": False},
            "admissionPolicy": {"enabled": True, "runServiceAccounts": list(self.run_service_accounts)},
        }

    def denial(self, policy: str) -> str:
        """The apiserver's words for a refusal by one of this release's policies."""
        name = f"{self.fullname}-{policy}"
        return f"ValidatingAdmissionPolicy '{name}' with binding '{name}' denied request"


INSTALLS = {
    # The default list (default only).
    "cluster": Install("cluster", "grpo-vap-cw", "grpo-vap-cw", "grpo-vap-cw-runs", None, ("default",)),
    # A list naming a ServiceAccount made for runs; the binding of the runs policy covers the watched
    # namespace only.
    "namespaced": Install("namespaced", "grpo-vap-ns", "grpo-vap-ns", "grpo-vap-ns-runs", "grpo-vap-ns-other",
                          ("default", "grpo-runs")),
}


# ------------------------------------------------------------------------------------------ helpers


def kubectl_as(cp: ControlPlane, install: Install, *args: str,
               input: str | None = None) -> subprocess.CompletedProcess[str]:
    """kubectl as the operator's ServiceAccount, in the runs' namespace."""
    return cp.kubectl(f"--as={install.operator}", "-n", install.run_namespace, *args, input=input)


def refused(result: subprocess.CompletedProcess[str], install: Install, policy: str, *words: str) -> None:
    """The request failed, and by the policy's hand, in its words."""
    assert result.returncode != 0, f"the request was accepted:\n{result.stdout}"
    assert install.denial(policy) in result.stderr, f"not refused by the {policy} policy:\n{result.stderr}"
    for word in words:
        assert word in result.stderr, f"the refusal does not say {word!r}:\n{result.stderr}"


def run_manifest(install: Install, name: str = RUN, service_account: str | None = None,
                 namespace: str | None = None) -> dict[str, Any]:
    """A small server-mode run with inline reward code and its own claim: every builder has work."""
    spec: dict[str, Any] = {
        "model": {"name": "tiny", "path": "/models/tiny"},
        "dataset": {"path": "/data/prompts.jsonl"},
        "rewards": [{"function": "my_rewards:fn"}],
        "rewardCode": {"inline": {"my_rewards.py": REWARD_MODULE}},
        "server": {"engine": "transformers", "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}},
        "trainer": {"resources": {"limits": {"cpu": "1", "memory": "1Gi"}}, "lora": {"r": 8}, "maxSteps": 4},
        "storage": {"size": "1Gi"},
    }
    if service_account is not None:
        spec["scheduling"] = {"serviceAccountName": service_account}
    return {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun",
            "metadata": {"name": name, "namespace": namespace or install.run_namespace}, "spec": spec}


def as_model(body: dict[str, Any], **spec_changes: Any) -> GRPORun:
    """The run as the operator's reconciler reads it (the server's metadata, uid included)."""
    spec = copy.deepcopy(body["spec"])
    spec.update(spec_changes)
    return GRPORun.model_validate({"metadata": body["metadata"], "spec": spec})


def operator_children(run: GRPORun, attempt: int = 1) -> list[dict[str, Any]]:
    """Every child the operator makes for a server-mode run (reconcile.provision and execute)."""
    objects = [
        builders.build_config_map(run),
        builders.build_volume_claim(run),
        builders.build_rewards_config_map(run),
        builders.build_token_secret(run, "t0ken"),
        builders.build_service(run),
        builders.build_network_policy(run, builders.ServerIngress(scraper_namespaces={})),
        builders.build_initializer_job(run),
        builders.build_server_deployment(run, attempt, 1),
        builders.build_trainer_job(run, attempt, placement=builders.Placement(same_node=True)),
    ]
    return [obj for obj in objects if obj is not None]


def policy_refuses_a_probe(cp: ControlPlane, install: Install) -> bool:
    """Both policies are in force: an unlabelled ConfigMap from the operator and a run naming a
    ServiceAccount off the list are refused (server-side dry runs: nothing is stored either way)."""
    probe = kubectl_as(cp, install, "create", "configmap", "vap-probe", "--dry-run=server")
    run = run_manifest(install, name="vap-probe", service_account="vap-not-allowed")
    probe_run = cp.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(run))
    return (install.denial("children") in probe.stderr) and (install.denial("runs") in probe_run.stderr)


# ------------------------------------------------------------------------------------------ fixtures


@dataclass
class Installed:
    install: Install
    cp: ControlPlane
    run: dict[str, Any]  # the GRPORun as the apiserver stored it


@pytest.fixture(scope="module", params=sorted(INSTALLS))
def installed(request: pytest.FixtureRequest, control_plane: ControlPlane, grporun_crd: dict[str, Any],
              chart_tools: ChartTools, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    install = INSTALLS[request.param]
    cp = control_plane
    helm = Helm(chart_tools, cp, tmp_path_factory.mktemp(f"helm-{install.mode}"))
    namespaces = [install.run_namespace] + ([install.unwatched_namespace] if install.unwatched_namespace else [])
    for name in namespaces:
        ensure_namespace(cp, name)
    installed_ = helm("install", install.release, str(CHART), "--namespace", install.namespace,
                      "--create-namespace", values=install.values)
    assert installed_.returncode == 0, installed_.stderr
    try:
        wait_for(lambda: policy_refuses_a_probe(cp, install), timeout=POLICY_ACTIVE_TIMEOUT_S,
                 interval=0.5, what=f"the {install.mode} release's admission policies to be in force")
        created = cp.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(run_manifest(install)))
        assert created.returncode == 0, created.stderr
        yield Installed(install, cp, json.loads(created.stdout))
    finally:
        uninstalled = helm("uninstall", install.release, "--namespace", install.namespace)
        for name in [*namespaces, install.namespace]:
            cp.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")
    assert uninstalled.returncode == 0, uninstalled.stderr


@pytest.fixture
def bystanders(installed: Installed) -> Iterator[dict[str, str]]:
    """A Deployment and a Service no run owns, created by the admin in the runs' namespace."""
    cp, ns = installed.cp, installed.install.run_namespace
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "bystander", "namespace": ns, "labels": {"app": "bystander"}},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "bystander"}},
                 "template": {"metadata": {"labels": {"app": "bystander"}},
                              "spec": {"containers": [{"name": "app", "image": "registry.example/app:1"}]}}},
    }
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "bystander", "namespace": ns, "labels": {"app": "bystander"}},
        "spec": {"selector": {"app": "bystander"}, "ports": [{"port": 80}]},
    }
    applied = cp.kubectl("apply", "--server-side", f"--field-manager={FIELD_MANAGER}", "-f", "-",
                         input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [deployment, service]}))
    assert applied.returncode == 0, applied.stderr
    yield {"deployment": "bystander", "service": "bystander"}
    cp.kubectl("-n", ns, "delete", "deployment/bystander", "service/bystander", "--ignore-not-found", "--wait=false")


class Operator:
    """The operator's own KubeClient, speaking as the operator's ServiceAccount (impersonated)."""

    def __init__(self, installed: Installed) -> None:
        from grpo_operator.kube import KubeClient

        self.install = installed.install
        self.api = installed.cp.api_client()
        self.api.set_default_header("Impersonate-User", installed.install.operator)
        self.kube = KubeClient(self.api)

    def refused(self, status: int, policy: str, words: str, call: Callable[..., Any], *args: Any,
                **kwargs: Any) -> None:
        """The call fails with this HTTP status, by the policy's hand (an RBAC refusal does not name it),
        in these words."""
        from kubernetes.client.exceptions import ApiException

        with pytest.raises(ApiException) as caught:
            call(*args, **kwargs)
        message = str(json.loads(caught.value.body or "{}").get("message", caught.value.body))
        assert self.install.denial(policy) in message, f"not refused by the {policy} policy: {message}"
        assert words in message, f"the refusal does not say {words!r}: {message}"
        assert caught.value.status == status, f"HTTP {caught.value.status}, not {status}: {message}"


@pytest.fixture
def operator(installed: Installed) -> Iterator[Operator]:
    op = Operator(installed)
    try:
        yield op
    finally:
        op.api.close()


# --------------------------------------------------------------------------------------------- tests


def test_rbac_alone_would_let_the_operator_do_what_the_policy_refuses(installed: Installed) -> None:
    """So the refusals below are the policy's doing, and it bounds what the Role/ClusterRole grants."""
    cp, install = installed.cp, installed.install
    for verb, resource in (("patch", "deployments.apps"), ("delete", "services"), ("create", "jobs.batch"),
                           ("create", "deployments.apps"), ("create", "secrets"), ("create", "services"),
                           ("create", "networkpolicies.networking.k8s.io")):
        can = cp.kubectl("auth", "can-i", verb, resource, f"--as={install.operator}", "-n", install.run_namespace)
        assert can.stdout.strip() == "yes", f"{verb} {resource}: {can.stdout}{can.stderr}"


def test_operator_may_not_patch_an_unrelated_deployments_image(installed: Installed, operator: Operator,
                                                               bystanders: dict[str, str]) -> None:
    cp, install = installed.cp, installed.install
    ns = install.run_namespace
    # What `kubectl set image` sends.
    evil = {"spec": {"template": {"spec": {"containers": [{"name": "app", "image": "registry.example/evil:1"}]}}}}
    operator.refused(403, "children", f"grpo-operator may update only objects a GRPORun owns: Deployment "
                     f"{ns}/bystander lacks the grpo.dev/run label",
                     operator.kube.patch_deployment, ns, "bystander", evil)
    # Dressing it up as a run's child in the same patch does not help: the object as it was counts too.
    owner = builders.owner_reference(as_model(installed.run))
    disguise = {"metadata": {"labels": {builders.RUN_LABEL: RUN}, "ownerReferences": [owner]}, **evil}
    operator.refused(403, "children", f"Deployment {ns}/bystander lacks the grpo.dev/run label",
                     operator.kube.patch_deployment, ns, "bystander", disguise)
    image = cp.kubectl("-n", ns, "get", "deployment/bystander", "-o",
                       "jsonpath={.spec.template.spec.containers[0].image}", check=True).stdout
    assert image == "registry.example/app:1"


def test_operator_may_not_delete_an_unrelated_service(installed: Installed, operator: Operator,
                                                      bystanders: dict[str, str]) -> None:
    cp, install = installed.cp, installed.install
    ns = install.run_namespace
    operator.refused(403, "children", f"grpo-operator may delete only objects a GRPORun owns: Service "
                     f"{ns}/bystander lacks the grpo.dev/run label",
                     operator.kube.delete_if_present, "Service", ns, "bystander")
    assert cp.kubectl("-n", ns, "get", "service/bystander").returncode == 0


def test_operator_may_not_run_pods_under_another_service_account(installed: Installed, operator: Operator) -> None:
    """Not even a Job or Deployment its run owns, labelled as the operator labels them.

    422 (Invalid): the reconciler fails the run quoting this message instead of retrying forever."""
    install = installed.install
    ns = install.run_namespace
    # The stored run names no ServiceAccount (the runs policy would refuse one off the list); these children
    # are built for it (its real uid) as if it did.
    powerful = as_model(installed.run, scheduling={"serviceAccountName": "cluster-admin-sa"})
    allowed = ", ".join(install.run_service_accounts)
    for obj in (builders.build_trainer_job(powerful, 7), builders.build_server_deployment(powerful, 7, 1),
                builders.build_initializer_job(powerful)):
        obj["metadata"]["name"] = f"{RUN}-powerful-{obj['kind'].lower()}"
        operator.refused(422, "children",
                         f"grpo-operator may run the pods of a run only as the ServiceAccounts {allowed} "
                         f"(admissionPolicy.runServiceAccounts of the grpo-operator release {install.namespace}/"
                         f"{install.release}): {obj['kind']} {ns}/{obj['metadata']['name']} would run as "
                         "cluster-admin-sa",
                         operator.kube.create_if_absent, obj)
    # The deprecated alias counts too.
    job = builders.build_trainer_job(as_model(installed.run), 8)
    job["spec"]["template"]["spec"]["serviceAccount"] = "cluster-admin-sa"
    operator.refused(422, "children", "would run as cluster-admin-sa", operator.kube.create_if_absent, job)


def test_operator_may_not_mint_a_service_account_token(installed: Installed, operator: Operator) -> None:
    secret = builders.build_token_secret(as_model(installed.run), "unused")
    secret["metadata"]["name"] = f"{RUN}-sa-token"
    secret["type"] = "kubernetes.io/service-account-token"
    secret["metadata"]["annotations"] = {"kubernetes.io/service-account.name": "default"}
    del secret["stringData"]
    operator.refused(403, "children",
                     "grpo-operator may create only Secrets of type Opaque (never a "
                     "kubernetes.io/service-account-token or other credential): Secret "
                     f"{installed.install.run_namespace}/{RUN}-sa-token has type kubernetes.io/service-account-token",
                     operator.kube.create_if_absent, secret)


def test_operator_may_not_create_a_network_policy_no_run_owns(installed: Installed, operator: Operator) -> None:
    ns = installed.install.run_namespace
    deny_all = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"name": "deny-all", "namespace": ns},
                "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    operator.refused(403, "children", f"grpo-operator may create only objects a GRPORun owns: the new "
                     f"NetworkPolicy {ns}/deny-all lacks the grpo.dev/run label",
                     operator.kube.create_if_absent, deny_all)
    # Labelled and owned by the run, but selecting every pod of the namespace.
    owned = builders.build_network_policy(as_model(installed.run), builders.ServerIngress())
    owned["metadata"]["name"] = f"{RUN}-everything"
    owned["spec"]["podSelector"] = {}
    operator.refused(403, "children", "grpo-operator may create only NetworkPolicies that select the pods of the "
                     f"run that owns them: NetworkPolicy {ns}/{RUN}-everything does not select by grpo.dev/run={RUN}",
                     operator.kube.create_if_absent, owned)
    # Labelled, but owned by something else than a GRPORun.
    foreign = builders.build_network_policy(as_model(installed.run), builders.ServerIngress())
    foreign["metadata"]["name"] = f"{RUN}-foreign"
    foreign["metadata"]["ownerReferences"][0].update(apiVersion="apps/v1", kind="Deployment")
    operator.refused(403, "children", f"NetworkPolicy {ns}/{RUN}-foreign lacks an ownerReference to GRPORun {RUN} "
                     "(grpo.dev/v1alpha1), the run its grpo.dev/run label names",
                     operator.kube.create_if_absent, foreign)


def test_operator_may_not_expose_a_service_outside_the_cluster(installed: Installed, operator: Operator) -> None:
    service = builders.build_service(as_model(installed.run))
    service["metadata"]["name"] = f"{RUN}-external"
    service["spec"]["externalIPs"] = ["203.0.113.7"]
    operator.refused(403, "children", "grpo-operator may create only ClusterIP Services without externalIPs: "
                     f"Service {installed.install.run_namespace}/{RUN}-external is of type ClusterIP with externalIPs",
                     operator.kube.create_if_absent, service)


def test_operator_may_not_take_a_child_from_its_run(installed: Installed, operator: Operator) -> None:
    """An update must leave the object a run's child, running as a ServiceAccount on the list."""
    ns = installed.install.run_namespace
    deployment = builders.build_server_deployment(as_model(installed.run), 1, 0)
    name = deployment["metadata"]["name"] = f"{RUN}-kept"
    assert operator.kube.create_if_absent(deployment)
    try:
        orphan = [{"op": "remove", "path": "/metadata/ownerReferences"}]
        operator.refused(403, "children", f"grpo-operator may update only objects a GRPORun owns: the updated "
                         f"Deployment {ns}/{name} lacks an ownerReference to GRPORun {RUN}",
                         operator.kube.apps.patch_namespaced_deployment, name, ns, orphan,
                         _content_type="application/json-patch+json")
        elevate = {"spec": {"template": {"spec": {"serviceAccountName": "admin"}}}}
        operator.refused(422, "children", f"Deployment {ns}/{name} would run as admin",
                         operator.kube.patch_deployment, ns, name, elevate)
    finally:
        assert operator.kube.delete_if_present("Deployment", ns, name)


def test_what_the_operator_builds_is_created_patched_and_deleted(installed: Installed, operator: Operator) -> None:
    """The builders' children of a real run, through the operator's KubeClient as its ServiceAccount."""
    cp, install = installed.cp, installed.install
    ns = install.run_namespace
    # A run whose pods name a ServiceAccount on the list (the last one: not default where there are two).
    service_account = install.run_service_accounts[-1]
    body = installed.run
    if service_account != "default":
        manifest = run_manifest(install, name=f"{RUN}-sa", service_account=service_account)
        created = cp.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(manifest))
        assert created.returncode == 0, created.stderr
        body = json.loads(created.stdout)
    run = as_model(body)
    names = builders.child_names(run)
    children = operator_children(run)
    assert {c["kind"] for c in children} == {"ConfigMap", "PersistentVolumeClaim", "Secret", "Service",
                                             "NetworkPolicy", "Job", "Deployment"}
    for child in children:
        assert operator.kube.create_if_absent(child), f"{child['kind']} {child['metadata']['name']} existed"
    # Again, as after an operator restart: "already exists" (409), not a refusal.
    for child in children:
        assert not operator.kube.create_if_absent(child)
    # The attempt bump (EnsureServer of a new attempt) and the scale to zero (StopServer), as reconcile sends them.
    desired = builders.build_server_deployment(run, 2, 1)
    operator.kube.patch_deployment(ns, names.server, {"metadata": {"annotations": desired["metadata"]["annotations"]},
                                                      "spec": desired["spec"]})
    operator.kube.patch_deployment(ns, names.server, {"spec": {"replicas": 0}})
    got = json.loads(cp.kubectl("-n", ns, "get", f"deployment/{names.server}", "-o", "json", check=True).stdout)
    assert got["spec"]["replicas"] == 0
    assert got["metadata"]["annotations"][builders.ATTEMPT_ANNOTATION] == "2"
    assert got["spec"]["template"]["spec"].get("serviceAccountName", "default") == service_account
    # DeleteServer, DeleteTrainer, and the initializer.
    for kind, name in (("Service", names.server), ("Deployment", names.server), ("Job", names.trainer(1)),
                       ("Job", names.initializer)):
        assert operator.kube.delete_if_present(kind, ns, name), f"{kind} {name} was not there"
    assert cp.kubectl("-n", ns, "get", f"service/{names.server}").returncode != 0


def test_a_run_naming_another_service_account_is_refused_at_apply(installed: Installed) -> None:
    cp, install = installed.cp, installed.install
    allowed = ", ".join(install.run_service_accounts)
    manifest = run_manifest(install, name=f"{RUN}-admin", service_account="cluster-admin-sa")
    created = cp.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(manifest))
    refused(created, install, "runs",
            f"spec.scheduling.serviceAccountName: the pods of a run may run only as {allowed} "
            f"(admissionPolicy.runServiceAccounts of the grpo-operator release {install.namespace}/{install.release}), "
            "not cluster-admin-sa")
    # Every name on the list, and none at all, is accepted.
    for service_account in (*install.run_service_accounts, None):
        ok = run_manifest(install, name=f"{RUN}-ok", service_account=service_account)
        accepted = cp.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(ok))
        assert accepted.returncode == 0, f"{service_account}: {accepted.stderr}"
    if install.unwatched_namespace is not None:
        # Namespaces this release does not watch are another release's business.
        elsewhere = run_manifest(install, name=f"{RUN}-admin", service_account="cluster-admin-sa",
                                 namespace=install.unwatched_namespace)
        accepted = cp.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(elsewhere))
        assert accepted.returncode == 0, accepted.stderr


def test_the_policy_binds_the_operator_only(installed: Installed, bystanders: dict[str, str]) -> None:
    """An admin (and anyone else) keeps what RBAC gives them: the matchCondition names the operator."""
    cp, install = installed.cp, installed.install
    patched = cp.kubectl("-n", install.run_namespace, "set", "image", "deployment/bystander",
                         "app=registry.example/app:2", "--dry-run=server")
    assert patched.returncode == 0, patched.stderr


# --------------------------------------------------------------------------------- rendering (no cluster)


def policies_of(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs
            if d["kind"] in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")}


def test_rendered_policies_name_what_the_builders_write(chart: Chart) -> None:
    """The label, owner apiVersion and kind the policy requires are the builders' (a rename breaks it)."""
    from grpo_api.models import API_VERSION, KIND

    text = yaml.safe_dump(policies_of(chart.render())["ValidatingAdmissionPolicy/grpo-grpo-operator-children"])
    assert f"'{builders.RUN_LABEL}'" in text and f"'{API_VERSION}'" in text and f"'{KIND}'" in text


def test_policies_are_on_by_default_for_the_operators_service_account(chart: Chart) -> None:
    for values, username in (({}, "system:serviceaccount:grpo-system:grpo-grpo-operator"),
                             ({"serviceAccount": {"create": False, "name": "existing-operator"}},
                              "system:serviceaccount:grpo-system:existing-operator")):
        found = policies_of(chart.render(values))
        assert sorted(found) == ["ValidatingAdmissionPolicy/grpo-grpo-operator-children",
                                 "ValidatingAdmissionPolicy/grpo-grpo-operator-runs",
                                 "ValidatingAdmissionPolicyBinding/grpo-grpo-operator-children",
                                 "ValidatingAdmissionPolicyBinding/grpo-grpo-operator-runs"]
        children = found["ValidatingAdmissionPolicy/grpo-grpo-operator-children"]["spec"]
        assert children["matchConditions"] == [{"name": "is-the-operator",
                                                "expression": f"request.userInfo.username == '{username}'"}]
        for name in ("children", "runs"):
            assert found[f"ValidatingAdmissionPolicy/grpo-grpo-operator-{name}"]["spec"]["failurePolicy"] == "Fail"
            binding = found[f"ValidatingAdmissionPolicyBinding/grpo-grpo-operator-{name}"]["spec"]
            assert binding["validationActions"] == ["Deny"]
    assert not policies_of(chart.render({"admissionPolicy": {"enabled": False}}))


def test_only_the_runs_binding_follows_the_watched_namespaces(chart: Chart) -> None:
    watched = {"watch": {"mode": "namespaced", "namespaces": ["team-a", "team-b"]}}
    found = policies_of(chart.render(watched))
    assert "matchResources" not in found["ValidatingAdmissionPolicyBinding/grpo-grpo-operator-children"]["spec"]
    assert found["ValidatingAdmissionPolicyBinding/grpo-grpo-operator-runs"]["spec"]["matchResources"] == {
        "namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}]}}
    for values in ({"watch": {"mode": "cluster"}}, {}):
        found = policies_of(chart.render(values))
        runs = found["ValidatingAdmissionPolicyBinding/grpo-grpo-operator-runs"]["spec"]
        if values:
            assert "matchResources" not in runs
        else:  # namespaced, default: the release namespace
            assert runs["matchResources"]["namespaceSelector"]["matchExpressions"][0]["values"] == ["grpo-system"]


def test_a_cluster_without_validating_admission_policies_is_told_what_to_do(chart: Chart) -> None:
    result = chart.helm("template", RELEASE, str(CHART), "--kube-version", "1.29.4")
    assert result.returncode != 0
    assert "admissionPolicy.enabled needs Kubernetes 1.30 or later" in result.stderr, result.stderr
    assert "set admissionPolicy.enabled=false" in result.stderr
    off = chart.helm("template", RELEASE, str(CHART), "--kube-version", "1.29.4",
                     values={"admissionPolicy": {"enabled": False}})
    assert off.returncode == 0, off.stderr


@pytest.mark.parametrize("accounts", [[], ["Not_A_Name"], ["default", "default"]])
def test_schema_refuses_a_bad_service_account_list(chart: Chart, accounts: list[str]) -> None:
    result = chart.helm("template", RELEASE, str(CHART), values={"admissionPolicy": {"runServiceAccounts": accounts}})
    assert result.returncode != 0, f"helm template accepted {accounts}"
    assert "runServiceAccounts" in result.stderr, result.stderr
