"""Object storage as the spec names it: s3://BUCKET[/PREFIX] (spec.output's destination and the sources), the
S3 service's endpoint, region and credentials Secret (`S3Access`), and https:// file URLs (a dataset file or a
reward module of the sources).

Names are checked as their services check them, and stricter: buckets by S3's naming rules, path segments that
cannot climb (no `.`, `..` or empty segment; they start with a letter, digit or '_'), hosts as DNS names or IPv4
addresses, no query, fragment or user in a URL (a presigned URL carries a credential, which the spec never holds).
The patterns hold no backslashes: CEL rules embed them in string literals.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from grpo_api.spec.api import ApiModel
from grpo_api.spec.names import DNS_SUBDOMAIN_PATTERN

#: A path segment under a claim, a bucket or a web host: starts with a letter, digit or '_', so never '.' or '..'.
SEGMENT = r"[A-Za-z0-9_][-A-Za-z0-9_.]{0,254}"
PATH = rf"(/{SEGMENT})*"
#: S3 bucket names (docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html): 3-63 characters
#: of a-z, 0-9, '.' and '-', starting and ending with a letter or digit, no '..' (checked apart).
BUCKET = r"[a-z0-9][-a-z0-9.]{1,61}[a-z0-9]"
S3_PATTERN = rf"^s3://(?P<bucket>{BUCKET})(?P<path>{PATH})$"
#: The same without group names, to build the source patterns from.
S3_URI = rf"s3://{BUCKET}{PATH}"
#: '--' and '..' are refused in a whole s3:// URI: S3 refuses '..' in bucket names and keeps '--' suffixes
#: (--x-s3, --ol-s3) for its own buckets.
DOUBLE_MESSAGE = "may not hold '--' or '..' (hf:// repository ids and s3:// buckets refuse them)"
ENDPOINT_PATTERN = r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[-A-Za-z0-9_.~/]*)?$"
#: An S3 region: AWS's (us-east-1), R2's `auto`, a MinIO or Ceph zone group's name.
REGION_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,62}[a-z0-9])?$"
#: A web host: a DNS name (labels of letters, digits and '-') or an IPv4 address, an optional port.
_HOST = r"[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?([.][A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?)*"
HTTPS_PATTERN = rf"^https://(?P<host>{_HOST})(?P<port>:[0-9]{{1,5}})?(?P<path>(/{SEGMENT})+)$"
HTTPS_URI = rf"https://{_HOST}(:[0-9]{{1,5}})?(/{SEGMENT})+"


#: The values of spec.output's and the sources' S3 settings: a Secret's name, an endpoint URL, a region.
SecretName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)]
EndpointUrl = Annotated[str, Field(max_length=512, pattern=ENDPOINT_PATTERN)]
Region = Annotated[str, Field(max_length=64, pattern=REGION_PATTERN)]
REGION_TEXT = "the region requests are signed for (AWS: the bucket's, default us-east-1; R2: auto)."


@dataclass(frozen=True)
class BucketLocation:
    """An s3:// URI's bucket and prefix (no leading or trailing '/', "" for the bucket's root)."""

    bucket: str
    prefix: str = ""

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")


def parse_s3(value: str) -> BucketLocation | None:
    """The bucket and prefix of an s3:// URI, None when it is not one (the same checks as the CRD's)."""
    if "--" in value or ".." in value:
        return None
    m = re.fullmatch(S3_PATTERN, value)
    return BucketLocation(m["bucket"], m["path"].lstrip("/")) if m else None


def https_file_name(value: str) -> str | None:
    """The last path segment of an https:// file URL (the name the file lands under), None when it is not one."""
    m = re.fullmatch(HTTPS_PATTERN, value)
    return m["path"].rsplit("/", 1)[-1] if m else None


class S3Access(ApiModel):
    """How an s3:// source is read: the credentials Secret, the endpoint of an S3 service other than AWS, the
    region. The same Secret keys and endpoint as spec.output's s3:// destination."""

    credentials_secret: SecretName | None = Field(
        default=None,
        description="A Secret in the run's namespace with keys accessKeyId and secretAccessKey (sessionToken "
        "optional); only the initializer gets them. Without it: the pod's own identity (a web identity token, "
        "an instance role), else unsigned requests (a public bucket). `grpo run` reads AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY from its own environment instead.",
    )
    endpoint: EndpointUrl | None = Field(
        default=None,
        description="The endpoint URL of an S3 service other than AWS (MinIO, Ceph RGW, Cloudflare R2, Google "
        "Cloud Storage's XML API); requests to it name the bucket in the path.",
    )
    region: Region | None = Field(default=None, description=REGION_TEXT[0].upper() + REGION_TEXT[1:])
