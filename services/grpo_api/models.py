"""The `GRPORun` API (`grpo.dev/v1alpha1`) as typed models.

These models are the single source of truth for the custom resource: the CRD
schema (`grpo crd`), the run-config the server and trainer read, and the local
runner's validation are all derived from them. Every field carries a one-line
description and a default; cross-field rules are written once, as CEL
(`x-kubernetes-validations`) for the API server, and mirrored by pydantic
validators so `grpo run` refuses the same specs before anything starts.
"""

from __future__ import annotations

import datetime as dt
import re
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

GROUP = "grpo.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "GRPORun"
PLURAL = "grporuns"
SINGULAR = "grporun"
SHORT_NAMES = ["grpo"]

#: The images a run gets when neither its spec nor the operator names one (the chart sets the operator's).
DEFAULT_SERVER_IMAGE = "ghcr.io/grpo-dev/grpo-server:0.1.0"
DEFAULT_TRAINER_IMAGE = "ghcr.io/grpo-dev/grpo-trainer:0.1.0"

#: LoRA ranks vLLM can serve (`vllm/config/lora.py`).
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)

#: Quantity strings as Kubernetes accepts them ("10Gi", "500m", "1").
QUANTITY_PATTERN = r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+|[KMGTPE]i?|[munkMGTPE]|m)?$"


def _cel(rule: str, message: str, **extra: str) -> dict[str, str]:
    return {"rule": rule, "message": message, **extra}


class ApiModel(BaseModel):
    """Base: camelCase on the wire, unknown fields refused, values validated on assignment."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        use_enum_values=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """camelCase dict with unset optional fields left out, as the API server stores it."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


Quantity = Annotated[str | int, Field(description="A Kubernetes quantity such as 2, 500m or 16Gi.")]


class Resources(ApiModel):
    """Compute resources of a container, as in a Pod spec."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict, description="Minimum resources, e.g. {cpu: 4, memory: 32Gi}."
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, description="Maximum resources, e.g. {nvidia.com/gpu: 1, memory: 64Gi}."
    )


#: Environment variable names a container accepts (C identifiers; what every shell can export).
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
#: Names of Kubernetes objects (DNS-1123 subdomains) and of volumes and ports (DNS-1123 labels).
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: ConfigMap and Secret keys.
KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"


def ObjectName(description: str) -> Any:
    return Field(description=description, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)


class SecretKeySelector(ApiModel):
    """One key of a Secret in the run's namespace."""

    name: str = ObjectName("Name of the Secret.")
    key: str = Field(description="Key in the Secret.", min_length=1, max_length=253, pattern=KEY_PATTERN)
    optional: bool | None = Field(default=None, description="Start even when the Secret or key is missing.")


class ConfigMapKeySelector(ApiModel):
    """One key of a ConfigMap in the run's namespace."""

    name: str = ObjectName("Name of the ConfigMap.")
    key: str = Field(description="Key in the ConfigMap.", min_length=1, max_length=253, pattern=KEY_PATTERN)
    optional: bool | None = Field(default=None, description="Start even when the ConfigMap or key is missing.")


class FieldSelector(ApiModel):
    """A field of the pod (metadata.name, metadata.namespace, spec.nodeName, status.podIP, ...)."""

    field_path: str = Field(description="Path of the field, e.g. metadata.name.", min_length=1, max_length=256)


class EnvVarSource(ApiModel):
    """Where a variable's value comes from: exactly one of a Secret key, a ConfigMap key or a pod field."""

    secret_key_ref: SecretKeySelector | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: ConfigMapKeySelector | None = Field(default=None, description="A key of a ConfigMap.")
    field_ref: FieldSelector | None = Field(default=None, description="A field of the pod.")

    @model_validator(mode="after")
    def _exactly_one(self) -> EnvVarSource:
        given = [x for x in (self.secret_key_ref, self.config_map_key_ref, self.field_ref) if x is not None]
        if len(given) != 1:
            raise ValueError("valueFrom needs exactly one of secretKeyRef, configMapKeyRef or fieldRef")
        return self


class EnvVar(ApiModel):
    """An extra environment variable for a container: a literal value, or one read from a Secret,
    a ConfigMap or the pod (valueFrom), as in a Pod spec."""

    name: str = Field(description="Variable name.", min_length=1, max_length=256, pattern=ENV_NAME_PATTERN)
    value: str | None = Field(default=None, description="Literal value.", max_length=4096)
    value_from: EnvVarSource | None = Field(
        default=None, description="Read the value from a Secret key, a ConfigMap key or a pod field."
    )

    @model_validator(mode="after")
    def _one_value(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name}: set value or valueFrom, not both")
        return self

    @property
    def literal(self) -> str:
        return self.value or ""


ENV_RULES: list[dict[str, str]] = [
    {"rule": "!(has(self.value) && has(self.valueFrom))", "message": "set value or valueFrom, not both"},
]
ENV_SOURCE_RULES: list[dict[str, str]] = [
    {
        "rule": "[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef)]"
        ".filter(x, x).size() == 1",
        "message": "valueFrom needs exactly one of secretKeyRef, configMapKeyRef or fieldRef",
    },
]


# ---------------------------------------------------------------------------------------------- spec


class ModelDType(StrEnum):
    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


#: Where a model, a dataset or reward code comes from (services/grpo_api/sources.py reads them):
#: pvc://CLAIM[/PATH] an existing claim in the run's namespace, hf://[ORG/]NAME[@REVISION] a Hugging
#: Face repository fetched once per run, oci://REFERENCE an OCI image mounted read-only (image volume),
#: configmap://NAME a ConfigMap in the run's namespace (datasets and reward code only).
PVC_URI = r"pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/[-A-Za-z0-9_.@+=,/]*)?"
HF_URI = r"hf://([A-Za-z0-9][-A-Za-z0-9_.]{0,95}/)?[A-Za-z0-9][-A-Za-z0-9_.]{0,95}(@[-A-Za-z0-9_./]{1,256})?"
OCI_URI = r"oci://[a-z0-9][-a-z0-9.]*(:[0-9]+)?(/[-a-z0-9_.]+)+(:[A-Za-z0-9_][-A-Za-z0-9_.]{0,127})?(@sha256:[a-f0-9]{64})?"
CONFIGMAP_URI = r"configmap://[a-z0-9]([-a-z0-9.]*[a-z0-9])?"
MODEL_SOURCE_PATTERN = f"^({PVC_URI}|{HF_URI}|{OCI_URI})$"
DATASET_SOURCE_PATTERN = f"^({PVC_URI}|{HF_URI}|{OCI_URI}|{CONFIGMAP_URI})$"
CODE_SOURCE_PATTERN = f"^({PVC_URI}|{OCI_URI}|{CONFIGMAP_URI})$"
#: A path inside a source: relative, no `..` segment (checked again by CEL and the validators).
RELATIVE_PATH_PATTERN = r"^[-A-Za-z0-9_.@+=,/ ]*$"
#: CEL: the path has no `..` segment.
NO_DOTDOT_CEL = "!self.matches('(^|/)[.][.](/|$)')"


