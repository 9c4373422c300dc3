"""Faults on the real node, each ending in a correct final state.

Each test runs its own GRPORun of the CPU example and breaks one thing the way production does: the
kubelet, the Deployment and Job controllers and the garbage collector do their real work.
"""

from __future__ import annotations

import json
import time

from tests.e2e.conftest import (
    NAMESPACE,
    RELEASE_NAMESPACE,
    Node,
    VolumeReader,
    example_run,
    run_status,
    wait_for,
    wait_phase,
    wait_step,
)

#: Longer runs than the main test (a CPU step takes well under a second here): the fault must land
#: mid-training although the run's status reports progress only every few seconds.
STEPS = 120
CHECKPOINT_INTERVAL = 10
RUN_TIMEOUT_S = 15 * 60


def children(node: Node, run: str) -> dict[str, list[str]]:
    found = {}
    for kind in ("deployment", "job", "service", "configmap", "secret", "networkpolicy", "pod"):
        found[kind] = [o["metadata"]["name"] for o in node.list(kind, f"grpo.dev/run={run}")]
    return found


def server_pods(node: Node, run: str) -> list[dict]:
    return [p for p in node.list("pod", f"grpo.dev/run={run},grpo.dev/component=server")
            if not p["metadata"].get("deletionTimestamp")]


def assert_each_step_once(volume: VolumeReader, run: str, last: int) -> list[dict]:
    history = volume.history(run)
    steps = [h["step"] for h in history]
    assert steps == list(range(1, last + 1)), f"steps trained (one line per step): {steps}"
    return history


def test_server_pod_deleted_mid_training_keeps_the_attempt_and_the_run_succeeds(
        node: Node, staged: str, volume: VolumeReader) -> None:
    run = "fault-server"
    node.apply(example_run(node, run, maxSteps=STEPS))
    first_boot = wait_step(node, run, 5, RUN_TIMEOUT_S)["server"]["bootId"]
    (pod,) = server_pods(node, run)
    node.kubectl("delete", "pod", "-n", NAMESPACE, pod["metadata"]["name"], "--wait=false")

    status = wait_phase(node, run, "Succeeded", RUN_TIMEOUT_S)
    assert status["attempt"] == 1 and status.get("failedAttempts", 0) == 0, status
    new_boot = status["server"]["bootId"]
    assert new_boot and new_boot != first_boot, (first_boot, status["server"])
    events = [e for e in node.list("events", "", NAMESPACE) if e["involvedObject"].get("name") == run]
    assert any(e["reason"] == "ServerRestarted" and new_boot in e["message"] for e in events), (
        [(e["reason"], e["message"]) for e in events])

    (trainer,) = node.list("pod", f"grpo.dev/run={run},grpo.dev/component=trainer")
    lines = node.kubectl("logs", "-n", NAMESPACE, trainer["metadata"]["name"]).stdout.splitlines()
    assert not [line for line in lines if "Traceback" in line], lines[-40:]
    # the trainer found the new pod (a new address behind the headless Service, a new boot id) and loaded
    # its current adapter there before generating on it
    (restart,) = [i for i, line in enumerate(lines) if line.startswith(f"server restarted: boot id {first_boot} ->")]
    after = [line for line in lines[restart + 1:]
             if "caught up to adapter" in line or line.startswith(("published adapter", "generated"))]
    assert not after[0].startswith("generated"), lines[restart: restart + 5]
    assert_each_step_once(volume, run, STEPS)
    assert status["adapter"]["version"] == STEPS


