"""The run's shared volume (adapters, checkpoints, progress) and the optional claim of model weights.

Access modes mirror ValidatePersistentVolumeClaim (ReadWriteOncePod alone); sizes are quantities above zero.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from grpo_api.spec import cel
from grpo_api.spec.api import ApiModel
from grpo_api.spec.names import DNS_SUBDOMAIN_PATTERN, ObjectName, OptionalName
from grpo_api.spec.pods import VolumeMountPath
from grpo_api.spec.resources import NONNEGATIVE_QUANTITY_PATTERN, parse_quantity

STORAGE_SIZE_MESSAGE = "storage.size must be a quantity greater than zero, e.g. 20Gi"
ACCESS_MODES_MESSAGE = "ReadWriteOncePod cannot be combined with other access modes"
MODEL_CACHE_MOUNT_MESSAGE = "storage.modelCache.mountPath must differ from storage.mountPath"
STORAGE_RULES: list[cel.Rule] = [
    cel.rule(
        "has(self.existingClaim) != has(self.size)",
        "storage needs exactly one of existingClaim or size",
    ),
    cel.rule(
        "!has(self.modelCache) || !has(self.mountPath) || !has(self.modelCache.mountPath) || "
        "self.modelCache.mountPath != self.mountPath",
        MODEL_CACHE_MOUNT_MESSAGE,
        fieldPath=".modelCache.mountPath",
    ),
]


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
        json_schema_extra=cel.schema(cel.rule("quantity(self).isGreaterThan(quantity('0'))", STORAGE_SIZE_MESSAGE)),
    )
    storage_class_name: str | None = OptionalName("Storage class of a created claim (\"\": none, no provisioning).")
    access_modes: list[AccessMode] = Field(
        default_factory=_rwo, description="Access modes of a created claim.", min_length=1, max_length=4,
        json_schema_extra=cel.schema(
            cel.rule("!self.exists(m, m == 'ReadWriteOncePod') || self.all(m, m == 'ReadWriteOncePod')",
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

    model_config = ConfigDict(json_schema_extra=cel.rules(*STORAGE_RULES))

    @model_validator(mode="after")
    def _one_source(self) -> StorageSpec:
        if (self.existing_claim is None) == (self.size is None):
            raise ValueError("storage needs exactly one of existingClaim or size")
        if self.model_cache is not None and self.model_cache.mount_path == self.mount_path:
            raise ValueError(MODEL_CACHE_MOUNT_MESSAGE)
        return self