class HubAccess(ApiModel):
    """How an hf:// source is fetched: the token and the endpoint (a mirror, a proxy)."""

    token_secret_ref: SecretKeySelector | None = Field(
        default=None,
        description="Secret key holding a Hugging Face token (HF_TOKEN); only the initializer reads it.",
    )
    endpoint: str | None = Field(
        default=None,
        description="Hub endpoint (HF_ENDPOINT), e.g. an internal mirror; default https://huggingface.co.",
        max_length=1024,
        pattern=r"^https?://[^\s]+$",
    )


def _has_dotdot(path: str) -> bool:
    return ".." in path.split("/")


class ModelSpec(ApiModel):
    """The base model that the server serves and the trainer adapts."""

    name: str = Field(
        description="Model name: the served name; without `source` or `path`, a hub id resolved from the "
        "model cache (e.g. Qwen/Qwen2.5-1.5B-Instruct).",
        min_length=1,
        max_length=253,
    )
    source: str | None = Field(
        default=None,
        description="Where the weights come from: pvc://CLAIM/PATH (an existing claim in the run's "
        "namespace), hf://ORG/NAME@REVISION (fetched once per run onto the run's volume by the "
        "initializer), or oci://REGISTRY/IMAGE:TAG (an OCI image mounted read-only; Kubernetes image "
        "volumes). `path` is then a directory inside the source.",
        max_length=1024,
        pattern=MODEL_SOURCE_PATTERN,
    )
    path: str | None = Field(
        default=None,
        description="With `source`: the model directory inside it (relative). Without: the directory of a "
        "Hugging Face model on a mounted volume (absolute in the cluster; relative to the run file for "
        "`grpo run`).",
        max_length=1024,
    )
    revision: str | None = Field(default=None, description="Revision (branch, tag or commit) of a hub model.")
    hub: HubAccess | None = Field(default=None, description="Token and endpoint for an hf:// source.")
    dtype: ModelDType = Field(default=ModelDType.AUTO, description="Weights dtype for serving and training.")

    @model_validator(mode="after")
    def _source_path(self) -> ModelSpec:
        _check_source_path("model", self.source, self.path)
        if self.hub is not None and not (self.source or "").startswith("hf://"):
            raise ValueError("model.hub applies only to an hf:// model.source")
        if self.source is not None and self.revision is not None:
            raise ValueError("model.revision applies to a model resolved by name; with a source, write "
                             "hf://ORG/NAME@REVISION")
        return self


def _check_source_path(section: str, source: str | None, path: str | None) -> None:
    if source is not None and ".." in re.split(r"[/@]", source):
        raise ValueError(f"{section}.source may not hold a '..' segment")
    if source is None or path is None:
        return
    if path.startswith("/") or _has_dotdot(path) or not re.fullmatch(RELATIVE_PATH_PATTERN, path):
        raise ValueError(
            f"{section}.path must be a relative path inside {section}.source (no leading '/', no '..'), "
            f"got {path!r}"
        )


def _source_rules(section: str) -> list[dict[str, str]]:
    return [
        _cel(
            "!has(self.source) || !has(self.path) || (!self.path.startsWith('/') && "
            f"self.path.matches('{RELATIVE_PATH_PATTERN}') && "
            f"{NO_DOTDOT_CEL.replace('self', 'self.path')})",
            f"{section}.path must be a relative path inside {section}.source (no leading '/', no '..')",
            fieldPath=".path",
        ),
        _cel(
            "!has(self.source) || !self.source.matches('(^|/)[.][.](/|@|$)')",
            f"{section}.source may not hold a '..' segment",
            fieldPath=".source",
        ),
        _cel(
            "!has(self.hub) || (has(self.source) && self.source.startsWith('hf://'))",
            f"{section}.hub applies only to an hf:// {section}.source",
            fieldPath=".hub",
        ),
    ]


MODEL_RULES = [
    *_source_rules("model"),
    _cel(
        "!has(self.source) || !has(self.revision)",
        "model.revision applies to a model resolved by name; with a source, write hf://ORG/NAME@REVISION",
        fieldPath=".revision",
    ),
]


class DatasetFormat(StrEnum):
    AUTO = "auto"
    JSONL = "jsonl"
    PARQUET = "parquet"
    ARROW = "arrow"


class PromptFormat(StrEnum):
    AUTO = "auto"
    PLAIN = "plain"
    CONVERSATIONAL = "conversational"


class DatasetSpec(ApiModel):
    """The prompts to train on: a file or a saved Hugging Face dataset on the volume."""

    source: str | None = Field(
        default=None,
        description="Where the data comes from: pvc://CLAIM/PATH, hf://ORG/NAME@REVISION (a dataset "
        "repository, fetched once per run), oci://REGISTRY/IMAGE:TAG (an image volume), or "
        "configmap://NAME (small prompt sets; `path` is then the key). Without it, `path` is on a mounted "
        "volume.",
        max_length=1024,
        pattern=DATASET_SOURCE_PATTERN,
    )
    path: str = Field(
        description="Path of a .jsonl or .parquet file, or of a directory written by `save_to_disk`: inside "
        "`source` (relative) when it is set, else on a mounted volume (absolute in the cluster; relative "
        "to the run file for `grpo run`).",
        min_length=1,
        max_length=1024,
    )
    hub: HubAccess | None = Field(default=None, description="Token and endpoint for an hf:// source.")
    format: DatasetFormat = Field(default=DatasetFormat.AUTO, description="File format; auto by extension.")
    prompt_field: str = Field(default="prompt", description="Column that holds the prompt.", max_length=128)
    prompt_format: PromptFormat = Field(
        default=PromptFormat.AUTO,
        description="plain (a string, no chat template) or conversational (a list of messages; the trainer "
        "applies the chat template); auto decides from the data.",
    )
    split: str = Field(default="train", description="Split to use when the dataset directory holds several.")

    @model_validator(mode="after")
    def _source_path(self) -> DatasetSpec:
        _check_source_path("dataset", self.source, self.path)
        if self.hub is not None and not (self.source or "").startswith("hf://"):
            raise ValueError("dataset.hub applies only to an hf:// dataset.source")
        if (self.source or "").startswith("configmap://") and not re.fullmatch(KEY_PATTERN, self.path):
            raise ValueError(f"dataset.path must be a key of the ConfigMap in dataset.source, got {self.path!r}")
        return self