def test_trainer_pod_killed_mid_run_retries_with_a_fresh_server_and_resumes(
        node: Node, staged: str, volume: VolumeReader) -> None:
    run = "fault-trainer"
    node.apply(example_run(node, run, maxSteps=STEPS, checkpointInterval=CHECKPOINT_INTERVAL))
    first = wait_step(node, run, CHECKPOINT_INTERVAL + 2, RUN_TIMEOUT_S)
    first_boot = first["server"]["bootId"]
    (pod,) = node.list("pod", f"grpo.dev/run={run},grpo.dev/component=trainer")
    node.kubectl("delete", "pod", "-n", NAMESPACE, pod["metadata"]["name"], "--grace-period=0", "--force")

    status = wait_phase(node, run, "Succeeded", RUN_TIMEOUT_S)
    assert status["attempt"] == 2 and status["failedAttempts"] == 1, status
    assert status["server"]["bootId"] and status["server"]["bootId"] != first_boot, (first_boot, status["server"])
    history = volume.history(run)
    first_steps = [h["step"] for h in history if h.get("attempt") == 1]
    second_steps = [h["step"] for h in history if h.get("attempt") == 2]
    assert first_steps and second_steps, history
    # the second attempt resumed from the last checkpoint the first one wrote, not from step 0, and finished
    resumed_from = second_steps[0] - 1
    assert resumed_from % CHECKPOINT_INTERVAL == 0 and resumed_from > 0, (first_steps, second_steps)
    assert first_steps[-1] - 2 * CHECKPOINT_INTERVAL <= resumed_from <= first_steps[-1], (first_steps, second_steps)
    assert second_steps == list(range(second_steps[0], STEPS + 1)), second_steps


def test_trainer_pod_evicted_mid_run_resumes_in_an_attempt_not_counted_against_backoff_limit(
        node: Node, staged: str, volume: VolumeReader) -> None:
    """The Eviction API (what `kubectl drain`, the cluster autoscaler and a node's upgrade use): the API server
    marks the pod DisruptionTarget, the kubelet ends it with SIGTERM, the Job's podFailurePolicy fails the Job
    naming the disruption, and the run goes on from its checkpoint with a fresh server, preempted, not failed."""
    run = "fault-evict"
    node.apply(example_run(node, run, maxSteps=STEPS, checkpointInterval=CHECKPOINT_INTERVAL))
    first = wait_step(node, run, CHECKPOINT_INTERVAL + 2, RUN_TIMEOUT_S)
    first_boot = first["server"]["bootId"]
    (pod,) = node.list("pod", f"grpo.dev/run={run},grpo.dev/component=trainer")
    name = pod["metadata"]["name"]
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": NAMESPACE}}
    node.kubectl("create", "--raw", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}/eviction", "-f", "-",
                 input=json.dumps(eviction))

    status = wait_phase(node, run, "Succeeded", RUN_TIMEOUT_S)
    assert status["attempt"] == 2 and status.get("failedAttempts", 0) == 0 and status["preemptions"] == 1, status
    assert status["server"]["bootId"] and status["server"]["bootId"] != first_boot, (first_boot, status["server"])
    job = node.get("job", f"{run}-trainer-1")
    assert job is not None
    failed = [c for c in job["status"].get("conditions", []) if c["type"] == "Failed" and c["status"] == "True"]
    assert [c["reason"] for c in failed] == ["PodFailurePolicy"], failed
    assert f"{name} has condition DisruptionTarget" in failed[0]["message"], failed
    events = [e for e in node.list("events", "", NAMESPACE) if e["involvedObject"].get("name") == run]
    preempted = [e["message"] for e in events if e["reason"] == "Preempted"]
    assert len(preempted) == 1 and name in preempted[0] and "not counted against backoffLimit" in preempted[0], (
        [(e["reason"], e["message"]) for e in events])
    assert not [e for e in events if e["reason"] in ("TrainerFailed", "Retrying")], [e["reason"] for e in events]
    history = volume.history(run)
    first_steps = [h["step"] for h in history if h.get("attempt") == 1]
    second_steps = [h["step"] for h in history if h.get("attempt") == 2]
    assert first_steps and second_steps, history
    # resumed from the last checkpoint attempt 1 wrote, not from step 0, and finished
    resumed_from = second_steps[0] - 1
    assert resumed_from % CHECKPOINT_INTERVAL == 0 and resumed_from > 0, (first_steps, second_steps)
    assert first_steps[-1] - 2 * CHECKPOINT_INTERVAL <= resumed_from <= first_steps[-1], (first_steps, second_steps)
    assert second_steps == list(range(second_steps[0], STEPS + 1)), second_steps


