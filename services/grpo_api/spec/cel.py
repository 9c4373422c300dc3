"""CEL plumbing: how a model or a field carries the rules the API server checks at admission.

A rule is a dict of `x-kubernetes-validations` (`rule`, `message`, and `fieldPath` or `reason` where
given). Each model declares its own rules beside the pydantic validator that checks the same in Python;
the CRD generator (`grpo_api.crd`) only places them. There are two ways to attach them, which differ only
in where the CRD prints them:

- `schema(*rules, **keys)`: the rules are a key of the JSON schema (json_schema_extra of a field, an
  `Annotated` type or a model), sorted with the schema's other keys, each rule's keys sorted too.
- `rules(*rules)`: json_schema_extra of a model or field whose rules the CRD generator appends to the
  node after every other rule it holds (the rules of the field that holds the model come first), each
  rule's keys as written.

Both are enforced alike. The second is how the CRD placed the rules it attached by JSON path before
they moved onto their models, so the CRD stayed byte-identical; new rules may use either.
"""

from __future__ import annotations

from typing import Any

#: Where the API server reads CEL rules in a structural schema.
RULES = "x-kubernetes-validations"
#: Where `rules()` keeps a model's or field's rules in the JSON schema until the CRD generator appends
#: them under RULES (never in the CRD itself).
APPENDED_RULES = "x-grpo-appended-validations"

Rule = dict[str, str]


def rule(expression: str, message: str, **extra: str) -> Rule:
    """One CEL rule: the expression, the message when it is false, and fieldPath or reason if given."""
    return {"rule": expression, "message": message, **extra}


def schema(*rules: Rule, **keys: Any) -> dict[str, Any]:
    """json_schema_extra of a field, an Annotated type or a model: CEL rules plus other schema keys."""
    return {RULES: [dict(r) for r in rules], **keys} if rules else dict(keys)


def rules(*rules: Rule) -> dict[str, Any]:
    """json_schema_extra of a model or a field: CEL rules the CRD appends after the node's other rules."""
    return {APPENDED_RULES: [dict(r) for r in rules]}
