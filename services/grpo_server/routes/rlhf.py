"""vLLM's runtime-LoRA and RL routes, so clients written for `vllm serve` run against this server unchanged.

TRL's `AsyncGRPOTrainer` syncs its adapter with `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`
(names `<lora>-v<N>`), between `/pause?mode=keep` and `/resume`. The same checks as
`/set_lora_adapter/` apply: the directory stays inside the adapter root, shapes and ranks match the
base model, weights are finite, versions only move forward. Whole weights (full fine-tuning, merged
LoRA) arrive through vLLM's weight-transfer routes, `/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update` (rules: weight_updates.py; the
ipc backend's handles as JSON, never vLLM's pickle: grpo_api.weight_transfer). Every
route but `/is_paused` needs the run's token (Bearer, or Basic auth with the token as password:
`requests` sends a netrc entry) and refuses a request tagged with an earlier attempt (security.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Query

from grpo_api.protocol import SetAdapterRequest, SetAdapterResponse
from grpo_api.weight_transfer import (
    FinishWeightUpdateRequest,
    InitWeightTransferRequest,
    StartWeightUpdateRequest,
    UpdateWeightsRequest,
    WeightTransferResponse,
)
from grpo_server.routes import add_routes, mutating
from grpo_server.schemas import (
    IsPausedResponse,
    LoadLoraAdapterRequest,
    PauseMode,
    PauseResponse,
    UnloadLoraAdapterRequest,
    UnloadLoraAdapterResponse,
)
from grpo_server.service import GenerationService


def router(service: GenerationService) -> APIRouter:
    api = APIRouter(tags=["rl"])
    checks = mutating(service)

    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> SetAdapterResponse:
        request = SetAdapterRequest(lora_name=body.lora_name, lora_path=body.lora_path)
        return await service.set_adapter(request, alias=body.lora_name)

    add_routes(
        api, ("/v1/load_lora_adapter",), load_lora_adapter, methods=["POST"], response_model=SetAdapterResponse,
        dependencies=checks,
        summary="vLLM's adapter load: validated, loaded and activated; `<name>-v<N>` is version N",
    )

    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> UnloadLoraAdapterResponse:
        adapter = await service.unload_adapter(body.lora_name)
        return UnloadLoraAdapterResponse(lora_name=body.lora_name, version=adapter.version)

    add_routes(
        api, ("/v1/unload_lora_adapter",), unload_lora_adapter, methods=["POST"],
        response_model=UnloadLoraAdapterResponse, dependencies=checks,
        summary="vLLM's adapter unload: no new request uses it; dropped once running ones end",
    )

    async def pause(mode: PauseMode = Query(default="abort")) -> PauseResponse:
        requests = await service.pause(mode)
        return PauseResponse(status="paused", mode=mode, requests=requests)

    add_routes(
        api, ("/pause",), pause, methods=["POST"], response_model=PauseResponse, dependencies=checks,
        summary="Pause generation: new requests wait for /resume; running ones are aborted, awaited or kept",
    )

    async def resume() -> PauseResponse:
        service.resume()
        return PauseResponse(status="resumed")

    add_routes(api, ("/resume",), resume, methods=["POST"], response_model=PauseResponse, dependencies=checks,
               summary="Resume generation after /pause")

    async def init_weight_transfer_engine(body: InitWeightTransferRequest) -> WeightTransferResponse:
        return await service.weights.join(service.weight_receiver(), body.init_info)

    async def start_weight_update(body: StartWeightUpdateRequest | None = None) -> WeightTransferResponse:
        return await service.weights.start(service.weight_receiver())

    async def update_weights(body: UpdateWeightsRequest) -> WeightTransferResponse:
        return await service.weights.update(service.weight_receiver(), body.update_info)

    async def finish_weight_update(body: FinishWeightUpdateRequest | None = None) -> WeightTransferResponse:
        return await service.finish_weight_update(body.version if body else None)

    for path, endpoint, summary in (
        ("/init_weight_transfer_engine", init_weight_transfer_engine,
         "Join the trainer's weight-transfer group (nccl, gloo: the trainer is rank 0 and hosts the rendezvous; "
         "ipc: init_info {})"),
        ("/start_weight_update", start_weight_update, "Begin a weight update (no adapter may be loaded)"),
        ("/update_weights", update_weights,
         "Receive the named tensors (broadcast by the trainer while this call runs, or by CUDA IPC handle)"),
        ("/finish_weight_update", finish_weight_update,
         "Make the update the served weights between generations; the next weights version serves"),
    ):
        add_routes(api, (path,), endpoint, methods=["POST"], response_model=WeightTransferResponse,
                   dependencies=checks, summary=summary)

    def is_paused() -> IsPausedResponse:
        return IsPausedResponse(is_paused=service.paused)

    add_routes(api, ("/is_paused",), is_paused, methods=["GET"], response_model=IsPausedResponse)
    return api