def test_operator_pod_deleted_mid_run_comes_back_without_duplicate_children(
        node: Node, staged: str, volume: VolumeReader) -> None:
    run = "fault-operator"
    node.apply(example_run(node, run, maxSteps=STEPS))
    wait_step(node, run, 3, RUN_TIMEOUT_S)
    selector = "app.kubernetes.io/name=grpo-operator"
    (old,) = node.list("pod", selector, RELEASE_NAMESPACE)
    node.kubectl("delete", "pod", "-n", RELEASE_NAMESPACE, old["metadata"]["name"], "--wait=false")

    def new_operator_ready() -> bool:
        pods = [p for p in node.list("pod", selector, RELEASE_NAMESPACE)
                if p["metadata"]["name"] != old["metadata"]["name"]]
        return any(c.get("ready") for p in pods for c in (p.get("status") or {}).get("containerStatuses") or [])

    wait_for(new_operator_ready, 180, what="the operator Deployment to bring a new pod up", interval=2.0)
    status = wait_phase(node, run, "Succeeded", RUN_TIMEOUT_S)
    assert status["attempt"] == 1, status
    found = children(node, run)
    assert found["deployment"] == [f"{run}-server"], found
    assert found["job"] == [f"{run}-init", f"{run}-trainer-1"], found
    assert sorted(found["service"]) == [f"{run}-replicas", f"{run}-server"], found
    assert_each_step_once(volume, run, STEPS)


def test_deleting_a_run_mid_training_removes_every_child_within_a_minute(
        node: Node, staged: str, volume: VolumeReader) -> None:
    run = "fault-delete"
    node.apply(example_run(node, run, maxSteps=STEPS))
    wait_step(node, run, 2, RUN_TIMEOUT_S)
    assert children(node, run)["deployment"], "nothing to delete"
    started = time.monotonic()
    node.kubectl("delete", "grporun", "-n", NAMESPACE, run, "--wait=false")

    wait_for(lambda: node.get("grporun", run) is None, 60, what="the run's finalizer to be released", interval=1)

    def all_gone() -> bool:
        return not any(children(node, run).values())

    wait_for(all_gone, max(1.0, 60 - (time.monotonic() - started)), what=f"every child of {run} to be deleted",
             interval=1)


def test_a_run_recreated_under_its_name_says_what_it_waits_for_and_then_trains(node: Node, staged: str) -> None:
    """`kubectl delete --wait` then `kubectl apply` of a changed spec (the way to change an immutable section):
    while the old pods really terminate and hold the old claim, the new run says so, then trains by itself."""
    run = "fault-recreate"
    node.apply(example_run(node, run, maxSteps=STEPS))
    wait_step(node, run, 2, RUN_TIMEOUT_S)
    old = node.get("grporun", run)
    assert old is not None
    old_uid = old["metadata"]["uid"]
    node.kubectl("delete", "grporun", "-n", NAMESPACE, run, "--wait=true", timeout=120)
    node.apply(example_run(node, run, maxSteps=STEPS // 2))
    applied = time.monotonic()

    def old_claim_left() -> bool:
        claim = node.get("pvc", f"{run}-data")
        refs = (claim or {}).get("metadata", {}).get("ownerReferences") or []
        return any(r.get("uid") == old_uid for r in refs)

    waited = False
    while True:
        status = run_status(node, run)   # read before the claim: it was there when this status was current
        if not old_claim_left():
            break
        if time.monotonic() - applied > 10:   # one reconcile, with room for a loaded node
            assert status.get("reason") == "WaitingForOldChildren", status
            assert f"PersistentVolumeClaim {run}-data" in status.get("message", ""), status
            waited = True
        assert time.monotonic() - applied < 300, f"the old claim outlived its pods by minutes: {status}"
        time.sleep(1)
    status = wait_step(node, run, 1, RUN_TIMEOUT_S)
    assert status["attempt"] == 1, status
    new = node.get("grporun", run)
    assert new is not None and new["metadata"]["uid"] != old_uid, new
    if waited:
        events = [e for e in node.list("events", "", NAMESPACE) if e["reason"] == "WaitingForOldChildren"
                  and e["involvedObject"].get("uid") == new["metadata"]["uid"]]
        assert len(events) == 1 and f"{run}-data" in events[0]["message"], events
    node.kubectl("delete", "grporun", "-n", NAMESPACE, run, "--wait=false")
