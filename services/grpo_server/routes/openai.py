"""`POST /v1/completions` and `/v1/chat/completions`: the OpenAI subset TRL's client and `openai` use."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from grpo_server.disconnect import cancel_on_disconnect
from grpo_server.responses import TokenNamer, chat_response, completion_response
from grpo_server.routes import generation_router, tagged, tagging
from grpo_server.sampling import check_prompts
from grpo_server.schemas import ChatRequest, ChatResponse, CompletionRequest, CompletionResponse
from grpo_server.service import GenerationService


def router(service: GenerationService) -> APIRouter:
    api = generation_router(service, "openai")

    @api.post("/v1/completions", response_model=CompletionResponse)
    @cancel_on_disconnect
    async def completions(body: CompletionRequest, raw_request: Request) -> Response:
        limits = service.require_limits()
        encoder = service.require_encoder()
        prompts = await encoder.prompts(body.prompt)
        check_prompts(prompts, limits)
        options = body.options(prompts, limits)
        generated = await service.generate(body.model, prompts, options)
        names = TokenNamer(encoder.decode_token, as_ids=body.return_tokens_as_token_ids)
        tag = tagging(service, body.model, generated, "cmpl")
        return await tagged(
            lambda: completion_response(
                generated.results,
                tag,
                names,
                with_logprobs=body.logprobs is not None,
                return_token_ids=body.return_token_ids,
            ),
            generated,
            service.boot_id,
        )

    @api.post("/v1/chat/completions", response_model=ChatResponse)
    @cancel_on_disconnect
    async def chat_completions(body: ChatRequest, raw_request: Request) -> Response:
        limits = service.require_limits()
        encoder = service.require_encoder()
        prompt = await encoder.chat(
            body.messages,
            chat_template=body.chat_template,
            template_kwargs=body.chat_template_kwargs,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=body.tools,
        )
        check_prompts([prompt], limits, field="messages")
        options = body.options(prompt, limits)
        generated = await service.generate(body.model, [prompt], options)
        names = TokenNamer(encoder.decode_token, as_ids=body.return_tokens_as_token_ids)
        tag = tagging(service, body.model, generated, "chatcmpl")
        return await tagged(
            lambda: chat_response(
                generated.results[0],
                tag,
                names,
                with_logprobs=body.logprobs,
                return_token_ids=body.return_token_ids,
            ),
            generated,
            service.boot_id,
        )

    return api
