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
import math
import re
from decimal import Decimal, localcontext
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
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

#: Quantity strings as Kubernetes parses them (resource.ParseQuantity: "10Gi", "500m", "1", "1e3"):
#: a decimal number, then a binary suffix (Ki..Ei), a decimal one (n, u, m, k, M..E) or an exponent.
#: ASCII classes only: the models' regex engine would take `\d` for any Unicode digit.
_QUANTITY_NUMBER = r"([0-9]+[.]?[0-9]*|[.][0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?"
QUANTITY_PATTERN = rf"^[+-]?{_QUANTITY_NUMBER}$"
#: A quantity that is not negative (what pod resources, volume sizes and sizeLimits take).
NONNEGATIVE_QUANTITY_PATTERN = rf"^[+]?{_QUANTITY_NUMBER}$"

#: A run's children are named after it: "<run>-trainer-<attempt>" (a Job, whose name the Job controller
#: also puts in a label value of at most 63 characters) and "<run>-server" (a Service: a DNS-1035 label).
MAX_RUN_NAME = 48
#: DNS-1035 label: what a Service name must be (lowercase alphanumerics and '-', starting with a letter).
RUN_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
RUN_NAME_MESSAGE = (
    f"metadata.name must start with a letter, hold only a-z, 0-9 and '-', end with a letter or digit and be "
    f"at most {MAX_RUN_NAME} characters: the server Service and trainer Jobs are named after it"
)


def _cel(rule: str, message: str, **extra: str) -> dict[str, str]:
    return {"rule": rule, "message": message, **extra}


def _rules(*rules: dict[str, str], **schema: Any) -> dict[str, Any]:
    """json_schema_extra of a field: CEL rules (x-kubernetes-validations) plus other schema keys."""
    return {"x-kubernetes-validations": [dict(r) for r in rules], **schema} if rules else dict(schema)


class ApiModel(BaseModel):
    """Base: camelCase on the wire, unknown fields refused, values validated on assignment."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        use_enum_values=True,
        # A `grpo run` file may say .nan or .inf (YAML); no spec number means either (JSON has neither).
        allow_inf_nan=False,
    )

    def to_wire(self) -> dict[str, Any]:
        """camelCase dict with unset optional fields left out, as the API server stores it."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


#: Environment variable names a container accepts (C identifiers; what every shell can export). Stricter
#: than Kubernetes (1.34+ takes any printable ASCII but '=').
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
#: Names of Kubernetes objects (DNS-1123 subdomains) and of volumes and ports (DNS-1123 labels).
#: No backslashes in these patterns: the CEL rules embed them in string literals.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = rf"{_DNS_LABEL}([.]{_DNS_LABEL})*"
DNS_SUBDOMAIN_PATTERN = rf"^{_DNS_SUBDOMAIN}$"
DNS_LABEL_PATTERN = rf"^{_DNS_LABEL}$"
#: An optional object name: empty (unset) or a DNS-1123 subdomain.
OPTIONAL_NAME_PATTERN = rf"^({_DNS_SUBDOMAIN})?$"
#: ConfigMap and Secret keys (IsConfigMapKey: [-._a-zA-Z0-9]+, but not '.', '..' nor starting with '..').
KEY_PATTERN = r"^[.]?[-_a-zA-Z0-9][-._a-zA-Z0-9]*$"
#: Label and annotation keys, resource names (qualified names): [PREFIX/]NAME with PREFIX a DNS-1123
#: subdomain of at most 253 characters (checked apart: a pattern cannot count it) and NAME at most 63
#: characters of [-A-Za-z0-9_.] that start and end alphanumeric. A label value is such a NAME or empty.
_QUALIFIED_NAME_PART = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
QUALIFIED_NAME_PATTERN = rf"^({_DNS_SUBDOMAIN}/)?{_QUALIFIED_NAME_PART}$"
LABEL_VALUE_PATTERN = rf"^({_QUALIFIED_NAME_PART})?$"
MAX_QUALIFIED_NAME_PREFIX = 253
QUALIFIED_NAME_TEXT = (
    "NAME or PREFIX/NAME: NAME at most 63 characters of a-z, A-Z, 0-9, '-', '_' and '.' that start and end "
    "with a letter or digit, PREFIX a lowercase DNS subdomain of at most 253 characters"
)


def is_qualified_name(key: str) -> bool:
    """A label key, annotation key or resource name as Kubernetes validates it (IsQualifiedName)."""
    return re.fullmatch(QUALIFIED_NAME_PATTERN, key) is not None and key.find("/") <= MAX_QUALIFIED_NAME_PREFIX


def qualified_name_cel(var: str) -> str:
    """CEL: the string `var` is a qualified name (is_qualified_name)."""
    return f"{var}.matches('{QUALIFIED_NAME_PATTERN}') && {var}.indexOf('/') <= {MAX_QUALIFIED_NAME_PREFIX}"


def ObjectName(description: str) -> Any:
    return Field(description=description, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)


def OptionalName(description: str) -> Any:
    """An optional reference to an object by name (a claim, a class, a ServiceAccount): unset, "" or a name."""
    return Field(default=None, description=description, max_length=253, pattern=OPTIONAL_NAME_PATTERN)


# ----------------------------------------------------------------------------------------- quantities

_QUANTITY_PARTS = re.compile(
    r"(?P<number>[+-]?([0-9]+[.]?[0-9]*|[.][0-9]+))(?P<suffix>[KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?"
)
_DECIMAL_SUFFIXES = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SUFFIXES = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_INT64 = 2**63


def parse_quantity(value: str | int) -> Decimal | None:
    """A Kubernetes quantity as an exact number (resource.ParseQuantity), None if it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Decimal(value)
    match = _QUANTITY_PARTS.fullmatch(value)
    if match is None:
        return None
    suffix = match["suffix"] or ""
    with localcontext() as ctx:
        ctx.prec, ctx.Emax, ctx.Emin = 200, 10**6, -(10**6)
        number = Decimal(match["number"])
        if suffix in _BINARY_SUFFIXES:
            return number * (Decimal(2) ** _BINARY_SUFFIXES[suffix])
        exponent = _DECIMAL_SUFFIXES[suffix] if suffix in _DECIMAL_SUFFIXES else int(suffix[1:])
        if abs(exponent) > 1000:  # Kubernetes keeps the exponent in 32 bits; nothing real comes near this
            return None
        return number.scaleb(exponent)


def is_integer_quantity(value: Decimal) -> bool:
    """CEL's quantity.isInteger(): whole, and an int64."""
    return value == value.to_integral_value() and -_INT64 <= value < _INT64


def _nonnegative_quantity(value: str | int) -> str | int:
    number = parse_quantity(value)
    if number is None or number < 0 or (isinstance(value, str) and value.startswith("-")):
        raise ValueError(f"{value!r} is not a quantity such as 2, 500m or 16Gi (and not negative)")
    return value


