"""Every place the project overrides TRL (pinned: trl==1.16.0). Nothing else touches TRL internals.

TRL's GRPOTrainer with `use_vllm=True, vllm_mode="server"` already does what we
want from a server: it sends token ids, asks for the sampled tokens' logprobs
and feeds them to the importance-sampling correction and off-policy masking.
What differs is the transport and the weight sync, so the override is small:

1. `ServerGeneration` replaces `VLLMGeneration` (looked up as a module global of
   `trl.trainer.grpo_trainer` when the trainer is built):
   - `_init_vllm`: no `VLLMClient` (it needs vLLM installed and opens an NCCL
     group); `vllm_client` becomes a stub that answers `get_server_info()`.
   - `generate`: calls our checked, optionally prefetching GenerationBackend.
   - `sync_weights`: a no-op; adapters are published every syncInterval
     optimizer steps by the session's step-end callback instead of TRL's
     per-step NCCL weight push.
2. `ServerGRPOTrainer._get_train_sampler` wraps TRL's RepeatSampler to record
   the epoch's order, so async prefetch knows which prompts come next.
3. `ServerGRPOTrainer._generate_and_score_completions` measures how far a stale
   batch's sampler is from the policy that trains on it (from the logprobs TRL
   already computed for the importance-sampling correction) and, past
   importanceSampling.maxDrift, scores a batch generated again from the current
   policy instead (generation.DriftGuard); the discarded batch's metrics are
   taken back out of TRL's step metrics.
4. Where the policy that scores a batch is the one that trains on it (`old_logps_in_loss`), the scoring skips
   TRL's no-grad forward for the correction's old-policy logprobs and `_compute_loss` forms the ratio from the
   training forward's own logprobs instead (sampler_ratio): one forward pass of the policy fewer per step.

`surface_problems()` lists what of TRL this module relies on and reports
anything a TRL upgrade moved; the trainer runs it at start-up and a test runs it
in CI, so an upgrade fails loudly instead of silently changing behaviour.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch
import trl
import trl.trainer.grpo_trainer as grpo_trainer_module
from accelerate.utils import broadcast_object_list, gather_object
from torch.utils.data import Sampler
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from trl import GRPOConfig, GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration
from trl.trainer.utils import RepeatSampler, nanmax, nanmin

from grpo_trainer.errors import TrainingFailed, UnsupportedSetting
from grpo_trainer.generation import DriftGuard, GenerationBackend, generation_batches
from grpo_trainer.sampler_ratio import ratio_figures, sampler_ratio

PINNED_TRL_VERSION = "1.16.0"


class _ServerInfo:
    """Stands in for TRL's VLLMClient: GRPOTrainer.__init__ only reads the server's logprobs mode."""

    def __init__(self, backend: GenerationBackend) -> None:
        self._backend = backend

    def get_server_info(self) -> dict[str, Any]:
        try:
            return self._backend.pool.server_info()
        except Exception as exc:
            raise TrainingFailed(
                f"{self._backend.pool.base_url}/server_info failed ({type(exc).__name__}: {exc}); the "
                "importance-sampling correction needs to know the server's logprobs mode"
            ) from exc


class ServerGeneration(VLLMGeneration):
    """TRL's generation backend, speaking to the run's server over HTTP."""

    backend: ClassVar[GenerationBackend | None] = None

    def _init_vllm(self) -> None:
        if self.mode != "server":
            raise UnsupportedSetting(f"ServerGeneration handles vllm_mode 'server', not {self.mode!r}")
        if not self.accelerator.is_main_process:
            return  # only rank 0 talks to the server (see generate)
        backend = self._backend()
        sampling: dict[str, Any] = {
            "repetition_penalty": self.repetition_penalty,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "max_tokens": self.max_completion_length,
        }
        if self.structured_outputs_regex is not None:
            sampling["structured_outputs"] = {"regex": self.structured_outputs_regex}
        # TRL merges these at the top level, overriding the above; spec.trainer.structuredOutputs arrives
        # here as {"structured_outputs": {...}} (StructuredOutputsSpec.vllm_params), as in TRL's own client
        sampling.update(self.generation_kwargs)
        backend.sampling = sampling
        self.vllm_client = _ServerInfo(backend)  # type: ignore[assignment]

    def _backend(self) -> GenerationBackend:
        if self.backend is None:
            raise RuntimeError("ServerGeneration used outside server_generation_installed()")
        return self.backend

    def sync_weights(self) -> None:
        """No-op: the session publishes the LoRA adapter every syncInterval optimizer steps."""

    def generate(
        self,
        prompts: list[list[int]],
        images: list[list[Any] | None] | None,
        num_generations: int,
        profiler: Any = None,
    ) -> tuple[list[list[int]], list[list[int]], list[list[list[float | None]]], None]:
        if images is not None and any(img is not None for img in images):
            raise UnsupportedSetting("image prompts are not supported by the server-mode trainer")
        accelerator = self.accelerator
        several = accelerator.num_processes > 1
        # As TRL's server mode: every process's prompts go to rank 0, which generates them all at once;
        # each process takes the slice of the answer that belongs to its prompts.
        all_prompts = [list(p) for p in (gather_object(prompts) if several else prompts)]
        payload: tuple[list[list[int]], list[list[float | None]]] | None = None
        if accelerator.is_main_process:
            backend = self._backend()
            if num_generations != backend.num_generations:
                raise RuntimeError(f"TRL asked for {num_generations} generations, backend set up for "
                                   f"{backend.num_generations}")
            result = backend.generate(all_prompts[::num_generations])
            payload = (result.completion_ids, result.logprobs)
        if several:
            box: list[Any] = [payload]
            broadcast_object_list(box, from_process=0)
            payload = box[0]
        assert payload is not None
        completion_ids, seq_logprobs = payload
        mine = slice(accelerator.process_index * len(prompts), (accelerator.process_index + 1) * len(prompts))
        # TRL's shape: [sequence][position][top-k]; with logprobs=0 only the sampled token's logprob.
        logprobs = [[[lp] for lp in seq] for seq in seq_logprobs[mine]]
        return all_prompts[mine], completion_ids[mine], logprobs, None


@contextmanager
def server_generation_installed(backend: GenerationBackend | None) -> Iterator[None]:
    """While building the trainer, make GRPOTrainer construct ServerGeneration bound to backend (None on the
    ranks other than 0, which never talk to the server)."""
    bound: type[VLLMGeneration] = type("BoundServerGeneration", (ServerGeneration,), {"backend": backend})
    original = grpo_trainer_module.VLLMGeneration
    grpo_trainer_module.VLLMGeneration = bound  # type: ignore[misc]
    try:
        yield
    finally:
        grpo_trainer_module.VLLMGeneration = original  # type: ignore[misc]


class ScheduleRecordingSampler(Sampler[int]):
    """Yields exactly what TRL's RepeatSampler yields, telling a listener the epoch's generation batches."""

    def __init__(self, inner: RepeatSampler, listener: Callable[[list[list[int]]], None]) -> None:
        self.inner = inner
        self.listener = listener

    def __iter__(self) -> Iterator[int]:
        indices = list(iter(self.inner))
        self.listener(
            generation_batches(indices, self.inner.batch_size, self.inner.mini_repeat_count, self.inner.repeat_count)
        )
        return iter(indices)

    def __len__(self) -> int:
        return len(self.inner)


class ServerGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose train sampler can report its schedule (for async prefetch), and that trains on no stale
    batch its policy has moved too far from (drift_guard)."""

    schedule_listener: Callable[[list[list[int]]], None] | None = None
    drift_guard: DriftGuard | None = None
    #: The session's measures of the step (step and sync time, staleness), added to each step's log.
    step_log_metrics: Callable[[], dict[str, float]] | None = None
    #: The correction's old-policy logprobs are the training forward's (sampler_ratio.old_logps_from_training_forward).
    old_logps_in_loss: bool = False
    #: The micro-batch whose ratio the next training forward forms (set by _compute_loss for that one call).
    _ratio_inputs: dict[str, Any] | None = None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """A step's log (the one with its `loss`; not the end-of-training summary) gets the session's measures too,
        before TRL adds its own and the callbacks run: transformers' tracker integrations report what this gets."""
        if self.step_log_metrics is not None and "loss" in logs:
            logs.update(self.step_log_metrics())
        super().log(logs, start_time)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if not (self.old_logps_in_loss and self.model is not None and self.model.training):
            return self._guarded_batch(inputs)
        # TRL reads the flag in scoring only to compute the old logprobs, the ratio and its metrics: all three
        # are done in _compute_loss instead, from the training forward (the flag is back on by then)
        self.vllm_importance_sampling_correction = False
        try:
            return self._guarded_batch(inputs)
        finally:
            self.vllm_importance_sampling_correction = True

    def _guarded_batch(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        guard = self.drift_guard
        if guard is None or self.model is None or not self.model.training:
            return super()._generate_and_score_completions(inputs)
        step_metrics = self._metrics["train"]
        marks = {key: len(values) for key, values in step_metrics.items()}
        tokens_seen = self.state.num_input_tokens_seen
        started = time.monotonic()
        output = super()._generate_and_score_completions(inputs)
        drift = self._policy_drift(output)
        decision = [guard.rejects(drift)]  # rank 0 decides: it knows the batch's staleness
        if self.accelerator.num_processes > 1:
            broadcast_object_list(decision, from_process=0)
        if not decision[0]:
            return output
        for key, values in step_metrics.items():  # the discarded batch's rewards, lengths, ratios
            del values[marks.get(key, 0):]
        self.state.num_input_tokens_seen = tokens_seen
        guard.regenerate(drift, time.monotonic() - started)
        return super()._generate_and_score_completions(inputs)

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        if not (self.old_logps_in_loss and model.training and "importance_sampling_ratio" not in inputs):
            return super()._compute_loss(model, inputs)
        if inputs.get("sampling_per_token_logps") is None:
            raise TrainingFailed("the generation batch has no sampler logprobs; the importance-sampling correction "
                                 "(spec.trainer.importanceSampling) needs them")
        self._ratio_inputs = inputs
        try:
            loss: torch.Tensor = super()._compute_loss(model, inputs)
        finally:
            self._ratio_inputs = None
        return loss

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        inputs, self._ratio_inputs = self._ratio_inputs, None  # _compute_loss's first call is its training forward
        if inputs is not None:
            inputs["importance_sampling_ratio"] = self._sampler_ratio(result[0].detach(), inputs)
        return result

    def _sampler_ratio(self, policy_logps: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """TRL's ratio and its step metrics (_generate_and_score_completions), from the training forward's logprobs."""
        sampled = inputs["sampling_per_token_logps"]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        mode = self.vllm_importance_sampling_mode
        ratio = sampler_ratio(policy_logps, sampled, mask, mode=mode, clip_min=self.vllm_importance_sampling_clip_min,
                              clip_max=self.vllm_importance_sampling_clip_max)
        figures = ratio_figures(policy_logps, sampled, mask, ratio, mode=mode)
        metrics, gather = self._metrics["train"], self.accelerator.gather
        metrics["sampling/sampling_logp_difference/mean"].append(gather(figures.logp_difference_mean).mean().item())
        metrics["sampling/sampling_logp_difference/max"].append(gather(figures.logp_difference_max).max().item())
        metrics["sampling/importance_sampling_ratio/min"].append(nanmin(gather(figures.ratio_min)).item())
        metrics["sampling/importance_sampling_ratio/mean"].append(gather(figures.ratio_mean).nanmean().item())
        metrics["sampling/importance_sampling_ratio/max"].append(nanmax(gather(figures.ratio_max)).item())
        return ratio

    def _policy_drift(self, output: dict[str, Any]) -> float:
        """Mean |log-ratio| between the training policy and the sampler over the batch's completion tokens, all
        processes' together (0 without the importance-sampling correction's logprobs)."""
        old, sampled = output.get("old_per_token_logps"), output.get("sampling_per_token_logps")
        if old is None or sampled is None:
            return 0.0
        delta = (old - sampled).abs()
        counted = output["completion_mask"].bool() & ~torch.isnan(delta)
        totals = torch.stack([delta[counted].sum().float(), counted.sum().float()])
        totals = self.accelerator.gather(totals).reshape(-1, 2).sum(dim=0)
        return float(totals[0] / totals[1].clamp(min=1.0))

    def _get_train_sampler(self, dataset: Any = None) -> Sampler[int]:
        sampler = super()._get_train_sampler(dataset)
        if self.schedule_listener is None:
            return sampler
        if not isinstance(sampler, RepeatSampler):
            raise TrainingFailed(f"TRL's train sampler is a {type(sampler).__name__}, expected RepeatSampler")
        return ScheduleRecordingSampler(sampler, self.schedule_listener)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """transformers maps a distributed run's optimizer state to args.device, which is "cpu:<rank>" with
        several CPU processes (gloo) and which torch.load cannot place: load those onto "cpu"."""
        if checkpoint is None or self.args.world_size <= 1 or self.args.device.type != "cpu":
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        optimizer_file = Path(checkpoint) / OPTIMIZER_NAME
        scheduler_file = Path(checkpoint) / SCHEDULER_NAME
        if optimizer_file.is_file() and scheduler_file.is_file():
            assert self.optimizer is not None and self.lr_scheduler is not None  # created before resuming
            self.optimizer.load_state_dict(torch.load(optimizer_file, map_location="cpu", weights_only=True))
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, map_location="cpu", weights_only=True))

    def prompt_token_ids(self, prompts: list[Any]) -> list[list[int]]:
        """Token ids of prompts exactly as TRL computes them before generation."""
        prompt_ids = self._tokenize_prompts(prompts)[0]
        return [list(ids) for ids in prompt_ids]


