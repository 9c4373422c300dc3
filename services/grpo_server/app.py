"""The FastAPI application: thin handlers over `GenerationService`.

Endpoints (native, Axolotl-compatible; and the OpenAI subset TRL 1.16 uses):

    GET  /health, /health/                 503 while loading, 200 when a generation can be served
    POST /set_lora_adapter/                load + activate an adapter version (token)
    POST /clear_lora_adapter/              back to the base model (token)
    POST /reset_prefix_cache, /reset_prefix_cache/   (token)
    GET  /get_world_size, /get_world_size/
    POST /generate/                        prompt-major ids and logprobs
    GET  /v1/models
    GET  /server_info                      ?config_format=json|text
    POST /v1/completions
    POST /v1/chat/completions
    GET  /metrics                          Prometheus (server and, with vLLM, `vllm:` metrics)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import Depends, FastAPI, Query
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from grpo_api.protocol import (
    ADAPTER_VERSION_HEADER,
    BOOT_ID_HEADER,
    ErrorResponse,
    HealthResponse,
    SetAdapterRequest,
    SetAdapterResponse,
)
from grpo_server.middleware import BodyLimitMiddleware, RequestMetricsMiddleware
from grpo_server.registry import BASE_SUFFIX
from grpo_server.responses import Tagging, TokenNamer, chat_response, completion_response, generate_response
from grpo_server.sampling import (
    BadRequest,
    check_generation_kwargs,
    check_prompts,
    options_from_fields,
    resolve_max_tokens,
)
from grpo_server.schemas import (
    ChatRequest,
    ChatResponse,
    ClearAdapterResponse,
    CompletionRequest,
    CompletionResponse,
    GenerateRequest,
    GenerateResponse,
    ModelCard,
    ModelList,
    ResetPrefixCacheResponse,
    SamplingFields,
    ServerInfo,
    WorldSizeResponse,
)
from grpo_server.security import require_token
from grpo_server.service import Generated, GenerationService
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
`server.authenticateGeneration`. Errors are `{{"error": reason, "message": detail}}`.
"""

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 413, 422, 503)
}


def add_routes(app: FastAPI, paths: tuple[str, ...], endpoint: Callable[..., Any], **route: Any) -> None:
    """Serve one endpoint at each path (with and without the trailing slash different clients send).

    /docs lists the first path only.
    """
    for index, path in enumerate(paths):
        app.add_api_route(path, endpoint, include_in_schema=index == 0, **route)


def tagged(model: BaseModel, generated: Generated, boot_id: str) -> Response:
    version = generated.adapter_version
    headers = {BOOT_ID_HEADER: boot_id, ADAPTER_VERSION_HEADER: str(version) if version is not None else "none"}
    # pydantic's own JSON serialiser: a generation body carries a few values per sampled token.
    return Response(content=model.model_dump_json(), media_type="application/json", headers=headers)


def token_prompts(prompt: str | list[int] | list[list[int]] | list[str], service: GenerationService) -> list[list[int]]:
    """Any OpenAI prompt form as a list of token-id lists."""
    if isinstance(prompt, str):
        return [service.encode_text(prompt)]
    if not prompt:
        return []
    prompts: list[list[int]] = []
    for item in prompt:
        if isinstance(item, int):  # a single token-id prompt
            return [[int(t) for t in prompt if isinstance(t, int)]]
        prompts.append(service.encode_text(item) if isinstance(item, str) else list(item))
    return prompts


def refuse_unsupported(fields: SamplingFields, *, stream: bool = False, echo: bool = False) -> None:
    if stream:
        raise BadRequest("stream: streaming responses are not supported")
    if echo:
        raise BadRequest("echo: echoing the prompt is not supported")


