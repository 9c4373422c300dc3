"""The server's state and operations behind the HTTP handlers.

`GenerationService` owns the engine, the tokenizer, the adapter registry and the
boot identity. Handlers call it and stay thin. Everything here runs on the event
loop; blocking work (model load, adapter checksums) goes to threads and engine
calls are awaited.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from grpo_api.adapters import linear_shapes
from grpo_api.fingerprint import model_fingerprint
from grpo_api.protocol import (
    ActiveAdapter,
    HealthResponse,
    SetAdapterRequest,
    SetAdapterResponse,
    TrainingProgress,
)
from grpo_server import metrics
from grpo_server.adapter_checks import (
    AdapterRefusal,
    CheckedAdapter,
    ServedModel,
    inspect_adapter,
    verify_adapter_files,
)
from grpo_server.engines import EngineUnavailable, choose_engine, create_engine
from grpo_server.engines.base import (
    AdapterHandle,
    AdapterLoadError,
    Engine,
    PromptResult,
    SamplingOptions,
    WeightReceiver,
)
from grpo_server.errors import ApiError, BadRequest
from grpo_server.prompts import PromptEncoder
from grpo_server.registry import (
    BASE_SUFFIX,
    VERSIONED_NAME,
    AdapterRegistry,
    LoadedAdapter,
    ModelNotFound,
    adapter_name,
)
from grpo_server.sampling import Limits, check_options, check_prompts
from grpo_server.schemas import PauseMode
from grpo_server.settings import TRIGGER_WAIT_SECONDS, ServerSettings
from grpo_server.weight_updates import WeightUpdates

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from grpo_api.weight_transfer import WeightTransferResponse

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Generated:
    results: list[PromptResult]
    adapter_version: int | None
    weights_version: int = 0


class GenerationService:
    def __init__(self, settings: ServerSettings, engine_kind: str | None = None) -> None:
        self.settings = settings
        self.boot_id = uuid.uuid4().hex
        self.started_at = time.time()
        self._started_monotonic = time.monotonic()
        #: The base model's fingerprint; hashing the weights takes a while, so it is computed in `start`
        #: beside the engine load and stays empty while /health/ answers 503 (loading).
        self.fingerprint = ""
        self.engine_kind = engine_kind or choose_engine(settings.engine)
        self.registry = AdapterRegistry(settings.served_model_name, settings.server.max_loras)
        self.engine: Engine | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.encoder: PromptEncoder | None = None
        self.limits: Limits | None = None
        self.ready = False
        self.load_error: str | None = None
        #: The engine cannot run in this process at all (EngineUnavailable: no vLLM, no GPU): a configuration
        #: problem that no fresh server fixes, so the process exits with EXIT_INVALID_SPEC.
        self.load_error_permanent = False
        #: Called when the engine cannot start: the process should exit.
        self.on_fatal: Callable[[], None] = lambda: None
        self._trigger_lock = asyncio.Lock()
        self._served: ServedModel | None = None
        self._background: set[asyncio.Task[Any]] = set()
        #: Set while generation may run; cleared by /pause (new generations wait for /resume).
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._inflight: set[asyncio.Future[list[PromptResult]]] = set()
        self._aborted: set[asyncio.Future[list[PromptResult]]] = set()
        #: Cleared while a weight update is applied (new generations wait, running ones finish first).
        self._weights_settled = asyncio.Event()
        self._weights_settled.set()
        self.weights = WeightUpdates(self._exclusive, lambda: len(self.registry.loaded))
        metrics.BOOT_TIME.set(self.started_at)
        metrics.ENGINE_READY.set(0)
        metrics.PAUSED.set(0)
        metrics.ACTIVE_ADAPTER_VERSION.set(0)
        metrics.LOADED_ADAPTERS.set(0)
        metrics.INFO.labels(self.boot_id, self.engine_kind, settings.served_model_name).set(1)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Load tokenizer and engine and fingerprint the model; on failure record why and ask the process to exit."""
        settings = self.settings
        fingerprint = asyncio.create_task(asyncio.to_thread(model_fingerprint, settings.model_dir))
        fingerprint.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved, even if unused
        try:
            from transformers import AutoTokenizer

            tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(settings.model_dir))
            shapes = await asyncio.to_thread(linear_shapes, settings.model_dir)
            engine = create_engine(
                self.engine_kind, settings.model_dir, settings.served_model_name, settings.server, tokenizer,
                weight_transfer=settings.weight_transfer, adapter_loads=settings.adapter_loads,
                weight_loads=settings.weight_loads, logprob_transport=settings.logprob_transport,
            )
            await engine.start()
            self.fingerprint = await fingerprint
            self._served = ServedModel(settings.served_model_name, settings.model_dir, self.fingerprint, shapes)
        except Exception as exc:
            fingerprint.cancel()
            self.load_error = f"{type(exc).__name__}: {exc}"
            self.load_error_permanent = isinstance(exc, EngineUnavailable)
            log.exception("engine %s failed to start", self.engine_kind)
            self.on_fatal()
            return
        self.tokenizer = tokenizer
        self.engine = engine
        self.limits = Limits(max_model_len=engine.max_model_len, vocab_size=len(tokenizer))
        self.encoder = PromptEncoder(
            tokenizer, max_model_len=engine.max_model_len, allow_chat_templates=self.settings.allow_chat_templates
        )
        self.ready = True
        metrics.ENGINE_READY.set(1)
        log.info(
            "ready: engine=%s model=%s max_model_len=%d boot_id=%s",
            self.engine_kind, self.settings.served_model_name, engine.max_model_len, self.boot_id,
        )

    async def shutdown(self) -> None:
        self.ready = False
        metrics.ENGINE_READY.set(0)
        if self.engine is not None:
            await self.engine.shutdown()
        if self.encoder is not None:
            self.encoder.close()

    def serving(self) -> bool:
        """The engine is up and its weights are known (a weight update that could not be undone stops serving)."""
        return self.ready and self.engine is not None and self.engine.healthy() and self.weights.broken is None

    def require_engine(self) -> Engine:
        if not self.serving() or self.engine is None:
            if self.weights.broken is not None:
                state = "unusable: " + self.weights.broken
            elif self.ready:
                state = "unhealthy"
            else:
                state = "failed: " + self.load_error if self.load_error else "still loading"
            raise ApiError(503, "engine_not_ready", f"the {self.engine_kind} engine is {state}")
        return self.engine

    def require_tokenizer(self) -> PreTrainedTokenizerBase:
        self.require_engine()
        assert self.tokenizer is not None
        return self.tokenizer

    def require_limits(self) -> Limits:
        self.require_engine()
        assert self.limits is not None
        return self.limits

    # ------------------------------------------------------------------ health

    def health(self) -> tuple[int, HealthResponse]:
        ok = self.serving()
        if ok:
            status = "ok"
        elif self.load_error:
            status = "failed"
        elif self.ready:
            status = "unhealthy"
        else:
            status = "loading"
        active = self.registry.active
        body = HealthResponse(
            status=status,
            boot_id=self.boot_id,
            model=self.settings.served_model_name,
            model_fingerprint=self.fingerprint,
            engine=self.engine_kind,
            adapter=active.info if active is not None else None,
            weights_version=self.weights.version,
            uptime_seconds=round(time.monotonic() - self._started_monotonic, 3),
            progress=self.read_progress(),
        )
        return (200 if ok else 503), body

    def read_progress(self) -> TrainingProgress | None:
        path = self.settings.progress_file
        try:
            return TrainingProgress.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:  # a half-written or foreign file: report nothing, not an error
            log.debug("progress file %s unreadable: %s", path, exc)
            return None

    # ------------------------------------------------------------------ prompts

    def require_encoder(self) -> PromptEncoder:
        self.require_engine()
        assert self.encoder is not None
        return self.encoder

    # ------------------------------------------------------------------ generation

    async def generate(self, model: str | None, prompts: list[list[int]], options: SamplingOptions) -> Generated:
        engine = self.require_engine()
        limits = self.require_limits()
        check_prompts(prompts, limits)
        check_options(options, prompts, limits)
        while self.paused or not self._weights_settled.is_set():
            await self._resumed.wait()
            await self._weights_settled.wait()
            engine = self.require_engine()  # a weight update that could not be undone ends serving
        weights_version = self.weights.version
        with self.registry.lease(model) as lease, metrics.REQUESTS_IN_FLIGHT.track_inprogress():
            task = asyncio.ensure_future(engine.generate(prompts, options, lease.handle))
            self._inflight.add(task)
            try:
                results = await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if task in self._aborted and (current is None or not current.cancelling()):
                    raise ApiError(
                        503, "generation_aborted", "the generation was aborted by POST /pause?mode=abort; retry it"
                    ) from None
                raise
            finally:
                self._inflight.discard(task)
                self._aborted.discard(task)
        self._schedule_eviction()
        metrics.PROMPT_TOKENS.inc(sum(len(p) for p in prompts))
        metrics.GENERATION_TOKENS.inc(sum(len(c.token_ids) for r in results for c in r.completions))
        return Generated(results, lease.version, weights_version)

    def response_model_name(self, model: str | None) -> str:
        return model or self.settings.served_model_name

    # ------------------------------------------------------------------ adapters

    async def set_adapter(self, request: SetAdapterRequest, *, alias: str | None = None) -> SetAdapterResponse:
        """Validate, load and activate an adapter version.

        `alias`: the name a vLLM-style client loads it under (`/v1/load_lora_adapter`); requests may
        select it by that name, and `<name>-v<N>` makes it version N.
        """
        engine = self.require_engine()
        ours = request.path is not None
        if ours == (request.lora_path is not None):
            raise BadRequest(
                "send either {path, version, sha256} or Axolotl's {lora_name, lora_int_id, lora_path}"
            )
        if ours and request.version is None:
            raise BadRequest("version is required with path")
        if alias is not None and alias in (self.settings.served_model_name,
                                           self.settings.served_model_name + BASE_SUFFIX):
            raise BadRequest(f"lora_name: {alias!r} names the served model itself (requests for it would never "
                             "select the adapter); choose another name")
        named_version = _version_in(alias)
        try:
            self._refuse_replaced_base()
            if ours and request.version is not None:  # a stale trigger need not queue behind a load
                self.registry.refuse_out_of_order(request.version, request.sha256)
            elif named_version is not None:
                self.registry.refuse_out_of_order(named_version, None)
            try:
                await asyncio.wait_for(self._trigger_lock.acquire(), TRIGGER_WAIT_SECONDS)
            except TimeoutError as exc:
                raise AdapterRefusal(
                    "adapter_load_busy", f"another adapter load is still running after {TRIGGER_WAIT_SECONDS:.0f}s"
                ) from exc
        except AdapterRefusal as refusal:
            self._refused(refusal)
            raise
        started = time.perf_counter()
        phases: dict[str, float] = {}
        try:
            adapter = await self._load_and_activate(engine, request, ours, phases, alias)
        except AdapterRefusal as refusal:
            self._refused(refusal)
            raise
        finally:
            self._trigger_lock.release()
        seconds = time.perf_counter() - started
        metrics.ADAPTER_LOADS.inc()
        metrics.ADAPTER_LOAD_DURATION.observe(seconds)
        log.info("adapter %s active (%s) in %.3fs (%s)", adapter.info.name, adapter.info.path, seconds,
                 ", ".join(f"{phase} {value:.3f}s" for phase, value in phases.items()))
        return SetAdapterResponse(adapter=adapter.info, load_seconds=round(seconds, 6), boot_id=self.boot_id)

    def _refuse_replaced_base(self) -> None:
        if self.weights.version > 0 or self.weights.updating:
            raise AdapterRefusal(
                "adapter_base_model_mismatch",
                f"the base weights were replaced by weight transfer (weights version {self.weights.version}"
                f"{', an update in progress' if self.weights.updating else ''}); adapters are trained on the "
                "checkpoint's weights. Use a fresh server for adapters",
            )

    async def _load_and_activate(
        self, engine: Engine, request: SetAdapterRequest, ours: bool, phases: dict[str, float], alias: str | None
    ) -> LoadedAdapter:
        """Under the trigger lock: triggers run one at a time, so the highest version accepted is the active one.
        The seconds each phase took go into `phases` (the log line of the load)."""
        if ours and request.version is not None:
            version = request.version
        else:
            version = _version_in(alias) or self.registry.next_version()
        path = request.path if ours else request.lora_path
        assert path is not None
        # again under the lock: a higher version may have been accepted while this trigger waited, or a weight
        # update started or finished (an update finishes under this lock: see finish_weight_update)
        self.registry.refuse_out_of_order(version, request.sha256 if ours else None)
        self._refuse_replaced_base()
        served = self._served_model()
        started = time.perf_counter()
        checked = await asyncio.to_thread(
            inspect_adapter,
            path,
            root=self.settings.adapter_root,
            served=served,
            max_rank=self.settings.server.max_lora_rank,
            require_manifest=ours,
            expected_digest=request.sha256 if ours else None,
            version=version if ours else None,
        )
        phases["checks"] = time.perf_counter() - started
        existing = self.registry.get(version)
        if existing is not None:  # a retry: same number, and (inspection compared the digests) same contents
            if checked.digest is None or existing.digest != checked.digest:
                raise AdapterRefusal(
                    "adapter_version_conflict",
                    f"version {version} is already loaded with other contents; publish a new version",
                )
            await asyncio.to_thread(verify_adapter_files, checked)
            existing.info = existing.info.model_copy(update={"loaded_at": dt.datetime.now(dt.UTC)})
            adapter = existing
        else:
            handle = AdapterHandle(adapter_name(version), self.registry.next_int_id(), str(checked.path))
            await self._load_verified(engine, handle, checked, phases)
            info = ActiveAdapter(
                name=handle.name,
                version=version,
                sha256=checked.digest,
                path=str(checked.path),
                loaded_at=dt.datetime.now(dt.UTC),
            )
            adapter = LoadedAdapter(handle=handle, info=info, digest=checked.digest, alias=alias)
            self.registry.add(adapter)
        self.registry.activate(version)
        metrics.ACTIVE_ADAPTER_VERSION.set(version)
        started = time.perf_counter()
        await self._evict()
        phases["evict"] = time.perf_counter() - started
        return adapter

    async def _load_verified(
        self, engine: Engine, handle: AdapterHandle, checked: CheckedAdapter, phases: dict[str, float]
    ) -> None:
        """Engine load and checksum verification side by side; unloaded again unless both succeed.

        No request can use the version before it is registered and activated, which happens
        only after this returns, so a file that fails its checksum is never served.
        """
        verify = asyncio.create_task(_timed(asyncio.to_thread(verify_adapter_files, checked), phases, "checksum"))
        load = asyncio.create_task(_timed(engine.add_adapter(handle), phases, "engine load"))
        await asyncio.wait((verify, load))
        verify_error, load_error = verify.exception(), load.exception()
        if verify_error is not None or load_error is not None:
            if load_error is None:
                try:
                    await engine.remove_adapter(handle)
                except Exception:  # the refusal is the answer; an unload failure only costs a slot
                    log.exception("unloading refused adapter %s failed", handle.name)
            if verify_error is not None:
                raise verify_error
            if isinstance(load_error, AdapterLoadError):
                raise AdapterRefusal("adapter_load_failed", str(load_error)) from load_error
            assert load_error is not None
            raise load_error

    def _served_model(self) -> ServedModel:
        """What adapters are checked against (the layer shapes are read in `start`)."""
        assert self._served is not None, "the engine is started before any adapter is loaded"
        return self._served

    async def clear_adapter(self) -> None:
        self.require_engine()
        async with self._trigger_lock:
            self.registry.clear()
            metrics.ACTIVE_ADAPTER_VERSION.set(0)
            await self._evict()

    async def unload_adapter(self, name: str) -> LoadedAdapter:
        """vLLM's unload: the named version serves no new request; the engine drops it once running ones end.

        The active version is refused (409): requests naming the served model run on it.
        """
        self.require_engine()
        async with self._trigger_lock:
            adapter = self.registry.named(name)
            if adapter is None:
                raise ModelNotFound(f"lora_name {name!r}: no loaded adapter has that name (see GET /v1/models)")
            if adapter is self.registry.active:
                raise ApiError(
                    409, "adapter_active",
                    f"lora_name {name!r} is version {adapter.version}, the active adapter; load a newer version "
                    "first, or clear it with POST /clear_lora_adapter/",
                )
            self.registry.forget(adapter.version)
            metrics.LOADED_ADAPTERS.set(len(self.registry.loaded))
        self._spawn(self._remove_when_unused(adapter))
        log.info("adapter %s (%s) unloaded by name %r", adapter.handle.name, adapter.info.path, name)
        return adapter

    async def _remove_when_unused(self, adapter: LoadedAdapter) -> None:
        while adapter.leases > 0:
            await asyncio.sleep(0.05)
        try:
            if self.engine is not None:
                await self.engine.remove_adapter(adapter.handle)
        except Exception:  # the unload was answered; a failure only costs a slot
            log.exception("unloading %s failed", adapter.handle.name)

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ pause (vLLM's /pause, /resume)

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def pause(self, mode: PauseMode) -> int:
        """New generations wait at admission until `resume`; the number of running ones aborted or waited for.

        keep: running generations go on (each runs on the adapter version it was admitted on, which
        never changes); wait: returns once they have finished; abort: cancels them (their clients get
        503 generation_aborted) and returns once they have stopped.
        """
        self.require_engine()
        self._resumed.clear()
        metrics.PAUSED.set(1)
        running = set(self._inflight)
        if mode == "abort":
            for task in running:
                self._aborted.add(task)
                task.cancel()
        if mode != "keep" and running:
            await asyncio.wait(running)
        log.info("generation paused (mode %s, %d running request(s) %s)", mode, len(running),
                 {"abort": "aborted", "wait": "finished", "keep": "left running"}[mode])
        return len(running) if mode != "keep" else 0

    @asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        """The body runs while no generation runs: new ones wait, running ones finish first."""
        self._weights_settled.clear()
        try:
            running = set(self._inflight)
            if running:
                await asyncio.wait(running)
            yield
        finally:
            self._weights_settled.set()

    def lora_config(self) -> dict[str, int] | None:
        """vLLM's `lora_config` of /server_info: None when the engine runs without LoRA (as vLLM reports it),
        so a client such as TRL's AsyncGRPOTrainer does not pick the adapter path."""
        if self.engine is not None and not self.engine.serves_adapters():
            return None
        server = self.settings.server
        return {"max_loras": server.max_loras, "max_lora_rank": server.max_lora_rank}

    def weight_transfer_config(self) -> dict[str, str] | None:
        """vLLM's `weight_transfer_config` of /server_info: the engine's backend, None when it takes none."""
        receiver = self.engine.weight_receiver() if self.engine is not None else None
        return {"backend": receiver.backend} if receiver is not None else None

    def weight_receiver(self) -> WeightReceiver:
        receiver = self.require_engine().weight_receiver()
        if receiver is None:
            raise ApiError(501, "weight_transfer_unsupported",
                           f"the {self.engine_kind} engine runs without a weight-transfer backend (nccl or ipc: set "
                           "for full fine-tuning runs)")
        return receiver

    async def finish_weight_update(self, version: int | None) -> WeightTransferResponse:
        """`WeightUpdates.finish` after every adapter load under way: a load checks for an update before it
        waits for the trigger lock, so one that passed that check just before /start_weight_update may land
        during the update; `finish` then finds it loaded and drops the update (409 `adapters_loaded`)."""
        receiver = self.weight_receiver()
        async with self._trigger_lock:
            return await self.weights.finish(receiver, version)

    def resume(self) -> None:
        self._resumed.set()
        metrics.PAUSED.set(0)
        log.info("generation resumed")

    def _refused(self, refusal: AdapterRefusal) -> None:
        metrics.ADAPTER_LOAD_FAILURES.labels(refusal.reason).inc()
        log.warning("adapter refused (%s): %s", refusal.reason, refusal.message)

    def _schedule_eviction(self) -> None:
        if len(self.registry.loaded) > self.registry.max_loaded:
            self._spawn(self._evict())

    async def _evict(self) -> None:
        """Unload versions beyond maxLoras that no request holds (forgotten first, so none can lease them)."""
        engine = self.engine
        victims = self.registry.evictable()
        for adapter in victims:
            self.registry.forget(adapter.version)
        for adapter in victims:
            try:
                if engine is not None:
                    await engine.remove_adapter(adapter.handle)
            except Exception:  # an unload failure must not fail the trigger that caused it
                log.exception("unloading %s failed", adapter.handle.name)
        metrics.LOADED_ADAPTERS.set(len(self.registry.loaded))

    async def reset_prefix_cache(self) -> bool:
        return await self.require_engine().reset_prefix_cache()


def _version_in(name: str | None) -> int | None:
    """N of a client's adapter name `<name>-v<N>` (TRL names each sync so), if it has one above 0."""
    match = VERSIONED_NAME.match(name) if name else None
    return int(match.group(1)) or None if match else None


async def _timed(work: Awaitable[T], phases: dict[str, float], phase: str) -> T:
    """Await work, recording how long it took (also when it fails)."""
    started = time.perf_counter()
    try:
        return await work
    finally:
        phases[phase] = time.perf_counter() - started
