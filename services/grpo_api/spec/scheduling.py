"""Where the run's pods may run: node selector, tolerations, affinity and pod-level names.

Mirrors from k8s.io/kubernetes/pkg/apis/core/validation: validateTolerations (a label key or none with
operator Exists, no value with Exists, tolerationSeconds only with NoExecute), ValidateNodeSelector's
label keys and values, and the shape of a core/v1 Affinity down to its terms (the API server checks the
terms themselves when it admits the pods).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from grpo_api.spec import cel
from grpo_api.spec.api import ApiModel
from grpo_api.spec.names import (
    DNS_SUBDOMAIN_PATTERN,
    LABEL_KEYS_RULE,
    QUALIFIED_NAME_TEXT,
    LabelValue,
    OptionalName,
    check_label_keys,
    is_qualified_name,
    qualified_name_cel,
)

TOLERATION_KEY_MESSAGE = f"a toleration key must be a label key: {QUALIFIED_NAME_TEXT}"
TOLERATION_RULES: list[cel.Rule] = [
    cel.rule("(has(self.key) && size(self.key) > 0) || (has(self.operator) && self.operator == 'Exists')",
             "a toleration without a key must have operator Exists (it then tolerates every taint)"),
    cel.rule("!has(self.operator) || self.operator != 'Exists' || !has(self.value) || size(self.value) == 0",
             "a toleration with operator Exists takes no value"),
    cel.rule("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
             "tolerationSeconds applies only with effect NoExecute"),
]


class Toleration(ApiModel):
    """A Pod toleration."""

    model_config = ConfigDict(json_schema_extra=cel.schema(*TOLERATION_RULES))  # CEL beside the type it checks

    key: str | None = Field(
        default=None, description="Taint key.", max_length=317,
        json_schema_extra=cel.schema(
            cel.rule(f"size(self) == 0 || ({qualified_name_cel('self')})", TOLERATION_KEY_MESSAGE)
        ),
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
        json_schema_extra=cel.schema(LABEL_KEYS_RULE, maxProperties=64),
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
        return check_label_keys(value)

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