DATASET_RULES = [
    *_source_rules("dataset"),
    _cel(
        "!has(self.source) || !self.source.startsWith('configmap://') || "
        f"self.path.matches('{KEY_PATTERN}')",
        "dataset.path must be a key of the ConfigMap in dataset.source",
        fieldPath=".path",
    ),
]

#: Reward functions the trainer ships (services/grpo_trainer/rewards.py registers exactly these).
BUILTIN_REWARDS: tuple[str, ...] = ("exact_match", "regex_match", "length_penalty", "token_fraction")


class RewardCodeSpec(ApiModel):
    """User reward modules: mounted read-only at /opt/grpo/rewards and importable by the trainer."""

    source: str | None = Field(
        default=None,
        description="configmap://NAME (each key NAME.py is a module), oci://REGISTRY/IMAGE:TAG (an image "
        "volume; `path` the directory of the modules in it), or pvc://CLAIM/PATH (a directory on a claim).",
        max_length=1024,
        pattern=CODE_SOURCE_PATTERN,
    )
    path: str | None = Field(
        default=None, description="Directory of the modules inside an oci:// source (relative).", max_length=1024
    )
    inline: dict[str, str] = Field(
        default_factory=dict,
        description="Modules written in the spec: file name (NAME.py) to source, for a short function. The "
        "operator puts them in a ConfigMap owned by the run.",
        max_length=8,
        json_schema_extra={"maxProperties": 8},
    )

    @model_validator(mode="after")
    def _one_kind(self) -> RewardCodeSpec:
        if (self.source is None) == (not self.inline):
            raise ValueError("rewardCode needs exactly one of source or inline")
        _check_source_path("rewardCode", self.source, self.path)
        for name, text in self.inline.items():
            if not re.fullmatch(INLINE_MODULE_PATTERN, name):
                raise ValueError(f"rewardCode.inline: {name!r} must be a module file name such as my_rewards.py")
            if len(text.encode()) > MAX_INLINE_MODULE_BYTES:
                raise ValueError(
                    f"rewardCode.inline[{name}] is larger than {MAX_INLINE_MODULE_BYTES} bytes: use "
                    "configmap:// (grpo stage --configmap) or an image"
                )
        return self


INLINE_MODULE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,100}[.]py$"
MAX_INLINE_MODULE_BYTES = 65536
REWARD_CODE_RULES = [
    _cel("has(self.source) != (has(self.inline) && size(self.inline) > 0)",
         "rewardCode needs exactly one of source or inline"),
    _cel(
        f"!has(self.inline) || self.inline.all(k, k.matches('{INLINE_MODULE_PATTERN}') && "
        f"size(self.inline[k]) <= {MAX_INLINE_MODULE_BYTES})",
        f"rewardCode.inline keys must be module file names (NAME.py) and each module at most "
        f"{MAX_INLINE_MODULE_BYTES} bytes",
        fieldPath=".inline",
    ),
    *_source_rules("rewardCode")[:2],
]


class RewardSpec(ApiModel):
    """One reward function: a built-in by name or a user function by import path."""

    function: str = Field(
        description="A built-in (exact_match, regex_match, length_penalty, token_fraction) or "
        "`module:function` of a user function with TRL's reward contract (modules from spec.rewardCode, "
        "or installed in the trainer image).",
        min_length=1,
        max_length=512,
        pattern=r"^([a-z_]+|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$",
    )
    weight: float = Field(default=1.0, description="Weight of this reward in the total.")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the function (e.g. {pattern: ...} for regex_match).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

    @model_validator(mode="after")
    def _known_builtin(self) -> RewardSpec:
        if ":" not in self.function and self.function not in BUILTIN_REWARDS:
            raise ValueError(
                f"function {self.function!r} is not a built-in ({', '.join(BUILTIN_REWARDS)}); "
                "a user function is written module:function"
            )
        return self


REWARD_RULES = [
    _cel(
        "self.contains(':') || self in [" + ", ".join(f"'{b}'" for b in BUILTIN_REWARDS) + "]",
        "function must be a built-in (" + ", ".join(BUILTIN_REWARDS) + ") or module:function",
    ),
]


class Mode(StrEnum):
    SERVER = "server"
    COLOCATE = "colocate"


class Engine(StrEnum):
    AUTO = "auto"
    VLLM = "vllm"
    TRANSFORMERS = "transformers"


class LogprobsSource(StrEnum):
    AUTO = "auto"
    SAMPLER = "sampler"


#: Volume names the operator uses in its pods; extra volumes may not take them.
RESERVED_VOLUMES: tuple[str, ...] = ("run-config", "data", "dshm", "token", "model-cache")
RESERVED_VOLUME_PREFIX = "src-"
#: Label prefixes the operator owns (selectors depend on them).
RESERVED_LABEL_PREFIXES: tuple[str, ...] = ("grpo.dev/", "app.kubernetes.io/")
#: Where the operator mounts its own things; extra mounts may not shadow them.
RESERVED_MOUNT_PREFIXES: tuple[str, ...] = ("/etc/grpo", "/var/run/grpo", "/mnt/grpo", "/opt/grpo", "/dev/shm")


#: core/v1 Volume objects, kept as written (the API server checks them when the pods are created).
EXTRA_VOLUMES_SCHEMA: dict[str, Any] = {
    "items": {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "pattern": DNS_LABEL_PATTERN, "maxLength": 63, "description": "Volume name."}
        },
    }
}


class VolumeMount(ApiModel):
    """A mount of one of the extra volumes into the container."""

    name: str = Field(description="Name of the volume.", min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN)
    mount_path: str = Field(
        description="Absolute path in the container.", min_length=2, max_length=1024, pattern=r"^/[^:]*$"
    )
    sub_path: str | None = Field(
        default=None, description="A sub-path of the volume (relative).", max_length=1024, pattern=r"^[^/].*$"
    )
    read_only: bool = Field(default=False, description="Mount read-only.")


