"""Warm start (`spec.model.adapter`): the LoRA adapter a run trains on from, checked against the base model.

The initializer checks it before any server starts (a refusal fails the run as SourceUnavailable) and the trainer
again before it loads it (InvalidSpec, exit code 2): a plain LoRA the server can serve, its files as its manifest
says (when a run published it), trained on this base model (the manifest's fingerprint, else every LoRA tensor's
shape against the model's layer) and no rank above the server's maxLoraRank.

The trainer loads it as TRL and PEFT users load an adapter to train further,
`PeftModel.from_pretrained(model, path, is_trainable=True)`: its own adapter_config.json decides rank, alpha,
dropout and target modules, and spec.trainer.lora's are not used. The session publishes it as the first
version, at step 0, before the first generation (`TrainingSession.on_train_begin`), so the server serves it from
the first batch on and the protocol is unchanged: versions still start at 1 on a fresh server.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_api.adapters import MANIFEST_NAME, ManifestError, linear_shapes, plain_lora_problems, verify_manifest
from grpo_api.models import GRPORunSpec, Mode
from grpo_trainer.errors import InvalidSpec

ADAPTER_FIELD = "spec.model.adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: The prefix PEFT gives an adapter's tensor names (PeftModel.base_model.model is the causal LM).
PEFT_PREFIX = "base_model.model."
LORA_HALVES = (".lora_A.weight", ".lora_B.weight")


class WarmAdapterRefused(InvalidSpec):
    """The warm-start adapter cannot start this run: missing, not a servable LoRA, or of another base model."""


@dataclass(frozen=True)
class WarmAdapter:
    """A checked warm-start adapter."""

    path: Path
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    #: The base-model fingerprint its manifest names; None: no manifest (checked by its tensors' shapes).
    manifest_fingerprint: str | None

    def describe(self) -> str:
        return (f"{self.path} (r {self.rank}, alpha {self.alpha:g}, targets {', '.join(self.target_modules)}"
                f"{', manifest' if self.manifest_fingerprint else ''})")


def max_adapter_rank(spec: GRPORunSpec) -> int | None:
    """The largest rank the run can serve: the server's maxLoraRank when adapters reach it as adapters; None when
    weights are pushed (merged, or colocate: TRL merges the adapter into its own vLLM)."""
    if spec.mode != Mode.SERVER or spec.trainer.pushes_weights:
        return None
    return spec.effective_server.max_lora_rank


def _refuse(adapter_dir: Path, problem: str) -> WarmAdapterRefused:
    return WarmAdapterRefused(f"{ADAPTER_FIELD}: {adapter_dir}: {problem}")


def check_warm_adapter(
    adapter_dir: Path, *, model_dir: Path, fingerprint: str | None, max_rank: int | None
) -> WarmAdapter:
    """The adapter, or WarmAdapterRefused naming spec.model.adapter and the first problem found.

    fingerprint: the base model's, compared with the adapter's manifest when it has one (None: not compared).
    """
    if not adapter_dir.is_dir():
        raise _refuse(adapter_dir, "no such directory (check spec.model.adapter's source and path)")
    config = _read_config(adapter_dir)
    problems = plain_lora_problems(config)
    if problems:
        raise _refuse(adapter_dir, f"not a plain LoRA adapter the server can serve: {'; '.join(problems)}")
    weights = adapter_dir / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise _refuse(adapter_dir, f"no {ADAPTER_WEIGHTS} (PEFT's save_pretrained writes it; convert a .bin "
                                   "adapter with safe_serialization=True)")
    manifest_fingerprint = None
    if (adapter_dir / MANIFEST_NAME).exists():
        try:
            manifest = verify_manifest(adapter_dir)
        except ManifestError as exc:
            raise _refuse(adapter_dir, f"its files do not match its manifest: {exc}") from exc
        manifest_fingerprint = manifest.base_model_fingerprint
        if fingerprint is not None and manifest_fingerprint != fingerprint:
            raise _refuse(adapter_dir, f"trained on another base model: its manifest names the base model "
                                       f"fingerprint {manifest_fingerprint}, spec.model ({model_dir}) has "
                                       f"{fingerprint}")
    ranks = _check_shapes(adapter_dir, weights, linear_shapes(model_dir))
    rank = max(ranks) if ranks else int(config.get("r") or 0)
    if max_rank is not None and rank > max_rank:
        raise _refuse(adapter_dir, f"rank {rank} exceeds spec.server.maxLoraRank ({max_rank}): raise maxLoraRank "
                                   "(one of vLLM's ranks) to serve it")
    targets = config.get("target_modules") or []
    return WarmAdapter(
        path=adapter_dir,
        rank=rank,
        alpha=float(config.get("lora_alpha") or rank),
        target_modules=(targets,) if isinstance(targets, str) else tuple(str(t) for t in targets),
        manifest_fingerprint=manifest_fingerprint,
    )


def _read_config(adapter_dir: Path) -> dict[str, Any]:
    path = adapter_dir / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise _refuse(adapter_dir, f"no {ADAPTER_CONFIG}: not a PEFT adapter directory") from exc
    except (OSError, ValueError) as exc:
        raise _refuse(adapter_dir, f"{ADAPTER_CONFIG} does not load ({type(exc).__name__}: {exc})") from exc
    if not isinstance(config, dict):
        raise _refuse(adapter_dir, f"{ADAPTER_CONFIG} is not a JSON object")
    return config


def _check_shapes(adapter_dir: Path, weights: Path, model: Mapping[str, tuple[int, int]]) -> list[int]:
    """Every LoRA tensor fits its layer of the model (lora_A: r × in, lora_B: out × r); the ranks found."""
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as handle:
            tensors = {key: tuple(int(d) for d in handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise _refuse(adapter_dir, f"{ADAPTER_WEIGHTS} does not load ({type(exc).__name__}: {exc})") from exc
    ranks: list[int] = []
    for key, shape in sorted(tensors.items()):
        half = next((h for h in LORA_HALVES if key.endswith(h)), None)
        if half is None or len(shape) != 2:
            raise _refuse(adapter_dir, f"{key} {list(shape)} is not a LoRA weight (lora_A or lora_B, 2-D)")
        module = key.removesuffix(half).removeprefix(PEFT_PREFIX)
        if not model:
            continue  # no safetensors weights to compare with: the server checks the published version
        layer = model.get(module)
        if layer is None:
            raise _refuse(adapter_dir, f"trained on another base model: {key} adapts {module}, which this "
                                       "model does not have")
        out_features, in_features = layer
        fits = shape[1] == in_features if half == LORA_HALVES[0] else shape[0] == out_features
        if not fits:
            raise _refuse(adapter_dir, f"trained on another base model: {key} has shape {list(shape)}, but "
                                       f"{module} of this model is {out_features} × {in_features} (out × in)")
        ranks.append(shape[0] if half == LORA_HALVES[0] else shape[1])
    if not tensors:
        raise _refuse(adapter_dir, f"{ADAPTER_WEIGHTS} holds no tensor")
    return ranks