# ------------------------------------------------------------------------------------- the TRL surface

#: (object, member, parameters it must accept, in order, after self)
_SIGNATURES: tuple[tuple[type, str, tuple[str, ...]], ...] = (
    (VLLMGeneration, "_init_vllm", ()),
    (VLLMGeneration, "sync_weights", ()),
    (VLLMGeneration, "generate", ("prompts", "images", "num_generations", "profiler")),
    (GRPOTrainer, "_get_train_sampler", ("dataset",)),
    (GRPOTrainer, "_tokenize_prompts", ("prompts",)),
    (GRPOTrainer, "_load_optimizer_and_scheduler", ("checkpoint",)),
    (GRPOTrainer, "_generate_and_score_completions", ("inputs",)),
    (GRPOTrainer, "_compute_loss", ("model", "inputs")),
    (GRPOTrainer, "_get_per_token_logps_and_entropies", ("model", "input_ids", "attention_mask", "logits_to_keep")),
    (GRPOTrainer, "log", ("logs", "start_time")),
    (RepeatSampler, "__init__", ("data_source", "mini_repeat_count", "batch_size", "repeat_count", "shuffle",
                                 "seed")),
)

#: Attributes VLLMGeneration.__init__ must set before calling _init_vllm (ServerGeneration reads them).
_GENERATION_ATTRIBUTES = (
    "mode", "accelerator", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
    "max_completion_length", "structured_outputs_regex", "generation_kwargs",
)

