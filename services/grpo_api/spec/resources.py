"""Quantities and container resources, as Kubernetes validates them.

Mirrors k8s.io/apimachinery's resource.ParseQuantity (the quantity syntax and its exact value) and, from
k8s.io/kubernetes/pkg/apis/core/validation, validateContainerResourceName (the resource names a container
may request), ValidateResourceRequirements (requests at most their limits; extended resources and
hugepages whole and equal to their limits) and validateResourceQuantityValue (hugepages in multiples of
their page size).
"""

from __future__ import annotations

import re
from decimal import Decimal, localcontext
from typing import Annotated

from pydantic import AfterValidator, ConfigDict, Field, field_validator, model_validator

from grpo_api.spec import cel
from grpo_api.spec.api import ApiModel
from grpo_api.spec.names import is_qualified_name, qualified_name_cel

#: Quantity strings as Kubernetes parses them (resource.ParseQuantity: "10Gi", "500m", "1", "1e3"):
#: a decimal number, then a binary suffix (Ki..Ei), a decimal one (n, u, m, k, M..E) or an exponent.
#: ASCII classes only: the models' regex engine would take `\d` for any Unicode digit.
_QUANTITY_NUMBER = r"([0-9]+[.]?[0-9]*|[.][0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?"
QUANTITY_PATTERN = rf"^[+-]?{_QUANTITY_NUMBER}$"
#: A quantity that is not negative (what pod resources, volume sizes and sizeLimits take).
NONNEGATIVE_QUANTITY_PATTERN = rf"^[+]?{_QUANTITY_NUMBER}$"
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


RESOURCES_RULES: list[cel.Rule] = [
    cel.rule(_resources_cel("requests"), RESOURCE_NAME_MESSAGE, fieldPath=".requests"),
    cel.rule(_resources_cel("limits"), RESOURCE_NAME_MESSAGE, fieldPath=".limits"),
    cel.rule(_resource_values_cel("requests"), RESOURCE_VALUE_MESSAGE, fieldPath=".requests"),
    cel.rule(_resource_values_cel("limits"), RESOURCE_VALUE_MESSAGE, fieldPath=".limits"),
    cel.rule(
        "!has(self.requests) || self.requests.all(k, (has(self.limits) && k in self.limits) ? "
        f"({_OVERCOMMIT_CEL} ? !quantity(string(self.requests[k])).isGreaterThan("
        "quantity(string(self.limits[k]))) : quantity(string(self.requests[k])).compareTo("
        f"quantity(string(self.limits[k]))) == 0) : {_OVERCOMMIT_CEL})",
        RESOURCE_LIMIT_MESSAGE,
    ),
    cel.rule(
        f"!((has(self.requests) && self.requests.exists(k, k.startsWith('{HUGEPAGES_PREFIX}'))) || "
        f"(has(self.limits) && self.limits.exists(k, k.startsWith('{HUGEPAGES_PREFIX}')))) || "
        "(has(self.requests) && ('cpu' in self.requests || 'memory' in self.requests)) || "
        "(has(self.limits) && ('cpu' in self.limits || 'memory' in self.limits))",
        HUGEPAGES_MESSAGE,
    ),
]


class Resources(ApiModel):
    """Compute resources of a container, as in a Pod spec."""

    model_config = ConfigDict(json_schema_extra=cel.schema(*RESOURCES_RULES))  # CEL beside the type it checks

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


def gpu_resources() -> Resources:
    """The default resources of the server's and the trainer's container: one GPU."""
    return Resources(requests={"cpu": "4", "memory": "32Gi"}, limits={"nvidia.com/gpu": 1, "memory": "64Gi"})

