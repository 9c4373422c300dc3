"""The trainer image's one S3 client, for the initializer's s3:// sources and the export step's s3:// destination:
boto3 (its SigV4 signing, its retries) with the endpoint, region and credentials the spec gives, every request
bounded in time and retried a bounded number of times, and what an S3 error means: permanent (credentials
refused, no such bucket or key: no retry fixes it) or transient (the network, a 5xx, throttling).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from grpo_trainer.errors import causes

#: Seconds to open a connection, and to wait for each read of an answer (boto3's default is 60 for both).
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
#: Tries of one request in all (boto3's standard retry mode: throttling, 5xx and connection errors, with backoff).
MAX_ATTEMPTS = 3
#: S3 error codes that say the credentials or their permissions are refused.
_ACCESS_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
                           "ExpiredToken", "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem",
                           "InvalidSecurity", "AuthorizationHeaderMalformed"})
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_BUSY_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
                         "RequestTimeTooSkewed"})


@dataclass(frozen=True)
class S3Credentials:
    access_key_id: str
    secret_access_key: str
    session_token: str | None = None


def credentials_from_env(names: list[tuple[str, str, bool]]) -> S3Credentials | None:
    """The credentials in the variables `names` ((variable, Secret key, optional), as
    grpo_api.sources.s3_credential_env gives them); None when a required one is unset or empty."""
    values = {key: os.environ.get(env, "").strip() for env, key, _ in names}
    required = [key for _, key, optional in names if not optional]
    if not all(values[key] for key in required):
        return None
    return S3Credentials(values["accessKeyId"], values["secretAccessKey"], values.get("sessionToken") or None)


def s3_client(*, endpoint: str | None, region: str | None, credentials: S3Credentials | None = None) -> Any:
    """A boto3 S3 client. Without `credentials`, boto3's own chain (AWS_* variables, a web identity token, an
    instance role), and unsigned requests when it finds none (a public bucket). An endpoint other than AWS's is
    spoken to with the bucket in the path (MinIO, Ceph, R2 and GCS take it; a bucket name as a host name
    needs DNS the cluster seldom has)."""
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    config = Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                    retries={"max_attempts": MAX_ATTEMPTS, "mode": "standard"},
                    s3={"addressing_style": "path"} if endpoint else None)
    session = boto3.session.Session()  # credentials read now, not cached across clients
    if credentials is not None:
        return session.client("s3", endpoint_url=endpoint, region_name=region, config=config,
                              aws_access_key_id=credentials.access_key_id,
                              aws_secret_access_key=credentials.secret_access_key,
                              aws_session_token=credentials.session_token)
    if session.get_credentials() is None:
        config = config.merge(Config(signature_version=UNSIGNED))
    return session.client("s3", endpoint_url=endpoint, region_name=region, config=config)


@dataclass(frozen=True)
class S3ErrorInfo:
    permanent: bool
    reason: str
    status: int | None = None

    def __str__(self) -> str:
        return self.reason + (f" (HTTP {self.status})" if self.status is not None else "")


def classify_s3_error(exc: BaseException) -> S3ErrorInfo:
    """What an error of boto3 (or one raised around it) means: permanent or transient, and why in words."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
        ReadTimeoutError,
    )

    for error in causes(exc):
        if isinstance(error, ClientError):
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(error.response.get("Error", {}).get("Code", ""))
            if code in _ACCESS_CODES or status in (401, 403):
                return S3ErrorInfo(True, f"access denied ({code or 'Forbidden'}): check the credentials and what "
                                   "they may read", status)
            if code == "NoSuchBucket":
                return S3ErrorInfo(True, "no such bucket", status)
            if code in _MISSING_CODES or status == 404:
                return S3ErrorInfo(True, "no such key", status)
            if code == "PreconditionFailed" or status == 412:
                return S3ErrorInfo(False, "the object changed while it was read", status)
            if code in _BUSY_CODES or status in (408, 429) or (status or 0) >= 500:
                return S3ErrorInfo(False, f"the service is busy or failing ({code})", status)
            return S3ErrorInfo(True, f"request refused ({code})", status)
        if isinstance(error, NoCredentialsError | PartialCredentialsError):
            return S3ErrorInfo(True, f"no usable credentials ({error})")
        if isinstance(error, ConnectTimeoutError | ReadTimeoutError):
            return S3ErrorInfo(False, f"timed out ({error})")
        if isinstance(error, EndpointConnectionError):
            return S3ErrorInfo(False, f"cannot connect ({error})")
        if isinstance(error, BotoCoreError):
            return S3ErrorInfo(False, f"network error ({type(error).__name__}: {error})")
    return S3ErrorInfo(False, f"{type(exc).__name__}: {exc}")
