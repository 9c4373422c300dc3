"""Why `grpo prepare` fails, and the table that tells a hub error permanent (exit 2) from transient (exit 1)."""

from __future__ import annotations

import errno
from dataclasses import dataclass

from grpo_trainer.errors import causes

__all__ = ["DownloadStopped", "HubAnswerRefused", "HubErrorInfo", "PrepareFailed", "causes", "classify_hub_error"]


class PrepareFailed(Exception):
    """The run cannot start; permanent: no retry fixes it (exit 2), else transient (exit 1)."""

    def __init__(self, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


class DownloadStopped(Exception):
    """Raised inside huggingface_hub's download of one file when another file of the repository failed."""


class HubAnswerRefused(Exception):
    """Raised inside huggingface_hub's download of one file: the endpoint's answer is refused (the message says
    why); permanent unless said otherwise."""

    def __init__(self, message: str, *, permanent: bool = True) -> None:
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class HubErrorInfo:
    permanent: bool
    reason: str
    status: int | None = None


def classify_hub_error(exc: BaseException) -> HubErrorInfo:
    """Permanent (repository, revision, access, a non-Hub endpoint) or transient (network, 5xx, 429)."""
    import httpx
    from huggingface_hub.errors import (
        DisabledRepoError,
        FileMetadataError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    for error in causes(exc):
        if isinstance(error, HubAnswerRefused):
            return HubErrorInfo(error.permanent, str(error))
        if isinstance(error, HfHubHTTPError):
            response = getattr(error, "response", None)
            status = getattr(response, "status_code", None)
            if isinstance(error, GatedRepoError):
                return HubErrorInfo(True, "gated repository: the token's account has not been granted access", status)
            if isinstance(error, RepositoryNotFoundError):
                if status == 401:
                    return HubErrorInfo(
                        True, "repository not found, or private and the request had no valid token", status
                    )
                return HubErrorInfo(True, "repository not found", status)
            if isinstance(error, RevisionNotFoundError):
                return HubErrorInfo(True, "revision not found (not a branch, tag or commit of the repository)", status)
            if isinstance(error, RemoteEntryNotFoundError):
                return HubErrorInfo(True, "a file the repository lists is missing on the endpoint", status)
            if isinstance(error, DisabledRepoError):
                return HubErrorInfo(True, "the repository is disabled", status)
            if status is not None:
                if status in (408, 429) or status >= 500:
                    return HubErrorInfo(False, "the endpoint is busy or failing", status)
                if status in (401, 403):
                    return HubErrorInfo(True, "access denied: check the token and its permissions", status)
                if status == 404:
                    return HubErrorInfo(True, "repository or revision not found", status)
                if status == 400:
                    return HubErrorInfo(True, "request refused (is the revision a valid branch, tag or commit?)",
                                        status)
                return HubErrorInfo(True, "request refused", status)
        if isinstance(error, FileMetadataError):
            return HubErrorInfo(True, f"the endpoint does not answer like a Hugging Face hub ({error})")
        if isinstance(error, OfflineModeIsEnabled):
            return HubErrorInfo(True, "HF_HUB_OFFLINE is set in the environment")
        if isinstance(error, httpx.TimeoutException):
            return HubErrorInfo(False, f"timed out ({type(error).__name__})")
        if isinstance(error, TimeoutError):
            return HubErrorInfo(False, f"timed out ({error})")
        if isinstance(error, httpx.ConnectError):
            return HubErrorInfo(False, f"cannot connect ({error})")
        if isinstance(error, httpx.TransportError):
            return HubErrorInfo(False, f"network error ({type(error).__name__}: {error})")
        if isinstance(error, HFValidationError):
            return HubErrorInfo(True, f"invalid repository id or revision ({error})")
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                                                          errno.EPERM):
            return HubErrorInfo(True, f"cannot write the files ({error})")
    return HubErrorInfo(False, f"{type(exc).__name__}: {exc}")
