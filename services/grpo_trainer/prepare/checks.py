"""What the server and trainer will read, checked before either starts: the image, the model, the warm-start adapter,
the dataset, the reward functions; and the model's fingerprint cached beside its weights."""

from __future__ import annotations

import os
from pathlib import Path

from grpo_api.fingerprint import model_fingerprint
from grpo_api.runconfig import RunConfig, RunConfigError
from grpo_trainer.prepare.errors import PrepareFailed
from grpo_trainer.prepare.reporting import PrepareResult, Reporter


def _model_field(cfg: RunConfig) -> str:
    model = cfg.spec.model
    if model.source:
        return f"spec.model.source {model.source}"
    return "spec.model.path" if model.path else "spec.model.name"


def check_sources(cfg: RunConfig, reporter: Reporter) -> PrepareResult:
    """What the trainer does before its first step, without loading the weights."""
    from transformers import AutoConfig, AutoTokenizer

    from grpo_trainer.data import load_prompts
    from grpo_trainer.errors import TrainingFailed
    from grpo_trainer.launch import world_size
    from grpo_trainer.rewards import RewardContext, build_rewards

    spec = cfg.spec
    trainer = spec.trainer
    try:
        model_dir = cfg.model_dir()
    except RunConfigError as exc:
        raise PrepareFailed(str(exc), permanent=True) from exc
    reporter.progress(f"checking the model in {model_dir}")
    field = _model_field(cfg)
    try:
        AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:
        raise PrepareFailed(
            f"{field}: {model_dir}/config.json does not load ({type(exc).__name__}: {exc})", permanent=True
        ) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        sample = tokenizer("The quick brown fox")["input_ids"]
    except Exception as exc:
        raise PrepareFailed(
            f"{field}: the tokenizer in {model_dir} does not load ({type(exc).__name__}: {exc})", permanent=True
        ) from exc
    if not sample or len(tokenizer) < 2:
        # transformers builds an empty tokenizer from config.json alone rather than failing
        raise PrepareFailed(
            f"{field}: the tokenizer in {model_dir} is empty ({len(tokenizer)} tokens): the directory has no "
            "tokenizer files (tokenizer.json, tokenizer.model or vocab files)",
            permanent=True,
        )

    try:
        dataset_path = cfg.dataset_path()
    except RunConfigError as exc:
        raise PrepareFailed(str(exc), permanent=True) from exc
    reporter.progress(f"checking the dataset {dataset_path}")
    try:
        dataset = load_prompts(
            dataset_path,
            spec.dataset,
            tokenizer=tokenizer,
            max_prompt_length=trainer.max_prompt_length,
            # the prompts of one step of all the trainer's processes, as the trainer (runner) asks
            min_rows=trainer.generation_batch_size * world_size(trainer) // trainer.num_generations,
        )
    except TrainingFailed as exc:  # its message names the spec.dataset field, the file and the line
        raise PrepareFailed(str(exc), permanent=True) from exc
    except Exception as exc:
        raise PrepareFailed(
            f"spec.dataset: {dataset_path} does not load ({type(exc).__name__}: {exc})", permanent=True
        ) from exc

    reporter.progress(f"checking {len(spec.rewards)} reward function(s)")
    try:
        funcs, _ = build_rewards(
            spec.rewards,
            RewardContext(
                max_completion_length=trainer.max_completion_length, dataset_columns=tuple(dataset.column_names)
            ),
            cfg.reward_search_paths(),
        )
    except TrainingFailed as exc:  # its message names spec.rewards[i], and the module's file and line
        raise PrepareFailed(str(exc), permanent=True) from exc
    return PrepareResult(model_dir=model_dir, dataset_path=dataset_path, prompts=len(dataset), rewards=len(funcs))


def check_image(cfg: RunConfig) -> None:
    """This image (the trainer's) can run the spec: a run it could not execute fails here, before any server
    exists, for good (`image_capabilities`)."""
    from grpo_trainer.errors import UnsupportedSetting
    from grpo_trainer.image_capabilities import check_trainer_image

    try:
        check_trainer_image(cfg.spec)
    except UnsupportedSetting as exc:
        raise PrepareFailed(str(exc), permanent=True) from exc


def warm_fingerprint(model_dir: Path, reporter: Reporter) -> None:
    """Hash the weights into the fingerprint cache beside them, where the server and the trainer look first.

    Only where the cache can sit beside the model directory (else it would be cached in this pod's home,
    which no other pod reads); a failure only costs the server the time to hash them itself.
    """
    if not os.access(model_dir.parent, os.W_OK):
        return
    reporter.progress(f"fingerprinting the weights in {model_dir}")
    try:
        model_fingerprint(model_dir)
    except (OSError, ValueError) as exc:
        reporter.note(f"the model fingerprint is not cached ({type(exc).__name__}: {exc}); the server computes it")


def check_warm_adapter(cfg: RunConfig, model_dir: Path, reporter: Reporter) -> None:
    """spec.model.adapter, when set: an adapter of this base model that the server can serve (warm_start)."""
    from grpo_trainer.warm_start import WarmAdapterRefused, check_warm_adapter, max_adapter_rank

    try:
        adapter_dir = cfg.adapter_dir()
    except RunConfigError as exc:
        raise PrepareFailed(str(exc), permanent=True) from exc
    if adapter_dir is None:
        return
    reporter.progress(f"checking the warm-start adapter in {adapter_dir}")
    try:
        adapter = check_warm_adapter(adapter_dir, model_dir=model_dir, fingerprint=model_fingerprint(model_dir),
                                     max_rank=max_adapter_rank(cfg.spec))
    except WarmAdapterRefused as exc:
        raise PrepareFailed(str(exc), permanent=True) from exc
    reporter.note(f"warm start from {adapter.describe()}")