Quantity = Annotated[
    str | int,
    AfterValidator(_nonnegative_quantity),
    Field(
        description="A Kubernetes quantity such as 2, 500m or 16Gi.",
        json_schema_extra={"pattern": NONNEGATIVE_QUANTITY_PATTERN, "maxLength": 64, "minimum": 0},
    ),
]

#: Resource names a container may request without a domain (validateContainerResourceName).
CONTAINER_RESOURCES: tuple[str, ...] = ("cpu", "memory", "ephemeral-storage")
HUGEPAGES_PREFIX = "hugepages-"
RESOURCE_NAME_MESSAGE = (
    "resource names must be cpu, memory, ephemeral-storage, hugepages-<size> or an extended resource "
    "DOMAIN/NAME such as nvidia.com/gpu"
)
RESOURCE_VALUE_MESSAGE = (
    "an extended resource (such as nvidia.com/gpu) takes a whole number, hugepages-<size> a multiple of <size>"
)
RESOURCE_LIMIT_MESSAGE = (
    "every request must be at most its limit, and a request of an extended resource (such as nvidia.com/gpu) "
    "or of hugepages needs a limit equal to it"
)
HUGEPAGES_MESSAGE = "hugepages need a cpu or memory request or limit"


def _is_native_resource(name: str) -> bool:
    return "/" not in name or "kubernetes.io/" in name


def _overcommit_allowed(name: str) -> bool:
    return _is_native_resource(name) and not name.startswith(HUGEPAGES_PREFIX)


def _hugepage_size(name: str) -> int | None:
    size = parse_quantity(name[len(HUGEPAGES_PREFIX):])
    return int(size) if size is not None and size > 0 and is_integer_quantity(size) else None


def is_container_resource_name(name: str) -> bool:
    """What a container's requests and limits may name (validateContainerResourceName)."""
    if name in CONTAINER_RESOURCES:
        return True
    if not is_qualified_name(name):
        return False
    if name.startswith(HUGEPAGES_PREFIX):
        return _hugepage_size(name) is not None
    if "/" not in name:
        return False
    # An extended resource: "requests.<name>" must still be a qualified name (ResourceQuota's form).
    return "kubernetes.io/" in name or (not name.startswith("requests.") and name.find("/") <= 244)


def _resource_value_ok(name: str, value: str | int) -> bool:
    number = parse_quantity(value)
    if number is None or _overcommit_allowed(name):
        return True  # the value's own check names a bad quantity
    if name.startswith(HUGEPAGES_PREFIX):
        size = _hugepage_size(name)
        return size is None or (is_integer_quantity(number) and int(number) % size == 0)
    return is_integer_quantity(number)


def _resources_cel(maps: str) -> str:
    """CEL on a Resources object: every key of self.<maps> is a container resource name."""
    k = "k"
    size = f"{k}.substring({len(HUGEPAGES_PREFIX)})"
    hugepages = (f"({k}.startsWith('{HUGEPAGES_PREFIX}') && isQuantity({size}) && quantity({size}).isInteger() "
                 f"&& quantity({size}).isGreaterThan(quantity('0')))")
    extended = (f"({k}.contains('/') && ({k}.contains('kubernetes.io/') || (!{k}.startsWith('requests.') && "
                f"{k}.indexOf('/') <= 244)))")
    names = ", ".join(f"'{r}'" for r in CONTAINER_RESOURCES)
    return (f"!has(self.{maps}) || self.{maps}.all({k}, {k} in [{names}] || ({qualified_name_cel(k)} && "
            f"({hugepages} || ({extended} && !{k}.startsWith('{HUGEPAGES_PREFIX}')))))")


_NATIVE_CEL = "(!k.contains('/') || k.contains('kubernetes.io/'))"
_OVERCOMMIT_CEL = f"({_NATIVE_CEL} && !k.startsWith('{HUGEPAGES_PREFIX}'))"


def _resource_values_cel(maps: str) -> str:
    size = f"quantity(k.substring({len(HUGEPAGES_PREFIX)}))"
    value = f"quantity(string(self.{maps}[k]))"
    hugepages = (f"(!isQuantity(k.substring({len(HUGEPAGES_PREFIX)})) || !{size}.isInteger() || "
                 f"{size}.asInteger() <= 0 || ({value}.isInteger() && "
                 f"{value}.asInteger() % {size}.asInteger() == 0))")
    return (f"!has(self.{maps}) || self.{maps}.all(k, {_OVERCOMMIT_CEL} || "
            f"(k.startsWith('{HUGEPAGES_PREFIX}') ? {hugepages} : {value}.isInteger()))")


RESOURCES_RULES: list[dict[str, str]] = [
    _cel(_resources_cel("requests"), RESOURCE_NAME_MESSAGE, fieldPath=".requests"),
    _cel(_resources_cel("limits"), RESOURCE_NAME_MESSAGE, fieldPath=".limits"),
    _cel(_resource_values_cel("requests"), RESOURCE_VALUE_MESSAGE, fieldPath=".requests"),
    _cel(_resource_values_cel("limits"), RESOURCE_VALUE_MESSAGE, fieldPath=".limits"),
    _cel(
        "!has(self.requests) || self.requests.all(k, (has(self.limits) && k in self.limits) ? "
        f"({_OVERCOMMIT_CEL} ? !quantity(string(self.requests[k])).isGreaterThan("
        "quantity(string(self.limits[k]))) : quantity(string(self.requests[k])).compareTo("
        f"quantity(string(self.limits[k]))) == 0) : {_OVERCOMMIT_CEL})",
        RESOURCE_LIMIT_MESSAGE,
    ),
    _cel(
        f"!((has(self.requests) && self.requests.exists(k, k.startsWith('{HUGEPAGES_PREFIX}'))) || "
        f"(has(self.limits) && self.limits.exists(k, k.startsWith('{HUGEPAGES_PREFIX}')))) || "
        "(has(self.requests) && ('cpu' in self.requests || 'memory' in self.requests)) || "
        "(has(self.limits) && ('cpu' in self.limits || 'memory' in self.limits))",
        HUGEPAGES_MESSAGE,
    ),
]


def _resources_rules(schema: dict[str, Any]) -> None:
    schema["x-kubernetes-validations"] = [dict(rule) for rule in RESOURCES_RULES]


