"""HTTP client of the generation server (httpx, explicit timeouts, bounded retries).

Speaks the project's protocol (`grpo_api.protocol`): `/health/`, `/set_lora_adapter/`,
vLLM's weight-transfer routes (`grpo_api.weight_transfer`) and the OpenAI-shaped
`/v1/completions` with token-id prompts. Every generation answer carries the server's
boot id and the adapter and weights versions that produced it, so the caller can refuse
a batch from the wrong policy. Every request carries the trainer's attempt, so a server of a
later attempt refuses a trainer process that outlived its own (409 `attempt_superseded`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import ValidationError

from grpo_api.protocol import (
    ADAPTER_VERSION_HEADER,
    ATTEMPT_HEADER,
    BOOT_ID_HEADER,
    CLIENT_KEEPALIVE_SECONDS,
    ErrorResponse,
    HealthResponse,
    SetAdapterRequest,
    SetAdapterResponse,
)
from grpo_api.weight_transfer import WEIGHTS_VERSION_HEADER, WeightTransferResponse
from grpo_trainer.errors import ServerUnavailable, TrainingFailed

#: Seconds to wait between retries: doubles from the first value up to the cap.
BACKOFF_START_SECONDS = 0.5
BACKOFF_CAP_SECONDS = 5.0
#: Timeout of control calls (health, adapter load) that do no generation.
CONTROL_TIMEOUT_SECONDS = 60.0
#: Longest wait for a TCP connection: the address of a replica that is gone may drop packets silently.
CONNECT_TIMEOUT_SECONDS = 5.0


def _timeout(seconds: float) -> httpx.Timeout:
    return httpx.Timeout(seconds, connect=min(seconds, CONNECT_TIMEOUT_SECONDS))


@dataclass(frozen=True)
class Completions:
    """One generation answer: n completions per prompt, prompt-major."""

    completion_ids: list[list[int]]
    logprobs: list[list[float | None]]
    boot_id: str
    adapter_version: int | None
    seconds: float
    #: The pushed weights that generated it (full fine-tuning); 0 or None: the weights read from disk.
    weights_version: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.completion_ids)


class AdapterRefused(TrainingFailed):
    """The server answered the load trigger with a 4xx: retrying the same request cannot help."""

    def __init__(self, status: int, error: str, message: str, *, what: str = "the adapter") -> None:
        super().__init__(f"server refused {what} ({status} {error}): {message}")
        self.status = status
        self.error = error


def _error_text(response: httpx.Response) -> tuple[str, str]:
    try:
        err = ErrorResponse.model_validate_json(response.content)
        return err.error, err.message
    except (ValidationError, ValueError):
        return f"http_{response.status_code}", response.text[:500]


def _optional_int(value: object) -> int | None:
    if value is None or value == "" or str(value).lower() in {"none", "null"}:
        return None
    return int(str(value))


def backoff_delays(total_seconds: float) -> list[float]:
    """Waits between attempts whose sum stays within total_seconds (at least one retry)."""
    delays: list[float] = []
    delay, spent = BACKOFF_START_SECONDS, 0.0
    while spent + delay <= total_seconds or not delays:
        delays.append(delay)
        spent += delay
        delay = min(delay * 2, BACKOFF_CAP_SECONDS)
    return delays


class ServerClient:
    """The trainer's view of the run's server."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None,
        generation_timeout: float,
        on_retry: Callable[[], None] | None = None,
        attempt: int | None = None,
    ) -> None:
        """attempt: the trainer's, sent with every request (None: untagged, as a client written for vLLM)."""
        self.base_url = base_url.rstrip("/")
        self.generation_timeout = generation_timeout
        self._on_retry = on_retry
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if attempt is not None:
            headers[ATTEMPT_HEADER] = str(attempt)
        # One connection pool per thread of use is not needed: httpx.Client is thread-safe for requests. Idle
        # connections are dropped before the server closes them (grpo_api.protocol.CLIENT_KEEPALIVE_SECONDS):
        # otherwise a load trigger sent after a long step on a connection the server is closing at that moment
        # fails as unreachable.
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, trust_env=False,
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=20,
                                keepalive_expiry=CLIENT_KEEPALIVE_SECONDS),
        )

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------------------------------ health

    def health(self) -> HealthResponse:
        """One `/health/` call; raises httpx errors, or TrainingFailed for a non-JSON answer."""
        response = self._http.get("/health/", timeout=_timeout(min(CONTROL_TIMEOUT_SECONDS, self.generation_timeout)))
        response.raise_for_status()
        try:
            return HealthResponse.model_validate_json(response.content)
        except ValidationError as exc:
            raise TrainingFailed(f"{self.base_url}/health/ answered an unexpected body: {exc}") from exc

    def server_info(self) -> dict[str, Any]:
        """vLLM-style `/server_info` (TRL reads `model_config.logprobs_mode` from it)."""
        response = self._http.get(
            "/server_info", params={"config_format": "json"}, timeout=_timeout(CONTROL_TIMEOUT_SECONDS)
        )
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        config = body.get("vllm_config", body)
        assert isinstance(config, dict)
        return config

    # ----------------------------------------------------------------------------------------- adapter

    def set_adapter(self, request: SetAdapterRequest) -> SetAdapterResponse:
        """POST the load trigger once. 4xx: AdapterRefused; transport errors and 5xx: httpx errors."""
        response = self._http.post(
            "/set_lora_adapter/",
            json=request.model_dump(mode="json", exclude_none=True),
            timeout=_timeout(max(CONTROL_TIMEOUT_SECONDS, self.generation_timeout)),
        )
        if 400 <= response.status_code < 500:
            error, message = _error_text(response)
            raise AdapterRefused(response.status_code, error, message)
        response.raise_for_status()
        return SetAdapterResponse.model_validate_json(response.content)

    # ---------------------------------------------------------------------------------- weight transfer

    def weight_transfer(self, route: str, body: dict[str, Any], *, timeout: float | None = None
                        ) -> WeightTransferResponse:
        """POST one of vLLM's weight-transfer routes (`init_weight_transfer_engine`, `start_weight_update`,
        `update_weights`, `finish_weight_update`) once. 4xx: AdapterRefused naming the weights; transport
        errors and 5xx: httpx errors."""
        response = self._http.post(
            f"/{route}", json=body,
            timeout=_timeout(timeout if timeout is not None else max(CONTROL_TIMEOUT_SECONDS, self.generation_timeout)),
        )
        if 400 <= response.status_code < 500:
            error, message = _error_text(response)
            raise AdapterRefused(response.status_code, error, message, what=f"the weights ({route})")
        response.raise_for_status()
        return WeightTransferResponse.model_validate_json(response.content)

    # -------------------------------------------------------------------------------------- generation

    def completions(
        self,
        *,
        model: str,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: dict[str, Any],
        retry: bool = True,
        timeout: float | None = None,
    ) -> Completions:
        """`POST /v1/completions` with token-id prompts; retries transport errors and 5xx within the timeout
        (with retry=False one try: the caller sends the work elsewhere). timeout: of the request, default
        the generation timeout."""
        body = {
            "model": model,
            "prompt": [list(p) for p in prompts],
            "n": n,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **sampling,
        }
        delays = backoff_delays(self.generation_timeout) if retry else []
        timeout = self.generation_timeout if timeout is None else timeout
        last_error = ""
        for attempt in range(len(delays) + 1):
            if attempt:
                if self._on_retry:
                    self._on_retry()
                time.sleep(delays[attempt - 1])
            started = time.monotonic()
            try:
                response = self._http.post("/v1/completions", json=body, timeout=_timeout(timeout))
            except httpx.HTTPError as exc:
                last_error = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code >= 500:
                last_error = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            if response.status_code >= 400:
                error, message = _error_text(response)
                raise TrainingFailed(
                    f"generation server refused the request ({response.status_code} {error}): {message}"
                )
            return self._parse(response, len(prompts) * n, time.monotonic() - started)
        raise ServerUnavailable(
            f"generation at {self.base_url}/v1/completions failed {len(delays) + 1} times within about "
            f"{self.generation_timeout:g}s (trainer.generationTimeoutSeconds); last error: {last_error}"
        )

    def _parse(self, response: httpx.Response, expected: int, seconds: float) -> Completions:
        data = response.json()
        choices = data.get("choices") or []
        if len(choices) != expected:
            raise TrainingFailed(f"generation server returned {len(choices)} completions, expected {expected}")
        completion_ids: list[list[int]] = []
        logprobs: list[list[float | None]] = []
        for choice in choices:
            ids = [int(t) for t in choice["token_ids"]]
            lps = (choice.get("logprobs") or {}).get("token_logprobs")
            if lps is None or len(lps) != len(ids):
                raise TrainingFailed(
                    "generation server returned no per-token logprobs (needed for the importance-sampling "
                    "correction)"
                )
            completion_ids.append(ids)
            logprobs.append([None if lp is None else float(lp) for lp in lps])
        boot_id = response.headers.get(BOOT_ID_HEADER) or str(data.get("boot_id") or "")
        version_raw = response.headers.get(ADAPTER_VERSION_HEADER, data.get("adapter_version"))
        return Completions(
            completion_ids=completion_ids,
            logprobs=logprobs,
            boot_id=boot_id,
            adapter_version=_optional_int(version_raw),
            seconds=seconds,
            weights_version=_optional_int(response.headers.get(WEIGHTS_VERSION_HEADER)),
        )
