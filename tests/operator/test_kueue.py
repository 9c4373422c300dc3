"""Kueue against the real control plane: Kueue v0.17's own manager (tests/fixtures/kueue.py) admits runs labelled
kueue.x-k8s.io/queue-name through the Workload the operator creates for each, with a pod set for the server and one
for the trainer. A run waits suspended, with no pod, until admitted; a ClusterQueue with quota for one run admits one
of two; a run of higher priority preempts one of lower priority, which suspends (its checkpoint kept on its claim,
not a failed attempt) and resumes with a new attempt when admitted again; missing queues and priority classes are
named in the status; an operator without Kueue refuses a labelled run.

No kubelet runs here: the tests play it (initializer pods succeed by themselves, trainer pods are finished by the
test), and servers are `grpo serve` processes reached through the run's server-url annotation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from grpo_operator.kueue import PRIORITY_CLASS_LABEL, QUEUE_LABEL
from tests.fixtures.controlplane import ControlPlane
from tests.fixtures.kueue import KueueManager, Queues
from tests.fixtures.server import RunningServer
from tests.fixtures.waiting import consistently, wait_for
from tests.operator.conftest import Kube, OperatorProcess, operator_identity, running_operator

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

KUEUE_SA = "grpo-operator-kueue"
COLOCATE: dict[str, Any] = {"mode": "colocate", "server": None}


@pytest.fixture(scope="session")
def kueue_operator_kubeconfig(control_plane: ControlPlane, grporun_crd: dict[str, Any], kueue: KueueManager,
                              tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ServiceAccount with exactly the operator's rules and Kueue's (the chart's kueue.enabled)."""
    return operator_identity(control_plane, tmp_path_factory, KUEUE_SA, "grpo-operator-kueue-test", kueue=True)


@pytest.fixture
def kueue_operator(control_plane: ControlPlane, kueue_operator_kubeconfig: Path, namespace: str,
                   tmp_path: Path) -> Iterator[OperatorProcess]:
    """`grpo operator --kueue` watching the test's namespace."""
    yield from running_operator(control_plane, OperatorProcess(
        namespace=namespace, kubeconfig=kueue_operator_kubeconfig, log_path=tmp_path / "operator.log",
        extra_args=("--kueue",)))


@pytest.fixture
def start_server(server_factory: Callable[..., RunningServer], tiny_model_dir: Path) -> Callable[[], RunningServer]:
    return lambda: server_factory(tiny_model_dir)


def queued(queue: str, priority: str | None = None) -> dict[str, str]:
    return {QUEUE_LABEL: queue, **({PRIORITY_CLASS_LABEL: priority} if priority else {})}


def workload_of(queues: Queues, kube: Kube, run: str) -> dict[str, Any] | None:
    """The run's Workload (found by its grpo.dev/run label)."""
    got = queues.cp.kubectl("get", "workloads.kueue.x-k8s.io", "-n", kube.namespace, "-l", f"grpo.dev/run={run}",
                            "-o", "json")
    assert got.returncode == 0, got.stderr
    items: list[dict[str, Any]] = json.loads(got.stdout)["items"]
    return items[0] if items else None


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def nothing_of(kube: Kube, run: str) -> bool:
    """No pod, Job or Deployment of the run exists."""
    selector = f"grpo.dev/run={run}"
    return not (kube.core.list_namespaced_pod(kube.namespace, label_selector=selector).items
                or kube.batch.list_namespaced_job(kube.namespace, label_selector=selector).items
                or kube.apps.list_namespaced_deployment(kube.namespace, label_selector=selector).items)