#: Source fragments whose presence keeps our assumptions true.
_SOURCE_FACTS: tuple[tuple[Callable[..., Any], str, str], ...] = (
    (GRPOTrainer.__init__, "self.vllm_generation = VLLMGeneration(",
     "GRPOTrainer builds its generation backend from the module global VLLMGeneration"),
    (GRPOTrainer.__init__, 'vllm_client.get_server_info()["model_config"]["logprobs_mode"]',
     "GRPOTrainer reads only the logprobs mode from the server info"),
    (GRPOTrainer._generate_single_turn, "self.vllm_generation.sync_weights()",
     "TRL calls sync_weights before generating"),
    (GRPOTrainer._generate_single_turn, "self.vllm_generation.generate(",
     "TRL generates through VLLMGeneration.generate"),
    (GRPOTrainer._generate_single_turn, "[[lp[0] for lp in seq] for seq in logprobs]",
     "TRL keeps the first logprob per position (the sampled token's)"),
    (GRPOTrainer._generate_and_score_completions, "sampling_per_token_logps",
     "the sampler's logprobs feed the importance-sampling correction"),
    (GRPOTrainer.get_train_dataloader, "sampler_fn=self._get_train_sampler",
     "the train dataloader takes its sampler from _get_train_sampler"),
    (GRPOTrainer._generate_and_score_completions, 'output["old_per_token_logps"] = old_per_token_logps',
     "the scored batch carries the training policy's logprobs (the drift guard reads them)"),
    (GRPOTrainer._generate_and_score_completions, 'output["sampling_per_token_logps"] = sampling_per_token_logps',
     "the scored batch carries the sampler's logprobs (the drift guard reads them)"),
    (GRPOTrainer._generate, "self.state.num_input_tokens_seen +=",
     "the only trainer state generating a batch changes besides the step metrics (undone for a discarded one)"),
    (VLLMGeneration.__init__, "self._init_vllm()", "VLLMGeneration.__init__ ends by calling _init_vllm"),
    (GRPOTrainer._generate_and_score_completions, "self.use_vllm and self.vllm_importance_sampling_correction",
     "scoring computes the old logprobs, the ratio and its metrics only under the correction's flag"),
    (GRPOTrainer._compute_loss, "old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None",
     "without scored old logprobs the loss takes the training forward's, detached"),
    (GRPOTrainer._compute_loss, 'per_token_loss * inputs["importance_sampling_ratio"]',
     "the loss reads the correction's ratio from its inputs"),
    (RepeatSampler.__iter__, "for _ in range(self.repeat_count)", "RepeatSampler's stream layout"),
)


