"""Which pod's log `grpo logs` shows, and why there is none yet. Pure: pods (API dicts) in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo_operator.builders import ATTEMPT_LABEL, INITIALIZER, SERVER, TRAINER
from grpo_stage.manifests import pod_state

#: The container of each component's pods (the operator's builders name them so).
CONTAINERS = {SERVER: "server", TRAINER: TRAINER, INITIALIZER: INITIALIZER}
#: The trainer pod of an indexed Job that carries rank 0 (the one that logs steps and syncs).
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


@dataclass(frozen=True)
class Choice:
    pod: str | None
    #: Why there is no log to read yet (the pod is missing or has not started): the user's line.
    waiting: str | None


def _attempt(pod: dict[str, Any]) -> int:
    try:
        return int(((pod.get("metadata") or {}).get("labels") or {}).get(ATTEMPT_LABEL, 0))
    except ValueError:
        return 0


def _index(pod: dict[str, Any]) -> int:
    meta = pod.get("metadata") or {}
    value = (meta.get("annotations") or {}).get(COMPLETION_INDEX) or (meta.get("labels") or {}).get(COMPLETION_INDEX)
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0


def started(pod: dict[str, Any]) -> bool:
    """A container of the pod ran (running now, or ended, or ended before a restart): it has a log."""
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        state, last = container.get("state") or {}, container.get("lastState") or {}
        if "running" in state or "terminated" in state or "terminated" in last:
            return True
    return False


def choose(pods: list[dict[str, Any]], run: str, namespace: str, component: str) -> Choice:
    """The pod of the latest attempt (rank 0 of several trainer nodes, the newest of several replicas)."""
    if not pods:
        return Choice(None, f"no {component} pod of GRPORun {run} in namespace {namespace} yet")
    newest = max(
        pods,
        key=lambda p: (
            _attempt(p),
            not (p.get("metadata") or {}).get("deletionTimestamp"),
            -_index(p),
            (p.get("metadata") or {}).get("creationTimestamp") or "",
        ),
    )
    name = (newest.get("metadata") or {}).get("name", "?")
    if started(newest):
        return Choice(name, None)
    return Choice(name, f"{component} pod {name} of GRPORun {run} in namespace {namespace} has not started yet "
                        f"({pod_state(newest).reason})")
