"""The vLLM engine: vLLM 0.26 `AsyncLLM` in-process, LoRA adapters at runtime.

Imported only when the vllm engine is selected (vLLM is not installed in CI).
Logprobs are `processed_logprobs` (after temperature/top-k/top-p), stats logging is on
so vLLM's `vllm:` metrics register on prometheus_client's default registry, which the
server's /metrics exposes. Every adapter version is added under its own name and id
and awaited before the trigger answers; requests carry their `LoRARequest`.

The logprob path is the costly one in vLLM 0.26 (BENCHMARKS.md): with default settings
its frontend decodes every logprob token (`tokenizer.decode([id])` per token per step)
and builds a `Logprob` object per token, and the engine core serialises three small
arrays per request per decoding step, which the frontend deserialises again. So:

- a request that asked for no logprobs asks vLLM for none (`SamplingOptions.logprobs`; the server
  computed them for every request until December 7);
- requests ask for `flat_logprobs` (a few flat lists per request instead of per-token
  objects) and `detokenize=False` unless stop strings need incremental detokenization;
  the completion text is decoded once at the end with the fast tokenizer;
- with `logprobsSource: auto` (opt-in; the default is `sampler`), when the processed logprobs equal the
  model's own (`rescore_equals_sampler`: GRPO's usual temperature 1 without truncation),
  completions are generated without logprobs and then scored in one prefill pass over
  prompt + completion (`prompt_logprobs=0`, same adapter): one array per sequence
  instead of three per token. Anything else takes the sampler's logprobs.

The engine is built as `vllm serve` builds its own (`USAGE_CONTEXT`, vLLM's OpenAI server context), so
it schedules what `vllm serve` would on the same GPU: on an H100 or H200 up to 1024 sequences and 8192
tokens a step. `AsyncLLM.from_engine_args`' default context has no batch defaults in vLLM 0.26 and
falls back to 128 sequences and 2048 tokens a step (on the H100 a 512-sequence batch with logprobs went
from 0.516x to 0.529x of plain `LLM.generate` with vllm serve's limits; BENCHMARKS.md, eighth lease).
`server.extraEngineArgs` `max_num_seqs` and `max_num_batched_tokens` override them; the server logs the
limits the engine took.

Whole-weight updates go through vLLM's own weight transfer (`vllm_weights.py`) when the engine is
built with a backend (`weight_transfer`: nccl or ipc, or `weight_transfer_config` in extraEngineArgs,
which wins as every extra argument does); without one, `weight_receiver()` is None and the routes
answer 501.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, assert_never

from vllm import SamplingParams, TokensPrompt
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.usage.usage_lib import UsageContext
from vllm.utils.gc_utils import freeze_gc_heap
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from grpo_api.models import ServerSpec
from grpo_server.engines.base import (
    AdapterHandle,
    AdapterLoadError,
    Completion,
    EngineError,
    InvalidRequestError,
    PromptResult,
    SamplingOptions,
    StructuredOutput,
)
from grpo_server.engines.logprobs import (
    completion_logprobs,
    prompt_logprobs,
    rescore_equals_sampler,
    sampled_logprobs,
)
from grpo_server.engines.ray_stand_in import provide_ray_stand_in
from grpo_server.engines.vllm_lora_load import SET_DEVICE as SET_LORA_LOAD_DEVICE
from grpo_server.engines.vllm_weights import BACKENDS, IN_PLACE_SUPPORTED, VllmWeightReceiver
from grpo_server.engines.vllm_worker import EXTENSION as WORKER_EXTENSION
from grpo_server.sampling import MAX_LOGPROBS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

#: Alternatives per token a request may ask for (vLLM's `max_logprobs`).


def engine_args(
    model_dir: Path, served_name: str, server: ServerSpec, weight_transfer: str | None = None,
) -> AsyncEngineArgs:
    """AsyncEngineArgs from the run's server section; extraEngineArgs override the rest.

    `weight_transfer` (nccl, ipc) sets vLLM's `weight_transfer_config`; None leaves it unset (no
    weight transfer engine in the workers). With a weight-transfer backend LoRA is off (unless
    extraEngineArgs say otherwise): vLLM loads pushed tensors, and the checkpoint when an update is
    undone, by checkpoint name through the model's `load_weights`, and its LoRA wrappers move every
    linear layer's weight to `<layer>.base_layer.weight`, where those loaders do not look (vLLM 0.26);
    a full fine-tuning run serves no adapter anyway.

    The server's `vllm_worker.WorkerExtension` is mixed into vLLM's worker (`worker_extension_cls`): once the
    engine is up the server switches the workers' adapter loads onto their GPU (unless the engine's
    `adapter_loads` is host: vLLM's loads as shipped) and, over ipc with `weight_loads` in-place, loads pushed
    weights in place. A `worker_extension_cls` in extraEngineArgs wins: adapter loads and weight updates then
    stay vLLM's.
    """
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "served_model_name": [served_name],
        "dtype": str(server.dtype),
        "tensor_parallel_size": server.tensor_parallel_size,
        "data_parallel_size": server.data_parallel_size,
        "gpu_memory_utilization": server.gpu_memory_utilization,
        "max_model_len": server.max_model_len,
        "enable_prefix_caching": server.enable_prefix_caching,
        "enforce_eager": server.enforce_eager,
        "enable_lora": True,
        "max_loras": server.max_loras,
        "max_lora_rank": server.max_lora_rank,
        # requests still running on evicted versions finish while new ones load: room for both
        "max_cpu_loras": server.max_loras * 2,
        "logprobs_mode": "processed_logprobs",
        "max_logprobs": MAX_LOGPROBS,
        "disable_log_stats": False,
    }
    if weight_transfer is not None:
        kwargs["weight_transfer_config"] = {"backend": weight_transfer}
    kwargs["worker_extension_cls"] = WORKER_EXTENSION
    kwargs.update(server.extra_engine_args)
    if kwargs.get("weight_transfer_config") is not None and "enable_lora" not in server.extra_engine_args:
        kwargs["enable_lora"] = False
    try:
        return AsyncEngineArgs(**kwargs)
    except TypeError as exc:
        raise ValueError(f"server.extraEngineArgs: {exc}") from exc


#: The context the engine is built in: `vllm serve`'s, whose batch defaults (sequences and tokens a step) vLLM
#: sets by GPU; the default of `AsyncLLM.from_engine_args` has none and takes vLLM's generic 128 and 2048.
USAGE_CONTEXT = UsageContext.OPENAI_API_SERVER


def prepare_ipc_weight_transfer() -> None:
    """What an engine with ipc weight transfer needs in this process's environment before its engine core starts
    (it and its workers read it at startup)."""
    # vLLM's worker reads IPC handles only as a pickle, and only with this set; the pickle is built by this
    # server from validated JSON (vllm_weights.py), never taken from a request.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # vLLM's IPC module imports ray (unused here), which vLLM does not install
    provide_ray_stand_in()


class VllmEngine:
    """Engine over `vllm.v1.engine.async_llm.AsyncLLM`."""

    name = "vllm"

    def __init__(
        self, model_dir: Path, served_name: str, server: ServerSpec, tokenizer: PreTrainedTokenizerBase,
        weight_transfer: str | None = None, adapter_loads: str = "gpu", weight_loads: str = "in-place",
        logprob_transport: str = "compact",
    ) -> None:
        if weight_transfer is not None and weight_transfer not in BACKENDS:
            raise ValueError(f"weight_transfer: {weight_transfer!r} is not one of {', '.join(BACKENDS)} (or None: off)")
        self._args = engine_args(model_dir, served_name, server, weight_transfer)
        self._adapter_loads = adapter_loads
        self._weight_loads = weight_loads
        self._logprob_transport = logprob_transport
        #: the transport in use once started: compact only where its check at start passed
        self.logprob_transport: str | None = None
        #: where the workers load adapters, once started: their device ("cuda:0"), "cpu" (vLLM's own) or "no-lora"
        self.adapter_load_device: str | None = None
        self._tokenizer = tokenizer
        self.logprobs_source = str(server.logprobs_source)
        self._llm: AsyncLLM | None = None
        # the backend vLLM is configured with (extraEngineArgs may have set it)
        config = self._args.weight_transfer_config
        backend = config.backend if config is not None else None
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"server.extraEngineArgs.weight_transfer_config.backend: {backend!r}; this server "
                             f"forwards only {', '.join(BACKENDS)}")
        self._weights = (
            VllmWeightReceiver(backend, lambda: self.llm, model_dir, lambda: self.world_size) if backend else None
        )

    async def start(self) -> None:
        # The engine core is a child process; spawn avoids forking a threaded server process.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if self._weights is not None and self._weights.backend == "ipc":
            prepare_ipc_weight_transfer()
        self.logprob_transport = "vllm"
        if self._logprob_transport == "compact":
            from grpo_server.engines import vllm_compact_logprobs

            # before the engine core starts: it reads the request for its side from the environment
            if vllm_compact_logprobs.enable():
                self.logprob_transport = "compact"
        log.info("logprobs reach the server as %s", "plain lists (compact)" if self.logprob_transport == "compact"
                 else "vLLM's per-request arrays")
        # Built off the event loop so /health answers 503 while it loads; AsyncLLM starts its
        # output handler on the first request, inside the loop.
        llm = await asyncio.to_thread(AsyncLLM.from_engine_args, self._args, usage_context=USAGE_CONTEXT)
        self._llm = llm
        scheduler = llm.vllm_config.scheduler_config
        log.info("vLLM schedules up to %d sequences and %d tokens a step (vllm serve's defaults for this GPU unless "
                 "server.extraEngineArgs set max_num_seqs or max_num_batched_tokens)", scheduler.max_num_seqs,
                 scheduler.max_num_batched_tokens)
        ours = self._args.worker_extension_cls == WORKER_EXTENSION
        if self._args.enable_lora and ours and self._adapter_loads == "gpu":
            where = await llm.collective_rpc(SET_LORA_LOAD_DEVICE, args=(True,))
            self.adapter_load_device = ",".join(sorted(set(map(str, where))))
        else:
            self.adapter_load_device = "cpu" if self._args.enable_lora else "no-lora"
        log.info("vLLM workers load adapters onto %s", self.adapter_load_device)
        if self._weights is not None and self._weights.backend == "ipc":
            self._weights.loads_in_place = (ours and self._weight_loads == "in-place"
                                            and all(await llm.collective_rpc(IN_PLACE_SUPPORTED)))
            log.info("ipc weight updates load %s", "in place" if self._weights.loads_in_place else
                     f"through vLLM's layerwise reload (weight loads {self._weight_loads}, the model quantized, "
                     "or another worker extension)")
        # As vllm serve does once its app has started: the startup heap (vLLM, torch, the tokenizer) is frozen, so the
        # garbage collector's full passes in this process walk only what serving allocates.
        freeze_gc_heap()

    @property
    def llm(self) -> AsyncLLM:
        if self._llm is None:
            raise EngineError("vLLM engine is not started")
        return self._llm

    @property
    def max_model_len(self) -> int:
        return int(self.llm.model_config.max_model_len)

    @property
    def world_size(self) -> int:
        parallel = self.llm.vllm_config.parallel_config
        return int(
            parallel.tensor_parallel_size * parallel.pipeline_parallel_size * parallel.data_parallel_size
        )

    def healthy(self) -> bool:
        return self._llm is not None and not self._llm.errored

    async def shutdown(self) -> None:
        if self._llm is not None:
            await asyncio.to_thread(self._llm.shutdown)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.llm.reset_prefix_cache())

    def weight_receiver(self) -> VllmWeightReceiver | None:
        """vLLM's own weight transfer (nccl or ipc) when the engine has a backend, else None (routes answer 501)."""
        return self._weights

    def serves_adapters(self) -> bool:
        return bool(self._args.enable_lora)

    async def add_adapter(self, adapter: AdapterHandle) -> None:
        if not self._args.enable_lora:
            raise AdapterLoadError(f"{adapter.path}: this engine runs without LoRA (it takes whole weights over "
                                   f"{self._weights.backend if self._weights else 'weight transfer'})")
        try:
            ok = await self.llm.add_lora(LoRARequest(adapter.name, adapter.int_id, adapter.path))
        except EngineDeadError as exc:
            raise EngineError("vLLM engine is dead") from exc
        except Exception as exc:
            raise AdapterLoadError(f"{adapter.path}: {type(exc).__name__}: {exc}") from exc
        if not ok:
            raise AdapterLoadError(f"{adapter.path}: vLLM did not add adapter {adapter.name}")

    async def remove_adapter(self, adapter: AdapterHandle) -> None:
        await self.llm.remove_lora(adapter.int_id)

    async def generate(
        self, prompts: list[list[int]], options: SamplingOptions, adapter: AdapterHandle | None
    ) -> list[PromptResult]:
        # vLLM refuses n > 1 with greedy sampling; greedy samples are all the same sequence, so one is
        # generated and repeated (OpenAI's and the transformers engine's answer to the same request).
        repeat = options.n if options.greedy and options.n > 1 else 1
        if repeat > 1:
            options = dataclasses.replace(options, n=1)
        rescore = self._rescores(prompts, options)
        params = generation_params(options, rescore)
        lora = LoRARequest(adapter.name, adapter.int_id, adapter.path) if adapter is not None else None
        batch = uuid.uuid4().hex
        try:
            async with asyncio.TaskGroup() as group:  # one failure cancels (and so aborts) the siblings
                tasks = [
                    group.create_task(self._one(ids, params, f"grpo-{batch}-{i}", lora))
                    for i, ids in enumerate(prompts)
                ]
        except ExceptionGroup as group_error:
            raise _as_engine_error(group_error.exceptions[0]) from group_error
        results = [task.result() for task in tasks]
        if rescore:
            results = await self.rescore(results, adapter)
        if not params.detokenize:
            self._decode_texts(results, options.skip_special_tokens)
        if repeat > 1:
            results = [dataclasses.replace(r, completions=r.completions * repeat) for r in results]
        return results

    def _rescores(self, prompts: list[list[int]], options: SamplingOptions) -> bool:
        """Score in a prefill pass instead of streaming the sampler's logprobs (see the module doc)?"""
        if self.logprobs_source != "auto" or not options.logprobs or not rescore_equals_sampler(options):
            return False
        # the scoring request holds prompt + completion and samples one token: it must fit too
        return max(len(p) for p in prompts) + options.max_tokens + 1 <= self.max_model_len

    async def rescore(self, results: list[PromptResult], adapter: AdapterHandle | None) -> list[PromptResult]:
        """The same results with each completion's logprobs computed by one prefill over prompt + completion."""
        lora = LoRARequest(adapter.name, adapter.int_id, adapter.path) if adapter is not None else None
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, flat_logprobs=True,
                                detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        jobs = [(r, c) for r in range(len(results)) for c in range(len(results[r].completions))]
        batch = uuid.uuid4().hex
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(self._prompt_logprobs(
                        results[r].prompt_token_ids + results[r].completions[c].token_ids, params,
                        f"grpo-{batch}-score-{k}", lora,
                    ))
                    for k, (r, c) in enumerate(jobs)
                ]
        except ExceptionGroup as group_error:
            raise _as_engine_error(group_error.exceptions[0]) from group_error
        scored = [dataclasses.replace(r, completions=list(r.completions)) for r in results]
        for (r, c), task in zip(jobs, tasks, strict=True):
            completion = scored[r].completions[c]
            try:
                logprobs = completion_logprobs(task.result(), len(scored[r].prompt_token_ids), completion.token_ids)
            except ValueError as exc:
                raise EngineError(f"scoring the completion failed: {exc}") from exc
            top = [[(token, lp)] for token, lp in zip(completion.token_ids, logprobs, strict=True)]
            scored[r].completions[c] = dataclasses.replace(completion, logprobs=logprobs, top_logprobs=top)
        return scored

    async def _prompt_logprobs(
        self, ids: list[int], params: SamplingParams, request_id: str, lora: LoRARequest | None
    ) -> Any:
        return (await self._final(ids, params, request_id, lora)).prompt_logprobs

    async def _final(
        self, ids: list[int], params: SamplingParams, request_id: str, lora: LoRARequest | None
    ) -> RequestOutput:
        """The finished output of one request (FINAL_ONLY: vLLM yields it once)."""
        final: RequestOutput | None = None
        async for output in self.llm.generate(
            TokensPrompt(prompt_token_ids=ids), params, request_id, lora_request=lora
        ):
            final = output
        if final is None or not final.finished:
            raise EngineError(f"request {request_id} ended without a final output")
        return final

    def _decode_texts(self, results: list[PromptResult], skip_special_tokens: bool) -> None:
        """Fill each completion's text with one batched decode (vLLM was asked not to detokenize)."""
        texts = iter(
            self._tokenizer.batch_decode(
                [c.token_ids for r in results for c in r.completions], skip_special_tokens=skip_special_tokens
            )
        )
        for result in results:
            result.completions[:] = [dataclasses.replace(c, text=next(texts)) for c in result.completions]

    async def _one(
        self, ids: list[int], params: SamplingParams, request_id: str, lora: LoRARequest | None
    ) -> PromptResult:
        final = await self._final(ids, params, request_id, lora)
        completions = [_completion(c) for c in sorted(final.outputs, key=lambda c: c.index)]
        prompt = list(final.prompt_token_ids or ids)
        scored_prompt = None
        if params.prompt_logprobs is not None:
            try:
                scored_prompt = prompt_logprobs(final.prompt_logprobs, prompt)
            except ValueError as exc:
                raise EngineError(f"prompt logprobs: {exc}") from exc
        return PromptResult(prompt, completions, prompt_logprobs=scored_prompt)


