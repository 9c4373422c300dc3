"""Token checks for mutating endpoints (and generation, when the run asks for it).

The run's token travels as `Authorization: Bearer <token>` (our trainer, Axolotl, curl) or as the
password of HTTP Basic auth (any login): clients built on `requests` that send no header of their own,
TRL's `AsyncGRPOTrainer` among them, send Basic auth from a netrc entry (`$NETRC`, `machine <host> login
grpo password <token>`), so they pass the check unchanged.

With no token configured the mutating endpoints stay closed: a server that cannot
authenticate its trainer refuses adapter loads rather than accept anyone's.

Attempts: every attempt of a run gets a fresh server, which learns its attempt from `$GRPO_ATTEMPT`, and our
trainer tags every request with its own (`X-GRPO-Attempt`). A request tagged with an earlier attempt is
refused (409 `attempt_superseded`): a trainer process that outlived its attempt can neither load an adapter
or weights into the next attempt's server nor generate on it. A request without the tag passes: every
trainer of this project sends it, so an untagged request comes from a client written for vLLM (TRL's
AsyncGRPOTrainer, Axolotl's serve script, curl), which knows nothing of attempts and still needs the token.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Awaitable, Callable

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from grpo_api.protocol import ATTEMPT_HEADER
from grpo_server.errors import ApiError

bearer = HTTPBearer(auto_error=False, description="The run's token (Secret, $GRPO_TOKEN or tokenFile).")

Check = Callable[[Request, HTTPAuthorizationCredentials | None], Awaitable[None]]

#: Longest Authorization header read (a Basic header for a 256-character token and login is far shorter).
MAX_AUTHORIZATION = 2048
#: Most digits an attempt header may have.
MAX_ATTEMPT_DIGITS = 9


def _same(given: str, expected: str) -> bool:
    return secrets.compare_digest(given.encode(), expected.encode())


def basic_password(authorization: str) -> str | None:
    """The password of an `Authorization: Basic base64(login:password)` header (None: not Basic, or malformed)."""
    scheme, _, encoded = authorization.partition(" ")
    if scheme.lower() != "basic" or len(authorization) > MAX_AUTHORIZATION:
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    _login, colon, password = decoded.partition(":")
    return password if colon else None


def token_valid(expected: str | None, credentials: HTTPAuthorizationCredentials | None,
                authorization: str | None = None) -> bool:
    """Whether a request carries the token: as a Bearer credential, or as the password of Basic auth."""
    if expected is None:
        return False
    if credentials is not None and credentials.scheme.lower() == "bearer":
        return _same(credentials.credentials, expected)
    password = basic_password(authorization) if authorization else None
    return password is not None and _same(password, expected)


def require_token(expected: str | None, *, enabled: bool = True) -> Check:
    """A FastAPI dependency answering 401 unless the request carries the token (no-op when not enabled)."""

    async def check(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if not enabled:
            return
        if expected is None:
            raise ApiError(
                401,
                "unauthorized",
                "this server has no token configured ($GRPO_TOKEN, $GRPO_TOKEN_FILE or tokenFile): "
                "authenticated endpoints are closed",
                {"WWW-Authenticate": "Bearer"},
            )
        if not token_valid(expected, credentials, request.headers.get("authorization")):
            raise ApiError(
                401, "unauthorized",
                "missing or wrong token (Authorization: Bearer <token>, or Basic auth with the token as password)",
                {"WWW-Authenticate": "Bearer"},
            )

    return check


def require_current_attempt(own: int | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency answering 409 to a request tagged with an attempt before `own` (the server's)."""

    async def check(request: Request) -> None:
        raw = request.headers.get(ATTEMPT_HEADER)
        if own is None or raw is None:
            return
        value = raw.strip()
        if not value.isdigit() or len(value) > MAX_ATTEMPT_DIGITS:
            raise ApiError(400, "invalid_request", f"{ATTEMPT_HEADER} must be a whole number, got {raw[:40]!r}")
        if int(value) < own:
            raise ApiError(
                409, "attempt_superseded",
                f"this server belongs to attempt {own}; a request from attempt {int(value)} ({ATTEMPT_HEADER}) "
                "may not change it or generate on it: that attempt has ended",
            )

    return check
