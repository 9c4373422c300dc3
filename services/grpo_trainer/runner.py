"""One training attempt, start to finish.

Order matters: the cheap checks that can refuse the run (server reachable,
same base model, fresh server unless resuming) come before the heavy imports
and model loading, so a misconfigured attempt fails in seconds with a reason.
How it ended is its exit code (`grpo_api.exit_codes`: a configuration problem
no retry fixes is told apart from a failure the next attempt may not meet).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from grpo_api.childenv import TRACKER_DIR_ENV
from grpo_api.exit_codes import EXIT_INVALID_SPEC, EXIT_SUCCEEDED, clip_final_message, write_termination_message
from grpo_api.fingerprint import model_fingerprint
from grpo_api.models import Mode, Strategy
from grpo_api.protocol import ENV_ATTEMPT, HealthResponse, TrainingProgress
from grpo_api.runconfig import RunConfig, RunConfigError, load_run_config
from grpo_api.weight_transfer import ENV_WEIGHT_TRANSFER, resolve_weight_transfer
from grpo_trainer.checkpoints import AttemptFence, latest_complete, remove_incomplete
from grpo_trainer.config import Platform, Savings, tracker_environment
from grpo_trainer.errors import InvalidSpec, ServerMismatch, TrainingFailed, exit_code
from grpo_trainer.image_capabilities import available_trackers
from grpo_trainer.launch import end_on_sigterm, launch, needs_launch, rank, report_exit, world_size
from grpo_trainer.metrics import TrainerMetrics, metrics_port
from grpo_trainer.transport.adapter_files import publish_dtype
from grpo_trainer.transport.adapter_store import AdapterStore
from grpo_trainer.transport.policy_sync import AdapterSync, PolicySync
from grpo_trainer.transport.replica_set import ReplicaSet, dns_discovery, static_discovery
from grpo_trainer.transport.replicas import ServerPool
from grpo_trainer.transport.weight_sync import MergedSync, WeightLoader, WeightSync
from grpo_trainer.warm_start import WarmAdapter, check_warm_adapter, max_adapter_rank

if TYPE_CHECKING:
    from trl import GRPOConfig

    from grpo_trainer.generation import GenerationBackend
    from grpo_trainer.rewards import RewardFunc
    from grpo_trainer.session import TrainingSession
    from grpo_trainer.trl_overrides import ServerGRPOTrainer

log: Callable[[str], None] = functools.partial(print, flush=True)


def attempt_from_env() -> int:
    raw = os.environ.get(ENV_ATTEMPT, "1") or "1"
    try:
        return max(int(raw), 1)
    except ValueError as exc:
        raise TrainingFailed(f"${ENV_ATTEMPT} must be an integer, got {raw!r}") from exc


def server_pool(cfg: RunConfig, *, token: str | None, metrics: TrainerMetrics, attempt: int) -> ServerPool:
    """The run's server replicas: a headless Service's addresses, the local processes, or server_url.

    With trainer.tuning full a version reaches a replica as pushed weights, not as an adapter."""
    endpoints = cfg.server_endpoints
    timeout = cfg.spec.trainer.generation_timeout_seconds
    if endpoints is not None and endpoints.dns_name:
        port = endpoints.port or cfg.spec.effective_server.port
        discover, describe = dns_discovery(endpoints.dns_name, port), f"{endpoints.dns_name}:{port}"
    elif endpoints is not None and endpoints.urls:
        discover, describe = static_discovery(endpoints.urls), ", ".join(endpoints.urls)
    else:
        discover, describe = static_discovery([cfg.server_url]), cfg.server_url
    return ServerPool(ReplicaSet(discover, expected=endpoints.replicas if endpoints else 1, describe=describe,
                                 token=token, generation_timeout=timeout, metrics=metrics, log=log,
                                 loader=WeightLoader() if cfg.spec.trainer.pushes_weights else None, attempt=attempt))


def handshake(pool: ServerPool, *, fingerprint: str, model_dir: Path, resuming: bool,
              timeout: float) -> HealthResponse:
    """Every replica must serve our base model and, unless we resume, no adapter yet; the first's health."""
    answers = pool.wait_ready(timeout)
    for url, health in answers:
        if health.model_fingerprint != fingerprint:
            raise ServerMismatch(
                f"base model mismatch: server {url} serves model {health.model!r} with fingerprint "
                f"{health.model_fingerprint}, but the trainer's base model {model_dir} has fingerprint "
                f"{fingerprint}. Training against a different base model would silently corrupt the run; point "
                "both at the same model."
            )
        if not resuming and (health.adapter is not None or health.weights_version):
            serves = (f"adapter v{health.adapter.version} ({health.adapter.path})" if health.adapter is not None
                      else f"pushed weights v{health.weights_version}")
            raise ServerMismatch(
                f"server {url} (boot {health.boot_id}) already has {serves} active, but this attempt starts "
                "from step 0 with no checkpoint: it needs a fresh server"
            )
    pool.fingerprint = fingerprint
    return answers[0][1]