def generation_params(options: SamplingOptions, rescore: bool) -> SamplingParams:
    """A generation's SamplingParams: the sampler's logprobs only where the request asked for logprobs and they
    are not scored afterwards (`rescore`)."""
    return sampling_params(options, logprobs=options.logprobs and not rescore)


def sampling_params(options: SamplingOptions, *, logprobs: bool = True) -> SamplingParams:
    """vLLM SamplingParams for one request: flat logprobs, and no detokenization unless stop strings need it.

    `logprobs=False` asks for none (the request asked for none, or the completions are scored afterwards).
    Structured outputs go to vLLM's own backends (xgrammar, guidance, outlines or lm-format-enforcer, as the
    engine chooses).
    """
    try:
        return SamplingParams(
            n=options.n,
            temperature=options.temperature,
            top_p=options.top_p,
            top_k=options.top_k if options.top_k > 0 else 0,
            min_p=options.min_p,
            repetition_penalty=options.repetition_penalty,
            frequency_penalty=options.frequency_penalty,
            presence_penalty=options.presence_penalty,
            max_tokens=options.max_tokens,
            min_tokens=options.min_tokens,
            seed=options.seed,
            stop=list(options.stop) or None,
            stop_token_ids=list(options.stop_token_ids) or None,
            include_stop_str_in_output=options.include_stop_str_in_output,
            ignore_eos=options.ignore_eos,
            skip_special_tokens=options.skip_special_tokens,
            logprobs=options.top_logprobs if logprobs else None,
            prompt_logprobs=options.prompt_logprobs,
            flat_logprobs=True,
            detokenize=bool(options.stop),  # stop strings are matched on vLLM's incremental text
            logit_bias=dict(options.logit_bias) or None,
            allowed_token_ids=list(options.allowed_token_ids) if options.allowed_token_ids is not None else None,
            structured_outputs=structured_outputs_params(options.structured_output),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc


def structured_outputs_params(constraint: StructuredOutput | None) -> StructuredOutputsParams | None:
    """vLLM's StructuredOutputsParams for one constraint (exactly one kind set, as vLLM requires)."""
    if constraint is None:
        return None
    match constraint.kind:
        case "regex":
            return StructuredOutputsParams(regex=constraint.spec)
        case "json":
            return StructuredOutputsParams(json=constraint.schema())
        case "json_object":
            return StructuredOutputsParams(json_object=True)
        case "choice":
            return StructuredOutputsParams(choice=list(constraint.choices))
        case "grammar":
            return StructuredOutputsParams(grammar=constraint.spec)
        case _:
            assert_never(constraint.kind)


def _as_engine_error(exc: BaseException) -> Exception:
    """vLLM's request validation errors are the client's fault (400); anything else is the engine's (503)."""
    if isinstance(exc, EngineDeadError):
        return EngineError("vLLM engine is dead")
    if isinstance(exc, (ValueError, TypeError)) or type(exc).__name__ in ("VLLMValidationError", "VLLMClientError"):
        return InvalidRequestError(str(exc))
    return EngineError(f"{type(exc).__name__}: {exc}")


def _completion(output: Any) -> Completion:
    token_ids = [int(t) for t in output.token_ids]
    try:
        logprobs, top = sampled_logprobs(output.logprobs, len(token_ids))
    except ValueError as exc:
        raise EngineError(str(exc)) from exc
    reason = output.finish_reason
    if reason not in ("stop", "length"):
        raise EngineError(f"generation ended with finish_reason={reason!r}")
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        top_logprobs=top,
        text=output.text or "",
        finish_reason=reason,
        stop_reason=output.stop_reason,
    )
