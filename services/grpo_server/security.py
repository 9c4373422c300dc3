"""Bearer-token checks for mutating endpoints (and generation, when the run asks for it).

With no token configured the mutating endpoints stay closed: a server that cannot
authenticate its trainer refuses adapter loads rather than accept anyone's.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from grpo_server.errors import ApiError

bearer = HTTPBearer(auto_error=False, description="The run's token (Secret, $GRPO_TOKEN or tokenFile).")

Check = Callable[[HTTPAuthorizationCredentials | None], Awaitable[None]]


def token_valid(expected: str | None, credentials: HTTPAuthorizationCredentials | None) -> bool:
    if expected is None or credentials is None or credentials.scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(credentials.credentials.encode(), expected.encode())


def require_token(expected: str | None, *, enabled: bool = True) -> Check:
    """A FastAPI dependency answering 401 unless the request carries the token (no-op when not enabled)."""

    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
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
        if not token_valid(expected, credentials):
            raise ApiError(
                401, "unauthorized", "missing or wrong bearer token (Authorization: Bearer <token>)",
                {"WWW-Authenticate": "Bearer"},
            )

    return check