def run_train(config_path: str | Path | None) -> int:
    """Load the run-config and train this attempt ($GRPO_ATTEMPT); the exit code (grpo_api.exit_codes).

    A failure's message goes to stderr and to the termination log, where the executor reads it. An
    unforeseen exception is not caught: its traceback is the log, and Python exits 1 (perhaps transient).
    With several trainer processes (trainer.numNodes × numProcPerNode) this launches them (launch.py).
    """
    try:
        cfg = load_run_config(config_path)
        if needs_launch(cfg.spec.trainer):
            return launch(cfg.spec.trainer, None if config_path is None else str(config_path))
        end_on_sigterm()
        run_training(cfg, attempt=attempt_from_env())
    except (RunConfigError, TrainingFailed) as exc:
        code = exit_code(exc)
        message = clip_final_message(str(exc))
        note = " (a configuration problem: no retry fixes it)" if code == EXIT_INVALID_SPEC else ""
        print(f"grpo train: error{note}: {message}", file=sys.stderr, flush=True)
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one process per pod writes its termination log
            try:
                write_termination_message(message)
            except OSError as err:
                print(f"grpo train: cannot write the termination message: {err}", file=sys.stderr, flush=True)
        report_exit(code)
        return code
    report_exit(EXIT_SUCCEEDED)
    return EXIT_SUCCEEDED


def run_training(cfg: RunConfig, *, attempt: int) -> TrainingProgress:
    """Train the run described by cfg; raises TrainingFailed (with the reason) if it cannot finish."""
    spec = cfg.spec
    t = spec.trainer
    server_mode = spec.mode == Mode.SERVER
    try:
        model_dir = cfg.model_dir()
    except RunConfigError as exc:
        raise InvalidSpec(str(exc)) from exc
    fingerprint = model_fingerprint(model_dir)
    warm = warm_adapter(cfg, model_dir, fingerprint)
    checkpoint_root = Path(cfg.paths.checkpoint_dir)
    # Claimed before anything there is read: a process of an earlier attempt still alive stops at its next write.
    fence = AttemptFence(cfg.run.uid, attempt, (checkpoint_root, Path(cfg.paths.adapter_root)))
    fence.claim()
    resume = latest_complete(checkpoint_root)
    metrics = TrainerMetrics()
    metrics.max_steps.set(t.max_steps)
    store = AdapterStore(Path(cfg.paths.adapter_root), fingerprint, fence=fence)
    main = rank() == 0  # with several processes, rank 0 alone talks to the server and publishes

    pool: ServerPool | None = None
    health: HealthResponse | None = None
    if server_mode and main:
        pool = server_pool(cfg, token=cfg.read_token(), metrics=metrics, attempt=attempt)
        health = handshake(pool, fingerprint=fingerprint, model_dir=model_dir, resuming=resume is not None,
                           timeout=t.generation_timeout_seconds)
        versions = [r.version for r in pool.replicas.values() if r.version is not None]
        if versions and not t.pushes_weights:  # adapter versions continue from those a resumed server holds
            store.floor = max(versions)
        log(f"server {pool.base_url} ok: {len(pool.replicas)} replica(s), model {health.model}, boot "
            f"{', '.join(str(r.boot_id) for r in pool.replicas.values())}, engine {health.engine}")
    sync: PolicySync[Any, Any]
    if t.full:
        sync = WeightSync(pool, metrics, retry_seconds=t.generation_timeout_seconds)
    elif t.pushes_weights and server_mode:  # sync merged (colocate: TRL merges into its own vLLM anyway)
        sync = MergedSync(pool, store, metrics, retry_seconds=t.generation_timeout_seconds)
    else:
        sync = AdapterSync(store, pool, metrics, retry_seconds=t.generation_timeout_seconds)
    try:
        with _environment_defaults(tracker_environment(cfg.spec)):
            return _train(cfg, attempt=attempt, model_dir=model_dir, resume=resume, metrics=metrics, sync=sync,
                          pool=pool, health=health, fence=fence, warm=warm)
    finally:
        sync.close()
        if pool is not None:
            pool.close()