class Resources(ApiModel):
    """Compute resources of a container, as in a Pod spec."""

    model_config = ConfigDict(json_schema_extra=_resources_rules)  # CEL beside the type it checks

    requests: dict[str, Quantity] = Field(
        default_factory=dict, description="Minimum resources, e.g. {cpu: 4, memory: 32Gi}.",
        json_schema_extra={"maxProperties": 16},
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, description="Maximum resources, e.g. {nvidia.com/gpu: 1, memory: 64Gi}.",
        json_schema_extra={"maxProperties": 16},
    )

    @field_validator("requests", "limits")
    @classmethod
    def _names_and_values(cls, value: dict[str, str | int]) -> dict[str, str | int]:
        if len(value) > 16:
            raise ValueError("at most 16 resources")
        for name, quantity in value.items():
            if not is_container_resource_name(name):
                raise ValueError(f"{name!r}: {RESOURCE_NAME_MESSAGE}")
            if not _resource_value_ok(name, quantity):
                raise ValueError(f"{name}: {quantity!r}: {RESOURCE_VALUE_MESSAGE}")
        return value

    @model_validator(mode="after")
    def _requests_fit_limits(self) -> Resources:
        for name, request in self.requests.items():
            if name not in self.limits:
                if not _overcommit_allowed(name):
                    raise ValueError(f"{name} has no limit: {RESOURCE_LIMIT_MESSAGE}")
                continue
            asked, limit = parse_quantity(request), parse_quantity(self.limits[name])
            if asked is None or limit is None:
                continue
            if (asked > limit) if _overcommit_allowed(name) else (asked != limit):
                raise ValueError(f"{name} request {request} against limit {self.limits[name]}: "
                                 f"{RESOURCE_LIMIT_MESSAGE}")
        names = {*self.requests, *self.limits}
        if any(n.startswith(HUGEPAGES_PREFIX) for n in names) and not {"cpu", "memory"} & names:
            raise ValueError(HUGEPAGES_MESSAGE)
        return self


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
    rf"metadata[.](labels|annotations)\['({_DNS_SUBDOMAIN}/)?{_QUALIFIED_NAME_PART}'\])$"
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


#: Variables the operator (and `grpo run`) sets in the run's containers from the run itself (its config, attempt,
#: token, addresses and hub tokens), and the server's token variable, which wins over the token file: a spec's
#: env may not replace them. The other variables of ours it may, on purpose (HF_HOME, GRPO_MASTER_PORT).
OPERATOR_ENV: tuple[str, ...] = (
    "GRPO_RUN_CONFIG", "GRPO_ATTEMPT", "GRPO_TOKEN_FILE", "GRPO_TOKEN", "GRPO_SERVER_URL", "GRPO_MASTER_ADDR",
    "GRPO_TRAINER_ADDRESS", "GRPO_HF_TOKEN_MODEL", "GRPO_HF_TOKEN_DATASET",
)
OPERATOR_ENV_MESSAGE = f"is set by the operator ({', '.join(OPERATOR_ENV)}): env may not replace it"


class EnvVar(ApiModel):
    """An extra environment variable for a container: a literal value, or one read from a Secret,
    a ConfigMap or the pod (valueFrom), as in a Pod spec."""

    name: str = Field(
        description=f"Variable name; not one the operator sets ({', '.join(OPERATOR_ENV)}).",
        min_length=1, max_length=256, pattern=ENV_NAME_PATTERN,
    )
    value: str | None = Field(default=None, description="Literal value.", max_length=4096)
    value_from: EnvVarSource | None = Field(
        default=None, description="Read the value from a Secret key, a ConfigMap key or a pod field."
    )

    @field_validator("name")
    @classmethod
    def _not_ours(cls, value: str) -> str:
        if value in OPERATOR_ENV:
            raise ValueError(f"{value} {OPERATOR_ENV_MESSAGE}")
        return value

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
    _cel("!(self.name in [" + ", ".join(f"'{n}'" for n in OPERATOR_ENV) + "])", f"name {OPERATOR_ENV_MESSAGE}",
         fieldPath=".name"),
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
PVC_URI = rf"pvc://{_DNS_SUBDOMAIN}(/[-A-Za-z0-9_.@+=,/]*)?"
#: A hub revision: a branch, a tag (refs/pr/1, refs/convert/parquet) or a commit. Relative, of elements that
#: do not start with '.', no '//' nor a trailing '/' (as git ref names): it is a directory on the volume.
_REVISION_PART = r"[-A-Za-z0-9_][-A-Za-z0-9_.]{0,127}"
REVISION = rf"{_REVISION_PART}(/{_REVISION_PART}){{0,7}}"
REVISION_PATTERN = rf"^{REVISION}$"
HF_URI = rf"hf://([A-Za-z0-9][-A-Za-z0-9_.]{{0,95}}/)?[A-Za-z0-9][-A-Za-z0-9_.]{{0,95}}(@{REVISION})?"
OCI_URI = r"oci://[a-z0-9][-a-z0-9.]*(:[0-9]+)?(/[-a-z0-9_.]+)+(:[A-Za-z0-9_][-A-Za-z0-9_.]{0,127})?(@sha256:[a-f0-9]{64})?"
CONFIGMAP_URI = rf"configmap://{_DNS_SUBDOMAIN}"
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
    revision: str | None = Field(
        default=None, description="Revision (branch, tag or commit) of a hub model, e.g. main or refs/pr/1.",
        max_length=256, pattern=REVISION_PATTERN,
    )
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
        f"size(bytes(self.inline[k])) <= {MAX_INLINE_MODULE_BYTES})",
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


class Tuning(StrEnum):
    """What training changes: a LoRA adapter, or every weight of the policy."""

    LORA = "lora"
    FULL = "full"


class SyncPath(StrEnum):
    """How a LoRA run's policy reaches the server."""

    ADAPTER = "adapter"
    MERGED = "merged"


class WeightTransfer(StrEnum):
    """How a full fine-tuning run's weights reach the vllm engine (vLLM's weight-transfer backends)."""

    AUTO = "auto"
    IPC = "ipc"
    NCCL = "nccl"


class LogprobsSource(StrEnum):
    AUTO = "auto"
    SAMPLER = "sampler"


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
        json_schema_extra=_rules(_cel(f"self.matches('{MOUNT_PATH_PATTERN}')", MOUNT_PATH_MESSAGE)),
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
        json_schema_extra=_rules(
            _cel(f"self.matches('{MOUNT_PATH_PATTERN}')", MOUNT_PATH_MESSAGE),
            _cel(_NOT_RESERVED_CEL.format(v="self"), RESERVED_MOUNT_MESSAGE),
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
        json_schema_extra=_rules(_cel(NO_DOTDOT_CEL, SUB_PATH_MESSAGE)),
    )
    read_only: bool = Field(default=False, description="Mount read-only.")

    @field_validator("sub_path")
    @classmethod
    def _descending(cls, value: str | None) -> str | None:
        if value is not None and _has_dotdot(value):
            raise ValueError(f"{value!r} {SUB_PATH_MESSAGE}")
        return value


