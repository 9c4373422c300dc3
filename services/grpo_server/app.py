"""The FastAPI application: lifespan, middleware, error handlers and the routers of `grpo_server.routes`.

Endpoints (native, Axolotl-compatible; vLLM's runtime-LoRA and RL routes; the OpenAI subset TRL 1.16 uses).
Every route is listed (tests/server/test_routes.py holds the list to the app's routes); a path with and
without its trailing slash is one line:

    GET  /health, /health/                 503 while loading, 200 when a generation can be served (also at
                                           spec.server.healthPath)
    GET  /get_world_size, /get_world_size/
    GET  /v1/models
    GET  /server_info                      ?config_format=json|text
    GET  /metrics                          Prometheus (server and, with vLLM, `vllm:` metrics)
    POST /set_lora_adapter/, /set_lora_adapter       load + activate an adapter version (token)
    POST /clear_lora_adapter/, /clear_lora_adapter   back to the base model (token)
    POST /reset_prefix_cache, /reset_prefix_cache/   (token)
    POST /v1/load_lora_adapter             vLLM's runtime LoRA load (token)
    POST /v1/unload_lora_adapter           (token)
    POST /pause                            new generations wait for /resume (token)
    POST /resume                           (token)
    GET  /is_paused
    POST /init_weight_transfer_engine      vLLM's weight transfer: whole weights (token)
    POST /start_weight_update              (token)
    POST /update_weights                   (token)
    POST /finish_weight_update             (token)
    POST /generate/                        prompt-major ids and logprobs
    POST /v1/completions
    POST /v1/chat/completions
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute

from grpo_api.protocol import ADAPTER_VERSION_HEADER, ATTEMPT_HEADER, BOOT_ID_HEADER, ErrorResponse
from grpo_server.errors import install_error_handlers
from grpo_server.middleware import BodyLimitMiddleware, RequestMetricsMiddleware, UnexpectedErrorMiddleware
from grpo_server.registry import BASE_SUFFIX
from grpo_server.routes import adapters, health, native, openai, rlhf
from grpo_server.routes.health import HEALTH_ROUTE_NAME
from grpo_server.service import GenerationService
from grpo_server.settings import GRACEFUL_SHUTDOWN_SECONDS

log = logging.getLogger(__name__)

DESCRIPTION = f"""
Generation server of a GRPORun: the base model plus the policy's LoRA adapter versions.

**Which policy a generation uses** (the `model` field of every generation request):
- omitted, or the served model name: the adapter active when the request is admitted (the base model if none);
- `policy-v<N>`: adapter version N, which must be loaded (see `GET /v1/models`), else 404;
- `<served model name>{BASE_SUFFIX}`: the base model.

A request keeps the adapter it was admitted with until it finishes, even if a newer version is
activated meanwhile; requests admitted after `POST /set_lora_adapter/` returns use the new version.
Every generation response carries `{BOOT_ID_HEADER}` and `{ADAPTER_VERSION_HEADER}` headers
(version number or `none`) and the same as `boot_id` / `adapter_version` in the body.

Mutating endpoints need `Authorization: Bearer <token>`; generation needs it only when the run sets
`server.authenticateGeneration`. A request whose `{ATTEMPT_HEADER}` names an earlier attempt of the run than
the server's own is refused (409 `attempt_superseded`). Errors are `{{"error": reason, "message": detail}}`.
"""

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 413, 422, 500, 503)
}


def create_app(service: GenerationService) -> FastAPI:
    settings = service.settings

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The listener starts right after this yields; the engine loads meanwhile (health says 503).
        loading = asyncio.create_task(service.start(), name="engine-load")
        yield
        if not loading.done():
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await loading
        try:
            await asyncio.wait_for(service.shutdown(), GRACEFUL_SHUTDOWN_SECONDS)
        except TimeoutError:
            log.warning("engine shutdown did not finish in %ss", GRACEFUL_SHUTDOWN_SECONDS)

    app = FastAPI(
        title="grpo-operator generation server",
        description=DESCRIPTION,
        version="0.1.0",
        lifespan=lifespan,
        responses=ERRORS,
    )
    install_error_handlers(app)
    app.add_middleware(UnexpectedErrorMiddleware)  # innermost of these three (added first)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetricsMiddleware)
    routers = [family.router(service) for family in (health, adapters, rlhf, native, openai)]
    _check_health_path(settings.server.health_path, routers)
    for router in routers:
        app.include_router(router)
    return app


class HealthPathTaken(ValueError):
    """spec.server.healthPath is the path of another endpoint: a probe there would not see the health check."""


def _check_health_path(path: str, routers: list[APIRouter]) -> None:
    """No endpoint but the health check (routes named `health`) may serve `path`."""
    routes = [r for router in routers for r in router.routes if isinstance(r, APIRoute)]
    if any(r.path == path and r.name != HEALTH_ROUTE_NAME for r in routes):
        raise HealthPathTaken(f"spec.server.healthPath {path!r} is already an endpoint of the server; choose a path "
                              "of its own (the default /health/ always answers too)")
