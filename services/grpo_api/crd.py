"""Generate the GRPORun CustomResourceDefinition from the pydantic models.

The models' JSON schema (draft 2020-12) is turned into a Kubernetes structural
OpenAPI v3 schema: references inlined, titles dropped, optional-null unions
collapsed, int-or-string marked, numeric exclusive bounds rewritten, default
factories evaluated. The CEL rules come with the models (grpo_api.spec.cel says
how); this module only places them.
"""

from __future__ import annotations

import copy
from enum import Enum
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from grpo_api import models as m
from grpo_api.spec.cel import APPENDED_RULES, RULES

CRD_NAME = f"{m.PLURAL}.{m.GROUP}"
CRD_FILE = "crds/grpo.dev_grporuns.yaml"


class _Generator(GenerateJsonSchema):
    """Evaluates default factories so nested defaults land in the CRD, serialised by alias."""

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        json_schema = self.generate_inner(schema["schema"])
        if "default" in schema:
            value = schema["default"]
        elif "default_factory" in schema:
            value = schema["default_factory"]()  # type: ignore[call-arg]
        else:
            return json_schema
        if value is None:
            return json_schema
        json_schema["default"] = _encode(value)
        return json_schema

    def sort(self, value: JsonSchemaValue, parent_key: str | None = None) -> JsonSchemaValue:
        """pydantic's order (keys sorted, but not those of properties and default), except the rules of
        `cel.rules()`: they keep the order written."""
        return _sorted(value, parent_key)


def _sorted(value: Any, parent_key: str | None) -> Any:
    if parent_key == APPENDED_RULES:
        return copy.deepcopy(value)
    if isinstance(value, dict):
        keys = value.keys() if parent_key in ("properties", "default") else sorted(value)
        return {key: _sorted(value[key], key) for key in keys}
    if isinstance(value, list):
        return [_sorted(item, parent_key) for item in value]
    return value


def _encode(value: Any) -> Any:
    if isinstance(value, m.ApiModel):
        return value.to_wire()
    if isinstance(value, BaseModel):
        return value.model_dump(by_alias=True, exclude_none=True, mode="json")
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, Enum):
        return value.value
    return value


def _merged(target: dict[str, Any], field: dict[str, Any]) -> dict[str, Any]:
    """A type's schema under a field's: the field's keys (description, default) win, CEL rules add up.

    The rules a type appends (cel.rules) come after the field's: `_structural` adds them last."""
    rules = [*target.get(RULES, []), *field.get(RULES, [])]
    appended = [*field.get(APPENDED_RULES, []), *target.get(APPENDED_RULES, [])]
    node = {**target, **field}
    if rules:
        node[RULES] = rules
    if appended:
        node[APPENDED_RULES] = appended
    return node


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Rewrite one JSON-schema node (recursively) into a structural OpenAPI v3 node."""
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").split("/")[-1]])
        node = _merged(target, node)
        return _structural(node, defs)
    if "allOf" in node and len(node["allOf"]) == 1:
        inner = node.pop("allOf")[0]
        node = _merged(inner, node)
        return _structural(node, defs)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        types = {o.get("type") for o in options}
        node.pop("anyOf")
        if len(options) == 1:
            node = {**options[0], **node}
            return _structural(node, defs)
        if types == {"string", "integer"}:
            node["x-kubernetes-int-or-string"] = True
        else:  # pragma: no cover - a model change that needs a new rule here
            raise ValueError(f"cannot express union {options} in a structural schema")
    node.pop("title", None)
    if node.get("default", 0) is None:
        node.pop("default")
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node and not isinstance(node[bound], bool):
            node[plain] = node.pop(bound)
            node[bound] = True
    if node.get("x-kubernetes-preserve-unknown-fields"):
        node.pop("additionalProperties", None)
        node.setdefault("type", "object")
    if node.get("format") == "date-time":
        node["type"] = "string"
    for key in ("properties",):
        if key in node:
            node[key] = {k: _structural(v, defs) for k, v in node[key].items()}
    for key in ("items", "additionalProperties"):
        if key in node and isinstance(node[key], dict):
            node[key] = _structural(node[key], defs)
    if node.get("additionalProperties") is False:
        # Structural schemas may not say this; the API server prunes (or, with
        # strict field validation, refuses) unknown fields instead.
        node.pop("additionalProperties")
    if node.get("additionalProperties") is True:
        node.pop("additionalProperties")
        node["x-kubernetes-preserve-unknown-fields"] = True
    if APPENDED_RULES in node:
        node.setdefault(RULES, []).extend(node.pop(APPENDED_RULES))
    return node


def _schema_of(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation", schema_generator=_Generator)
    defs = raw.pop("$defs", {})
    result: dict[str, Any] = _structural(raw, defs)
    return result


def spec_schema() -> dict[str, Any]:
    """The spec's schema, its description and then its CEL rules last."""
    spec = _schema_of(m.GRPORunSpec)
    rules = spec.pop(RULES)
    spec.pop("description", None)
    spec["description"] = m.GRPORunSpec.__doc__
    spec[RULES] = rules
    return spec


def metadata_schema() -> dict[str, Any]:
    """metadata.name, the one metadata field a CRD may restrict: the run's children are named after it.

    The rule sits on the name itself, not at the root: an unchanged name is ratcheted, so a run admitted
    before the rule existed can still have its status written."""
    return {
        "type": "object",
        "properties": {
            "name": {
                "type": "string",
                "maxLength": 253,
                RULES: [
                    {
                        "rule": f"size(self) <= {m.MAX_RUN_NAME} && self.matches('{m.RUN_NAME_PATTERN}')",
                        "message": m.RUN_NAME_MESSAGE,
                    }
                ],
            }
        },
    }


def status_schema() -> dict[str, Any]:
    status = _schema_of(m.GRPORunStatus)
    status["description"] = m.GRPORunStatus.__doc__
    return status


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Run phase."},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step", "description": "Steps done."},
    {"name": "Reward", "type": "number", "jsonPath": ".status.progress.rewardMean",
     "description": "Mean reward of the latest step."},
    {"name": "Attempt", "type": "integer", "jsonPath": ".status.attempt", "description": "Current attempt."},
    {"name": "Reason", "type": "string", "jsonPath": ".status.reason", "priority": 1,
     "description": "Reason of the latest phase change."},
    {"name": "Adapter", "type": "integer", "jsonPath": ".status.adapter.version", "priority": 1,
     "description": "Latest adapter version."},
    {"name": "Preemptions", "type": "integer", "jsonPath": ".status.preemptions", "priority": 1,
     "description": "Attempts ended by a preempted or evicted trainer pod (not counted against backoffLimit)."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> dict[str, Any]:
    """The full CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "grpo-operator", "app.kubernetes.io/part-of": "grpo-operator"},
        },
        "spec": {
            "group": m.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": m.KIND,
                "listKind": f"{m.KIND}List",
                "plural": m.PLURAL,
                "singular": m.SINGULAR,
                "shortNames": list(m.SHORT_NAMES),
                "categories": ["all", "grpo"],
            },
            "versions": [
                {
                    "name": m.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": m.GRPORun.__doc__,
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": metadata_schema(),
                                "spec": spec_schema(),
                                "status": status_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


HEADER = "# Generated by `grpo crd` from services/grpo_api/spec/. Do not edit by hand.\n"


def render_crd() -> str:
    return HEADER + yaml.safe_dump(build_crd(), sort_keys=False, width=120, allow_unicode=True)
