"""Full fine-tuning on the real node: every weight pushed from the trainer pod into two server pods.

The CPU example with `trainer.tuning: full` and `server.replicas: 2`. The servers (transformers engine)
take weights over gloo: each joins a group the trainer hosts at its pod IP (`GRPO_TRAINER_ADDRESS`,
from the downward API), across the pod network. One server pod is deleted mid-run; its replacement
starts from the weights on disk (version 0) and gets the latest weights pushed before it serves a
batch (when it comes up before the run ends: the steps are fast), and the run still succeeds in its
first attempt.
"""

from __future__ import annotations

import re

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
RUN_TIMEOUT_S = 15 * 60
SMALL = {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"memory": "4Gi"}}
PUSHED = re.compile(r"^pushed weights v(\d+) \((\d+) tensors", re.M)


def test_full_tuning_pushes_weights_across_pods_and_a_replaced_server_catches_up(
        node: Node, staged: str, volume: VolumeReader) -> None:
    run = "full-tuning"
    # a full step moves every weight: the example's LoRA rate would wreck the tiny model
    body = example_run(node, run, tuning="full", maxSteps=STEPS, learningRate=1e-3, resources=SMALL,
                       checkpointInterval=STEPS)
    body["spec"]["server"].update(replicas=2, resources=SMALL)
    node.apply(body)
    trainer_logs = LogFollower(node, run, "trainer")

    wait_step(node, run, 3, RUN_TIMEOUT_S)
    trainer_logs.poll()
    (trainer,) = pods(node, run, "trainer")
    env = {e["name"]: e for e in trainer["spec"]["containers"][0]["env"]}
    assert env["GRPO_TRAINER_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    servers = pods(node, run, "server")
    assert len(servers) == 2
    lost = servers[1]["metadata"]["name"]
    node.kubectl("delete", "pod", "-n", NAMESPACE, lost, "--wait=false")
    wait_for(lambda: lost not in [p["metadata"]["name"] for p in pods(node, run, "server")], 120,
             what=f"server pod {lost} to go", interval=1.0)

    status = wait_phase(node, run, "Succeeded", RUN_TIMEOUT_S)
    assert status["attempt"] == 1 and status.get("failedAttempts", 0) == 0, status
    assert status["progress"]["step"] == STEPS, status["progress"]
    trainer_logs.poll()
    text = trainer_logs.text()
    assert "Traceback" not in text, text[-4000:]
    pushed = [int(v) for v, _ in PUSHED.findall(text)]
    assert pushed == list(range(1, STEPS + 1)), text[-4000:]
    assert len({n for _, n in PUSHED.findall(text)}) == 1  # the whole model each time
    assert [h["step"] for h in volume.history(run)] == list(range(1, STEPS + 1))
