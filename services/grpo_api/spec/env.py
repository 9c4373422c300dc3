"""Environment variables of a container: literal values and values read from a Secret, a ConfigMap or the pod.

Mirrors validateEnv, validateEnvVarValueFrom and validateObjectFieldSelector
(k8s.io/kubernetes/pkg/apis/core/validation): one source per valueFrom, selectors that name an object
and a key, the downward API's field paths. Variable names are stricter than Kubernetes asks (C
identifiers), and the variables the operator sets may not be replaced.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, field_validator, model_validator

from grpo_api.spec import cel
from grpo_api.spec.api import ApiModel
from grpo_api.spec.names import DNS_SUBDOMAIN, KEY_PATTERN, QUALIFIED_NAME_PART, ObjectName

#: Environment variable names a container accepts (C identifiers; what every shell can export). Stricter
#: than Kubernetes (1.34+ takes any printable ASCII but '=').
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"


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


#: The pod fields an env variable may read (validateObjectFieldSelector with the downward API's v1 paths).
FIELD_PATH_PATTERN = (
    r"^(metadata[.](name|namespace|uid)|spec[.](nodeName|serviceAccountName)|status[.](hostIPs?|podIPs?)|"
    rf"metadata[.](labels|annotations)\['({DNS_SUBDOMAIN}/)?{QUALIFIED_NAME_PART}'\])$"
)


class FieldSelector(ApiModel):
    """A field of the pod (metadata.name, metadata.namespace, spec.nodeName, status.podIP, ...)."""

    field_path: str = Field(
        description="Path of the field: metadata.name, metadata.namespace, metadata.uid, spec.nodeName, "
        "spec.serviceAccountName, status.hostIP(s), status.podIP(s), metadata.labels['KEY'] or "
        "metadata.annotations['KEY'].",
        min_length=1,
        max_length=400,
        pattern=FIELD_PATH_PATTERN,
    )


ENV_SOURCE_RULES: list[cel.Rule] = [
    cel.rule(
        "[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef)].filter(x, x).size() == 1",
        "valueFrom needs exactly one of secretKeyRef, configMapKeyRef or fieldRef",
    ),
]


class EnvVarSource(ApiModel):
    """Where a variable's value comes from: exactly one of a Secret key, a ConfigMap key or a pod field."""

    secret_key_ref: SecretKeySelector | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: ConfigMapKeySelector | None = Field(default=None, description="A key of a ConfigMap.")
    field_ref: FieldSelector | None = Field(default=None, description="A field of the pod.")

    model_config = ConfigDict(json_schema_extra=cel.rules(*ENV_SOURCE_RULES))

    @model_validator(mode="after")
    def _exactly_one(self) -> EnvVarSource:
        given = [x for x in (self.secret_key_ref, self.config_map_key_ref, self.field_ref) if x is not None]
        if len(given) != 1:
            raise ValueError("valueFrom needs exactly one of secretKeyRef, configMapKeyRef or fieldRef")
        return self


#: Variables the operator (and `grpo run`) sets in the run's containers from the run itself (its config, attempt,
#: token, addresses and hub tokens), and the server's token variable, which wins over the token file: a spec's
#: env may not replace them. The other variables of ours it may, on purpose (HF_HOME, GRPO_MASTER_PORT).
OPERATOR_ENV: tuple[str, ...] = (
    "GRPO_RUN_CONFIG", "GRPO_ATTEMPT", "GRPO_TOKEN_FILE", "GRPO_TOKEN", "GRPO_SERVER_URL", "GRPO_MASTER_ADDR",
    "GRPO_TRAINER_ADDRESS", "GRPO_HF_TOKEN_MODEL", "GRPO_HF_TOKEN_DATASET", "GRPO_HF_TOKEN_ADAPTER",
)
#: ...and every variable of this prefix: an s3:// source's credentials, one per source and key
#: (grpo_api.sources.S3_CREDENTIAL_PREFIX).
OPERATOR_ENV_PREFIX = "GRPO_S3_"
OPERATOR_ENV_MESSAGE = (
    f"is set by the operator ({', '.join(OPERATOR_ENV)}, {OPERATOR_ENV_PREFIX}*): env may not replace it"
)
#: Variables that hold a credential the trainer's libraries read (Hugging Face, the experiment trackers, the
#: object stores MLflow keeps artifacts in): a spec may take them only from a Secret or the like (valueFrom),
#: never as a literal value, which anyone who may read the GRPORun (and its run-config) would see.
CREDENTIAL_ENV: tuple[str, ...] = (
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD",
    "DATABRICKS_TOKEN", "AWS_SECRET_ACCESS_KEY", "AZURE_STORAGE_ACCESS_KEY", "AZURE_STORAGE_CONNECTION_STRING",
)
CREDENTIAL_ENV_MESSAGE = (
    f"holds a credential ({', '.join(CREDENTIAL_ENV)}): take it from a Secret (valueFrom.secretKeyRef), "
    "not a literal value"
)
ENV_RULES: list[cel.Rule] = [
    cel.rule("!(has(self.value) && has(self.valueFrom))", "set value or valueFrom, not both"),
    cel.rule("!(self.name in [" + ", ".join(f"'{n}'" for n in OPERATOR_ENV) + "])"
             f" && !self.name.startsWith('{OPERATOR_ENV_PREFIX}')", f"name {OPERATOR_ENV_MESSAGE}", fieldPath=".name"),
    cel.rule("!has(self.value) || !(self.name in [" + ", ".join(f"'{n}'" for n in CREDENTIAL_ENV) + "])",
             f"this variable {CREDENTIAL_ENV_MESSAGE}", fieldPath=".value"),
]


class EnvVar(ApiModel):
    """An extra environment variable for a container: a literal value, or one read from a Secret,
    a ConfigMap or the pod (valueFrom), as in a Pod spec."""

    name: str = Field(
        description=f"Variable name; not one the operator sets ({', '.join(OPERATOR_ENV)}, {OPERATOR_ENV_PREFIX}*).",
        min_length=1, max_length=256, pattern=ENV_NAME_PATTERN,
    )
    value: str | None = Field(default=None, description="Literal value.", max_length=4096)
    value_from: EnvVarSource | None = Field(
        default=None, description="Read the value from a Secret key, a ConfigMap key or a pod field."
    )

    model_config = ConfigDict(json_schema_extra=cel.rules(*ENV_RULES))

    @field_validator("name")
    @classmethod
    def _not_ours(cls, value: str) -> str:
        if value in OPERATOR_ENV or value.startswith(OPERATOR_ENV_PREFIX):
            raise ValueError(f"{value} {OPERATOR_ENV_MESSAGE}")
        return value

    @model_validator(mode="after")
    def _one_value(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name}: set value or valueFrom, not both")
        if self.value is not None and self.name in CREDENTIAL_ENV:
            raise ValueError(f"env {self.name} {CREDENTIAL_ENV_MESSAGE}")
        return self

    @property
    def literal(self) -> str:
        return self.value or ""