def _check_pod_settings(
    section: str, pod_labels: dict[str, str], volumes: list[dict[str, Any]], mounts: list[VolumeMount]
) -> None:
    for key in pod_labels:
        if key.startswith(RESERVED_LABEL_PREFIXES):
            raise ValueError(f"{section}.podLabels: {key!r} is set by the operator")
    names: list[str] = []
    for index, volume in enumerate(volumes):
        name = volume.get("name") if isinstance(volume, dict) else None
        if not isinstance(name, str) or not re.fullmatch(DNS_LABEL_PATTERN, name) or len(name) > 63:
            raise ValueError(f"{section}.volumes[{index}].name must be a DNS label, got {name!r}")
        if name in RESERVED_VOLUMES or name.startswith(RESERVED_VOLUME_PREFIX):
            raise ValueError(f"{section}.volumes[{index}].name {name!r} is used by the operator")
        if name in names:
            raise ValueError(f"{section}.volumes[{index}].name {name!r} is given twice")
        names.append(name)
    for index, mount in enumerate(mounts):
        if mount.name not in names:
            raise ValueError(f"{section}.volumeMounts[{index}].name {mount.name!r} is not in {section}.volumes")
        if _shadows(mount.mount_path):
            raise ValueError(
                f"{section}.volumeMounts[{index}].mountPath {mount.mount_path!r} overlaps a path the operator "
                f"mounts ({', '.join(RESERVED_MOUNT_PREFIXES)})"
            )
        if mount.sub_path is not None and _has_dotdot(mount.sub_path):
            raise ValueError(f"{section}.volumeMounts[{index}].subPath may not hold '..'")


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

    pod_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Extra labels of the pods (not grpo.dev/* nor app.kubernetes.io/*, which the operator sets).",
        json_schema_extra={"maxProperties": 64},
    )
    pod_annotations: dict[str, str] = Field(
        default_factory=dict, description="Extra annotations of the pods.", json_schema_extra={"maxProperties": 64}
    )
    volumes: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Extra pod volumes (core/v1 Volume, e.g. a Secret, a ConfigMap, a claim); names must not "
        "collide with the operator's (run-config, data, dshm, token, model-cache, src-*).",
        max_length=32,
        json_schema_extra=EXTRA_VOLUMES_SCHEMA,
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, description="Mounts of extra volumes into the container.", max_length=32
    )


    @model_validator(mode="after")
    def _pod_settings(self) -> PodSettings:
        _check_pod_settings(self.section, self.pod_labels, self.volumes, self.volume_mounts)
        return self


def pod_rules(section: str) -> list[dict[str, str]]:
    reserved = ", ".join(f"'{v}'" for v in RESERVED_VOLUMES)
    prefixes = " || ".join(f"k.startsWith('{p}')" for p in RESERVED_LABEL_PREFIXES)
    return [
        _cel(
            f"!has(self.podLabels) || !self.podLabels.exists(k, {prefixes})",
            f"{section}.podLabels may not set grpo.dev/* or app.kubernetes.io/* labels (the operator's)",
            fieldPath=".podLabels",
        ),
        _cel(
            f"!has(self.volumes) || self.volumes.all(v, !(v.name in [{reserved}]) && "
            f"!v.name.startsWith('{RESERVED_VOLUME_PREFIX}'))",
            f"{section}.volumes may not use the operator's volume names ({', '.join(RESERVED_VOLUMES)}, "
            f"{RESERVED_VOLUME_PREFIX}*)",
            fieldPath=".volumes",
        ),
        _cel(
            "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
            "self.volumes.exists(v, v.name == m.name))",
            f"every {section}.volumeMounts[].name must be one of {section}.volumes",
            fieldPath=".volumeMounts",
        ),
        _cel(
            "!has(self.volumeMounts) || self.volumeMounts.all(m, !["
            + ", ".join(f"'{p}'" for p in RESERVED_MOUNT_PREFIXES)
            + "].exists(p, m.mountPath == p || m.mountPath.startsWith(p + '/') || "
            "p.startsWith(m.mountPath.endsWith('/') ? m.mountPath : m.mountPath + '/')))",
            f"{section}.volumeMounts may not overlap the operator's mounts ({', '.join(RESERVED_MOUNT_PREFIXES)})",
            fieldPath=".volumeMounts",
        ),
    ]


def _gpu_resources() -> Resources:
    return Resources(requests={"cpu": "4", "memory": "32Gi"}, limits={"nvidia.com/gpu": 1, "memory": "64Gi"})


class ServerSpec(PodSettings):
    """The generation server: vLLM serving the base model plus the policy's current LoRA adapter."""

    section: ClassVar[str] = "server"

    image: str | None = Field(
        default=None,
        description="Server container image; default: the operator's (the chart's runImages.server).",
        max_length=512,
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy."
    )
    engine: Engine = Field(
        default=Engine.AUTO,
        description="Inference engine: vllm (GPU), transformers (CPU/GPU, slow but real), or auto "
        "(vllm when importable and a GPU is present).",
    )
    resources: Resources = Field(default_factory=_gpu_resources, description="Server container resources.")
    port: int = Field(default=8000, ge=1, le=65535, description="HTTP port of the server.")
    tensor_parallel_size: int = Field(default=1, ge=1, le=64, description="vLLM tensor parallel size.")
    data_parallel_size: int = Field(default=1, ge=1, le=64, description="vLLM data parallel size.")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0, description="Share of GPU memory vLLM may use."
    )
    dtype: ModelDType = Field(default=ModelDType.AUTO, description="Serving dtype.")
    max_model_len: int | None = Field(
        default=None, ge=16, description="Maximum prompt + completion length; default is the model's."
    )
    enable_prefix_caching: bool = Field(default=True, description="Enable vLLM prefix caching.")
    enforce_eager: bool = Field(default=False, description="Disable CUDA graphs and torch.compile in vLLM.")
    max_loras: int = Field(
        default=4, ge=1, le=64, description="Adapters resident at once (at least the staleness window + 1)."
    )
    max_lora_rank: int = Field(default=64, description="Largest LoRA rank the server accepts.")
    logprobs_source: LogprobsSource = Field(
        default=LogprobsSource.SAMPLER,
        description="Where the vllm engine takes the sampled tokens' logprobs from. sampler: vLLM's "
        "sampler, streamed with every decoding step (costly in vLLM 0.26). auto: when the processed "
        "logprobs equal the model's own (temperature 1, no top-k/top-p/min-p, no penalties, no "
        "alternatives asked), generate without logprobs and score the completions in one prefill pass; "
        "otherwise the sampler. Measured on vLLM 0.26 (H200, BENCHMARKS.md), auto is slower: the prefill "
        "pass costs more than the transport it saves (0.78x the sampler's throughput), so sampler is the "
        "default.",
    )
    extra_engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra vLLM engine arguments (AsyncEngineArgs field names).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    health_path: str = Field(default="/health/", description="Health endpoint path used by probes and gates.")
    authenticate_generation: bool = Field(
        default=False, description="Require the run's bearer token on generation endpoints too."
    )
    shm_size: str = Field(
        default="8Gi", description="Size of the /dev/shm memory volume.", pattern=QUANTITY_PATTERN
    )
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment variables.", max_length=64)
    @model_validator(mode="after")
    def _rank_supported(self) -> ServerSpec:
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"maxLoraRank must be one of {list(VLLM_LORA_RANKS)}, got {self.max_lora_rank}")
        return self


class LoraSpec(ApiModel):
    """The LoRA adapter trained on the policy (full fine-tuning is out of scope)."""

    r: int = Field(default=16, description="LoRA rank; one of vLLM's supported ranks.")
    alpha: int = Field(default=32, ge=1, description="LoRA alpha (scaling = alpha / r).")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="LoRA dropout.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["all-linear"],
        description="Modules to adapt; `all-linear` adapts every linear layer except lm_head.",
        min_length=1,
        max_length=64,
    )
    quantize_base: bool = Field(
        default=False, description="QLoRA: load the base model in 4 bits (needs bitsandbytes and a GPU)."
    )

    @model_validator(mode="after")
    def _adaptable(self) -> LoraSpec:
        if self.r not in VLLM_LORA_RANKS:
            raise ValueError(f"lora.r must be one of {list(VLLM_LORA_RANKS)}, got {self.r}")
        forbidden = {"lm_head", "embed_tokens"} & set(self.target_modules)
        if forbidden:
            raise ValueError(f"lora.targetModules may not include {sorted(forbidden)}: vLLM cannot serve them")
        return self


class LossType(StrEnum):
    GRPO = "grpo"
    BNPO = "bnpo"
    DR_GRPO = "dr_grpo"
    DAPO = "dapo"
    CISPO = "cispo"
    SAPO = "sapo"
    LUSPO = "luspo"


class Level(StrEnum):
    TOKEN = "token"
    SEQUENCE = "sequence"


class ImportanceSamplingMode(StrEnum):
    TRUNCATE = "truncate"
    MASK = "mask"


class ImportanceSamplingSpec(ApiModel):
    """Correction for the gap between the server's sampling policy and the trainer's policy."""

    enabled: bool = Field(default=True, description="Weight the loss by the trainer/server probability ratio.")
    level: Level = Field(default=Level.TOKEN, description="Ratio per token or per sequence.")
    mode: ImportanceSamplingMode = Field(
        default=ImportanceSamplingMode.MASK,
        description="truncate clips large ratios to clipMax; mask drops tokens or sequences beyond it.",
    )
    clip_max: float = Field(default=3.0, gt=1.0, description="Upper bound C of the ratio.")


STRUCTURED_OUTPUTS_RULES = [
    _cel(
        "(has(self.regex) ? 1 : 0) + (has(self.jsonSchema) ? 1 : 0) + (has(self.choice) ? 1 : 0) == 1",
        "structuredOutputs needs exactly one of regex, jsonSchema or choice",
    ),
]


def _structured_outputs_rules(schema: dict[str, Any]) -> None:
    schema["x-kubernetes-validations"] = [dict(rule) for rule in STRUCTURED_OUTPUTS_RULES]


class StructuredOutputsSpec(ApiModel):
    """Guided decoding of every rollout: exactly one of regex, jsonSchema or choice.

    TRL's `vllm_structured_outputs_regex` and Axolotl's guided decoding, and vLLM's
    `StructuredOutputsParams` (json, regex, choice) on the server.
    """

    model_config = ConfigDict(json_schema_extra=_structured_outputs_rules)  # CEL beside the type it checks

    regex: str | None = Field(
        default=None, description="A regular expression every completion matches.", min_length=1, max_length=4096
    )
    json_schema: dict[str, Any] | None = Field(
        default=None,
        description="A JSON schema (an object) every completion follows.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    choice: list[Annotated[str, Field(min_length=1, max_length=1024)]] | None = Field(
        default=None, description="Every completion is exactly one of these strings.", min_length=1, max_length=256
    )

    @model_validator(mode="after")
    def _one_valid_kind(self) -> StructuredOutputsSpec:
        kinds = [k for k in ("regex", "json_schema", "choice") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError("structuredOutputs needs exactly one of regex, jsonSchema or choice")
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"structuredOutputs.regex does not compile: {exc}") from exc
        return self

    def vllm_params(self) -> dict[str, Any]:
        """The constraint as vLLM's `StructuredOutputsParams` fields: a generation request's `structured_outputs`."""
        if self.regex is not None:
            return {"regex": self.regex}
        if self.json_schema is not None:
            return {"json": self.json_schema}
        return {"choice": list(self.choice or ())}


class TrainerSpec(PodSettings):
    """The GRPO trainer (TRL GRPOTrainer + PEFT LoRA) and its settings."""

    section: ClassVar[str] = "trainer"

    image: str | None = Field(
        default=None,
        description="Trainer (and initializer) container image; default: the operator's (the chart's "
        "runImages.trainer).",
        max_length=512,
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy."
    )
    resources: Resources = Field(default_factory=_gpu_resources, description="Trainer container resources.")
    lora: LoraSpec = Field(default_factory=LoraSpec, description="LoRA adapter settings.")
    num_generations: int = Field(default=8, ge=2, le=1024, description="Completions per prompt (the group).")
    max_completion_length: int = Field(default=256, ge=1, description="Maximum generated tokens per completion.")
    max_prompt_length: int | None = Field(
        default=None, ge=1, description="Prompts longer than this (in tokens) are dropped from the dataset."
    )
    learning_rate: float = Field(default=1e-5, gt=0.0, le=1.0, description="Peak learning rate.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        default="constant", description="Learning-rate schedule."
    )
    max_steps: int = Field(default=100, ge=1, description="Optimizer steps to train.")
    per_device_batch_size: int = Field(
        default=8, ge=1, description="Completions per device per micro-batch (prompts × generations)."
    )
    gradient_accumulation_steps: int = Field(default=1, ge=1, description="Micro-batches per optimizer step.")
    beta: float = Field(default=0.0, ge=0.0, description="KL coefficient against the base model (0 disables).")
    epsilon: float = Field(default=0.2, gt=0.0, lt=1.0, description="PPO clipping range.")
    loss_type: LossType = Field(default=LossType.DAPO, description="Loss aggregation (TRL loss_type).")
    ratio_level: Level = Field(
        default=Level.TOKEN, description="PPO ratio per token (GRPO) or per sequence (GSPO)."
    )
    temperature: float = Field(default=1.0, gt=0.0, le=10.0, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold.")
    top_k: int = Field(default=0, ge=-1, description="Top-k sampling; 0 or -1 disables.")
    structured_outputs: StructuredOutputsSpec | None = Field(
        default=None,
        description="Guided decoding of every rollout (regex, jsonSchema or choice), as TRL's "
        "vllm_structured_outputs_regex; unset: free generation.",
    )
    importance_sampling: ImportanceSamplingSpec = Field(
        default_factory=ImportanceSamplingSpec, description="Server/trainer importance-sampling correction."
    )
    off_policy_mask_threshold: float | None = Field(
        default=None,
        gt=0.0,
        description="Drop negative-advantage sequences whose mean log-ratio to the sampler exceeds this "
        "(0.5 is a good start); unset disables.",
    )
    sync_interval: int = Field(default=1, ge=1, description="Publish the adapter every N optimizer steps.")
    async_prefetch: bool = Field(
        default=False, description="Generate the next batch while the current one trains."
    )
    prefetch_depth: int = Field(
        default=1, ge=1, le=8,
        description="Batches generated ahead with asyncPrefetch, requested concurrently so the server decodes "
        "them together; each adds one step to the staleness bound. With server and trainer on one GPU, 2 "
        "measured steps 1.1-1.7x faster than TRL colocate, by how its short runs are sliced (1: 1.0-1.14x; "
        "BENCHMARKS.md).",
    )
    checkpoint_interval: int = Field(default=10, ge=1, description="Write a resumable checkpoint every N steps.")
    seed: int = Field(default=42, ge=0, description="Random seed (data order, sampling, initialisation).")
    gradient_checkpointing: bool = Field(default=False, description="Trade compute for activation memory.")
    generation_timeout_seconds: float = Field(
        default=600.0, gt=0.0, description="Timeout of one generation request to the server."
    )
    metrics_port: int = Field(default=9400, ge=1, le=65535, description="Port of the trainer's /metrics.")
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment variables.", max_length=64)
    @property
    def generation_batch_size(self) -> int:
        return self.per_device_batch_size * self.gradient_accumulation_steps

    @model_validator(mode="after")
    def _batch_divisible(self) -> TrainerSpec:
        if self.generation_batch_size % self.num_generations != 0:
            raise ValueError(
                "perDeviceBatchSize × gradientAccumulationSteps "
                f"({self.generation_batch_size}) must be divisible by numGenerations ({self.num_generations})"
            )
        return self


class VolumeClaimSpec(ApiModel):
    """An existing PersistentVolumeClaim to mount."""

    existing_claim: str = Field(description="Name of the claim.", min_length=1, max_length=253)
    mount_path: str = Field(default="/models", description="Where it is mounted in the containers.")


AccessMode = Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod", "ReadOnlyMany"]


def _rwo() -> list[AccessMode]:
    return ["ReadWriteOnce"]


class StorageSpec(ApiModel):
    """The shared volume for adapters, checkpoints and progress; one of existingClaim or size."""

    existing_claim: str | None = Field(
        default=None, description="Use this PersistentVolumeClaim (it must allow the server and trainer pods).",
        max_length=253,
    )
    size: str | None = Field(
        default=None, description="Create a claim of this size for the run.", pattern=QUANTITY_PATTERN
    )
    storage_class_name: str | None = Field(default=None, description="Storage class of a created claim.")
    access_modes: list[AccessMode] = Field(
        default_factory=_rwo, description="Access modes of a created claim.", max_length=4
    )
    mount_path: str = Field(default="/data", description="Where the volume is mounted in the containers.")
    model_cache: VolumeClaimSpec | None = Field(
        default=None, description="Optional claim holding model weights (mounted read-only, HF_HOME)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> StorageSpec:
        if (self.existing_claim is None) == (self.size is None):
            raise ValueError("storage needs exactly one of existingClaim or size")
        return self


def _default_storage() -> StorageSpec:
    return StorageSpec(size="20Gi")


def _initializer_resources() -> Resources:
    return Resources(requests={"cpu": "500m", "memory": "1Gi"}, limits={"memory": "8Gi"})


class InitializerSpec(ApiModel):
    """The run's initializer: one pod, before the first server, that fetches hf:// sources onto the run's
    volume (resumable) and checks that the model, the dataset and every reward function can be loaded."""

    resources: Resources = Field(
        default_factory=_initializer_resources, description="Initializer container resources."
    )
    backoff_limit: int = Field(
        default=3, ge=0, le=20,
        description="Retries of a fetch that failed for a reason that may pass (network, hub); a missing "
        "file, module or function is not retried.",
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=60, description="Fail the run (SourceUnavailable) when the initializer takes longer."
    )
    start_timeout_seconds: int = Field(
        default=600, ge=10,
        description="Fail the run (SourceUnavailable) when the initializer's pod has not started this long "
        "after the run began and says why (a missing claim, an image that cannot be pulled, unschedulable).",
    )


class CleanupPolicy(StrEnum):
    STOP_SERVER = "StopServer"
    KEEP_SERVER = "KeepServer"
    DELETE_SERVER = "DeleteServer"


class RunPolicy(ApiModel):
    """Retries, deadlines and cleanup, with the meanings Kubernetes Jobs give them."""

    backoff_limit: int = Field(
        default=2, ge=0, le=100, description="Retries after a failed attempt; each starts a fresh server."
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, description="Fail the run (DeadlineExceeded) after this long since it started."
    )
    server_ready_timeout_seconds: int = Field(
        default=1200, ge=1, description="Fail the attempt (ServerNotReady) if the server is not healthy by then."
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, description="Delete the run this long after it succeeded or failed."
    )
    suspend: bool = Field(
        default=False, description="Stop the trainer and scale the server to 0; resuming continues from the "
        "last checkpoint.",
    )
    cleanup_policy: CleanupPolicy = Field(
        default=CleanupPolicy.STOP_SERVER,
        description="On finish: StopServer scales it to 0, KeepServer leaves it serving the final adapter, "
        "DeleteServer removes its Deployment and Service.",
    )


class Toleration(ApiModel):
    """A Pod toleration."""

    key: str | None = Field(default=None, description="Taint key.")
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Exists or Equal.")
    value: str | None = Field(default=None, description="Taint value.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect."
    )
    toleration_seconds: int | None = Field(default=None, description="How long a NoExecute taint is tolerated.")


class SchedulingSpec(ApiModel):
    """Where the server and trainer pods may run."""

    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods require.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Taints the pods tolerate.")
    affinity: dict[str, Any] = Field(
        default_factory=dict,
        description="Pod affinity (core/v1 Affinity).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    priority_class_name: str | None = Field(default=None, description="PriorityClass of the pods.")
    runtime_class_name: str | None = Field(default=None, description="RuntimeClass of the pods.")
    service_account_name: str | None = Field(
        default=None, description="ServiceAccount of the pods; default is the namespace's default."
    )
    image_pull_secrets: list[Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)]] = Field(
        default_factory=list,
        description="Secrets (names, in the run's namespace) for pulling the images of the pods.",
        max_length=16,
    )


IMMUTABLE = "{field} cannot change after the run is created"


def _immutable(field: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": [_cel("self == oldSelf", IMMUTABLE.format(field=field))]}


class GRPORunSpec(ApiModel):
    """What to train, on what, and how: one GRPO post-training run."""

    model: ModelSpec = Field(description="The base model.", json_schema_extra=_immutable("model"))
    dataset: DatasetSpec = Field(description="The prompt dataset.", json_schema_extra=_immutable("dataset"))
    rewards: list[RewardSpec] = Field(
        description="Reward functions; the total reward is their weighted sum.",
        min_length=1,
        max_length=16,
        json_schema_extra=_immutable("rewards"),
    )
    mode: Mode = Field(
        default=Mode.SERVER,
        description="server: a vLLM server Deployment plus a trainer Job; colocate: vLLM inside the trainer.",
        json_schema_extra=_immutable("mode"),
    )
    server: ServerSpec | None = Field(
        default=None,
        description="The generation server (server mode only; defaults apply when omitted).",
        json_schema_extra=_immutable("server"),
    )
    trainer: TrainerSpec = Field(
        default_factory=TrainerSpec, description="The trainer.", json_schema_extra=_immutable("trainer")
    )
    storage: StorageSpec = Field(
        default_factory=_default_storage,
        description="Shared volume for adapters and checkpoints.",
        json_schema_extra=_immutable("storage"),
    )
    run_policy: RunPolicy = Field(default_factory=RunPolicy, description="Retries, deadlines, suspend, cleanup.")
    scheduling: SchedulingSpec = Field(
        default_factory=SchedulingSpec,
        description="Node placement of the pods.",
        json_schema_extra=_immutable("scheduling"),
    )
    reward_code: RewardCodeSpec | None = Field(
        default=None,
        description="User reward modules (a ConfigMap, an image, a claim directory, or inline source), "
        "importable by the trainer from a read-only mount.",
        json_schema_extra=_immutable("rewardCode"),
    )
    initializer: InitializerSpec = Field(
        default_factory=InitializerSpec,
        description="The initializer that fetches and checks the sources once per run.",
        json_schema_extra=_immutable("initializer"),
    )

    @model_validator(mode="after")
    def _mode_matches_sections(self) -> GRPORunSpec:
        if self.mode == Mode.COLOCATE and self.server is not None:
            raise ValueError("mode colocate runs vLLM inside the trainer: remove the server section")
        if self.mode == Mode.SERVER and "ReadWriteOncePod" in self.storage.access_modes:
            raise ValueError(
                "storage.accessModes: ReadWriteOncePod lets one pod mount the volume, but server mode runs a "
                "server and a trainer on it; use ReadWriteOnce (same node) or ReadWriteMany"
            )
        if self.mode == Mode.SERVER:
            server = self.effective_server
            if self.trainer.lora.r > server.max_lora_rank:
                raise ValueError(
                    f"trainer.lora.r ({self.trainer.lora.r}) exceeds server.maxLoraRank ({server.max_lora_rank})"
                )
        return self

    @property
    def effective_server(self) -> ServerSpec:
        """The server section with defaults applied (server mode)."""
        return self.server if self.server is not None else ServerSpec()


#: CEL rules on the spec object: cross-field checks the API server enforces at admission.
SPEC_RULES: list[dict[str, str]] = [
    _cel(
        "self.mode != 'colocate' || !has(self.server)",
        "mode colocate runs vLLM inside the trainer: remove spec.server",
        fieldPath=".server",
        reason="FieldValueForbidden",
    ),
    # Server mode without a server section runs the default server: its maxLoraRank still applies.
    _cel(
        "self.mode == 'colocate' || !has(self.trainer) || !has(self.trainer.lora) || !has(self.trainer.lora.r) "
        "|| self.trainer.lora.r <= ((has(self.server) && has(self.server.maxLoraRank)) "
        f"? self.server.maxLoraRank : {ServerSpec.model_fields['max_lora_rank'].default})",
        "spec.trainer.lora.r must not exceed spec.server.maxLoraRank "
        f"({ServerSpec.model_fields['max_lora_rank'].default} when spec.server is omitted)",
        fieldPath=".trainer.lora.r",
    ),
    _cel(
        "self.mode == 'colocate' || !has(self.storage) || !has(self.storage.accessModes) || "
        "!self.storage.accessModes.exists(m, m == 'ReadWriteOncePod')",
        "spec.storage.accessModes: ReadWriteOncePod lets one pod mount the volume, but server mode runs a "
        "server and a trainer on it; use ReadWriteOnce (same node) or ReadWriteMany",
        fieldPath=".storage.accessModes",
    ),
]

TRAINER_RULES: list[dict[str, str]] = [
    _cel(
        "(self.perDeviceBatchSize * self.gradientAccumulationSteps) % self.numGenerations == 0",
        "perDeviceBatchSize × gradientAccumulationSteps must be divisible by numGenerations",
        fieldPath=".numGenerations",
    ),
]

RANKS_CEL = "[" + ", ".join(str(r) for r in VLLM_LORA_RANKS) + "]"
LORA_RULES: list[dict[str, str]] = [
    _cel(f"self.r in {RANKS_CEL}", f"r must be one of {RANKS_CEL} (vLLM's supported LoRA ranks)",
         fieldPath=".r"),
    _cel(
        "!self.targetModules.exists(m, m == 'lm_head' || m == 'embed_tokens')",
        "targetModules may not include lm_head or embed_tokens: vLLM cannot serve such adapters",
        fieldPath=".targetModules",
    ),
]
SERVER_RULES: list[dict[str, str]] = [
    _cel(f"self.maxLoraRank in {RANKS_CEL}", f"maxLoraRank must be one of {RANKS_CEL}",
         fieldPath=".maxLoraRank"),
]
STORAGE_RULES: list[dict[str, str]] = [
    _cel(
        "has(self.existingClaim) != has(self.size)",
        "storage needs exactly one of existingClaim or size",
    ),
]


# -------------------------------------------------------------------------------------------- status


class Phase(StrEnum):
    PENDING = "Pending"
    INITIALIZING = "Initializing"
    STARTING_SERVER = "StartingServer"
    TRAINING = "Training"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})


class Reason(StrEnum):
    """Machine-readable reasons, a fixed set (used in status.reason and conditions)."""

    CREATED = "Created"
    FETCHING_SOURCES = "FetchingSources"
    SOURCES_READY = "SourcesReady"
    SOURCE_UNAVAILABLE = "SourceUnavailable"
    WAITING_FOR_OLD_SERVER = "WaitingForOldServer"
    SERVER_STARTING = "ServerStarting"
    SERVER_READY = "HealthCheckPassed"
    SERVER_NOT_READY = "ServerNotReady"
    TRAINER_RUNNING = "TrainerRunning"
    TRAINER_FAILED = "TrainerFailed"
    RETRYING = "Retrying"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    COMPLETED = "Completed"
    INVALID_SPEC = "InvalidSpec"


class ConditionType(StrEnum):
    SOURCES_READY = "SourcesReady"
    SERVER_READY = "ServerReady"
    TRAINER_RUNNING = "TrainerRunning"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


class Condition(ApiModel):
    """A metav1.Condition."""

    model_config = ConfigDict(extra="ignore")

    type: str = Field(description="Condition type, e.g. ServerReady.", max_length=316)
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason of the last transition.", max_length=1024)
    message: str = Field(default="", description="Human-readable detail.", max_length=32768)
    last_transition_time: dt.datetime = Field(description="When status last changed.")
    observed_generation: int | None = Field(default=None, description="Spec generation the condition reflects.")


class ServerStatus(ApiModel):
    """What the operator last saw of the attempt's server."""

    boot_id: str | None = Field(default=None, description="Boot id of the server that passed the health gate.")
    ready: bool = Field(default=False, description="The server answered its health check for this attempt.")
    url: str | None = Field(default=None, description="In-cluster URL of the server.")
    message: str | None = Field(
        default=None,
        description="Trouble with the attempt's server pod, if any (Unschedulable, ImagePullBackOff, "
        "CrashLoopBackOff, a non-zero exit), as the operator last saw it.",
    )


class SourcesStatus(ApiModel):
    """The sources as the initializer left them: fetched once per run, before the first server."""

    ready: bool = Field(default=False, description="The sources were fetched and checked.")
    progress: str | None = Field(
        default=None, description="The initializer's latest progress line (files and bytes fetched).",
        max_length=1024,
    )
    completed_at: dt.datetime | None = Field(default=None, description="When the initializer succeeded.")


class AdapterStatus(ApiModel):
    """The latest adapter the trainer published."""

    version: int | None = Field(default=None, description="Adapter version N (directory v<N>).")
    path: str | None = Field(default=None, description="Adapter directory on the volume.")
    loaded_at: dt.datetime | None = Field(default=None, description="When the server loaded it.")


class ProgressStatus(ApiModel):
    """Training progress as the trainer reports it."""

    step: int = Field(default=0, description="Optimizer steps completed.")
    max_steps: int = Field(default=0, description="Optimizer steps to train.")
    reward_mean: float | None = Field(default=None, description="Mean total reward of the latest step.")


class GRPORunStatus(ApiModel):
    """Observed state of a run; written by the controller only."""

    model_config = ConfigDict(extra="ignore")

    phase: Phase = Field(default=Phase.PENDING, description="Pending, Initializing, StartingServer, Training, "
                         "Suspended, Succeeded or Failed.")
    reason: str | None = Field(default=None, description="Reason of the latest phase change.")
    message: str | None = Field(default=None, description="Human-readable detail of the phase.")
    observed_generation: int | None = Field(default=None, description="Spec generation last acted on.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Conditions (metav1.Condition), one per type.",
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    attempt: int = Field(default=0, description="Current attempt (1-based); each has a fresh server.")
    failed_attempts: int = Field(
        default=0,
        ge=0,
        description="Attempts that failed so far (counted against runPolicy.backoffLimit); a suspended "
        "attempt does not count.",
    )
    attempt_started_at: dt.datetime | None = Field(
        default=None, description="When the current attempt began waiting for its server."
    )
    sources: SourcesStatus = Field(
        default_factory=SourcesStatus, description="The initializer's fetch and checks of the sources."
    )
    server: ServerStatus = Field(default_factory=ServerStatus, description="The server of the attempt.")
    adapter: AdapterStatus = Field(default_factory=AdapterStatus, description="The latest adapter.")
    progress: ProgressStatus = Field(default_factory=ProgressStatus, description="Training progress.")
    start_time: dt.datetime | None = Field(default=None, description="When the run started.")
    completion_time: dt.datetime | None = Field(default=None, description="When the run succeeded or failed.")


class ObjectMeta(ApiModel):
    """The subset of metadata the tools read."""

    model_config = ConfigDict(extra="ignore", alias_generator=to_camel, populate_by_name=True)

    name: str = Field(default="run", description="Run name.")
    namespace: str | None = Field(default=None, description="Namespace.")
    uid: str | None = Field(default=None, description="UID.")
    generation: int | None = Field(default=None, description="Generation.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations.")


class GRPORun(ApiModel):
    """A GRPO post-training run: a vLLM server and a TRL trainer kept in step by the operator."""

    api_version: Literal["grpo.dev/v1alpha1"] = Field(default="grpo.dev/v1alpha1", description="API version.")
    kind: Literal["GRPORun"] = Field(default="GRPORun", description="Kind.")
    metadata: ObjectMeta = Field(default_factory=ObjectMeta, description="Object metadata.")
    spec: GRPORunSpec = Field(description="Desired run.")
    status: GRPORunStatus | None = Field(default=None, description="Observed state.")
