"""Scale-out on the real node: two server pods fed as one, and an indexed trainer Job of two pods (gloo).

The CPU example with `server.replicas: 2` and `trainer.numNodes: 2`: the trainer pods find each other
through the run's headless Service `<run>-trainer` (torchrun's rendezvous at pod 0) and the server
replicas through `<run>-replicas`; one server pod is deleted mid-run and the run still succeeds in
its first attempt, learning as the one-replica example does.
"""

from __future__ import annotations

from tests.e2e.conftest import (
    NAMESPACE,
    LogFollower,
    Node,
    VolumeReader,
    example_run,
    pods,
    wait_for,
    wait_phase,
    wait_step,
)

STEPS = 40
RUN_TIMEOUT_S = 20 * 60
#: Four pods of the run on a two-core node beside the control plane: small requests so all schedule.
SMALL = {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"memory": "4Gi"}}


def test_two_server_replicas_and_two_trainer_pods_learn_and_survive_a_lost_replica(
        node: Node, staged: str, volume: VolumeReader) -> None:
    run = "scale-out"
    body = example_run(node, run, maxSteps=STEPS, numNodes=2, resources=SMALL, checkpointInterval=20)
    body["spec"]["server"].update(replicas=2, resources=SMALL)
    node.apply(body)
    trainer_logs = LogFollower(node, run, "trainer")

    status = wait_step(node, run, 5, RUN_TIMEOUT_S)
    trainer_logs.poll()
    assert status["server"]["readyReplicas"] == 2 and len(status["server"]["bootIds"]) == 2, status["server"]
    servers = pods(node, run, "server")
    assert len(servers) == 2, [p["metadata"]["name"] for p in servers]
    trainers = pods(node, run, "trainer")
    indexes = sorted(p["metadata"]["annotations"].get("batch.kubernetes.io/job-completion-index") for p in trainers)
    assert indexes == ["0", "1"], indexes
    replicas_service = node.get("service", f"{run}-replicas")
    assert replicas_service is not None and replicas_service["spec"]["clusterIP"] == "None"
    assert node.get("service", f"{run}-trainer") is not None

    lost = servers[1]["metadata"]["name"]
    node.kubectl("delete", "pod", "-n", NAMESPACE, lost, "--wait=false")
    wait_for(lambda: lost not in [p["metadata"]["name"] for p in pods(node, run, "server")], 120,
             what=f"server pod {lost} to go", interval=1.0)

    status = wait_phase(node, run, "Succeeded", RUN_TIMEOUT_S)
    assert status["attempt"] == 1 and status.get("failedAttempts", 0) == 0, status
    trainer_logs.poll()
    text = trainer_logs.text()
    assert "Traceback" not in text, text[-4000:]
    assert "grpo train: 2 processes (2 node(s) × 1)" in text, text[:3000]
    assert "2 replica(s)" in text, text[:3000]

    history = volume.history(run)
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    rewards = [h["reward_mean"] for h in history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= 1.5 * first and last - first >= 0.1, [round(r, 3) for r in rewards]
