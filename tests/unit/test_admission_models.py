"""Values the run's children must carry, refused by the models as the API server refuses them (issue 18).

Every spec field that ends up in a child object (a container's env, resources, image, ports and mounts; the
pod's volumes, labels, annotations, node selector, tolerations and class names; the claim's size and class;
the source volumes' claim and ConfigMap names) has a rule at admission. ADMISSION_CASES is shared with
tests/integration/test_admission.py, which sends the same manifests to a real kube-apiserver: each `bad`
spec is refused by both, naming the field, and each `good` one (the nearest valid spec) accepted by both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from grpo_api.models import (
    MAX_RUN_NAME,
    GRPORunStatus,
    ProgressStatus,
    parse_quantity,
    round_reward,
)
from grpo_api.runconfig import parse_grporun
from tests.unit.test_api_models import refusal, run_with, valid_run


@dataclass(frozen=True)
class Case:
    """A spec patch both sides refuse, and its nearest valid form both accept."""

    id: str
    bad: dict[str, Any]
    good: dict[str, Any]
    field: str  # the field path the API server names (spec.x.y)
    api_text: str  # fragment of the API server's message
    model_loc: str  # the path the models' error names (camelCase, as parse_grporun formats it)
    model_text: str  # fragment of the models' message


def _mounts(*paths: str, sub_path: str | None = None) -> dict[str, Any]:
    volumes = [{"name": f"v{i}", "emptyDir": {}} for i in range(len(paths))]
    mounts: list[dict[str, Any]] = [{"name": f"v{i}", "mountPath": p} for i, p in enumerate(paths)]
    if sub_path is not None:
        mounts[0]["subPath"] = sub_path
    return {"volumes": volumes, "volumeMounts": mounts}


def _env(source: dict[str, Any]) -> dict[str, Any]:
    return {"env": [{"name": "A", "valueFrom": source}]}


def _tolerations(*items: dict[str, Any]) -> dict[str, Any]:
    return {"scheduling": {"tolerations": list(items)}}


SHOULD_MATCH = ("should match", "should match pattern")
MOUNT_PATH = "must be an absolute path without ':'"
RESERVED = "may not overlap a path the operator mounts"
LABEL_KEYS = "keys must be label keys"
RESOURCE_NAMES = "resource names must be cpu, memory"
WHOLE = "takes a whole number"
LIMITS = "every request must be at most its limit"
QUANTITY = "is not a quantity"

ADMISSION_CASES: list[Case] = [
    # container resources (requests, limits): names, quantities, requests against limits
    Case("resources-unknown-name", {"server": {"resources": {"requests": {"gpu": 1}}}},
         {"server": {"resources": {"requests": {"cpu": 1}}}},
         "spec.server.resources.requests", RESOURCE_NAMES, "spec.server.resources.requests", RESOURCE_NAMES),
    Case("resources-requests-prefix", {"trainer": {"resources": {"limits": {"requests.example.com/x": 1}}}},
         {"trainer": {"resources": {"limits": {"example.com/x": 1}}}},
         "spec.trainer.resources.limits", RESOURCE_NAMES, "spec.trainer.resources.limits", RESOURCE_NAMES),
    Case("resources-quantity-negative", {"trainer": {"resources": {"limits": {"memory": "-1Gi"}}}},
         {"trainer": {"resources": {"limits": {"memory": "1Gi"}}}},
         "spec.trainer.resources.limits.memory", "should match",
         "spec.trainer.resources.limits.memory", QUANTITY),
    Case("resources-quantity-negative-integer", {"trainer": {"resources": {"requests": {"cpu": -1}}}},
         {"trainer": {"resources": {"requests": {"cpu": 0}}}},
         "spec.trainer.resources.requests.cpu", "greater than or equal to 0",
         "spec.trainer.resources.requests.cpu", QUANTITY),
    Case("resources-quantity-capital-K", {"server": {"resources": {"limits": {"memory": "512K"}}}},
         {"server": {"resources": {"limits": {"memory": "512k"}}}},
         "spec.server.resources.limits.memory", "should match", "spec.server.resources.limits.memory", QUANTITY),
    Case("resources-gpu-fraction", {"trainer": {"resources": {"limits": {"nvidia.com/gpu": "0.5"}}}},
         {"trainer": {"resources": {"limits": {"nvidia.com/gpu": "1"}}}},
         "spec.trainer.resources.limits", WHOLE, "spec.trainer.resources.limits", WHOLE),
    Case("resources-request-above-limit",
         {"server": {"resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}}},
         {"server": {"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1Gi"}}}},
         "spec.server.resources", LIMITS, "spec.server.resources", LIMITS),
    Case("resources-gpu-request-without-limit", {"server": {"resources": {"requests": {"nvidia.com/gpu": 1}}}},
         {"server": {"resources": {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}}},
         "spec.server.resources", LIMITS, "spec.server.resources", LIMITS),
    Case("resources-hugepages-alone",
         {"initializer": {"resources": {"limits": {"hugepages-2Mi": "4Mi"}}}},
         {"initializer": {"resources": {"limits": {"hugepages-2Mi": "4Mi", "memory": "1Gi"}}}},
         "spec.initializer.resources", "hugepages need a cpu or memory",
         "spec.initializer.resources", "hugepages need a cpu or memory"),
    Case("resources-hugepages-not-a-multiple",
         {"initializer": {"resources": {"limits": {"hugepages-2Mi": "3Mi", "memory": "1Gi"}}}},
         {"initializer": {"resources": {"limits": {"hugepages-2Mi": "6Mi", "memory": "1Gi"}}}},
         "spec.initializer.resources.limits", "a multiple of <size>",
         "spec.initializer.resources.limits", "a multiple of <size>"),
    # env: the pod fields and keys a variable may read
    Case("env-fieldRef-unsupported", {"server": _env({"fieldRef": {"fieldPath": "spec.containers"}})},
         {"server": _env({"fieldRef": {"fieldPath": "metadata.labels['grpo.dev/run']"}})},
         "spec.server.env[0].valueFrom.fieldRef.fieldPath", "should match",
         "spec.server.env[0].valueFrom.fieldRef.fieldPath", "should match pattern"),
    Case("env-secret-key-dotdot", {"trainer": _env({"secretKeyRef": {"name": "s", "key": "..token"}})},
         {"trainer": _env({"secretKeyRef": {"name": "s", "key": ".token"}})},
         "spec.trainer.env[0].valueFrom.secretKeyRef.key", "should match",
         "spec.trainer.env[0].valueFrom.secretKeyRef.key", "should match pattern"),
    # images, ports, probes, /dev/shm
    Case("server-image-trailing-space", {"server": {"image": "grpo-server:0.1.0 "}},
         {"server": {"image": "grpo-server:0.1.0"}},
         "spec.server.image", "must be an image reference", "spec.server.image", "must be an image reference"),
    Case("trainer-image-uppercase-path", {"trainer": {"image": "registry.corp:5000/Team/trainer:1"}},
         {"trainer": {"image": "registry.corp:5000/team/trainer:1"}},
         "spec.trainer.image", "must be an image reference", "spec.trainer.image", "must be an image reference"),
    Case("trainer-metricsPort-zero", {"trainer": {"metricsPort": 0}}, {"trainer": {"metricsPort": 1}},
         "spec.trainer.metricsPort", "greater than or equal to 1",
         "spec.trainer.metricsPort", "greater than or equal to 1"),
    Case("server-healthPath-relative", {"server": {"healthPath": "health"}}, {"server": {"healthPath": "/health"}},
         "spec.server.healthPath", "should match", "spec.server.healthPath", "should match pattern"),
    Case("server-shmSize-negative", {"server": {"shmSize": "-8Gi"}}, {"server": {"shmSize": "8Gi"}},
         "spec.server.shmSize", "should match", "spec.server.shmSize", "should match pattern"),
    Case("serverReadyTimeout-beyond-int32", {"runPolicy": {"serverReadyTimeoutSeconds": 2**31 - 1}},
         {"runPolicy": {"serverReadyTimeoutSeconds": 2**31 - 61}},
         "spec.runPolicy.serverReadyTimeoutSeconds", "less than or equal to 2147483587",
         "spec.runPolicy.serverReadyTimeoutSeconds", "less than or equal to 2147483587"),
    # the run's volume and the model cache: claim size, names, class, mount paths
    Case("storage-size-zero", {"storage": {"size": "0"}}, {"storage": {"size": "1Mi"}},
         "spec.storage.size", "greater than zero", "spec.storage.size", "greater than zero"),
    Case("storage-size-negative", {"storage": {"size": "-1Gi"}}, {"storage": {"size": "1Gi"}},
         "spec.storage.size", "should match", "spec.storage.size", "should match pattern"),
    Case("storage-no-access-mode", {"storage": {"size": "1Gi", "accessModes": []}},
         {"storage": {"size": "1Gi", "accessModes": ["ReadWriteMany"]}},
         "spec.storage.accessModes", "at least 1 item", "spec.storage.accessModes", "at least 1 item"),
    Case("storage-read-write-once-pod-and-more",
         {"mode": "colocate", "storage": {"size": "1Gi", "accessModes": ["ReadWriteOncePod", "ReadWriteOnce"]}},
         {"mode": "colocate", "storage": {"size": "1Gi", "accessModes": ["ReadWriteOncePod"]}},
         "spec.storage.accessModes", "cannot be combined", "spec.storage.accessModes", "cannot be combined"),
    Case("storage-existingClaim-not-a-name", {"storage": {"existingClaim": "Shared_Claim"}},
         {"storage": {"existingClaim": "shared-claim"}},
         "spec.storage.existingClaim", "should match", "spec.storage.existingClaim", "should match pattern"),
    Case("storage-class-not-a-name", {"storage": {"size": "1Gi", "storageClassName": "Fast SSD"}},
         {"storage": {"size": "1Gi", "storageClassName": "fast-ssd"}},
         "spec.storage.storageClassName", "should match", "spec.storage.storageClassName", "should match pattern"),
    Case("storage-mountPath-relative", {"storage": {"size": "1Gi", "mountPath": "data"}},
         {"storage": {"size": "1Gi", "mountPath": "/data"}},
         "spec.storage.mountPath", MOUNT_PATH, "spec.storage.mountPath", MOUNT_PATH),
    Case("storage-mountPath-dotdot", {"storage": {"size": "1Gi", "mountPath": "/srv/../etc"}},
         {"storage": {"size": "1Gi", "mountPath": "/srv/etc"}},
         "spec.storage.mountPath", MOUNT_PATH, "spec.storage.mountPath", MOUNT_PATH),
    Case("storage-mountPath-colon", {"storage": {"size": "1Gi", "mountPath": "/data:rw"}},
         {"storage": {"size": "1Gi", "mountPath": "/data-rw"}},
         "spec.storage.mountPath", MOUNT_PATH, "spec.storage.mountPath", MOUNT_PATH),
    Case("storage-mountPath-of-the-operator", {"storage": {"size": "1Gi", "mountPath": "/etc/grpo"}},
         {"storage": {"size": "1Gi", "mountPath": "/etc/grpo-data"}},
         "spec.storage.mountPath", RESERVED, "spec.storage.mountPath", RESERVED),
    Case("modelCache-mountPath-of-the-volume",
         {"storage": {"size": "1Gi", "mountPath": "/models", "modelCache": {"existingClaim": "weights"}}},
         {"storage": {"size": "1Gi", "mountPath": "/models",
                      "modelCache": {"existingClaim": "weights", "mountPath": "/weights"}}},
         "spec.storage.modelCache.mountPath", "must differ from storage.mountPath",
         "spec.storage", "must differ from storage.mountPath"),
    Case("modelCache-claim-not-a-name", {"storage": {"size": "1Gi", "modelCache": {"existingClaim": "Weights!"}}},
         {"storage": {"size": "1Gi", "modelCache": {"existingClaim": "weights"}}},
         "spec.storage.modelCache.existingClaim", "should match",
         "spec.storage.modelCache.existingClaim", "should match pattern"),
    # extra volumes and mounts
    Case("volumeMount-mountPath-dotdot", {"trainer": _mounts("/x/../etc")}, {"trainer": _mounts("/x/etc")},
         "spec.trainer.volumeMounts[0].mountPath", MOUNT_PATH, "spec.trainer.volumeMounts[0].mountPath", MOUNT_PATH),
    Case("volumeMount-subPath-dotdot", {"trainer": _mounts("/x", sub_path="a/../../b")},
         {"trainer": _mounts("/x", sub_path="a/b")},
         "spec.trainer.volumeMounts[0].subPath", "without '..' elements",
         "spec.trainer.volumeMounts[0].subPath", "without '..' elements"),
    Case("volumeMounts-same-path-twice", {"server": _mounts("/x", "/x")}, {"server": _mounts("/x", "/y")},
         "spec.server.volumeMounts", "each mountPath may be used once",
         "spec.server", "each mountPath may be used once"),
    Case("volumeMount-at-the-run-volume", {"trainer": _mounts("/data")}, {"trainer": _mounts("/data2")},
         "spec.trainer.volumeMounts", "may not be that of spec.storage", "spec", "may not be that of spec.storage"),
    Case("volumes-same-name-twice",
         {"server": {"volumes": [{"name": "x", "emptyDir": {}}, {"name": "x", "emptyDir": {}}]}},
         {"server": {"volumes": [{"name": "x", "emptyDir": {}}, {"name": "y", "emptyDir": {}}]}},
         "spec.server.volumes", "names must be unique", "spec.server", "is given twice"),
    # pod labels and annotations
    Case("podLabels-key-with-two-slashes", {"server": {"podLabels": {"team/a/b": "x"}}},
         {"server": {"podLabels": {"example.com/team": "x"}}},
         "spec.server.podLabels", LABEL_KEYS, "spec.server.podLabels", LABEL_KEYS),
    Case("podLabels-value-with-a-space", {"trainer": {"podLabels": {"team": "a b"}}},
         {"trainer": {"podLabels": {"team": "a_b"}}},
         "spec.trainer.podLabels.team", "should match", "spec.trainer.podLabels.team", "should match pattern"),
    Case("podLabels-value-too-long", {"trainer": {"podLabels": {"team": "a" * 64}}},
         {"trainer": {"podLabels": {"team": "a" * 63}}},
         "spec.trainer.podLabels.team", "may not be more than 63", "spec.trainer.podLabels.team", "at most 63"),
    Case("podLabels-of-the-job-controller", {"trainer": {"podLabels": {"controller-uid": "x"}}},
         {"trainer": {"podLabels": {"controller": "x"}}},
         "spec.trainer.podLabels", "the Job controller's", "spec.trainer", "the Job controller"),
    Case("podLabels-of-the-job-controller-prefix", {"trainer": {"podLabels": {"batch.kubernetes.io/job-name": "x"}}},
         {"trainer": {"podLabels": {"example.com/job-name": "x"}}},
         "spec.trainer.podLabels", "the Job controller's", "spec.trainer", "the Job controller"),
    Case("podAnnotations-key-not-qualified", {"server": {"podAnnotations": {"-x": "1"}}},
         {"server": {"podAnnotations": {"x": "1"}}},
         "spec.server.podAnnotations", "keys must be annotation keys",
         "spec.server.podAnnotations", "keys must be annotation keys"),
    Case("podAnnotations-too-large", {"trainer": {"podAnnotations": {f"a{i}": "x" * 60000 for i in range(5)}}},
         {"trainer": {"podAnnotations": {f"a{i}": "x" * 60000 for i in range(4)}}},
         "spec.trainer.podAnnotations", "may hold at most 261120 bytes",
         "spec.trainer.podAnnotations", "may hold at most 261120 bytes"),
    # scheduling
    Case("nodeSelector-key-without-name", {"scheduling": {"nodeSelector": {"kubernetes.io/": "x"}}},
         {"scheduling": {"nodeSelector": {"kubernetes.io/os": "x"}}},
         "spec.scheduling.nodeSelector", LABEL_KEYS, "spec.scheduling.nodeSelector", LABEL_KEYS),
    Case("nodeSelector-value-with-a-space", {"scheduling": {"nodeSelector": {"pool": "gpu pool"}}},
         {"scheduling": {"nodeSelector": {"pool": "gpu-pool"}}},
         "spec.scheduling.nodeSelector.pool", "should match",
         "spec.scheduling.nodeSelector.pool", "should match pattern"),
    Case("toleration-key-not-qualified", _tolerations({"key": "a/b/c", "operator": "Exists"}),
         _tolerations({"key": "a/b", "operator": "Exists"}),
         "spec.scheduling.tolerations[0].key", "must be a label key",
         "spec.scheduling.tolerations[0].key", "must be a label key"),
    Case("toleration-exists-with-a-value", _tolerations({"key": "gpu", "operator": "Exists", "value": "a"}),
         _tolerations({"key": "gpu", "operator": "Equal", "value": "a"}),
         "spec.scheduling.tolerations[0]", "takes no value", "spec.scheduling.tolerations[0]", "takes no value"),
    Case("toleration-equal-without-a-key", _tolerations({"operator": "Equal", "value": "a"}),
         _tolerations({"key": "gpu", "operator": "Equal", "value": "a"}),
         "spec.scheduling.tolerations[0]", "without a key must have operator Exists",
         "spec.scheduling.tolerations[0]", "without a key must have operator Exists"),
    Case("toleration-seconds-without-NoExecute",
         _tolerations({"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 60}),
         _tolerations({"key": "gpu", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60}),
         "spec.scheduling.tolerations[0]", "only with effect NoExecute",
         "spec.scheduling.tolerations[0]", "only with effect NoExecute"),
    Case("toleration-value-with-a-space", _tolerations({"key": "gpu", "value": "a b"}),
         _tolerations({"key": "gpu", "value": "a-b"}),
         "spec.scheduling.tolerations[0].value", "should match",
         "spec.scheduling.tolerations[0].value", "should match pattern"),
    Case("priorityClassName-not-a-name", {"scheduling": {"priorityClassName": "High_Priority"}},
         {"scheduling": {"priorityClassName": "high-priority"}},
         "spec.scheduling.priorityClassName", "should match",
         "spec.scheduling.priorityClassName", "should match pattern"),
    Case("runtimeClassName-not-a-name", {"scheduling": {"runtimeClassName": "NVIDIA"}},
         {"scheduling": {"runtimeClassName": "nvidia"}},
         "spec.scheduling.runtimeClassName", "should match",
         "spec.scheduling.runtimeClassName", "should match pattern"),
    Case("serviceAccountName-not-a-name", {"scheduling": {"serviceAccountName": "system:trainer"}},
         {"scheduling": {"serviceAccountName": "trainer"}},
         "spec.scheduling.serviceAccountName", "should match",
         "spec.scheduling.serviceAccountName", "should match pattern"),
    # the source volumes: claim and ConfigMap names
    Case("model-source-claim-not-a-name", {"model": {"name": "m", "source": "pvc://models..x/m"}},
         {"model": {"name": "m", "source": "pvc://models.x/m"}},
         "spec.model.source", "should match", "spec.model.source", "should match pattern"),
    Case("dataset-source-configmap-not-a-name", {"dataset": {"source": "configmap://prompts-", "path": "p.jsonl"}},
         {"dataset": {"source": "configmap://prompts", "path": "p.jsonl"}},
         "spec.dataset.source", "should match", "spec.dataset.source", "should match pattern"),
    Case("dataset-configmap-key-dotdot", {"dataset": {"source": "configmap://prompts", "path": "..p.jsonl"}},
         {"dataset": {"source": "configmap://prompts", "path": ".p.jsonl"}},
         "spec.dataset.path", "must be a key of the ConfigMap", "spec.dataset", "must be a key of the ConfigMap"),
    Case("rewardCode-inline-too-many-bytes", {"rewardCode": {"inline": {"r.py": "# " + "é" * 40000}}},
         {"rewardCode": {"inline": {"r.py": "# " + "é" * 30000}}},
         "spec.rewardCode.inline", "at most 65536 bytes", "spec.rewardCode", "larger than 65536 bytes"),
    Case("max-staleness-below-prefetch-depth",
         {"trainer": {"asyncPrefetch": True, "prefetchDepth": 2, "maxStaleness": 1}},
         {"trainer": {"asyncPrefetch": True, "prefetchDepth": 2, "maxStaleness": 2}},
         "spec.trainer.maxStaleness", "at least trainer.prefetchDepth", "spec.trainer",
         "at least trainer.prefetchDepth"),
    Case("full-tuning-with-qlora", {"trainer": {"tuning": "full", "lora": {"quantizeBase": True}}},
         {"trainer": {"tuning": "full", "lora": {"quantizeBase": False}}},
         "spec.trainer.tuning", "cannot be combined with trainer.tuning full", "spec.trainer",
         "cannot be combined with trainer.tuning full"),
    Case("full-tuning-with-fsdp", {"trainer": {"tuning": "full", "strategy": "fsdp"}},
         {"trainer": {"tuning": "full", "strategy": "ddp"}},
         "spec.trainer.tuning", "strategy fsdp is not supported yet", "spec.trainer",
         "strategy fsdp is not supported yet"),
    Case("merged-sync-with-full-tuning", {"trainer": {"sync": "merged", "tuning": "full"}},
         {"trainer": {"sync": "merged", "tuning": "lora"}},
         "spec.trainer.sync", "needs trainer.tuning lora", "spec.trainer", "needs trainer.tuning lora"),
    Case("merged-sync-with-fsdp", {"trainer": {"sync": "merged", "strategy": "fsdp"}},
         {"trainer": {"sync": "adapter", "strategy": "fsdp"}},
         "spec.trainer.sync", "sync merged with strategy fsdp", "spec.trainer", "sync merged with strategy fsdp"),
]

#: metadata.name: refused (both sides) and accepted.
BAD_RUN_NAMES = ["9lives", "a" * (MAX_RUN_NAME + 1), "has.dot", "ends-with-dash-"]
GOOD_RUN_NAMES = ["a" * MAX_RUN_NAME, "r-1"]


@pytest.mark.parametrize("case", ADMISSION_CASES, ids=lambda c: c.id)
def test_models_refuse_what_no_child_can_carry_naming_the_field(case: Case) -> None:
    message = refusal(run_with(case.bad))
    lines = [line.strip() for line in message.splitlines()[1:]]
    assert any(line.startswith(f"{case.model_loc}:") and case.model_text in line for line in lines), (
        f"expected a line '{case.model_loc}: ...{case.model_text}...' in:\n{message}"
    )


@pytest.mark.parametrize("case", ADMISSION_CASES, ids=lambda c: c.id)
def test_models_accept_the_nearest_valid_spec(case: Case) -> None:
    parse_grporun(run_with(case.good), "good.yaml")


def test_the_cases_are_distinct() -> None:
    assert len({c.id for c in ADMISSION_CASES}) == len(ADMISSION_CASES)


@pytest.mark.parametrize("name", BAD_RUN_NAMES)
def test_models_refuse_a_run_name_its_children_cannot_carry(name: str) -> None:
    message = refusal(valid_run(name))
    assert "metadata.name:" in message and f"at most {MAX_RUN_NAME} characters" in message, message


@pytest.mark.parametrize("name", GOOD_RUN_NAMES)
def test_models_accept_a_run_name_its_children_can_carry(name: str) -> None:
    assert parse_grporun(valid_run(name), "run.yaml").metadata.name == name


@pytest.mark.parametrize(
    ("text", "value"),
    [("1", 1), ("500m", 0.5), ("1Ki", 1024), ("2Gi", 2 * 2**30), ("1e3", 1000), ("1.5k", 1500), (".5", 0.5),
     ("+2", 2), ("3E", 3 * 10**18), ("4n", 4e-9), ("1E-2", 0.01), (7, 7)],
)
def test_quantities_parse_as_kubernetes_parses_them(text: str | int, value: float) -> None:
    parsed = parse_quantity(text)
    assert parsed is not None and float(parsed) == pytest.approx(value)


@pytest.mark.parametrize("text", ["", "1K", "1 Gi", "Gi", "1e", "1Ki3", "1.2.3", "٣", "1gi", "0x10"])
def test_quantities_kubernetes_refuses_do_not_parse(text: str) -> None:
    assert parse_quantity(text) is None


def test_status_reward_is_kept_short_for_the_printer_column() -> None:
    """kubectl prints a number column with every digit the object holds (0.8234567890123456)."""
    assert ProgressStatus(reward_mean=0.8234567890123456).reward_mean == 0.8235
    assert round_reward(1234.5678) == 1235.0 and round_reward(-0.000123456) == -0.0001235
    status = GRPORunStatus.model_validate({"progress": {"rewardMean": 0.123456789}})
    assert status.to_wire()["progress"]["rewardMean"] == 0.1235
    assert round_reward(round_reward(2 / 3)) == round_reward(2 / 3)  # stable: the status is written when it changes