def test_a_queued_run_waits_with_no_pod_until_kueue_admits_its_server_and_trainer_together(
    kueue_operator: OperatorProcess, kube: Kube, queues: Queues, start_server: Callable[[], RunningServer]
) -> None:
    toleration = {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
    flavor = queues.flavor(node_labels={"pool": "gpu"}, tolerations=[toleration])
    cluster_queue = queues.cluster_queue(flavor, cpu="1")  # the server fits, the server and the trainer do not
    team = queues.local_queue(cluster_queue)
    server = start_server()
    kube.create_run("r", server_url=server.url, labels=queued(team))

    status = kube.wait_phase("r", "Suspended", reason="Queued")
    assert "waiting for Kueue to admit it" in status["message"], status
    consistently(lambda: nothing_of(kube, "r"), 3, what="no pod, Job or Deployment while Kueue has not admitted it")
    workload = workload_of(queues, kube, "r")
    assert workload is not None and workload["spec"]["queueName"] == team
    assert [(ps["name"], ps["count"]) for ps in workload["spec"]["podSets"]] == [("server", 1), ("trainer", 1)]
    assert (condition(workload, "Admitted") or {}).get("status", "False") == "False"
    reserved = condition(workload, "QuotaReserved")
    assert reserved is not None and reserved["status"] == "False", workload.get("status")
    kube.wait_event("r", "Normal", "Queued")

    queues.set_quota(cluster_queue, flavor, "2")  # room for both: both are admitted, together
    kube.wait_phase("r", "Training", timeout=90)
    assert any(e == ("Normal", "Admitted") for e in kube.events("r"))
    pods = kube.apps.read_namespaced_deployment("r-server", kube.namespace).spec.template.spec
    assert pods.node_selector == {"pool": "gpu"}, "the flavor's node labels"
    assert [(t.key, t.operator, t.effect) for t in pods.tolerations or []] == [("gpu", "Exists", "NoSchedule")]
    trainer = wait_for(lambda: kube.job("r-trainer-1"), what="the trainer Job").spec.template.spec
    assert trainer.node_selector == {"pool": "gpu"}
    assert (condition(workload_of(queues, kube, "r"), "Admitted") or {}).get("status") == "True"

    kube.finish_trainer("r-trainer-1", succeeded=True)
    kube.wait_phase("r", "Succeeded")
    finished = wait_for(lambda: condition(workload_of(queues, kube, "r"), "Finished"), timeout=30,
                        what="the Workload to be Finished once the server stopped")
    assert (finished["status"], finished["reason"]) == ("True", "Succeeded")


def test_a_quota_for_one_run_admits_one_of_two_and_the_other_when_the_first_ends(
    kueue_operator: OperatorProcess, kube: Kube, queues: Queues
) -> None:
    flavor = queues.flavor()
    team = queues.local_queue(queues.cluster_queue(flavor, cpu="1"))  # one colocate trainer: 1 cpu
    kube.create_run("a", labels=queued(team), **COLOCATE)
    kube.wait_phase("a", "Training", timeout=60)
    kube.create_run("b", labels=queued(team), **COLOCATE)

    kube.wait_phase("b", "Suspended", reason="Queued")
    wait_for(lambda: "insufficient" in kube.status("b")["message"], timeout=30,
             what=f"Kueue's words for the missing quota in the status (now {kube.status('b').get('message')})")
    consistently(lambda: nothing_of(kube, "b"), 3, what="no pod or Job of the second run")

    kube.finish_trainer("a-trainer-1", succeeded=True)
    kube.wait_phase("a", "Succeeded")
    kube.wait_phase("b", "Training", timeout=90)
    assert kube.status("b")["attempt"] == 1


def test_a_higher_priority_run_preempts_and_the_preempted_run_resumes_when_admitted_again(
    kueue_operator: OperatorProcess, kube: Kube, queues: Queues
) -> None:
    flavor = queues.flavor()
    team = queues.local_queue(queues.cluster_queue(flavor, cpu="1", preempt=True))
    low, high = queues.priority_class("low", 100), queues.priority_class("high", 1000)
    kube.create_run("low", labels=queued(team, low), runPolicy={"backoffLimit": 0}, **COLOCATE)
    kube.wait_phase("low", "Training", timeout=60)
    assert (workload_of(queues, kube, "low") or {}).get("spec", {}).get("priority") == 100
    init_uid = kube.job("low-init").metadata.uid

    kube.create_run("high", labels=queued(team, high), **COLOCATE)
    evicted = kube.wait_phase("low", "Suspended", reason="Evicted", timeout=60)
    assert (evicted["attempt"], evicted["preemptions"], evicted.get("failedAttempts", 0)) == (1, 1, 0), evicted
    assert "evicted by Kueue: Preempted" in evicted["message"] and "checkpoint kept" in evicted["message"]
    kube.wait_event("low", "Warning", "Evicted")
    wait_for(lambda: kube.job("low-trainer-1") is None, timeout=30, what="the preempted run's trainer to go")
    kube.wait_phase("high", "Training", timeout=60)

    kube.finish_trainer("high-trainer-1", succeeded=True)
    kube.wait_phase("high", "Succeeded")
    resumed = wait_for(lambda: (s := kube.status("low")).get("attempt") == 2 and s.get("phase") == "Training" and s,
                       timeout=90, what=f"the preempted run's attempt 2 (now {kube.status('low')})")
    assert (resumed["preemptions"], resumed.get("failedAttempts", 0), resumed["reason"]) == (1, 0, "Admitted"), resumed
    assert kube.job("low-init").metadata.uid == init_uid, "the sources are not fetched again"
    volumes = {v.name: v for v in wait_for(lambda: kube.job("low-trainer-2")).spec.template.spec.volumes}
    assert volumes["data"].persistent_volume_claim.claim_name == "low-data", "the claim that holds its checkpoint"


def test_missing_queues_and_priority_classes_are_named_and_runs_without_the_label_are_unchanged(
    kueue_operator: OperatorProcess, kube: Kube, queues: Queues
) -> None:
    flavor = queues.flavor()
    cluster_queue = queues.cluster_queue(flavor, cpu="4")
    kube.create_run("nolq", labels=queued("later"), **COLOCATE)
    kube.create_run("nopc", labels=queued("later", "nonesuch"), **COLOCATE)
    kube.create_run("plain", **COLOCATE)

    status = kube.wait_phase("nolq", "Suspended", reason="QueueNotFound", timeout=20)
    assert f"LocalQueue later (label {QUEUE_LABEL}) does not exist" in status["message"], status
    status = kube.wait_phase("nopc", "Suspended", reason="PriorityClassNotFound", timeout=20)
    assert f"WorkloadPriorityClass nonesuch (label {PRIORITY_CLASS_LABEL}) does not exist" in status["message"]
    assert workload_of(queues, kube, "nopc") is None, "no Workload without its priority"
    kube.wait_phase("plain", "Training", timeout=60)
    assert workload_of(queues, kube, "plain") is None, "a run without the label is no Workload"

    queues.local_queue(cluster_queue, name="later")
    kube.wait_phase("nolq", "Training", timeout=60)


def test_an_operator_without_kueue_refuses_a_labelled_run_naming_the_label(
    operator: OperatorProcess, kube: Kube
) -> None:
    kube.create_run("queued", labels=queued("team"), **COLOCATE)
    status = kube.wait_phase("queued", "Failed", reason="InvalidSpec")
    assert f"metadata.labels[{QUEUE_LABEL}]" in status["message"] and "--kueue" in status["message"], status
    kube.create_run("badname", labels=queued("Team_A"), **COLOCATE)
    status = kube.wait_phase("badname", "Failed", reason="InvalidSpec")
    assert f"metadata.labels[{QUEUE_LABEL}] is 'Team_A'" in status["message"], status
    assert nothing_of(kube, "queued") and nothing_of(kube, "badname")
