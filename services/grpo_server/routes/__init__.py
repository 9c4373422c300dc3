"""The server's endpoints, one router per family; `grpo_server.app.create_app` includes them all.

- `health`: health, world size, models, server info, Prometheus metrics;
- `adapters`: adapter load/clear and prefix-cache reset (the run's token);
- `rlhf`: vLLM's `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, `/pause`, `/resume` (the run's
  token) and `/is_paused`, for clients written for `vllm serve` (TRL's AsyncGRPOTrainer);
- `native`: `/generate/` (Axolotl's serve script, TRL ≤ 1.10);
- `openai`: `/v1/completions` and `/v1/chat/completions`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from pydantic import BaseModel

from grpo_api.protocol import ADAPTER_VERSION_HEADER, BOOT_ID_HEADER
from grpo_api.weight_transfer import WEIGHTS_VERSION_HEADER
from grpo_server.responses import Tagging
from grpo_server.security import require_current_attempt, require_token
from grpo_server.service import Generated, GenerationService


def generation_router(service: GenerationService, tag: str) -> APIRouter:
    """A router for generation endpoints: they need the run's token only with server.authenticateGeneration,
    and a request tagged with an earlier attempt than the server's is refused."""
    settings = service.settings
    check = require_token(settings.token, enabled=settings.server.authenticate_generation)
    return APIRouter(dependencies=[Depends(check), Depends(require_current_attempt(settings.attempt))], tags=[tag])


def mutating(service: GenerationService) -> list[Any]:
    """The dependencies of a route that changes the server: the run's token, then the current attempt."""
    return [Depends(require_token(service.settings.token)), Depends(require_current_attempt(service.settings.attempt))]


def add_routes(router: APIRouter, paths: tuple[str, ...], endpoint: Callable[..., Any], **route: Any) -> None:
    """Serve one endpoint at each path (with and without the trailing slash different clients send).

    /docs lists the first path only.
    """
    for index, path in enumerate(paths):
        router.add_api_route(path, endpoint, include_in_schema=index == 0, **route)


def tagging(service: GenerationService, model: str | None, generated: Generated, prefix: str) -> Tagging:
    return Tagging(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=service.response_model_name(model),
        boot_id=service.boot_id,
        adapter_version=generated.adapter_version,
    )


async def tagged(build: Callable[[], BaseModel], generated: Generated, boot_id: str) -> Response:
    """The response body built and serialised on a worker thread (a body holds a few values per sampled
    token: megabytes for a large batch with logprobs), with the boot id, adapter and weights version headers."""
    version = generated.adapter_version
    headers = {BOOT_ID_HEADER: boot_id, ADAPTER_VERSION_HEADER: str(version) if version is not None else "none",
               WEIGHTS_VERSION_HEADER: str(generated.weights_version)}

    def serialise() -> bytes:
        return build().model_dump_json().encode()

    content = await asyncio.to_thread(serialise)
    return Response(content=content, media_type="application/json", headers=headers)