#: Label values, node selector values and toleration values.
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]
LABEL_KEYS_MESSAGE = f"keys must be label keys: {QUALIFIED_NAME_TEXT}"
ANNOTATION_KEYS_MESSAGE = f"keys must be annotation keys: {QUALIFIED_NAME_TEXT}"
#: The Kubernetes limit on a pod's annotations (keys and values, in bytes), less room for the operator's own.
MAX_POD_ANNOTATIONS_BYTES = 256 * 1024 - 1024
#: Characters in one annotation value (bounds the cost of the size rule the API server estimates).
MAX_ANNOTATION_VALUE = 65536
ANNOTATIONS_SIZE_MESSAGE = f"keys and values together may hold at most {MAX_POD_ANNOTATIONS_BYTES} bytes"
LABEL_KEYS_RULE = _cel(f"self.all(k, {qualified_name_cel('k')})", LABEL_KEYS_MESSAGE)
ANNOTATION_RULES = [
    _cel(f"self.all(k, {qualified_name_cel('k')})", ANNOTATION_KEYS_MESSAGE),
    _cel(f"self.map(k, size(bytes(k)) + size(bytes(self[k]))).sum() <= {MAX_POD_ANNOTATIONS_BYTES}",
         ANNOTATIONS_SIZE_MESSAGE),
]


def _label_keys(value: dict[str, str], message: str = LABEL_KEYS_MESSAGE) -> dict[str, str]:
    bad = [k for k in value if not is_qualified_name(k)]
    if bad:
        raise ValueError(f"{bad[0]!r}: {message}")
    return value


