"""What a run's pods may be given beyond the operator's own: labels, annotations, volumes and mounts.

Mirrors what the API server would refuse in the pods (k8s.io/kubernetes/pkg/apis/core/validation):
ValidateVolumes (unique names, one source each; here only the sources the restricted Pod Security
Standard allows, and image volumes), validateVolumeMounts (absolute mount paths, unique per container,
sub-paths without `..`, names of volumes the pod has) and ValidateAnnotations (annotation keys, and the
total size of keys and values). It refuses besides what would collide with the operator's own volumes,
mounts, labels and security annotations.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, Field, field_validator, model_validator

from grpo_api.spec import cel
from grpo_api.spec.api import ApiModel
from grpo_api.spec.names import (
    DNS_LABEL_PATTERN,
    LABEL_KEYS_RULE,
    NO_DOTDOT_CEL,
    QUALIFIED_NAME_TEXT,
    LabelValue,
    check_label_keys,
    has_dotdot,
    qualified_name_cel,
)

#: Volume names the operator uses in its pods; extra volumes may not take them.
RESERVED_VOLUMES: tuple[str, ...] = ("run-config", "data", "dshm", "token", "model-cache")
RESERVED_VOLUME_PREFIX = "src-"
#: Label prefixes the operator owns (selectors depend on them), and those the Job controller puts on the pods
#: of the trainer and initializer Jobs (its selector matches them: another value would make the Job invalid).
RESERVED_LABEL_PREFIXES: tuple[str, ...] = ("grpo.dev/", "app.kubernetes.io/", "batch.kubernetes.io/")
RESERVED_LABELS: tuple[str, ...] = ("job-name", "controller-uid")
#: Where the operator mounts its own things; extra mounts may not shadow them.
RESERVED_MOUNT_PREFIXES: tuple[str, ...] = ("/etc/grpo", "/var/run/grpo", "/mnt/grpo", "/opt/grpo", "/dev/shm")
#: The volume sources extra volumes may use: those the restricted Pod Security Standard allows (nothing of the
#: node's, no file system the node mounts from the network on the pod's behalf), and image volumes.
EXTRA_VOLUME_SOURCES: tuple[str, ...] = (
    "configMap", "secret", "emptyDir", "persistentVolumeClaim", "projected", "downwardAPI", "ephemeral", "csi",
    "image",
)
#: The other sources of a core/v1 Volume (named in the CRD so its CEL rule can see them).
OTHER_VOLUME_SOURCES: tuple[str, ...] = (
    "hostPath", "gitRepo", "nfs", "iscsi", "glusterfs", "rbd", "cephfs", "flexVolume", "cinder", "fc", "flocker",
    "azureFile", "azureDisk", "vsphereVolume", "quobyte", "photonPersistentDisk", "portworxVolume", "scaleIO",
    "storageos", "gcePersistentDisk", "awsElasticBlockStore",
)
VOLUME_SOURCE_MESSAGE = f"needs exactly one volume source of {', '.join(EXTRA_VOLUME_SOURCES)}"
#: Annotations that choose a pod's AppArmor or seccomp profile: the operator sets the pods' security.
RESERVED_ANNOTATION_PREFIXES: tuple[str, ...] = (
    "container.apparmor.security.beta.kubernetes.io/", "seccomp.security.alpha.kubernetes.io/",
    "container.seccomp.security.alpha.kubernetes.io/",
)
RESERVED_ANNOTATION_MESSAGE = (
    "may not choose a security profile (AppArmor, seccomp annotations): the operator sets the pods' security"
)


#: core/v1 Volume objects, kept as written (the API server checks them when the pods are created).
EXTRA_VOLUMES_SCHEMA: dict[str, Any] = {
    "items": {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "pattern": DNS_LABEL_PATTERN, "maxLength": 63, "description": "Volume name."},
            **{
                source: {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                         "description": "Not allowed in a run's pods."}
                for source in OTHER_VOLUME_SOURCES
            },
        },
    }
}


#: A mount path: absolute and normalized (no empty, '.' or '..' element, no trailing '/'), without ':'
#: (a mount path is unique in its container only as written, and the runtimes split on ':').
MOUNT_PATH_PATTERN = r"^(/([^/:.][^/:]*|[.][^/:.][^/:]*|[.][.][^/:]+))+$"
MOUNT_PATH_MESSAGE = (
    "must be an absolute path without ':', '.' or '..' elements, '//' or a trailing '/', e.g. /data/cache"
)
RESERVED_MOUNT_MESSAGE = f"may not overlap a path the operator mounts ({', '.join(RESERVED_MOUNT_PREFIXES)})"
#: CEL: the string `var` is no reserved mount path, nor inside one, nor above one.
_NOT_RESERVED_CEL = (
    "![" + ", ".join(f"'{p}'" for p in RESERVED_MOUNT_PREFIXES) + "].exists(p, {v} == p || "
    "{v}.startsWith(p + '/') || p.startsWith({v}.endsWith('/') ? {v} : {v} + '/'))"
)


def _mount_path(value: str) -> str:
    if not re.fullmatch(MOUNT_PATH_PATTERN, value):
        raise ValueError(f"{value!r} {MOUNT_PATH_MESSAGE}")
    return value


def _unreserved_mount_path(value: str) -> str:
    if _shadows(value):
        raise ValueError(f"{value!r} {RESERVED_MOUNT_MESSAGE}")
    return value


#: An absolute mount path, as CEL and as a validator.
MountPath = Annotated[
    str,
    AfterValidator(_mount_path),
    Field(
        min_length=2,
        max_length=1024,
        json_schema_extra=cel.schema(cel.rule(f"self.matches('{MOUNT_PATH_PATTERN}')", MOUNT_PATH_MESSAGE)),
    ),
]
#: A mount path of the run's own volumes: also clear of the operator's mounts.
VolumeMountPath = Annotated[
    str,
    AfterValidator(_mount_path),
    AfterValidator(_unreserved_mount_path),
    Field(
        min_length=2,
        max_length=1024,
        json_schema_extra=cel.schema(
            cel.rule(f"self.matches('{MOUNT_PATH_PATTERN}')", MOUNT_PATH_MESSAGE),
            cel.rule(_NOT_RESERVED_CEL.format(v="self"), RESERVED_MOUNT_MESSAGE),
        ),
    ),
]
SUB_PATH_MESSAGE = "must be a relative path without '..' elements"


class VolumeMount(ApiModel):
    """A mount of one of the extra volumes into the container."""

    name: str = Field(description="Name of the volume.", min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN)
    mount_path: MountPath = Field(description="Absolute path in the container.")
    sub_path: str | None = Field(
        default=None, description="A sub-path of the volume (relative).", max_length=1024, pattern=r"^[^/].*$",
        json_schema_extra=cel.schema(cel.rule(NO_DOTDOT_CEL, SUB_PATH_MESSAGE)),
    )
    read_only: bool = Field(default=False, description="Mount read-only.")

    @field_validator("sub_path")
    @classmethod
    def _descending(cls, value: str | None) -> str | None:
        if value is not None and has_dotdot(value):
            raise ValueError(f"{value!r} {SUB_PATH_MESSAGE}")
        return value


ANNOTATION_KEYS_MESSAGE = f"keys must be annotation keys: {QUALIFIED_NAME_TEXT}"
#: The Kubernetes limit on a pod's annotations (keys and values, in bytes), less room for the operator's own.
MAX_POD_ANNOTATIONS_BYTES = 256 * 1024 - 1024
#: Characters in one annotation value (bounds the cost of the size rule the API server estimates).
MAX_ANNOTATION_VALUE = 65536
ANNOTATIONS_SIZE_MESSAGE = f"keys and values together may hold at most {MAX_POD_ANNOTATIONS_BYTES} bytes"
ANNOTATION_RULES: list[cel.Rule] = [
    cel.rule(f"self.all(k, {qualified_name_cel('k')})", ANNOTATION_KEYS_MESSAGE),
    cel.rule(f"self.map(k, size(bytes(k)) + size(bytes(self[k]))).sum() <= {MAX_POD_ANNOTATIONS_BYTES}",
             ANNOTATIONS_SIZE_MESSAGE),
]


def _annotations(value: dict[str, str]) -> dict[str, str]:
    check_label_keys(value, ANNOTATION_KEYS_MESSAGE)
    if sum(len(k.encode()) + len(v.encode()) for k, v in value.items()) > MAX_POD_ANNOTATIONS_BYTES:
        raise ValueError(ANNOTATIONS_SIZE_MESSAGE)
    return value


def _check_pod_settings(
    section: str, pod_labels: dict[str, str], pod_annotations: dict[str, str], volumes: list[dict[str, Any]],
    mounts: list[VolumeMount],
) -> None:
    for key in pod_labels:
        if key.startswith(RESERVED_LABEL_PREFIXES) or key in RESERVED_LABELS:
            raise ValueError(f"{section}.podLabels: {key!r} is set by the operator or the Job controller")
    for key in pod_annotations:
        if key.startswith(RESERVED_ANNOTATION_PREFIXES):
            raise ValueError(f"{section}.podAnnotations: {key!r} {RESERVED_ANNOTATION_MESSAGE}")
    names: list[str] = []
    for index, volume in enumerate(volumes):
        name = volume.get("name") if isinstance(volume, dict) else None
        if not isinstance(name, str) or not re.fullmatch(DNS_LABEL_PATTERN, name) or len(name) > 63:
            raise ValueError(f"{section}.volumes[{index}].name must be a DNS label, got {name!r}")
        if name in RESERVED_VOLUMES or name.startswith(RESERVED_VOLUME_PREFIX):
            raise ValueError(f"{section}.volumes[{index}].name {name!r} is used by the operator")
        if name in names:
            raise ValueError(f"{section}.volumes[{index}].name {name!r} is given twice")
        sources = [key for key in volume if key != "name"]
        if len(sources) != 1 or sources[0] not in EXTRA_VOLUME_SOURCES:
            raise ValueError(f"{section}.volumes[{index}] ({name}) {VOLUME_SOURCE_MESSAGE}, got {sources or 'none'}")
        names.append(name)
    for index, mount in enumerate(mounts):
        if mount.name not in names:
            raise ValueError(f"{section}.volumeMounts[{index}].name {mount.name!r} is not in {section}.volumes")
        if _shadows(mount.mount_path):
            raise ValueError(
                f"{section}.volumeMounts[{index}].mountPath {mount.mount_path!r} overlaps a path the operator "
                f"mounts ({', '.join(RESERVED_MOUNT_PREFIXES)})"
            )
        if any(m.mount_path == mount.mount_path for m in mounts[:index]):
            raise ValueError(f"{section}.volumeMounts[{index}].mountPath {mount.mount_path!r} {MOUNT_PATHS_UNIQUE}")


MOUNT_PATHS_UNIQUE = "each mountPath may be used once in a container"


def _shadows(path: str) -> bool:
    path = path.rstrip("/") or "/"
    return any(
        path == p or path.startswith(p + "/") or p.startswith(path.rstrip("/") + "/")
        for p in RESERVED_MOUNT_PREFIXES
    )


class PodSettings(ApiModel):
    """Pod settings of one component (server, trainer): extra labels, annotations, volumes and mounts."""

    #: The spec section these settings belong to, for messages.
    section: ClassVar[str] = "pod"

    pod_labels: dict[str, LabelValue] = Field(
        default_factory=dict,
        description="Extra labels of the pods (not grpo.dev/* nor app.kubernetes.io/*, which the operator sets, "
        "nor batch.kubernetes.io/*, job-name or controller-uid, which the Job controller sets).",
        json_schema_extra=cel.schema(LABEL_KEYS_RULE, maxProperties=64),
    )
    pod_annotations: dict[str, Annotated[str, Field(max_length=MAX_ANNOTATION_VALUE)]] = Field(
        default_factory=dict, description="Extra annotations of the pods (none that chooses an AppArmor or "
        "seccomp profile).",
        json_schema_extra=cel.schema(*ANNOTATION_RULES, maxProperties=64),
    )
    volumes: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Extra pod volumes (core/v1 Volume, e.g. a Secret, a ConfigMap, a claim) of one source each, "
        f"one of {', '.join(EXTRA_VOLUME_SOURCES)}; names must not collide with the operator's (run-config, data, "
        "dshm, token, model-cache, src-*).",
        max_length=32,
        json_schema_extra=EXTRA_VOLUMES_SCHEMA,
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, description="Mounts of extra volumes into the container.", max_length=32
    )

    @field_validator("pod_labels")
    @classmethod
    def _label_keys(cls, value: dict[str, str]) -> dict[str, str]:
        return check_label_keys(value)

    @field_validator("pod_annotations")
    @classmethod
    def _annotation_keys(cls, value: dict[str, str]) -> dict[str, str]:
        return _annotations(value)

    @model_validator(mode="after")
    def _pod_settings(self) -> PodSettings:
        _check_pod_settings(self.section, self.pod_labels, self.pod_annotations, self.volumes, self.volume_mounts)
        return self


def pod_rules(section: str) -> list[cel.Rule]:
    """CEL of PodSettings._pod_settings for the spec section `section` (server, trainer), which carries them."""
    reserved = ", ".join(f"'{v}'" for v in RESERVED_VOLUMES)
    prefixes = " || ".join(f"k.startsWith('{p}')" for p in RESERVED_LABEL_PREFIXES)
    names = ", ".join(f"'{n}'" for n in RESERVED_LABELS)
    return [
        cel.rule(
            f"!has(self.podLabels) || !self.podLabels.exists(k, {prefixes} || k in [{names}])",
            f"{section}.podLabels may not set grpo.dev/* or app.kubernetes.io/* labels (the operator's), nor "
            f"batch.kubernetes.io/*, {', '.join(RESERVED_LABELS)} (the Job controller's)",
            fieldPath=".podLabels",
        ),
        cel.rule(
            f"!has(self.volumes) || self.volumes.all(v, !(v.name in [{reserved}]) && "
            f"!v.name.startsWith('{RESERVED_VOLUME_PREFIX}'))",
            f"{section}.volumes may not use the operator's volume names ({', '.join(RESERVED_VOLUMES)}, "
            f"{RESERVED_VOLUME_PREFIX}*)",
            fieldPath=".volumes",
        ),
        cel.rule(
            "!has(self.volumes) || self.volumes.all(v, "
            + " && ".join(f"!has(v.{source})" for source in OTHER_VOLUME_SOURCES) + ")",
            f"{section}.volumes: every volume {VOLUME_SOURCE_MESSAGE}",
            fieldPath=".volumes",
        ),
        cel.rule(
            "!has(self.podAnnotations) || !self.podAnnotations.exists(k, "
            + " || ".join(f"k.startsWith('{p}')" for p in RESERVED_ANNOTATION_PREFIXES) + ")",
            f"{section}.podAnnotations {RESERVED_ANNOTATION_MESSAGE}",
            fieldPath=".podAnnotations",
        ),
        cel.rule(
            "!has(self.volumes) || self.volumes.all(v, self.volumes.exists_one(w, w.name == v.name))",
            f"{section}.volumes names must be unique",
            fieldPath=".volumes",
        ),
        cel.rule(
            "!has(self.volumeMounts) || self.volumeMounts.all(m, self.volumeMounts.exists_one(n, "
            "n.mountPath == m.mountPath))",
            f"{section}.volumeMounts: {MOUNT_PATHS_UNIQUE}",
            fieldPath=".volumeMounts",
        ),
        cel.rule(
            "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
            "self.volumes.exists(v, v.name == m.name))",
            f"every {section}.volumeMounts[].name must be one of {section}.volumes",
            fieldPath=".volumeMounts",
        ),
        cel.rule(
            "!has(self.volumeMounts) || self.volumeMounts.all(m, !["
            + ", ".join(f"'{p}'" for p in RESERVED_MOUNT_PREFIXES)
            + "].exists(p, m.mountPath == p || m.mountPath.startsWith(p + '/') || "
            "p.startsWith(m.mountPath.endsWith('/') ? m.mountPath : m.mountPath + '/')))",
            f"{section}.volumeMounts may not overlap the operator's mounts ({', '.join(RESERVED_MOUNT_PREFIXES)})",
            fieldPath=".volumeMounts",
        ),
    ]

