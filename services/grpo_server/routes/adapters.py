"""Adapter load, clear and prefix-cache reset: mutating, so every route needs the run's token (and refuses a
request of an earlier attempt)."""

from __future__ import annotations

from fastapi import APIRouter

from grpo_api.protocol import SetAdapterRequest, SetAdapterResponse
from grpo_server.routes import add_routes, mutating
from grpo_server.schemas import ClearAdapterResponse, ResetPrefixCacheResponse
from grpo_server.service import GenerationService


def router(service: GenerationService) -> APIRouter:
    api = APIRouter(dependencies=mutating(service), tags=["adapters"])

    async def set_adapter(body: SetAdapterRequest) -> SetAdapterResponse:
        return await service.set_adapter(body)

    add_routes(
        api,
        ("/set_lora_adapter/", "/set_lora_adapter"),
        set_adapter,
        methods=["POST"],
        response_model=SetAdapterResponse,
        summary="Validate, load and activate an adapter version before answering",
    )

    async def clear_adapter() -> ClearAdapterResponse:
        await service.clear_adapter()
        return ClearAdapterResponse(boot_id=service.boot_id)

    add_routes(
        api, ("/clear_lora_adapter/", "/clear_lora_adapter"), clear_adapter, methods=["POST"],
        response_model=ClearAdapterResponse,
    )

    async def reset_prefix_cache() -> ResetPrefixCacheResponse:
        success = await service.reset_prefix_cache()
        message = "prefix cache reset" if success else "prefix cache busy (requests running); not reset"
        return ResetPrefixCacheResponse(success=success, message=message)

    add_routes(
        api, ("/reset_prefix_cache", "/reset_prefix_cache/"), reset_prefix_cache, methods=["POST"],
        response_model=ResetPrefixCacheResponse,
    )
    return api
