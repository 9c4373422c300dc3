"""Where the run's result goes once the trainer's last step is done, and in which form (spec.output).

A destination is a URI of one of four schemes, each checked here as its service checks names, and
stricter: `pvc://CLAIM[/PATH]` (a claim name, path segments that cannot climb: no `.`, `..` or empty
segment), `hf://ORG/NAME` (Hugging Face repository ids: huggingface_hub's validate_repo_id, without
`--` or `..`), `oci://HOST[:PORT]/REPO[:TAG]` (distribution/reference, a registry host required, no
digest: the push makes it), `s3://BUCKET[/PREFIX]` (S3 bucket naming rules, the same path segments).
Credentials come from a Secret only (`credentialsSecret`), never from the spec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from grpo_api.spec import cel
from grpo_api.spec.api import ApiModel
from grpo_api.spec.names import DNS_SUBDOMAIN
from grpo_api.spec.objectstore import (
    DOUBLE_MESSAGE,
    PATH,
    REGION_TEXT,
    S3_PATTERN,
    EndpointUrl,
    Region,
    SecretName,
    parse_s3,
)

#: Hugging Face repository id parts (huggingface_hub.utils.validate_repo_id, stricter: no leading or
#: trailing '-', '_' or '.').
_HF_PART = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,94}[A-Za-z0-9])?"
#: distribution/reference: a registry host (a dot, a port or localhost tells it from a path component),
#: lowercase path components, an optional tag.
_OCI_HOST_PART = r"([a-zA-Z0-9]|[a-zA-Z0-9][-a-zA-Z0-9]*[a-zA-Z0-9])"
_PORT = r":[0-9]{1,5}"
_OCI_HOST_PORT = rf"((localhost|{_OCI_HOST_PART}([.]{_OCI_HOST_PART})+)({_PORT})?|{_OCI_HOST_PART}{_PORT})"
_OCI_COMPONENT = r"[a-z0-9]+(([._]|__|[-]+)[a-z0-9]+)*"
_OCI_TAG = r"[A-Za-z0-9_][-A-Za-z0-9_.]{0,127}"

PVC_PATTERN = rf"^pvc://(?P<claim>{DNS_SUBDOMAIN})(?P<path>{PATH})$"
HF_PATTERN = rf"^hf://(?P<repo>{_HF_PART}/{_HF_PART})$"
OCI_PATTERN = rf"^oci://(?P<registry>{_OCI_HOST_PORT})/(?P<repository>{_OCI_COMPONENT}(/{_OCI_COMPONENT})*)(:(?P<tag>{_OCI_TAG}))?$"
#: The same patterns without Python's group names, for CEL (RE2 takes (?P<...>), but one form is simpler to read).
_CEL_PATTERNS = {
    scheme: re.sub(r"\(\?P<[a-z]+>", "(", pattern)
    for scheme, pattern in (("pvc", PVC_PATTERN), ("hf", HF_PATTERN), ("oci", OCI_PATTERN), ("s3", S3_PATTERN))
}
DESTINATION_MESSAGE = (
    "must be pvc://CLAIM[/PATH], hf://ORG/NAME, oci://HOST[:PORT]/REPOSITORY[:TAG] or s3://BUCKET[/PREFIX]; "
    "path segments start with a letter, digit or '_' (no '.', '..' or empty segment)"
)
HF_NEEDS_SECRET = "an hf:// destination needs credentialsSecret (key 'token'): a push needs a token"
PVC_NO_SECRET = "a pvc:// destination takes no credentialsSecret, endpoint, region or plainHttp"
ENDPOINT_ONLY = "endpoint applies to s3:// and hf:// destinations only"
PLAIN_HTTP_ONLY = "plainHttp applies to oci:// destinations only"
REGION_ONLY = "region applies to s3:// destinations only"


class OutputForm(StrEnum):
    #: The trained LoRA adapter as PEFT saves it (adapter_config.json, adapter_model.safetensors).
    ADAPTER = "adapter"
    #: The base model with the adapter merged in: safetensors weights, config and tokenizer.
    MERGED = "merged"


Scheme = Literal["pvc", "hf", "oci", "s3"]


@dataclass(frozen=True)
class Destination:
    """A parsed destination: its scheme and parts (`path` without a leading '/', possibly empty)."""

    scheme: Scheme
    #: The claim, the hf repository id, the registry host[:port] or the bucket.
    target: str
    #: The path under the claim or the bucket's prefix; the OCI repository.
    path: str = ""
    #: The OCI tag (default "latest").
    tag: str = ""

    @property
    def uri(self) -> str:
        if self.scheme == "oci":
            return f"oci://{self.target}/{self.path}:{self.tag}"
        return f"{self.scheme}://{self.target}" + (f"/{self.path}" if self.path else "")


def parse_destination(value: str) -> Destination:
    """The destination's parts, or a ValueError naming what is wrong (the same checks as the CRD's)."""
    if "--" in value or ".." in value:
        raise ValueError(f"{value!r} {DOUBLE_MESSAGE}")
    if m := re.fullmatch(PVC_PATTERN, value):
        return Destination("pvc", m["claim"], m["path"].lstrip("/"))
    if m := re.fullmatch(HF_PATTERN, value):
        return Destination("hf", m["repo"])
    if m := re.fullmatch(OCI_PATTERN, value):
        return Destination("oci", m["registry"], m["repository"], m["tag"] or "latest")
    if bucket := parse_s3(value):
        return Destination("s3", bucket.bucket, bucket.prefix)
    raise ValueError(f"{value!r} {DESTINATION_MESSAGE}")


def _has(field: str) -> str:
    return f"has(self.{field})"


OUTPUT_RULES: list[cel.Rule] = [
    cel.rule(f"!self.destination.startsWith('hf://') || {_has('credentialsSecret')}", HF_NEEDS_SECRET,
             fieldPath=".credentialsSecret"),
    cel.rule(f"!self.destination.startsWith('pvc://') || !({_has('credentialsSecret')} || {_has('endpoint')} || "
             f"{_has('region')} || {_has('plainHttp')})", PVC_NO_SECRET, fieldPath=".destination"),
    cel.rule(f"!{_has('endpoint')} || self.destination.startsWith('s3://') || self.destination.startsWith('hf://')",
             ENDPOINT_ONLY, fieldPath=".endpoint"),
    cel.rule(f"!{_has('plainHttp')} || self.destination.startsWith('oci://')", PLAIN_HTTP_ONLY,
             fieldPath=".plainHttp"),
    cel.rule(f"!{_has('region')} || self.destination.startsWith('s3://')", REGION_ONLY, fieldPath=".region"),
]


class OutputSpec(ApiModel):
    """Where the final artifact goes once the trainer's last step is done, and in which form. The export
    runs as its own step after the trainer (a Job, or a process for `grpo run`); a failed export fails the
    run (ExportFailed) and leaves the adapters on the run's volume."""

    form: OutputForm = Field(
        default=OutputForm.ADAPTER,
        description="adapter: the trained LoRA adapter (PEFT files); merged: the base model with the adapter "
        "merged in, as safetensors with its config and tokenizer.",
    )
    destination: str = Field(
        description="pvc://CLAIM[/PATH] (a claim in the run's namespace; `grpo run`: the folder "
        "<run dir>/claims/CLAIM), hf://ORG/NAME (a Hugging Face model repository, created private if "
        "missing), oci://HOST[:PORT]/REPOSITORY[:TAG] (an OCI artifact; tag latest by default) or "
        "s3://BUCKET[/PREFIX].",
        min_length=6,
        max_length=1024,
        json_schema_extra=cel.schema(
            cel.rule(" || ".join(f"self.matches('{p}')" for p in _CEL_PATTERNS.values()), DESTINATION_MESSAGE),
            cel.rule("!self.contains('--') && !self.contains('..')", DOUBLE_MESSAGE),
        ),
    )
    credentials_secret: SecretName | None = Field(
        default=None,
        description="A Secret in the run's namespace with the destination's credentials: hf:// key token; "
        "s3:// keys accessKeyId and secretAccessKey (sessionToken optional); oci:// keys username and "
        "password. Only the export step gets them.",
    )
    endpoint: EndpointUrl | None = Field(
        default=None,
        description="s3://: the S3 endpoint URL of a service other than AWS; hf://: a Hub endpoint other than "
        "huggingface.co.",
    )
    region: Region | None = Field(default=None, description=f"s3://: {REGION_TEXT}")
    plain_http: bool | None = Field(
        default=None, description="oci://: talk plain HTTP to the registry (a registry on the cluster's network)."
    )

    model_config = ConfigDict(json_schema_extra=cel.rules(*OUTPUT_RULES))

    @field_validator("destination")
    @classmethod
    def _destination(cls, value: str) -> str:
        parse_destination(value)
        return value

    @model_validator(mode="after")
    def _fits_destination(self) -> OutputSpec:
        scheme = parse_destination(self.destination).scheme
        if scheme == "hf" and self.credentials_secret is None:
            raise ValueError(HF_NEEDS_SECRET)
        if scheme == "pvc" and (self.credentials_secret is not None or self.endpoint is not None
                                or self.region is not None or self.plain_http is not None):
            raise ValueError(PVC_NO_SECRET)
        if self.endpoint is not None and scheme not in ("s3", "hf"):
            raise ValueError(ENDPOINT_ONLY)
        if self.plain_http is not None and scheme != "oci":
            raise ValueError(PLAIN_HTTP_ONLY)
        if self.region is not None and scheme != "s3":
            raise ValueError(REGION_ONLY)
        return self

    @property
    def parsed(self) -> Destination:
        return parse_destination(self.destination)
