"""Health, identity and metrics: read-only, no token."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from grpo_api.protocol import HealthResponse
from grpo_server.registry import BASE_SUFFIX
from grpo_server.routes import add_routes
from grpo_server.sampling import MAX_LOGPROBS
from grpo_server.schemas import ModelCard, ModelList, ServerInfo, WorldSizeResponse
from grpo_server.service import GenerationService

#: The name of the health check's routes (app.py keeps spec.server.healthPath for them alone).
HEALTH_ROUTE_NAME = "health"


def router(service: GenerationService) -> APIRouter:
    settings = service.settings
    api = APIRouter()

    def health() -> JSONResponse:
        status_code, body = service.health()
        return JSONResponse(status_code=status_code, content=body.model_dump(mode="json"))

    # spec.server.healthPath is where probes and both executors look: served too when it is another path.
    paths = ("/health/", "/health")
    custom = settings.server.health_path
    add_routes(
        api,
        paths if custom in paths else (*paths, custom),
        health,
        methods=["GET"],
        response_model=HealthResponse,
        responses={503: {"model": HealthResponse, "description": "Engine loading or unhealthy."}},
        summary="Health: 200 only when a generation can be served",
        tags=["health"],
        name=HEALTH_ROUTE_NAME,
    )

    def world_size() -> WorldSizeResponse:
        return WorldSizeResponse(world_size=service.require_engine().world_size)

    add_routes(
        api, ("/get_world_size", "/get_world_size/"), world_size, methods=["GET"], response_model=WorldSizeResponse,
        tags=["info"],
    )

    @api.get("/v1/models", response_model=ModelList, tags=["openai"])
    def models() -> ModelList:
        created = int(service.started_at)
        max_len = service.limits.max_model_len if service.limits else None
        served = settings.served_model_name
        cards = [ModelCard(id=served, created=created, root=str(settings.model_dir), max_model_len=max_len)]
        cards.append(ModelCard(id=served + BASE_SUFFIX, created=created, root=str(settings.model_dir), parent=served))
        cards += [
            ModelCard(id=name, created=created, root=a.info.path, parent=served)
            for name, a in zip(service.registry.model_names(), service.registry.loaded, strict=True)
        ]
        return ModelList(data=cards)

    @api.get("/server_info", response_model=ServerInfo, tags=["openai"])
    def server_info(config_format: Literal["json", "text"] = Query(default="text")) -> ServerInfo:
        limits = service.limits
        config: dict[str, Any] = {
            "model_config": {
                "model": str(settings.model_dir),
                "served_model_name": settings.served_model_name,
                "logprobs_mode": "processed_logprobs",
                "max_model_len": limits.max_model_len if limits else None,
                "dtype": str(settings.server.dtype),
                "max_logprobs": MAX_LOGPROBS,
            },
            "lora_config": service.lora_config(),
            "parallel_config": {
                "tensor_parallel_size": settings.server.tensor_parallel_size,
                "data_parallel_size": settings.server.data_parallel_size,
            },
            "cache_config": {"enable_prefix_caching": settings.server.enable_prefix_caching},
            # whole weights through /init_weight_transfer_engine and the update routes, where the engine takes them
            "weight_transfer_config": service.weight_transfer_config(),
        }
        return ServerInfo(
            vllm_config=config if config_format == "json" else repr(config),
            engine=service.engine_kind,
            boot_id=service.boot_id,
        )

    @api.get("/metrics", response_class=Response, tags=["metrics"])
    def prometheus_metrics() -> Response:
        return Response(content=generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return api
