"""What the export step (`grpo export`) and its executors share: the variables it reads, and the result
line it leaves as its last words (its termination message), which the executors copy into status.output.

Exit codes are the initializer's (`grpo_api.prepare_protocol`): 0 exported, 1 transient (the network, a
5xx: the Job retries), 2 permanent (credentials refused, a destination that holds something else, no
adapter to export: no retry fixes it).
"""

from __future__ import annotations

import json
from typing import Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: Where the claim of a pvc:// destination is mounted (the operator), or the folder that stands for it
#: (`grpo run`: <run dir>/claims/<claim>).
ENV_EXPORT_CLAIM_ROOT: Final = "GRPO_EXPORT_CLAIM_ROOT"
#: The credentials, each from a key of spec.output.credentialsSecret (never a literal value).
ENV_EXPORT_TOKEN: Final = "GRPO_EXPORT_TOKEN"  # hf://: key token
ENV_EXPORT_USERNAME: Final = "GRPO_EXPORT_USERNAME"  # oci://: key username
ENV_EXPORT_PASSWORD: Final = "GRPO_EXPORT_PASSWORD"  # oci://: key password
#: s3://: boto3's own variables, from keys accessKeyId, secretAccessKey and sessionToken.
S3_CREDENTIAL_ENV: Final = (
    ("AWS_ACCESS_KEY_ID", "accessKeyId"), ("AWS_SECRET_ACCESS_KEY", "secretAccessKey"),
    ("AWS_SESSION_TOKEN", "sessionToken"),
)
#: The variable of each Secret key, by destination scheme; a key marked optional may be missing.
CREDENTIAL_KEYS: Final[dict[str, tuple[tuple[str, str, bool], ...]]] = {
    "hf": ((ENV_EXPORT_TOKEN, "token", False),),
    "oci": ((ENV_EXPORT_USERNAME, "username", False), (ENV_EXPORT_PASSWORD, "password", False)),
    "s3": tuple((env, key, key == "sessionToken") for env, key in S3_CREDENTIAL_ENV),
    "pvc": (),
}
#: The file naming every exported file's size and sha256, uploaded beside them; its digest is the export's.
EXPORT_MANIFEST_NAME: Final = "grpo-export.json"
#: The first word of the result line.
RESULT_PREFIX: Final = "grpo-export-result "


class ExportResult(BaseModel):
    """Where the result went: the export step's last words when it succeeded."""

    model_config = ConfigDict(extra="ignore")

    uri: str = Field(max_length=2048)
    form: str = Field(max_length=16)
    digest: str = Field(max_length=128, pattern=r"^sha256:[0-9a-f]{64}$")
    size: int = Field(ge=0)
    files: int = Field(ge=0)
    source: str = Field(default="", max_length=1024)

    def line(self) -> str:
        return RESULT_PREFIX + json.dumps(self.model_dump(mode="json"), sort_keys=True)


def parse_result(text: str) -> ExportResult | None:
    """The result line in text (a termination message or a log), the last one if several; None if none."""
    for line in reversed(text.splitlines()):
        if line.startswith(RESULT_PREFIX):
            try:
                return ExportResult.model_validate_json(line[len(RESULT_PREFIX):])
            except (ValidationError, ValueError):
                return None
    return None
