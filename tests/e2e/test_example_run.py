"""A GRPORun trains to Succeeded on a real node: our images, the chart, staged data, `kubectl apply`.

Everything a platform team's first day exercises runs for real here: the images' entrypoints, users
and file permissions, the server's probes, the PVC shared by server and trainer, /dev/shm, Service
DNS from the trainer to the server, the operator's in-cluster credentials and RBAC, Events.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import blake3

from tests.e2e.conftest import (
    NAMESPACE,
    LogFollower,
    Node,
    Prometheus,
    VolumeReader,
    describe,
    example_run,
    grpo,
    wait_for,
    wait_phase,
)

RUN = "tiny-cpu"
MAX_STEPS = 30
RUN_TIMEOUT_S = 20 * 60


def test_example_run_trains_to_succeeded_on_the_node(node: Node, staged: str, volume: VolumeReader,
                                                   prometheus: Prometheus, tmp_path: Path) -> None:
    started = time.time()
    node.apply(example_run(node, RUN))
    server_logs, trainer_logs = LogFollower(node, RUN, "server"), LogFollower(node, RUN, "trainer")

    def succeeded() -> dict | None:
        server_logs.poll()
        trainer_logs.poll()
        status = node.get("grporun", RUN)["status"] or {}
        if status.get("phase") == "Failed":
            raise AssertionError(f"run failed: {status.get('reason')}: {status.get('message')}\n{describe(node, RUN)}")
        return status if status.get("phase") == "Succeeded" else None

    status = wait_for(succeeded, RUN_TIMEOUT_S, what=f"{RUN} to succeed", interval=2.0)
    prometheus.windows[RUN] = (started, time.time())   # test_observability reads this healthy run's series

    # status as the operator wrote it
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Succeeded"]["status"] == "True", conditions
    assert conditions.get("Failed", {}).get("status") != "True", conditions
    assert status["attempt"] == 1 and status.get("failedAttempts", 0) == 0, status
    assert status["progress"]["step"] == MAX_STEPS, status["progress"]
    assert status["adapter"]["version"] == MAX_STEPS, status["adapter"]
    assert status["server"]["bootId"], status["server"]

    # what a user sees in `kubectl get grporuns`
    table = node.kubectl("get", "grporuns", "-n", NAMESPACE).stdout.splitlines()
    header, row = table[0].split(), next(line.split() for line in table[1:] if line.startswith(RUN))
    assert header[:5] == ["NAME", "PHASE", "STEP", "REWARD", "ATTEMPT"], header
    assert row[1] == "Succeeded" and row[2] == str(MAX_STEPS) and row[4] == "1", row

    # Events on every transition, from the operator
    events = node.list("events", "", NAMESPACE)
    reasons = [e["reason"] for e in events if e["involvedObject"].get("name") == RUN
               and e["involvedObject"].get("kind") == "GRPORun"]
    for reason in ("Created", "SourcesReady", "ServerStarting", "TrainerRunning", "Completed"):
        assert reason in reasons, f"no {reason} event; events: {reasons}"

    # the trainer's record on the volume: every step once, and the reward rose
    history = volume.history(RUN)
    steps = [h["step"] for h in history]
    assert steps == list(range(1, MAX_STEPS + 1)), steps
    rewards = [h["reward_mean"] for h in history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= 1.5 * first, f"reward did not rise enough: first-5 {first:.3f}, last-5 {last:.3f}: {rewards}"

    # adapters published on the PVC: the final version is there, with its manifest; older ones pruned
    versions = sorted(int(v[1:]) for v in volume.listdir(RUN, f"/data/adapters/{RUN}") if re.fullmatch(r"v\d+", v))
    assert versions and versions[-1] == MAX_STEPS, versions
    assert len(versions) <= 3, f"old adapter versions were not pruned: {versions}"
    files = volume.listdir(RUN, f"/data/adapters/{RUN}/v{MAX_STEPS}")
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files, files

    # the initializer ran once, in the trainer image, and read the sources the pods mount read-only
    assert status["sources"]["ready"] and "sources ready" in (status["sources"].get("progress") or ""), status
    init = node.get("job", f"{RUN}-init")
    assert init is not None and init["status"].get("succeeded") == 1, init and init["status"]
    (trainer_pod,) = node.list("pod", f"grpo.dev/run={RUN},grpo.dev/component=trainer")
    mounts = {m["name"]: m for m in trainer_pod["spec"]["containers"][0]["volumeMounts"]}
    assert all(mounts[name].get("readOnly") for name in ("src-claim-0", "src-dataset", "src-rewards")), mounts
    # its own claim is ReadWriteOnce (the default): the trainer was placed on the server's node
    affinity = trainer_pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert affinity[0]["topologyKey"] == "kubernetes.io/hostname", affinity

    # the finished run gave its server back (cleanupPolicy StopServer) and the trainer Job completed
    deployment = node.get("deployment", f"{RUN}-server")
    assert deployment is not None and deployment["spec"]["replicas"] == 0, deployment and deployment["spec"]
    job = node.get("job", f"{RUN}-trainer-1")
    assert job is not None and job["status"].get("succeeded") == 1, job and job["status"]

    # the pods' own logs: no traceback anywhere, and the server really served this run's adapters
    server_text, trainer_text = server_logs.text(), trainer_logs.text()
    assert server_text.strip() and trainer_text.strip(), "no pod logs were collected"
    for name, text in (("server", server_text), ("trainer", trainer_text)):
        assert "Traceback" not in text, f"{name} log has a traceback:\n{text[-5000:]}"
    assert f"v{MAX_STEPS}" in server_text or "set_lora_adapter" in server_text, server_text[-3000:]
    wait_phase(node, RUN, "Succeeded", 5)

    # the cluster CLI, as a user follows the run from a laptop (docs/cli.md)
    waited = grpo(node, "wait", RUN, "-n", NAMESPACE, "--for", "Succeeded", "--timeout", "60s", check=False)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert "reached phase Succeeded" in waited.stdout, waited.stdout
    shown = grpo(node, "status", RUN, "-n", NAMESPACE).stdout
    assert "Succeeded (Completed)" in shown and f"{MAX_STEPS}/{MAX_STEPS}" in shown, shown
    assert f"v{MAX_STEPS}" in shown and "Completed" in shown.split("Events")[-1], shown
    listed = grpo(node, "get", "-n", NAMESPACE).stdout.splitlines()
    assert any(line.split()[:3] == [RUN, "Succeeded", f"{MAX_STEPS}/{MAX_STEPS}"] for line in listed), listed
    trainer_log = grpo(node, "logs", RUN, "-n", NAMESPACE, "--trainer").stdout
    assert f"step {MAX_STEPS}/{MAX_STEPS}" in trainer_log, trainer_log[-3000:]
    dest = tmp_path / "adapter"
    pulled = grpo(node, "pull", RUN, str(dest), "-n", NAMESPACE, "--image", node.images["grpo-trainer"],
                  "--start-timeout", "180").stdout
    assert f"adapter v{MAX_STEPS} (step {MAX_STEPS})" in pulled and "each verified" in pulled, pulled
    manifest = json.loads((dest / "grpo-manifest.json").read_text())
    assert manifest["version"] == MAX_STEPS and {"adapter_model.safetensors", "adapter_config.json"} <= set(
        manifest["files"]), manifest
    for name, digest in manifest["files"].items():
        assert "blake3:" + blake3.blake3((dest / name).read_bytes()).hexdigest() == digest, name
    assert not [p for p in node.list("pod", "app.kubernetes.io/name=grpo-pull")
                if not p["metadata"].get("deletionTimestamp")], "the pull pod was left behind"
