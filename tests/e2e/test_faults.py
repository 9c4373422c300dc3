"""Faults on the real node, each ending in a correct final state.

Each test runs its own GRPORun of the CPU example and breaks things the way production does, one after the
other where one run can take several (each run costs a server, a trainer and their model loads on the node):
the kubelet, the Deployment and Job controllers and the garbage collector do their real work.
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
    pods,
    run_status,
    wait_for,
    wait_phase,
    wait_step,
)

#: Longer runs than the main test (a CPU step takes well under a second here): a fault must land
#: mid-training although the run's status reports progress only every few seconds, and the trainer test's
#: second fault needs its second attempt to pass a checkpoint of its own with room left.
STEPS = 60
#: The recreated run is deleted mid-training: it must not end first (it is never trained to the end).
RECREATED_STEPS = 120
CHECKPOINT_INTERVAL = 10
RUN_TIMEOUT_S = 15 * 60
OPERATOR_SELECTOR = "app.kubernetes.io/name=grpo-operator"


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


def new_operator_ready(node: Node, old: str) -> bool:
    pods = [p for p in node.list("pod", OPERATOR_SELECTOR, RELEASE_NAMESPACE) if p["metadata"]["name"] != old]
    return any(c.get("ready") for p in pods for c in (p.get("status") or {}).get("containerStatuses") or [])


def test_server_pod_then_operator_pod_deleted_mid_training_keep_the_attempt_and_no_child_is_duplicated(
        node: Node, staged: str, volume: VolumeReader) -> None:
    """Two faults the run rides out in its one attempt: its server pod deleted (the Deployment makes a new one, the
    trainer finds it and loads its adapter there before generating), then, once the operator has noted the new server,
    the operator's own pod deleted (its Deployment brings a new one up, which takes the run over mid-training without
    duplicating a child or restarting the server again)."""
    run = "fault-server"
    node.apply(example_run(node, run, maxSteps=STEPS))
    first_boot = wait_step(node, run, 5, RUN_TIMEOUT_S)["server"]["bootId"]
    (pod,) = server_pods(node, run)
    node.kubectl("delete", "pod", "-n", NAMESPACE, pod["metadata"]["name"], "--wait=false")

    def restarted() -> str | None:
        events = [e for e in node.list("events", "", NAMESPACE)
                  if e["involvedObject"].get("name") == run and e["reason"] == "ServerRestarted"]
        boot = run_status(node, run).get("server", {}).get("bootId")
        return boot if events and boot and boot != first_boot and boot in events[-1]["message"] else None

    new_boot = wait_for(restarted, RUN_TIMEOUT_S, what=f"the operator to note {run}'s new server", interval=2.0)
    (old,) = node.list("pod", OPERATOR_SELECTOR, RELEASE_NAMESPACE)
    node.kubectl("delete", "pod", "-n", RELEASE_NAMESPACE, old["metadata"]["name"], "--wait=false")
    wait_for(lambda: new_operator_ready(node, old["metadata"]["name"]), 180,
             what="the operator Deployment to bring a new pod up", interval=2.0)

    status = wait_phase(node, run, "Succeeded", RUN_TIMEOUT_S)
    assert status["attempt"] == 1 and status.get("failedAttempts", 0) == 0, status
    assert status["server"]["bootId"] == new_boot, (new_boot, status["server"])   # no third server
    found = children(node, run)
    assert found["deployment"] == [f"{run}-server"], found
    assert found["job"] == [f"{run}-init", f"{run}-trainer-1"], found
    assert sorted(found["service"]) == [f"{run}-replicas", f"{run}-server"], found
    events = [e for e in node.list("events", "", NAMESPACE) if e["involvedObject"].get("name") == run]
    assert len([e for e in events if e["reason"] == "ServerRestarted"]) == 1, (
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


def attempt_steps(history: list[dict], attempt: int) -> list[int]:
    return [h["step"] for h in history if h.get("attempt") == attempt]


def assert_resumed_from_a_checkpoint(before: list[int], after: list[int]) -> None:
    """The later attempt resumed from the last checkpoint the earlier one wrote, not from step 0."""
    assert before and after, (before, after)
    resumed_from = after[0] - 1
    assert resumed_from % CHECKPOINT_INTERVAL == 0 and resumed_from > 0, (before, after)
    assert before[-1] - 2 * CHECKPOINT_INTERVAL <= resumed_from <= before[-1], (before, after)


def test_trainer_pod_evicted_then_killed_resumes_twice_and_only_the_kill_counts_against_backoff_limit(
        node: Node, staged: str, volume: VolumeReader) -> None:
    """Two ends of the trainer pod, one per attempt, each followed by a new attempt with a fresh server that resumes
    from the last checkpoint. First the Eviction API (what `kubectl drain`, the cluster autoscaler and a node's upgrade
    use): the API server marks the pod DisruptionTarget, the kubelet ends it with SIGTERM, the Job's podFailurePolicy
    fails the Job naming the disruption, and the run is preempted, not failed. Then a forced deletion (a pod lost
    with its node): a failed attempt. The example's backoffLimit is 1, so the run succeeds only if the eviction was
    not counted."""
    run = "fault-trainer"
    node.apply(example_run(node, run, maxSteps=STEPS, checkpointInterval=CHECKPOINT_INTERVAL))
    first_boot = wait_step(node, run, CHECKPOINT_INTERVAL + 2, RUN_TIMEOUT_S)["server"]["bootId"]
    (pod,) = node.list("pod", f"grpo.dev/run={run},grpo.dev/component=trainer")
    evicted = pod["metadata"]["name"]
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": evicted, "namespace": NAMESPACE}}
    node.kubectl("create", "--raw", f"/api/v1/namespaces/{NAMESPACE}/pods/{evicted}/eviction", "-f", "-",
                 input=json.dumps(eviction))

    # attempt 2 trains past a checkpoint of its own; then its pod is deleted at once
    def second_attempt_past_a_checkpoint() -> list[dict] | None:
        status = run_status(node, run)
        assert status.get("phase") not in ("Failed", "Succeeded"), status
        if status.get("attempt") != 2:
            return None
        history = volume.history(run)
        second = attempt_steps(history, 2)
        return history if second and second[-1] >= second[0] + CHECKPOINT_INTERVAL + 1 else None

    wait_for(second_attempt_past_a_checkpoint, RUN_TIMEOUT_S, what=f"{run}'s attempt 2 to pass a checkpoint",
             interval=2.0)
    second_boot = run_status(node, run)["server"]["bootId"]
    (pod,) = pods(node, run, "trainer")
    killed = pod["metadata"]["name"]
    assert killed != evicted
    node.kubectl("delete", "pod", "-n", NAMESPACE, killed, "--grace-period=0", "--force")

    status = wait_phase(node, run, "Succeeded", RUN_TIMEOUT_S)
    assert status["attempt"] == 3 and status["failedAttempts"] == 1 and status["preemptions"] == 1, status
    boots = [first_boot, second_boot, status["server"]["bootId"]]
    assert all(boots) and len(set(boots)) == 3, f"every attempt gets a fresh server: {boots}"
    job = node.get("job", f"{run}-trainer-1")
    assert job is not None
    failed = [c for c in job["status"].get("conditions", []) if c["type"] == "Failed" and c["status"] == "True"]
    assert [c["reason"] for c in failed] == ["PodFailurePolicy"], failed
    assert f"{evicted} has condition DisruptionTarget" in failed[0]["message"], failed
    events = [e for e in node.list("events", "", NAMESPACE) if e["involvedObject"].get("name") == run]
    preempted = [e["message"] for e in events if e["reason"] == "Preempted"]
    assert len(preempted) == 1 and evicted in preempted[0] and "not counted against backoffLimit" in preempted[0], (
        [(e["reason"], e["message"]) for e in events])
    history = volume.history(run)
    first, second, third = (attempt_steps(history, attempt) for attempt in (1, 2, 3))
    assert_resumed_from_a_checkpoint(first, second)
    assert_resumed_from_a_checkpoint(second, third)
    assert third == list(range(third[0], STEPS + 1)), third


def delete_mid_training_and_see_every_child_go_within_a_minute(node: Node, run: str) -> None:
    assert children(node, run)["deployment"], "nothing to delete"
    started = time.monotonic()
    node.kubectl("delete", "grporun", "-n", NAMESPACE, run, "--wait=false")

    wait_for(lambda: node.get("grporun", run) is None, 60, what="the run's finalizer to be released", interval=1)

    def all_gone() -> bool:
        return not any(children(node, run).values())

    wait_for(all_gone, max(1.0, 60 - (time.monotonic() - started)), what=f"every child of {run} to be deleted",
             interval=1)


def test_a_run_recreated_under_its_name_says_what_it_waits_for_trains_and_goes_with_every_child_when_deleted(
        node: Node, staged: str) -> None:
    """`kubectl delete --wait` then `kubectl apply` of a changed spec (the way to change an immutable section):
    while the old pods really terminate and hold the old claim, the new run says so, then trains by itself. Deleted
    mid-training, the new run releases its finalizer and every child of it is gone within a minute."""
    run = "fault-recreate"
    node.apply(example_run(node, run, maxSteps=RECREATED_STEPS))
    wait_step(node, run, 2, RUN_TIMEOUT_S)
    old = node.get("grporun", run)
    assert old is not None
    old_uid = old["metadata"]["uid"]
    node.kubectl("delete", "grporun", "-n", NAMESPACE, run, "--wait=true", timeout=120)
    node.apply(example_run(node, run, maxSteps=RECREATED_STEPS // 2))
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
    delete_mid_training_and_see_every_child_go_within_a_minute(node, run)
