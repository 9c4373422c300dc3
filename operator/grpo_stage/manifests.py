"""Pure parts of the cluster side: the staging pod and claim manifests, the pod's state, the exec's
exit status and the comparison of the receiver's manifest with what was sent."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from grpo_stage.tarstream import FileDigest

#: The staging pod's user and group: the UID the operator runs server and trainer pods as
#: (grpo_operator.builders.NON_ROOT_UID), so the files it writes belong to them.
STAGE_UID = 1000
MOUNT_PATH = "/stage"
CONTAINER = "stage"
VOLUME = "claim"
POD_PREFIX = "grpo-stage-"
RECEIVER_ENV = "GRPO_STAGE_RECEIVER"
#: The exec runs this, which runs the receiver's source from the pod's environment: the exec's URL
#: (which carries the command) stays short enough for any proxy in front of the API server.
BOOTSTRAP = f"import os; exec(compile(os.environ[{RECEIVER_ENV!r}], 'grpo-stage-receiver', 'exec'))"
LABELS = {"app.kubernetes.io/name": "grpo-stage", "app.kubernetes.io/managed-by": "grpo-stage"}
#: Waiting reasons that do not go away by waiting longer.
FATAL_WAITING = frozenset({"ErrImageNeverPull", "InvalidImageName", "CreateContainerConfigError"})


def receiver_source() -> str:
    """The receiver program, as the pod runs it (grpo_stage/receiver.py)."""
    return resources.files("grpo_stage").joinpath("receiver.py").read_text(encoding="utf-8")


def sleeper_command(seconds: int) -> list[str]:
    """The pod's own process: sleep, exit on SIGTERM at once (so deleting the pod is quick)."""
    program = (
        f"import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep({int(seconds)})"
    )
    return ["python3", "-c", program]


def receiver_command(stage_id: str, dests: list[str], root: str = MOUNT_PATH) -> list[str]:
    return ["python3", "-c", BOOTSTRAP, root, stage_id, *dests]


def build_pod(
    *,
    name: str,
    namespace: str,
    claim: str,
    image: str,
    image_pull_policy: str,
    lifetime_seconds: int,
    program_env: dict[str, str] | None = None,
    read_only: bool = False,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod that mounts the claim at MOUNT_PATH and sleeps; the receiver runs in it by exec.

    `program_env` replaces the receiver's source in the environment (`grpo pull` puts its sender
    there), `read_only` mounts the claim read-only, `labels` replaces the pod's labels.

    It meets the `restricted` Pod Security Standard: non-root 1000/1000 (fsGroup 1000, so the
    volume is writable), RuntimeDefault seccomp, no capabilities, no privilege escalation, a
    read-only root filesystem and no service account token. It ends by itself after its lifetime
    (the sleep, then activeDeadlineSeconds), should the client never delete it.
    """
    container = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": image_pull_policy,
        "command": sleeper_command(lifetime_seconds),
        "env": [
            {"name": key, "value": value}
            for key, value in (program_env if program_env is not None else {RECEIVER_ENV: receiver_source()}).items()
        ],
        "volumeMounts": [{"name": VOLUME, "mountPath": MOUNT_PATH, **({"readOnly": True} if read_only else {})}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(labels if labels is not None else LABELS),
            "annotations": {"grpo.dev/staging-claim": claim},
        },
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 5,
            "activeDeadlineSeconds": lifetime_seconds + 60,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": STAGE_UID,
                "runAsGroup": STAGE_UID,
                "fsGroup": STAGE_UID,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [container],
            "volumes": [
                {
                    "name": VOLUME,
                    "persistentVolumeClaim": {"claimName": claim, **({"readOnly": True} if read_only else {})},
                }
            ],
        },
    }


def build_claim(*, name: str, namespace: str, size: str, access_mode: str, storage_class: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"accessModes": [access_mode], "resources": {"requests": {"storage": size}}}
    if storage_class:
        spec["storageClassName"] = storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/managed-by": "grpo-stage"}},
        "spec": spec,
    }


@dataclass(frozen=True)
class PodState:
    running: bool
    #: The pod will never run the receiver (it ended, or a waiting reason that does not pass).
    fatal: bool
    #: What it is waiting for or why it ended, for the user ("" when running).
    reason: str


def pod_state(pod: dict[str, Any]) -> PodState:
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    container_statuses = status.get("containerStatuses") or []
    state: dict[str, Any] = (container_statuses[0].get("state") or {}) if container_statuses else {}
    if phase == "Running" and "running" in state:
        return PodState(running=True, fatal=False, reason="")
    if "terminated" in state or phase in ("Succeeded", "Failed"):
        ended = state.get("terminated") or {}
        detail = ": ".join(
            str(p)
            for p in (ended.get("reason") or status.get("reason"), ended.get("message") or status.get("message"))
            if p
        )
        code = ended.get("exitCode")
        return PodState(
            running=False,
            fatal=True,
            reason=f"{phase}: the container ended"
            + (f" with exit code {code}" if code is not None else "")
            + (f" ({detail})" if detail else ""),
        )
    waiting = state.get("waiting") or {}
    if waiting.get("reason"):
        reason = waiting["reason"]
        message = waiting.get("message")
        return PodState(
            running=False,
            fatal=reason in FATAL_WAITING,
            reason=f"{phase}: {reason}" + (f": {message}" if message else ""),
        )
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            message = condition.get("message")
            return PodState(
                running=False,
                fatal=False,
                reason=f"{phase}: {condition.get('reason') or 'not scheduled'}" + (f": {message}" if message else ""),
            )
    return PodState(running=False, fatal=False, reason=phase)


def exec_status(error_channel: str) -> tuple[int | None, str]:
    """(exit code, message) from the exec's error channel: (0, "") on success, (None, why) if unknown."""
    text = error_channel.strip()
    if not text:
        return None, "the exec ended without an exit status (connection lost?)"
    try:
        status = json.loads(text)
    except ValueError:
        return None, text
    if not isinstance(status, dict):
        return None, text
    if status.get("status") == "Success":
        return 0, ""
    message = str(status.get("message") or text)
    for cause in (status.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            try:
                return int(cause.get("message")), message
            except (TypeError, ValueError):
                break
    return None, message


def compare_manifest(sent: dict[str, FileDigest], stdout: str) -> list[str]:
    """Problems, one per file, between what was sent and the receiver's manifest (its last stdout line)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return ["the receiver printed no manifest"]
    try:
        received = json.loads(lines[-1])
    except ValueError:
        return [f"the receiver's manifest is not JSON: {lines[-1][:200]!r}"]
    if not isinstance(received, dict):
        return ["the receiver's manifest is not a JSON object"]
    problems = []
    for name in sorted(set(sent) | set(received)):
        if name not in received:
            problems.append(f"{name}: missing on the claim")
            continue
        if name not in sent:
            problems.append(f"{name}: on the claim but not sent")
            continue
        got = received[name] if isinstance(received[name], dict) else {}
        want = sent[name]
        if got.get("size") != want.size:
            problems.append(f"{name}: size on the claim {got.get('size')}, sent {want.size}")
        elif got.get("sha256") != want.sha256:
            problems.append(f"{name}: sha256 on the claim {got.get('sha256')}, sent {want.sha256}")
    return problems
