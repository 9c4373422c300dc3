"""The server's health endpoint, as both executors (the operator and `grpo run`) check it before they let a
trainer start."""

from __future__ import annotations

import httpx
from pydantic import ValidationError

from grpo_api.lifecycle import HealthCheck
from grpo_api.protocol import HealthResponse

#: Short: a reconcile waits for this, and a server that is slow to answer is not ready anyway.
DEFAULT_TIMEOUT_SECONDS = 2.0


class HealthClient:
    """GET <base url><health path>, parsed into the lifecycle's HealthCheck. Safe to share across threads."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        # No keep-alive: a check is a few seconds apart, and a pooled connection open when the server dies
        # leaves the server's port in TIME_WAIT on its side (a local run's port could not be bound again).
        self._client = httpx.Client(
            timeout=timeout, follow_redirects=False, limits=httpx.Limits(max_keepalive_connections=0)
        )

    def check(self, base_url: str, path: str) -> HealthCheck:
        url = base_url.rstrip("/") + "/" + path.lstrip("/")
        try:
            response = self._client.get(url)
        except httpx.HTTPError as exc:
            return HealthCheck(reachable=False, error=f"{type(exc).__name__}: {exc}"[:300])
        try:
            body: HealthResponse | None = HealthResponse.model_validate_json(response.content)
        except ValidationError:
            body = None
        return HealthCheck(reachable=True, status_code=response.status_code, body=body)

    def close(self) -> None:
        self._client.close()
