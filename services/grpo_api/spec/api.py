"""The API's identity (group, version, kind and names) and `ApiModel`, the base of every spec and status model."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

GROUP = "grpo.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "GRPORun"
PLURAL = "grporuns"
SINGULAR = "grporun"
SHORT_NAMES = ["grpo"]


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
