"""A run re-created under the name of one being deleted (`kubectl delete grporun r --wait`, then `kubectl
apply` of a changed spec: the way to change an immutable section), against the real control plane.

What the earlier run left (its claim, held by the `kubernetes.io/pvc-protection` finalizer that admission
puts on every claim while no pvc-protection controller runs here; a Job a finalizer keeps terminating) must
show in the new run's status, an event and the operator's log within one reconcile, and the new run must go
on by itself once it is gone.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.fixtures.waiting import consistently, wait_for
from tests.operator.conftest import Kube, OperatorProcess, run_spec

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

HOLD = "test.grpo.dev/hold"
#: "Within one reconcile": the operator reconciles a new run at once (interval 1 s in these tests); a loaded
#: 2-core test machine gets some slack.
ONE_RECONCILE_S = 10.0


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions", [])}


def owner_uid(obj: Any) -> str | None:
    refs = obj.metadata.owner_references or []
    return next((r.uid for r in refs if r.kind == "GRPORun" and r.controller), None)


def claim(kube: Kube, name: str) -> Any:
    try:
        return kube.core.read_namespaced_persistent_volume_claim(name, kube.namespace)
    except kube.client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def release_claim(kube: Kube, name: str) -> None:
    """Play the pvc-protection controller: the claim's pods are gone, let the claim go."""
    kube.core.patch_namespaced_persistent_volume_claim(name, kube.namespace, {"metadata": {"finalizers": None}})


def delete_and_wait(kube: Kube, name: str) -> None:
    """`kubectl delete grporun NAME --wait`: background propagation, back once the run itself is gone."""
    kube.custom.delete_namespaced_custom_object("grpo.dev", "v1alpha1", kube.namespace, "grporuns", name,
                                                propagation_policy="Background")
    wait_for(lambda: kube.run(name) is None, timeout=30, what=f"run {name} to be deleted")


def event_messages(kube: Kube, run: str, reason: str) -> list[tuple[str, str, str]]:
    """(type, uid of the run it is about, message) of the run's events with this reason."""
    found = kube.core.list_namespaced_event(kube.namespace, field_selector=f"involvedObject.name={run}")
    return [(e.type, e.involved_object.uid, e.message) for e in found.items if e.reason == reason]


def waiting_status(kube: Kube, name: str) -> dict[str, Any] | None:
    status = kube.status(name)
    return status if status.get("reason") == "WaitingForOldChildren" else None


def test_a_run_recreated_while_the_old_claim_terminates_says_so_at_once_and_goes_on_by_itself(
    operator: OperatorProcess, kube: Kube
) -> None:
    old = kube.create_run("again")
    old_uid = old["metadata"]["uid"]
    wait_for(lambda: claim(kube, "again-data"), what="the first run's claim")
    assert "kubernetes.io/pvc-protection" in (claim(kube, "again-data").metadata.finalizers or [])
    delete_and_wait(kube, "again")
    # The collector deletes the run-config at once; the claim stays Terminating while (here: as if) pods use it.
    wait_for(lambda: kube.config_map("again-config") is None, timeout=60, what="the old run-config to go")
    wait_for(lambda: claim(kube, "again-data").metadata.deletion_timestamp, timeout=60,
             what="the collector to delete the old claim")

    # A changed spec under the same name.
    new = kube.create_run("again", spec=run_spec(storage={"size": "2Gi"}))
    new_uid = new["metadata"]["uid"]
    status = wait_for(lambda: waiting_status(kube, "again"), timeout=ONE_RECONCILE_S,
                      what=f"the new run to say what it waits for (now {kube.status('again')})")
    assert status["phase"] == "Pending", status
    assert "PersistentVolumeClaim again-data" in status["message"] and old_uid in status["message"], status
    cond = conditions(status)["Reconciled"]
    assert (cond["status"], cond["reason"]) == ("False", "WaitingForOldChildren"), cond
    assert "PersistentVolumeClaim again-data" in cond["message"], cond
    events = wait_for(lambda: event_messages(kube, "again", "WaitingForOldChildren"), timeout=ONE_RECONCILE_S,
                      what="a WaitingForOldChildren event")
    assert [(type_, uid) for type_, uid, _ in events] == [("Warning", new_uid)], events
    assert "PersistentVolumeClaim again-data" in events[0][2], events
    assert any("again" in line and "PersistentVolumeClaim again-data" in line
               for line in operator.log_tail(10**6).splitlines()), operator.log_tail()

    # Nothing of the new run is made beside what the old one left, and the wait is reported once.
    consistently(lambda: kube.config_map("again-config") is None and kube.job("again-init") is None
                 and waiting_status(kube, "again"), seconds=3, what="the wait with nothing created")
    assert len(event_messages(kube, "again", "WaitingForOldChildren")) == 1, "one event for one wait"

    release_claim(kube, "again-data")
    wait_for(lambda: (c := claim(kube, "again-data")) is not None and owner_uid(c) == new_uid, timeout=30,
             what="the new run's own claim")
    status = wait_for(lambda: (s := kube.status("again")).get("phase") not in (None, "Pending") and s,
                      timeout=30, what="the new run to go on by itself")
    assert status["phase"] in ("Initializing", "StartingServer"), status
    assert conditions(status)["Reconciled"]["status"] == "True", status
    assert claim(kube, "again-data").spec.resources.requests["storage"] == "2Gi", "the changed spec's claim"
    assert owner_uid(kube.config_map("again-config")) == new_uid


def test_a_run_recreated_while_a_child_of_the_old_uid_is_held_names_it_and_goes_on_once_it_is_gone(
    operator: OperatorProcess, kube: Kube
) -> None:
    old = kube.create_run("held")
    old_uid = old["metadata"]["uid"]
    wait_for(lambda: kube.job("held-init"), what="the first run's initializer Job")
    kube.batch.patch_namespaced_job("held-init", kube.namespace, {"metadata": {"finalizers": [HOLD]}})
    delete_and_wait(kube, "held")
    wait_for(lambda: claim(kube, "held-data").metadata.deletion_timestamp, timeout=60,
             what="the collector to delete the old claim")
    release_claim(kube, "held-data")
    wait_for(lambda: claim(kube, "held-data") is None and kube.config_map("held-config") is None, timeout=60,
             what="the old claim and run-config to go")
    wait_for(lambda: kube.job("held-init").metadata.deletion_timestamp, timeout=60,
             what="the collector to delete the old initializer Job")

    new = kube.create_run("held", spec=run_spec(trainer={"maxSteps": 6}))
    status = wait_for(lambda: waiting_status(kube, "held"), timeout=ONE_RECONCILE_S,
                      what=f"the new run to say what it waits for (now {kube.status('held')})")
    assert status["phase"] == "Pending", status
    assert "Job held-init" in status["message"] and old_uid in status["message"], status
    wait_for(lambda: event_messages(kube, "held", "WaitingForOldChildren"), timeout=ONE_RECONCILE_S,
             what="a WaitingForOldChildren event")
    assert owner_uid(kube.job("held-init")) == old_uid, "the old Job is never adopted"

    kube.batch.patch_namespaced_job("held-init", kube.namespace, {"metadata": {"finalizers": None}})
    wait_for(lambda: (j := kube.job("held-init")) is not None and owner_uid(j) == new["metadata"]["uid"],
             timeout=60, what="the new run's own initializer Job")
    status = wait_for(lambda: (s := kube.status("held")).get("phase") not in (None, "Pending") and s,
                      timeout=30, what="the new run to go on by itself")
    assert conditions(status)["Reconciled"]["status"] == "True", status