def _annotations(value: dict[str, str]) -> dict[str, str]:
    _label_keys(value, ANNOTATION_KEYS_MESSAGE)
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
        json_schema_extra=_rules(LABEL_KEYS_RULE, maxProperties=64),
    )
    pod_annotations: dict[str, Annotated[str, Field(max_length=MAX_ANNOTATION_VALUE)]] = Field(
        default_factory=dict, description="Extra annotations of the pods (none that chooses an AppArmor or "
        "seccomp profile).",
        json_schema_extra=_rules(*ANNOTATION_RULES, maxProperties=64),
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
        return _label_keys(value)

    @field_validator("pod_annotations")
    @classmethod
    def _annotation_keys(cls, value: dict[str, str]) -> dict[str, str]:
        return _annotations(value)

    @model_validator(mode="after")
    def _pod_settings(self) -> PodSettings:
        _check_pod_settings(self.section, self.pod_labels, self.pod_annotations, self.volumes, self.volume_mounts)
        return self


def pod_rules(section: str) -> list[dict[str, str]]:
    reserved = ", ".join(f"'{v}'" for v in RESERVED_VOLUMES)
    prefixes = " || ".join(f"k.startsWith('{p}')" for p in RESERVED_LABEL_PREFIXES)
    names = ", ".join(f"'{n}'" for n in RESERVED_LABELS)
    return [
        _cel(
            f"!has(self.podLabels) || !self.podLabels.exists(k, {prefixes} || k in [{names}])",
            f"{section}.podLabels may not set grpo.dev/* or app.kubernetes.io/* labels (the operator's), nor "
            f"batch.kubernetes.io/*, {', '.join(RESERVED_LABELS)} (the Job controller's)",
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
            "!has(self.volumes) || self.volumes.all(v, "
            + " && ".join(f"!has(v.{source})" for source in OTHER_VOLUME_SOURCES) + ")",
            f"{section}.volumes: every volume {VOLUME_SOURCE_MESSAGE}",
            fieldPath=".volumes",
        ),
        _cel(
            "!has(self.podAnnotations) || !self.podAnnotations.exists(k, "
            + " || ".join(f"k.startsWith('{p}')" for p in RESERVED_ANNOTATION_PREFIXES) + ")",
            f"{section}.podAnnotations {RESERVED_ANNOTATION_MESSAGE}",
            fieldPath=".podAnnotations",
        ),
        _cel(
            "!has(self.volumes) || self.volumes.all(v, self.volumes.exists_one(w, w.name == v.name))",
            f"{section}.volumes names must be unique",
            fieldPath=".volumes",
        ),
        _cel(
            "!has(self.volumeMounts) || self.volumeMounts.all(m, self.volumeMounts.exists_one(n, "
            "n.mountPath == m.mountPath))",
            f"{section}.volumeMounts: {MOUNT_PATHS_UNIQUE}",
            fieldPath=".volumeMounts",
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


#: Container images, as distribution/reference parses them: [HOST[:PORT]/]PATH[:TAG][@DIGEST], PATH of
#: lowercase components (IPv6 hosts left out). No backslashes: the CEL rule embeds it.
_IMAGE_COMPONENT = r"[a-z0-9]+(([._]|__|[-]+)[a-z0-9]+)*"
_IMAGE_HOST_PART = r"([a-zA-Z0-9]|[a-zA-Z0-9][-a-zA-Z0-9]*[a-zA-Z0-9])"
IMAGE_PATTERN = (
    rf"^({_IMAGE_HOST_PART}([.]{_IMAGE_HOST_PART})*(:[0-9]+)?/)?{_IMAGE_COMPONENT}(/{_IMAGE_COMPONENT})*"
    r"(:[A-Za-z0-9_][-A-Za-z0-9_.]{0,127})?(@[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)
IMAGE_MESSAGE = "must be an image reference such as registry.example.com:5000/team/image:tag or image@sha256:<hex>"
IMAGE_RULE = _cel(f"self.matches('{IMAGE_PATTERN}')", IMAGE_MESSAGE)


def _image(value: str | None) -> str | None:
    if value is not None and not re.fullmatch(IMAGE_PATTERN, value):
        raise ValueError(f"{value!r} {IMAGE_MESSAGE}")
    return value


#: The server's health path: an absolute URL path (no query, fragment or space).
HEALTH_PATH_PATTERN = r"^/[-A-Za-z0-9._~!$&()*+,;=:@%/]*$"


def _gpu_resources() -> Resources:
    return Resources(requests={"cpu": "4", "memory": "32Gi"}, limits={"nvidia.com/gpu": 1, "memory": "64Gi"})


#: Most server replicas of one run.
MAX_SERVER_REPLICAS = 16


class ServerSpec(PodSettings):
    """The generation server: vLLM serving the base model plus the policy's current LoRA adapter."""

    section: ClassVar[str] = "server"

    image: str | None = Field(
        default=None,
        description="Server container image; default: the operator's (the chart's runImages.server).",
        max_length=512,
        json_schema_extra=_rules(IMAGE_RULE),
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
    replicas: int = Field(
        default=1, ge=1, le=MAX_SERVER_REPLICAS,
        description="Server pods of an attempt, fed and synced as one. The trainer starts once every replica "
        "passed the fresh-boot health gate; each adapter version is loaded on every replica before a batch "
        "is generated on it (a replica that missed one gets no work until it caught up); each batch is "
        "spread over the replicas, all completions of a prompt on one replica; the work of a lost replica "
        "is sent to another. The trainer finds them through a headless Service (`<run>-replicas`).",
    )
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
    weight_transfer: WeightTransfer = Field(
        default=WeightTransfer.AUTO,
        description="With trainer.tuning full: how the trainer's weights reach the vllm engine. ipc: CUDA IPC "
        "handles, trainer and server on the same GPU (no copy over a network). nccl: a NCCL broadcast from "
        "the trainer (rank 0, hosting the rendezvous) to the server's workers, across GPUs and pods. auto: "
        "ipc under `grpo run`, nccl on a cluster. The transformers engine receives over gloo whatever this "
        "says. Unused with tuning lora.",
    )
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
    health_path: str = Field(
        default="/health/", description="Health endpoint path used by probes and gates; the server answers its "
        "health check there and at /health/, and refuses to start (exit code 2) when it is another endpoint's "
        "path.", max_length=256,
        pattern=HEALTH_PATH_PATTERN,
    )
    authenticate_generation: bool = Field(
        default=False, description="Require the run's bearer token on generation endpoints too."
    )
    shm_size: str = Field(
        default="8Gi", description="Size of the /dev/shm memory volume.", max_length=64,
        pattern=NONNEGATIVE_QUANTITY_PATTERN,
    )
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment variables.", max_length=64)

    _check_image = field_validator("image")(_image)

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


class Strategy(StrEnum):
    """How several trainer processes share the policy (PyTorch Lightning's names)."""

    DDP = "ddp"
    FSDP = "fsdp"


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
    max_drift: float = Field(
        default=0.3,
        gt=0.0,
        le=100.0,
        description="Most mean |log-ratio| a token, between the policy that trains on a stale batch and the one "
        "that sampled it (TRL's sampling/sampling_logp_difference/mean), for the batch to be trained on; a "
        "stale batch beyond it is generated again from the current policy "
        "(grpo_trainer_discarded_batches{reason=\"policy_drift\"}) and prefetching backs off, so at a rate that "
        "moves the policy that far in a step, asyncPrefetch trains as the synchronous loop does instead of "
        "collapsing. Needs enabled; 100 trains on every stale batch.",
    )


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


#: Most trainer pods, and processes per pod, of one run.
MAX_TRAINER_NODES = 64
MAX_TRAINER_PROCS_PER_NODE = 16
#: The torch.distributed rendezvous port of a trainer of several pods (on the pod of completion index 0).
TRAINER_RENDEZVOUS_PORT = 29500
METRICS_PORT_MESSAGE = (
    f"trainer.metricsPort may not be {TRAINER_RENDEZVOUS_PORT} with numNodes > 1: the trainer pods meet there"
)

FULL_TUNING_QLORA_MESSAGE = (
    "trainer.lora.quantizeBase (QLoRA) trains an adapter over a 4-bit base: it cannot be combined with "
    "trainer.tuning full"
)
FULL_TUNING_FSDP_MESSAGE = (
    "trainer.tuning full with strategy fsdp is not supported yet (the pushed weights would be gathered from "
    "the shards); use strategy ddp"
)

MERGED_SYNC_MESSAGE = (
    "trainer.sync merged merges a LoRA adapter into full-precision base weights: it needs trainer.tuning lora "
    "without lora.quantizeBase"
)
MERGED_SYNC_FSDP_MESSAGE = (
    "trainer.sync merged with strategy fsdp is not supported yet (the merged weights would be gathered from the "
    "shards); use strategy ddp or sync adapter"
)

MAX_STALENESS_MESSAGE = (
    "trainer.maxStaleness must be at least trainer.prefetchDepth with asyncPrefetch: a prefetched batch is "
    "that many versions behind by construction"
)


class TrainerSpec(PodSettings):
    """The GRPO trainer (TRL GRPOTrainer + PEFT LoRA) and its settings."""

    section: ClassVar[str] = "trainer"

    image: str | None = Field(
        default=None,
        description="Trainer (and initializer) container image; default: the operator's (the chart's "
        "runImages.trainer).",
        max_length=512,
        json_schema_extra=_rules(IMAGE_RULE),
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy."
    )
    resources: Resources = Field(default_factory=_gpu_resources, description="Trainer container resources.")
    tuning: Tuning = Field(
        default=Tuning.LORA,
        description="lora: train a LoRA adapter (trainer.lora); the server loads each published version "
        "from the shared volume. full: train every weight; each sync pushes the whole policy into the "
        "server with vLLM's weight transfer (server.weightTransfer) and the server reports the weights "
        "version behind each completion (X-GRPO-Weights-Version); checkpoints hold the full model.",
    )
    lora: LoraSpec = Field(default_factory=LoraSpec, description="LoRA adapter settings (tuning lora).")
    sync: SyncPath = Field(
        default=SyncPath.ADAPTER,
        description="With tuning lora in server mode, what each sync sends. adapter: the adapter, published to "
        "the shared volume and loaded by the server (vLLM's LoRA kernels at generation). merged: every weight, "
        "the target modules' with the adapter merged in (W + scale·BA), pushed like full fine-tuning's "
        "(server.weightTransfer), so the server generates on plain weights; checkpoints keep the adapter and "
        "the last one is published to the volume at the end. On one H200 (ipc, 20 steps, 32 × 256 tokens) "
        "merged measured 1.68 s a step against 2.03 s with adapter and 2.02 s for TRL colocate (BENCHMARKS.md); "
        "across GPUs it needs nccl, which needs vLLM in the trainer image.",
    )
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
        "them together; each adds one step to the staleness bound (a batch may be generated that many "
        "versions behind the step that trains on it; importanceSampling corrects for it and its maxDrift bounds "
        "it). It pays when server and trainer have GPUs of their own: on one shared GPU the two processes take "
        "turns, so overlap gains little (BENCHMARKS.md has the measurements).",
    )
    num_nodes: int = Field(
        default=1, ge=1, le=MAX_TRAINER_NODES,
        description="Trainer pods. Several are an indexed Job with a headless Service (`<run>-trainer`) for "
        "the rendezvous of torch.distributed, as Kubeflow Trainer lays it out; a lost pod fails the attempt "
        "and the next one resumes from the last checkpoint. `grpo run` starts numNodes × numProcPerNode "
        "processes on the one machine.",
    )
    num_proc_per_node: int = Field(
        default=1, ge=1, le=MAX_TRAINER_PROCS_PER_NODE,
        description="Trainer processes per pod, launched with torchrun (one per GPU on a GPU node: set "
        "resources.limits nvidia.com/gpu to at least this, or the attempt fails as InvalidSpec before any "
        "process starts; gloo on CPU; see strategy). Rank 0 alone talks to the server: it gathers every "
        "process's prompts, generates them, gives each its share, and publishes the adapter.",
    )
    strategy: Strategy = Field(
        default=Strategy.DDP,
        description="How the numNodes × numProcPerNode processes hold the policy. ddp: every process holds all "
        "of it and gradients are averaged (fastest while the model, its gradients and optimizer state fit one "
        "device). fsdp: PyTorch FSDP2 through Accelerate, as TRL users select it: parameters, gradients and "
        "optimizer state sharded over every process by decoder layer (the layout of DeepSpeed ZeRO-3), for a "
        "policy that does not fit one device; gradientCheckpointing becomes FSDP activation checkpointing, and "
        "each published adapter is gathered from the shards first.",
    )
    max_staleness: int | None = Field(
        default=None, ge=0, le=64,
        description="Most policy versions a batch's policy may lag behind the step that trains on it (a version "
        "is published every syncInterval steps); an older batch is generated again "
        "(grpo_trainer_discarded_batches{reason=\"stale_adapter\"}), and the age of every batch is in "
        "grpo_trainer_staleness_versions. The importance-sampling correction always uses the per-token "
        "logprobs of the version that generated the batch. Unset: the staleness the pipeline produces by "
        "construction, syncInterval - 1 + prefetchDepth steps (prefetchDepth counts with asyncPrefetch only). "
        "With asyncPrefetch it must be at least prefetchDepth.",
    )
    checkpoint_interval: int = Field(default=10, ge=1, description="Write a resumable checkpoint every N steps.")
    seed: int = Field(
        default=42, ge=0, le=2**32 - 1,
        description="Random seed (data order, sampling, initialisation); at most 2^32 - 1, as numpy takes it.",
    )
    gradient_checkpointing: bool = Field(default=False, description="Trade compute for activation memory.")
    generation_timeout_seconds: float = Field(
        default=600.0, gt=0.0, description="Timeout of one generation request to the server."
    )
    reward_timeout_seconds: float = Field(
        default=600.0, gt=0.0, le=86400.0,
        description="Longest one call of a reward function may take: past it the attempt ends (exit code 1, the "
        "function named) and the next one tries again, so a hung function (a judge that never answers) costs "
        "this long, not the run.",
    )
    metrics_port: int = Field(
        default=9400, ge=1, le=65535,
        description=f"Port of the trainer's /metrics; with numNodes > 1 not {TRAINER_RENDEZVOUS_PORT} (the "
        "rendezvous of the trainer pods).",
    )
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment variables.", max_length=64)

    _check_image = field_validator("image")(_image)

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
        if self.async_prefetch and self.max_staleness is not None and self.max_staleness < self.prefetch_depth:
            raise ValueError(f"{MAX_STALENESS_MESSAGE} (maxStaleness {self.max_staleness}, prefetchDepth "
                             f"{self.prefetch_depth})")
        if self.tuning == Tuning.FULL and self.lora.quantize_base:
            raise ValueError(FULL_TUNING_QLORA_MESSAGE)
        if self.sync == SyncPath.MERGED and (self.tuning == Tuning.FULL or self.lora.quantize_base):
            raise ValueError(MERGED_SYNC_MESSAGE)
        if self.sync == SyncPath.MERGED and self.strategy == Strategy.FSDP:
            raise ValueError(MERGED_SYNC_FSDP_MESSAGE)
        if self.tuning == Tuning.FULL and self.strategy == Strategy.FSDP:
            raise ValueError(FULL_TUNING_FSDP_MESSAGE)
        if self.num_nodes > 1 and self.metrics_port == TRAINER_RENDEZVOUS_PORT:
            raise ValueError(METRICS_PORT_MESSAGE)
        return self

    @property
    def full(self) -> bool:
        """Every weight trains and moves to the server by weight transfer."""
        return self.tuning == Tuning.FULL

    @property
    def pushes_weights(self) -> bool:
        """Each sync pushes weights into the server (full tuning, or LoRA merged into the target modules)."""
        return self.full or self.sync == SyncPath.MERGED


STORAGE_SIZE_MESSAGE = "storage.size must be a quantity greater than zero, e.g. 20Gi"
ACCESS_MODES_MESSAGE = "ReadWriteOncePod cannot be combined with other access modes"
MODEL_CACHE_MOUNT_MESSAGE = "storage.modelCache.mountPath must differ from storage.mountPath"


class VolumeClaimSpec(ApiModel):
    """An existing PersistentVolumeClaim to mount."""

    existing_claim: str = ObjectName("Name of the claim.")
    mount_path: VolumeMountPath = Field(default="/models", description="Where it is mounted in the containers.")


AccessMode = Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod", "ReadOnlyMany"]


def _rwo() -> list[AccessMode]:
    return ["ReadWriteOnce"]


class StorageSpec(ApiModel):
    """The shared volume for adapters, checkpoints and progress; one of existingClaim or size."""

    existing_claim: str | None = Field(
        default=None, description="Use this PersistentVolumeClaim (it must allow the server and trainer pods).",
        min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN,
    )
    size: str | None = Field(
        default=None, description="Create a claim of this size for the run.", max_length=64,
        pattern=NONNEGATIVE_QUANTITY_PATTERN,
        json_schema_extra=_rules(_cel("quantity(self).isGreaterThan(quantity('0'))", STORAGE_SIZE_MESSAGE)),
    )
    storage_class_name: str | None = OptionalName("Storage class of a created claim (\"\": none, no provisioning).")
    access_modes: list[AccessMode] = Field(
        default_factory=_rwo, description="Access modes of a created claim.", min_length=1, max_length=4,
        json_schema_extra=_rules(
            _cel("!self.exists(m, m == 'ReadWriteOncePod') || self.all(m, m == 'ReadWriteOncePod')",
                 ACCESS_MODES_MESSAGE)
        ),
    )
    mount_path: VolumeMountPath = Field(default="/data", description="Where the volume is mounted in the containers.")
    model_cache: VolumeClaimSpec | None = Field(
        default=None, description="Optional claim holding model weights (mounted read-only, HF_HOME)."
    )

    @field_validator("access_modes")
    @classmethod
    def _alone(cls, value: list[str]) -> list[str]:
        if "ReadWriteOncePod" in value and set(value) != {"ReadWriteOncePod"}:
            raise ValueError(ACCESS_MODES_MESSAGE)
        return value

    @field_validator("size")
    @classmethod
    def _positive(cls, value: str | None) -> str | None:
        number = parse_quantity(value) if value is not None else None
        if value is not None and (number is None or number <= 0):
            raise ValueError(f"{value!r}: {STORAGE_SIZE_MESSAGE}")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> StorageSpec:
        if (self.existing_claim is None) == (self.size is None):
            raise ValueError("storage needs exactly one of existingClaim or size")
        if self.model_cache is not None and self.model_cache.mount_path == self.mount_path:
            raise ValueError(MODEL_CACHE_MOUNT_MESSAGE)
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
        # The server Deployment's progressDeadlineSeconds is this plus 60, an int32.
        default=1200, ge=1, le=2**31 - 1 - 60,
        description="Fail the attempt (ServerNotReady) if the server is not healthy by then.",
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


TOLERATION_KEY_MESSAGE = f"a toleration key must be a label key: {QUALIFIED_NAME_TEXT}"
TOLERATION_RULES: list[dict[str, str]] = [
    _cel("(has(self.key) && size(self.key) > 0) || (has(self.operator) && self.operator == 'Exists')",
         "a toleration without a key must have operator Exists (it then tolerates every taint)"),
    _cel("!has(self.operator) || self.operator != 'Exists' || !has(self.value) || size(self.value) == 0",
         "a toleration with operator Exists takes no value"),
    _cel("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
         "tolerationSeconds applies only with effect NoExecute"),
]


def _toleration_rules(schema: dict[str, Any]) -> None:
    schema["x-kubernetes-validations"] = [dict(rule) for rule in TOLERATION_RULES]


class Toleration(ApiModel):
    """A Pod toleration."""

    model_config = ConfigDict(json_schema_extra=_toleration_rules)  # CEL beside the type it checks

    key: str | None = Field(
        default=None, description="Taint key.", max_length=317,
        json_schema_extra=_rules(_cel(f"size(self) == 0 || ({qualified_name_cel('self')})", TOLERATION_KEY_MESSAGE)),
    )
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Exists or Equal.")
    value: LabelValue | None = Field(default=None, description="Taint value.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect."
    )
    toleration_seconds: int | None = Field(default=None, description="How long a NoExecute taint is tolerated.")

    @field_validator("key")
    @classmethod
    def _label_key(cls, value: str | None) -> str | None:
        if value and not is_qualified_name(value):
            raise ValueError(f"{value!r}: {TOLERATION_KEY_MESSAGE}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if not self.key and self.operator != "Exists":
            raise ValueError(TOLERATION_RULES[0]["message"])
        if self.operator == "Exists" and self.value:
            raise ValueError(TOLERATION_RULES[1]["message"])
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError(TOLERATION_RULES[2]["message"])
        return self


class SchedulingSpec(ApiModel):
    """Where the server and trainer pods may run."""

    node_selector: dict[str, LabelValue] = Field(
        default_factory=dict, description="Node labels the pods require.",
        json_schema_extra=_rules(LABEL_KEYS_RULE, maxProperties=64),
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints the pods tolerate.", max_length=64
    )
    affinity: dict[str, Any] = Field(
        default_factory=dict,
        description="Pod affinity (core/v1 Affinity).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    priority_class_name: str | None = OptionalName("PriorityClass of the pods.")
    runtime_class_name: str | None = OptionalName("RuntimeClass of the pods.")
    service_account_name: str | None = OptionalName(
        "ServiceAccount of the pods; default is the namespace's default."
    )
    image_pull_secrets: list[Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)]] = Field(
        default_factory=list,
        description="Secrets (names, in the run's namespace) for pulling the images of the pods.",
        max_length=16,
    )

    @field_validator("node_selector")
    @classmethod
    def _label_keys(cls, value: dict[str, str]) -> dict[str, str]:
        return _label_keys(value)

    @field_validator("affinity")
    @classmethod
    def _affinity_shape(cls, value: dict[str, Any]) -> dict[str, Any]:
        _check_affinity(value)
        return value


#: The shape of core/v1 Affinity down to its term lists: what each kind holds, list (of term objects) or object.
_AFFINITY_SHAPE: dict[str, dict[str, type]] = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": dict,
        "preferredDuringSchedulingIgnoredDuringExecution": list,
    },
    **{
        kind: {
            "requiredDuringSchedulingIgnoredDuringExecution": list,
            "preferredDuringSchedulingIgnoredDuringExecution": list,
        }
        for kind in ("podAffinity", "podAntiAffinity")
    },
}


def _check_affinity(affinity: dict[str, Any]) -> None:
    """scheduling.affinity has the shape of a core/v1 Affinity (its terms are checked by the API server in the
    pods): a value of another type would have the pods refused after the run's other children exist."""
    for kind, rules in affinity.items():
        if kind not in _AFFINITY_SHAPE:
            raise ValueError(f"scheduling.affinity.{kind} is not one of {', '.join(_AFFINITY_SHAPE)}")
        if not isinstance(rules, dict):
            raise ValueError(f"scheduling.affinity.{kind} must be an object")
        for key, terms in rules.items():
            shape = _AFFINITY_SHAPE[kind].get(key)
            if shape is None:
                raise ValueError(f"scheduling.affinity.{kind}.{key} is not one of {', '.join(_AFFINITY_SHAPE[kind])}")
            if not isinstance(terms, shape):
                kind_of = "a list" if shape is list else "an object"
                raise ValueError(f"scheduling.affinity.{kind}.{key} must be {kind_of}")
            if isinstance(terms, list) and not all(isinstance(term, dict) for term in terms):
                raise ValueError(f"scheduling.affinity.{kind}.{key} must be a list of objects (terms)")


STORAGE_MOUNTS_TAKEN = "a mountPath may not be that of spec.storage or spec.storage.modelCache"
IMMUTABLE = "spec.{field} cannot change after the run is created"
PRESENCE = "spec.{field} cannot be added or removed after the run is created"
#: The spec sections that cannot change after the run is created (in value, and in presence).
IMMUTABLE_FIELDS: list[str] = []


def _immutable(field: str) -> dict[str, Any]:
    IMMUTABLE_FIELDS.append(field)
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
        taken = {self.storage.mount_path, *([self.storage.model_cache.mount_path] if self.storage.model_cache else [])}
        sections: list[ServerSpec | TrainerSpec] = [s for s in (self.server, self.trainer) if s is not None]
        for section in sections:
            for index, mount in enumerate(section.volume_mounts):
                if mount.mount_path in taken:
                    raise ValueError(f"{section.section}.volumeMounts[{index}].mountPath {mount.mount_path!r}: "
                                     f"{STORAGE_MOUNTS_TAKEN}")
        if self.mode == Mode.SERVER:
            server = self.effective_server
            if not self.trainer.pushes_weights and self.trainer.lora.r > server.max_lora_rank:
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
        "|| (has(self.trainer.tuning) && self.trainer.tuning == 'full') "
        "|| (has(self.trainer.sync) && self.trainer.sync == 'merged') "
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
    *(
        _cel(
            f"!has(self.{section}) || !has(self.{section}.volumeMounts) || !has(self.storage) || "
            f"self.{section}.volumeMounts.all(m, (!has(self.storage.mountPath) || m.mountPath != "
            "self.storage.mountPath) && (!has(self.storage.modelCache) || !has(self.storage.modelCache.mountPath) "
            "|| m.mountPath != self.storage.modelCache.mountPath))",
            f"spec.{section}.volumeMounts: {STORAGE_MOUNTS_TAKEN}",
            fieldPath=f".{section}.volumeMounts",
        )
        for section in ("server", "trainer")
    ),
    # A transition rule on a section (self == oldSelf) does not run when the section is added or removed.
    *(
        _cel(f"has(self.{field}) == has(oldSelf.{field})", PRESENCE.format(field=field), fieldPath=f".{field}")
        for field in IMMUTABLE_FIELDS
    ),
]

TRAINER_RULES: list[dict[str, str]] = [
    _cel(
        f"!has(self.numNodes) || self.numNodes <= 1 || !has(self.metricsPort) || "
        f"self.metricsPort != {TRAINER_RENDEZVOUS_PORT}",
        METRICS_PORT_MESSAGE,
        fieldPath=".metricsPort",
    ),
    _cel(
        "(self.perDeviceBatchSize * self.gradientAccumulationSteps) % self.numGenerations == 0",
        "perDeviceBatchSize × gradientAccumulationSteps must be divisible by numGenerations",
        fieldPath=".numGenerations",
    ),
    _cel(
        "!has(self.maxStaleness) || !has(self.asyncPrefetch) || !self.asyncPrefetch || "
        "self.maxStaleness >= (has(self.prefetchDepth) ? self.prefetchDepth : 1)",
        MAX_STALENESS_MESSAGE,
        fieldPath=".maxStaleness",
    ),
    _cel(
        "!has(self.tuning) || self.tuning != 'full' || !has(self.lora) || !has(self.lora.quantizeBase) || "
        "!self.lora.quantizeBase",
        FULL_TUNING_QLORA_MESSAGE,
        fieldPath=".tuning",
    ),
    _cel(
        "!has(self.tuning) || self.tuning != 'full' || !has(self.strategy) || self.strategy != 'fsdp'",
        FULL_TUNING_FSDP_MESSAGE,
        fieldPath=".tuning",
    ),
    _cel(
        "!has(self.sync) || self.sync != 'merged' || ((!has(self.tuning) || self.tuning == 'lora') && "
        "(!has(self.lora) || !has(self.lora.quantizeBase) || !self.lora.quantizeBase))",
        MERGED_SYNC_MESSAGE,
        fieldPath=".sync",
    ),
    _cel(
        "!has(self.sync) || self.sync != 'merged' || !has(self.strategy) || self.strategy != 'fsdp'",
        MERGED_SYNC_FSDP_MESSAGE,
        fieldPath=".sync",
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
    _cel(
        "!has(self.modelCache) || !has(self.mountPath) || !has(self.modelCache.mountPath) || "
        "self.modelCache.mountPath != self.mountPath",
        MODEL_CACHE_MOUNT_MESSAGE,
        fieldPath=".modelCache.mountPath",
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
    #: A child object the run needs was refused by the API server (a value no admission rule caught,
    #: a quota, a webhook of the cluster): no retry fixes it.
    CHILD_REJECTED = "ChildRejected"
    #: A child's name is taken by an object this run does not own (not one of a dying earlier run).
    CHILD_CONFLICT = "ChildConflict"
    #: A child that carries the attempt's state (token Secret, run-config) was deleted mid-attempt.
    CHILD_DELETED = "ChildDeleted"
    #: A child the run needs was deleted mid-attempt and has been created again.
    CHILD_RESTORED = "ChildRestored"
    #: The children of an earlier run of the same name are still being deleted.
    WAITING_FOR_OLD_CHILDREN = "WaitingForOldChildren"
    #: A reconcile failed unexpectedly; it is retried with backoff.
    RECONCILE_ERROR = "ReconcileError"
    RECONCILED = "Reconciled"
    #: The server stopped answering its health check mid-attempt for longer than the grace period.
    SERVER_UNHEALTHY = "ServerUnhealthy"


class ConditionType(StrEnum):
    SOURCES_READY = "SourcesReady"
    SERVER_READY = "ServerReady"
    TRAINER_RUNNING = "TrainerRunning"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"
    #: The operator could carry out its last decision (present once a reconcile first failed or waited).
    RECONCILED = "Reconciled"


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
    boot_ids: list[str] = Field(
        default_factory=list, max_length=64,
        description="Boot ids of every replica seen in this attempt (the first passed the gate with the "
        "others); a replica whose boot id is not here restarted.",
    )
    ready: bool = Field(
        default=False, description="Every replica of the attempt's server answers its health check."
    )
    ready_replicas: int = Field(default=0, ge=0, description="Replicas that answered their health check last.")
    url: str | None = Field(default=None, description="In-cluster URL of the server.")
    message: str | None = Field(
        default=None,
        description="Trouble with the attempt's server pod, if any (Unschedulable, ImagePullBackOff, "
        "CrashLoopBackOff, a non-zero exit), as the operator last saw it.",
    )
    unhealthy_since: dt.datetime | None = Field(
        default=None,
        description="Since when the server of the running attempt has failed its health check; ready turns "
        "false once that lasts longer than the grace period.",
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


#: Significant digits of status.progress.rewardMean.
REWARD_DIGITS = 4


def round_reward(value: float) -> float:
    """value to REWARD_DIGITS significant digits (0.8234567 -> 0.8235, 1234.5678 -> 1235.0)."""
    return float(f"{value:.{REWARD_DIGITS}g}") if math.isfinite(value) else value


class LaggingReplicaStatus(ApiModel):
    """A server replica the trainer gives no work: it does not serve the trainer's current policy version."""

    url: str = Field(description="The replica's address.", max_length=1024)
    since: dt.datetime = Field(description="Since when it has not served the current version.")
    reason: str = Field(default="", description="Why, as the trainer last saw it.", max_length=1024)


class ProgressStatus(ApiModel):
    """Training progress as the trainer reports it."""

    model_config = ConfigDict(allow_inf_nan=True)  # a diverged run's reward is reported as it is

    step: int = Field(default=0, description="Optimizer steps completed.")
    max_steps: int = Field(default=0, description="Optimizer steps to train.")
    reward_mean: float | None = Field(
        default=None,
        description=f"Mean total reward of the latest step, to {REWARD_DIGITS} significant digits (the "
        "Reward column of kubectl get; the trainer's metrics keep every digit).",
    )
    lagging_replicas: list[LaggingReplicaStatus] = Field(
        default_factory=list, max_length=64,
        description="Server replicas that lag (hung, unreachable, restarted, or behind the trainer's current "
        "policy version), with since when: they get no work until they serve the current version and are "
        "caught up in the background (grpo_trainer_server_replica_lagging_since_seconds).",
    )

    @field_validator("reward_mean")
    @classmethod
    def _short(cls, value: float | None) -> float | None:
        """kubectl prints a number column with every digit it has: keep the status short."""
        return None if value is None else round_reward(value)


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

    @field_validator("name")
    @classmethod
    def _names_children(cls, value: str) -> str:
        if len(value) > MAX_RUN_NAME or not re.fullmatch(RUN_NAME_PATTERN, value):
            raise ValueError(f"{value!r}: {RUN_NAME_MESSAGE}")
        return value

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
