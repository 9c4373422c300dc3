"""`POST /generate/`: the Axolotl/TRL-legacy native generation endpoint."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from grpo_server.disconnect import cancel_on_disconnect
from grpo_server.responses import generate_response
from grpo_server.routes import generation_router, tagged, tagging
from grpo_server.sampling import check_prompts
from grpo_server.schemas import GenerateRequest, GenerateResponse
from grpo_server.service import GenerationService


def router(service: GenerationService) -> APIRouter:
    api = generation_router(service, "native")

    @api.post("/generate/", response_model=GenerateResponse)
    @cancel_on_disconnect
    async def generate(body: GenerateRequest, raw_request: Request) -> Response:
        limits = service.require_limits()
        prompts = await service.require_encoder().prompts(body.prompts, field="prompts")
        check_prompts(prompts, limits, field="prompts")
        options = body.options(prompts, limits)
        generated = await service.generate(body.model, prompts, options)
        tag = tagging(service, body.model, generated, "gen")
        with_logprobs = body.top_logprobs() is not None
        return await tagged(
            lambda: generate_response(generated.results, tag, with_logprobs=with_logprobs), generated, service.boot_id
        )

    return api