def create_app(service: GenerationService) -> FastAPI:
    settings = service.settings
    mutating = Depends(require_token(settings.token))
    generating = Depends(require_token(settings.token, enabled=settings.server.authenticate_generation))

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
    from grpo_server.errors import install_error_handlers

    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetricsMiddleware)

    # ---------------------------------------------------------------- health and info

    def health() -> JSONResponse:
        status_code, body = service.health()
        return JSONResponse(status_code=status_code, content=body.model_dump(mode="json"))

    add_routes(
        app,
        ("/health/", "/health"),
        health,
        methods=["GET"],
        response_model=HealthResponse,
        responses={503: {"model": HealthResponse, "description": "Engine loading or unhealthy."}},
        summary="Health: 200 only when a generation can be served",
        tags=["health"],
    )

    def world_size() -> WorldSizeResponse:
        return WorldSizeResponse(world_size=service.require_engine().world_size)

    add_routes(
        app, ("/get_world_size", "/get_world_size/"), world_size, methods=["GET"], response_model=WorldSizeResponse,
        tags=["info"],
    )

    @app.get("/v1/models", response_model=ModelList, tags=["openai"])
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

    @app.get("/server_info", response_model=ServerInfo, tags=["openai"])
    def server_info(config_format: Literal["json", "text"] = Query(default="text")) -> ServerInfo:
        limits = service.limits
        config: dict[str, Any] = {
            "model_config": {
                "model": str(settings.model_dir),
                "served_model_name": settings.served_model_name,
                "logprobs_mode": "processed_logprobs",
                "max_model_len": limits.max_model_len if limits else None,
                "dtype": str(settings.server.dtype),
                "max_logprobs": 20,
            },
            "lora_config": {"max_loras": settings.server.max_loras, "max_lora_rank": settings.server.max_lora_rank},
            "parallel_config": {
                "tensor_parallel_size": settings.server.tensor_parallel_size,
                "data_parallel_size": settings.server.data_parallel_size,
            },
            "cache_config": {"enable_prefix_caching": settings.server.enable_prefix_caching},
            # adapters move through the shared volume and /set_lora_adapter/, not NCCL weight transfer
            "weight_transfer_config": None,
        }
        return ServerInfo(
            vllm_config=config if config_format == "json" else repr(config),
            engine=service.engine_kind,
            boot_id=service.boot_id,
        )

    # ---------------------------------------------------------------- mutating

    async def set_adapter(body: SetAdapterRequest) -> SetAdapterResponse:
        return await service.set_adapter(body)

    add_routes(
        app,
        ("/set_lora_adapter/", "/set_lora_adapter"),
        set_adapter,
        methods=["POST"],
        response_model=SetAdapterResponse,
        dependencies=[mutating],
        summary="Validate, load and activate an adapter version before answering",
        tags=["adapters"],
    )

    async def clear_adapter() -> ClearAdapterResponse:
        await service.clear_adapter()
        return ClearAdapterResponse(boot_id=service.boot_id)

    add_routes(
        app,
        ("/clear_lora_adapter/", "/clear_lora_adapter"),
        clear_adapter,
        methods=["POST"],
        response_model=ClearAdapterResponse,
        dependencies=[mutating],
        tags=["adapters"],
    )

    async def reset_prefix_cache() -> ResetPrefixCacheResponse:
        success = await service.reset_prefix_cache()
        message = "prefix cache reset" if success else "prefix cache busy (requests running); not reset"
        return ResetPrefixCacheResponse(success=success, message=message)

    add_routes(
        app,
        ("/reset_prefix_cache", "/reset_prefix_cache/"),
        reset_prefix_cache,
        methods=["POST"],
        response_model=ResetPrefixCacheResponse,
        dependencies=[mutating],
        tags=["adapters"],
    )

    # ---------------------------------------------------------------- generation

    @app.post("/generate/", response_model=GenerateResponse, dependencies=[generating], tags=["native"])
    async def generate(body: GenerateRequest) -> Response:
        if body.images:
            raise BadRequest("images: image prompts are not supported")
        limits = service.require_limits()
        prompts = [service.encode_text(p) if isinstance(p, str) else list(p) for p in body.prompts]
        check_prompts(prompts, limits, field="prompts")
        extra = check_generation_kwargs(body.generation_kwargs)
        merged = {
            "n": body.n,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
            "repetition_penalty": body.repetition_penalty,
            "seed": body.seed,
            "model": body.model,
            "structured_outputs": {"regex": body.structured_outputs_regex} if body.structured_outputs_regex else None,
        }
        merged.update({k: v for k, v in extra.items() if k not in ("max_tokens", "logprobs")})
        try:
            fields = SamplingFields.model_validate(merged)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise BadRequest(f"generation_kwargs: {problems}") from exc
        max_tokens = resolve_max_tokens(extra.get("max_tokens", body.max_tokens), prompts, limits)
        top_logprobs = extra.get("logprobs", body.logprobs)
        options = options_from_fields(fields, max_tokens=max_tokens, top_logprobs=top_logprobs or 0)
        generated = await service.generate(fields.model, prompts, options)
        tag = _tag(service, fields.model, generated, "gen")
        return tagged(generate_response(generated.results, tag, with_logprobs=top_logprobs is not None), generated,
                      service.boot_id)

    @app.post("/v1/completions", response_model=CompletionResponse, dependencies=[generating], tags=["openai"])
    async def completions(body: CompletionRequest) -> Response:
        refuse_unsupported(body, stream=body.stream, echo=body.echo)
        limits = service.require_limits()
        prompts = token_prompts(body.prompt, service)
        check_prompts(prompts, limits)
        max_tokens = resolve_max_tokens(body.max_tokens, prompts, limits)
        options = options_from_fields(body, max_tokens=max_tokens, top_logprobs=body.logprobs or 0)
        generated = await service.generate(body.model, prompts, options)
        names = TokenNamer(service.decode_token, as_ids=body.return_tokens_as_token_ids)
        response = completion_response(
            generated.results,
            _tag(service, body.model, generated, "cmpl"),
            names,
            with_logprobs=body.logprobs is not None,
            return_token_ids=body.return_token_ids,
        )
        return tagged(response, generated, service.boot_id)

    @app.post("/v1/chat/completions", response_model=ChatResponse, dependencies=[generating], tags=["openai"])
    async def chat_completions(body: ChatRequest) -> Response:
        refuse_unsupported(body, stream=body.stream)
        limits = service.require_limits()
        prompt = service.encode_chat(
            body.messages,
            chat_template=body.chat_template,
            template_kwargs=body.chat_template_kwargs,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=body.tools,
        )
        check_prompts([prompt], limits, field="messages")
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = resolve_max_tokens(requested, [prompt], limits)
        top = body.top_logprobs or 0
        options = options_from_fields(body, max_tokens=max_tokens, top_logprobs=top)
        generated = await service.generate(body.model, [prompt], options)
        names = TokenNamer(service.decode_token, as_ids=body.return_tokens_as_token_ids)
        response = chat_response(
            generated.results[0],
            _tag(service, body.model, generated, "chatcmpl"),
            names,
            with_logprobs=body.logprobs,
            return_token_ids=body.return_token_ids,
        )
        return tagged(response, generated, service.boot_id)

    # ---------------------------------------------------------------- metrics

    @app.get("/metrics", response_class=Response, tags=["metrics"])
    def prometheus_metrics() -> Response:
        return Response(content=generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def _tag(service: GenerationService, model: str | None, generated: Generated, prefix: str) -> Tagging:
    return Tagging(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=service.response_model_name(model),
        boot_id=service.boot_id,
        adapter_version=generated.adapter_version,
    )