def surface_problems() -> list[str]:
    """What of TRL's surface this module relies on has moved; empty when all is as pinned."""
    problems = []
    if trl.__version__ != PINNED_TRL_VERSION:
        problems.append(f"trl is {trl.__version__}, this override was written for {PINNED_TRL_VERSION}")
    if getattr(grpo_trainer_module, "VLLMGeneration", None) not in (VLLMGeneration,) and not (
        isinstance(grpo_trainer_module.VLLMGeneration, type)
        and issubclass(grpo_trainer_module.VLLMGeneration, ServerGeneration)
    ):
        problems.append("trl.trainer.grpo_trainer no longer imports VLLMGeneration as a module global")
    for owner, name, params in _SIGNATURES:
        member = getattr(owner, name, None)
        if member is None:
            problems.append(f"{owner.__name__}.{name} no longer exists")
            continue
        actual = [p for p in inspect.signature(member).parameters if p != "self"]
        if actual[: len(params)] != list(params):
            problems.append(f"{owner.__name__}.{name} parameters are {actual}, expected to start with {list(params)}")
    init_source = inspect.getsource(VLLMGeneration.__init__)
    for attr in _GENERATION_ATTRIBUTES:
        if f"self.{attr} = " not in init_source:
            problems.append(f"VLLMGeneration.__init__ no longer sets self.{attr}")
    for func, fragment, meaning in _SOURCE_FACTS:
        if fragment not in inspect.getsource(func):
            problems.append(f"{func.__qualname__} changed: expected {fragment!r} ({meaning})")
    for attr in ("batch_size", "mini_repeat_count", "repeat_count"):
        if f"self.{attr} = " not in inspect.getsource(RepeatSampler.__init__):
            problems.append(f"RepeatSampler no longer keeps self.{attr}")
    loss_source = inspect.getsource(GRPOTrainer._compute_loss)
    forward_at = loss_source.find("self._get_per_token_logps_and_entropies(")
    if not 0 <= forward_at < loss_source.find('inputs["importance_sampling_ratio"]'):
        problems.append("GRPOTrainer._compute_loss no longer runs its training forward before reading the ratio "
                        "(old_logps_in_loss forms the ratio in that forward)")
    config_fields = set(GRPOConfig.__dataclass_fields__)
    for required in ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
                     "vllm_importance_sampling_clip_min", "num_iterations", "steps_per_generation",
                     "off_policy_mask_threshold", "importance_sampling_level", "loss_type", "vllm_mode"):
        if required not in config_fields:
            problems.append(f"GRPOConfig has no field {required}")
    return problems


def check_surface() -> None:
    """Fail the run at start-up if TRL moved under the override."""
    problems = surface_problems()
    if problems:
        raise TrainingFailed("the installed TRL does not match grpo_trainer.trl_overrides:\n  " + "\n  ".join(problems))