def warm_adapter(cfg: RunConfig, model_dir: Path, fingerprint: str) -> WarmAdapter | None:
    """spec.model.adapter checked against the base model (as the initializer checked it; the files may have changed
    since): InvalidSpec naming the field when it cannot start this run; None without one."""
    try:
        adapter_dir = cfg.adapter_dir()
    except RunConfigError as exc:
        raise InvalidSpec(str(exc)) from exc
    if adapter_dir is None:
        return None
    adapter = check_warm_adapter(adapter_dir, model_dir=model_dir, fingerprint=fingerprint,
                                 max_rank=max_adapter_rank(cfg.spec))
    if rank() == 0:
        log(f"warm start from {adapter.describe()}")
    return adapter


@contextlib.contextmanager
def _environment_defaults(defaults: Mapping[str, str]) -> Iterator[None]:
    """Set each variable the environment lacks (the spec's env, already there, wins) while training, and take them
    away again after: a process that trains twice (the tests run the trainer in-process) starts the second clean."""
    added = [name for name in defaults if name not in os.environ]
    os.environ.update({name: defaults[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _train(
    cfg: RunConfig,
    *,
    attempt: int,
    model_dir: Path,
    resume: Path | None,
    metrics: TrainerMetrics,
    sync: PolicySync[Any, Any],
    pool: ServerPool | None,
    health: HealthResponse | None,
    fence: AttemptFence,
    warm: WarmAdapter | None,
) -> TrainingProgress:
    """Assemble the attempt's parts, in the order that fails soonest (what this process and TRL support, the
    dataset, the rewards, TRL's settings, then the model), and run them."""
    # Heavy imports only once the run is known to be viable; each part imports what it needs.
    import torch

    t = cfg.spec.trainer
    main = rank() == 0
    platform = _checked_platform(cfg, torch)
    savings = Savings.from_environment(os.environ)
    inputs = _training_inputs(cfg, model_dir)
    args = _grpo_args(cfg, inputs.reward_weights, platform)
    model = _load_model(model_dir, cfg.spec.model.dtype, quantize=t.lora.quantize_base, platform=platform)
    session = _session(cfg, sync=sync, metrics=metrics, model_dir=model_dir, attempt=attempt, main=main,
                       warm_start=warm is not None)
    trainer_kwargs = _trainer_kwargs(cfg, model, inputs, args, fence=fence, session=session, warm=warm)
    trainer, backend = _grpo_trainer(cfg, trainer_kwargs, inputs.dataset, session, sync=sync, metrics=metrics,
                                     pool=pool, health=health, main=main, savings=savings)
    _attach_session(cfg, trainer, session, main=main)
    return _run(cfg, trainer, backend, session, sync=sync, metrics=metrics, resume=resume, main=main, torch=torch,
                savings=savings)


class _TrainingInputs(NamedTuple):
    tokenizer: Any
    #: a datasets.Dataset with a `prompt` column (data.load_prompts)
    dataset: Any
    reward_funcs: list[RewardFunc]
    reward_weights: list[float]


def _checked_platform(cfg: RunConfig, torch: Any) -> Platform:
    """What this process offers (CUDA, bf16, vLLM, bitsandbytes), refused when the spec needs more; and the
    installed TRL checked against the surface trl_overrides relies on."""
    from grpo_trainer.config import check_supported
    from grpo_trainer.trl_overrides import check_surface

    spec = cfg.spec
    platform = _platform(torch)
    check_supported(spec, platform, resolve_weight_transfer(spec, os.environ.get(ENV_WEIGHT_TRANSFER)))
    check_surface()
    return platform


def _training_inputs(cfg: RunConfig, model_dir: Path) -> _TrainingInputs:
    """The tokenizer, the dataset (at least one step's prompts of all the processes) and the reward functions."""
    from transformers import AutoTokenizer

    from grpo_trainer.data import load_prompts
    from grpo_trainer.rewards import RewardContext, build_rewards

    spec = cfg.spec
    t = spec.trainer
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    dataset_path = cfg.dataset_path()
    prompts_per_step = t.generation_batch_size * world_size(t) // t.num_generations
    dataset = load_prompts(dataset_path, spec.dataset, tokenizer=tokenizer, max_prompt_length=t.max_prompt_length,
                           min_rows=prompts_per_step)
    reward_funcs, weights = build_rewards(
        spec.rewards,
        RewardContext(max_completion_length=t.max_completion_length,
                      dataset_columns=tuple(dataset.column_names), timeout_seconds=t.reward_timeout_seconds),
        cfg.reward_search_paths(),
    )
    return _TrainingInputs(tokenizer=tokenizer, dataset=dataset, reward_funcs=reward_funcs, reward_weights=weights)


def _grpo_args(cfg: RunConfig, reward_weights: list[float], platform: Platform) -> GRPOConfig:
    """TRL's GRPOConfig from spec.trainer; a setting TRL rejects is the spec's fault."""
    from trl import GRPOConfig

    from grpo_trainer.config import grpo_config_kwargs

    try:
        return GRPOConfig(**grpo_config_kwargs(cfg.spec, output_dir=cfg.paths.checkpoint_dir,
                                               server_url=cfg.server_url, reward_weights=reward_weights,
                                               platform=platform))
    except ValueError as exc:
        raise InvalidSpec(f"spec.trainer settings rejected by TRL: {exc}") from exc


def _session(cfg: RunConfig, *, sync: PolicySync[Any, Any], metrics: TrainerMetrics, model_dir: Path, attempt: int,
             main: bool, warm_start: bool) -> TrainingSession:
    from grpo_trainer.session import TrainingSession

    spec = cfg.spec
    t = spec.trainer
    return TrainingSession(sync=sync, metrics=metrics, progress_file=Path(cfg.paths.progress_file),
                           max_steps=t.max_steps, sync_interval=t.sync_interval, attempt=attempt, main=main,
                           sharded=t.strategy == Strategy.FSDP, warm_start=warm_start,
                           publish_dtype=publish_dtype(str(spec.server.dtype) if spec.server else "auto", model_dir),
                           log=log)


def _trainer_kwargs(cfg: RunConfig, model: Any, inputs: _TrainingInputs, args: GRPOConfig, *, fence: AttemptFence,
                    session: TrainingSession, warm: WarmAdapter | None) -> dict[str, Any]:
    """What TRL's trainer is built from: the model, rewards, settings, dataset, tokenizer, LoRA (none with tuning
    full: every weight trains; a warm start's adapter, loaded as PEFT loads one to train further, brings its own)
    and the callbacks (the attempt's fence, then the session)."""
    from peft import LoraConfig, PeftModel

    from grpo_trainer.config import lora_config_kwargs
    from grpo_trainer.fence_callback import FenceCallback
    from grpo_trainer.session import SessionCallback

    t = cfg.spec.trainer
    peft_config = None if t.full else LoraConfig(**lora_config_kwargs(t.lora))
    if warm is not None:
        model = PeftModel.from_pretrained(model, str(warm.path), is_trainable=True)
        peft_config = None  # TRL refuses a PeftModel with a peft_config: the adapter's own config decides
    return {
        "model": model,
        "reward_funcs": inputs.reward_funcs,
        "args": args,
        "train_dataset": inputs.dataset,
        "processing_class": inputs.tokenizer,
        "peft_config": peft_config,
        "callbacks": [FenceCallback(fence), SessionCallback(session)],
    }


def _grpo_trainer(
    cfg: RunConfig,
    trainer_kwargs: dict[str, Any],
    dataset: Any,
    session: TrainingSession,
    *,
    sync: PolicySync[Any, Any],
    metrics: TrainerMetrics,
    pool: ServerPool | None,
    health: HealthResponse | None,
    main: bool,
    savings: Savings,
) -> tuple[ServerGRPOTrainer, GenerationBackend | None]:
    """TRL's trainer, generating as the mode and rank say, and the generation backend rank 0 talks to the server
    through (None: not in server mode, or another rank)."""
    from grpo_trainer.generation import DriftGuard, GenerationBackend, StalenessBound
    from grpo_trainer.trl_overrides import ServerGRPOTrainer, server_generation_installed

    t = cfg.spec.trainer
    server_mode = cfg.spec.mode == Mode.SERVER
    backend: GenerationBackend | None = None
    if server_mode and not main:
        # The other ranks hand their prompts to rank 0 and take their share of its answer.
        with server_generation_installed(None):
            trainer = ServerGRPOTrainer(**trainer_kwargs)
        trainer.drift_guard = DriftGuard.for_spec(t.importance_sampling, None)
    elif pool is not None and health is not None:
        depth = t.prefetch_depth if t.async_prefetch else 0
        backend = GenerationBackend(
            pool, sync, metrics,
            model_name=health.model,
            num_generations=t.num_generations,
            bound=StalenessBound(t.sync_interval, depth, t.max_staleness),
            seed=t.seed,
            current_step=session.current_step,
            log=log,
        )
        with server_generation_installed(backend):
            trainer = ServerGRPOTrainer(**trainer_kwargs)
        if depth:
            prefetcher = backend.enable_prefetch(
                depth, lambda rows: trainer.prompt_token_ids([dataset[i]["prompt"] for i in rows])
            )
            trainer.schedule_listener = prefetcher.set_schedule
        trainer.drift_guard = DriftGuard.for_spec(t.importance_sampling, backend)
        session.staleness = lambda: backend.last_staleness if backend else None
    else:
        trainer = ServerGRPOTrainer(**trainer_kwargs)
    trainer.old_logps_in_loss = _ratio_in_loss(cfg, trainer, trainer_kwargs["args"], savings)
    if main and trainer.old_logps_in_loss:
        log("trainer: the importance-sampling ratio takes the policy's logprobs from the training forward "
            "(one forward pass fewer a step)")
    return trainer, backend


def _ratio_in_loss(cfg: RunConfig, trainer: ServerGRPOTrainer, args: GRPOConfig, savings: Savings) -> bool:
    """Whether this trainer forms the importance-sampling ratio in its training forward (sampler_ratio), from its
    GRPOConfig and whether its drift guard judges stale batches."""
    from grpo_trainer.sampler_ratio import old_logps_from_training_forward

    t = cfg.spec.trainer
    depth = t.prefetch_depth if cfg.spec.mode == Mode.SERVER and t.async_prefetch else 0
    guard = trainer.drift_guard
    return old_logps_from_training_forward(
        correction=t.importance_sampling.enabled, num_iterations=args.num_iterations,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        steps_per_generation=args.steps_per_generation or args.gradient_accumulation_steps,  # TRL's own default
        stale_batches_judged=guard is not None and guard.judges and (t.sync_interval > 1 or depth > 0),
        wanted=savings.ratio_in_loss,
    )


def _attach_session(cfg: RunConfig, trainer: ServerGRPOTrainer, session: TrainingSession, *, main: bool) -> None:
    """The session reads the trainer's state, and prints the step lines TRL's printer would have."""
    from transformers import PrinterCallback

    t = cfg.spec.trainer
    session.bind(trainer)
    trainer.step_log_metrics = session.step_log_metrics
    trainer.remove_callback(PrinterCallback)  # the session prints one line per step instead
    if main and (world_size(t) > 1 or t.strategy != Strategy.DDP):
        log(f"trainer: {world_size(t)} process(es), strategy {t.strategy} "
            f"(accelerate {trainer.accelerator.distributed_type.value})")


def _run(
    cfg: RunConfig,
    trainer: ServerGRPOTrainer,
    backend: GenerationBackend | None,
    session: TrainingSession,
    *,
    sync: PolicySync[Any, Any],
    metrics: TrainerMetrics,
    resume: Path | None,
    main: bool,
    torch: Any,
    savings: Savings,
) -> TrainingProgress:
    """Serve the metrics, drop interrupted checkpoints, train (resuming if there is a checkpoint), finish."""
    t = cfg.spec.trainer
    if main:
        metrics.serve(metrics_port(t.metrics_port))
        for variable in TRACKER_DIR_ENV:  # W&B falls back to a temporary folder when its folder does not exist
            if os.environ.get(variable):
                Path(os.environ[variable]).mkdir(parents=True, exist_ok=True)
        for path in remove_incomplete(Path(cfg.paths.checkpoint_dir)):
            log(f"removed interrupted checkpoint {path}")
    if resume is not None:
        log(f"resuming from {resume}")
    from peft.helpers import disable_input_dtype_casting

    from grpo_trainer.adapter_casts import drops_adapter_input_casts

    model = trainer.model
    assert model is not None  # TRL's trainer always holds its model
    drop_casts = drops_adapter_input_casts(trainer, wanted=savings.drop_adapter_input_casts)
    if main and drop_casts:
        log("trainer: LoRA layers take their bf16 inputs as they are under autocast (no float32 copies)")
    try:
        with disable_input_dtype_casting(model, active=drop_casts):
            trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    finally:
        if backend is not None:
            backend.close()
    progress = session.finish()
    _leave_process_group(torch)
    if main:
        log(f"done: step {progress.step}/{progress.max_steps}, {sync.kind} v{progress.adapter_version}")
    return progress


def _leave_process_group(torch: Any) -> None:
    """Several processes leave their process group together, once every rank has finished (rank 0's last
    sync included): a rank that exits while another still exchanges on the group can abort in the
    group's teardown ("terminate called without an active exception"). Only on success: a rank that
    failed exits at once, and the launcher stops the others."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        dist.destroy_process_group()


def _platform(torch: Any) -> Platform:
    cuda = bool(torch.cuda.is_available())
    return Platform(
        cuda=cuda,
        bf16=cuda and bool(torch.cuda.is_bf16_supported()),
        vllm=_importable("vllm"),
        bitsandbytes=_importable("bitsandbytes"),
        trackers=available_trackers(),
    )


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _load_model(model_dir: Path, dtype: str, *, quantize: bool, platform: Platform) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    if not platform.cuda:
        torch_dtype = torch.float32  # CPU: train in float32 whatever the checkpoint's dtype
    elif str(dtype) == "auto":
        torch_dtype = torch.bfloat16 if platform.bf16 else torch.float16
    else:
        torch_dtype = getattr(torch, str(dtype))
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if quantize:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch_dtype
        )
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    if quantize:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model)
    return model
