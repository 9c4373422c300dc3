"""Test adapters: real PEFT LoRA adapters on the tiny model, published like the trainer publishes them.

`LoraMaker` saves adapters with random (non-zero) B matrices, so every version changes the
model's output; `publish` writes the manifest into a temporary directory and renames it
atomically to `<root>/v<N>`, with `grpo_api.adapters` as the trainer uses it. It keeps one
PEFT model per LoRA configuration and draws fresh A and B matrices for each save, so a
1.5B-parameter base (the GPU runs) is copied once per configuration, not once per adapter.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from grpo_api.adapters import build_manifest, fsync_tree, version_dir, write_manifest
from grpo_api.fingerprint import model_fingerprint


class LoraMaker:
    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.model_dir = model_dir
        self.fingerprint = model_fingerprint(model_dir)
        self._base = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
        self._models: dict[str, Any] = {}

    def _model(self, options: dict[str, Any]) -> Any:
        from peft import LoraConfig, get_peft_model

        key = json.dumps(options, sort_keys=True, default=str)
        if key not in self._models:
            self._models[key] = get_peft_model(copy.deepcopy(self._base), LoraConfig(**options))
        return self._models[key]

    def save(self, out_dir: Path, *, seed: int, r: int = 8, scale: float = 0.5, **lora_kwargs: Any) -> Path:
        """Write an adapter (adapter_config.json + adapter_model.safetensors) to out_dir."""
        import torch

        options: dict[str, Any] = {"r": r, "lora_alpha": 2 * r, "target_modules": "all-linear"}
        options.update(lora_kwargs)
        model = self._model(options)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name or "lora_embedding_A" in name:
                    bound = 1.0 / math.sqrt(param.shape[-1])  # PEFT's kaiming-uniform scale
                    param.copy_(torch.empty(param.shape).uniform_(-bound, bound, generator=generator))
                elif "lora_B" in name or "lora_embedding_B" in name:
                    param.copy_(torch.empty(param.shape).normal_(0.0, scale, generator=generator))
        model.save_pretrained(str(out_dir))
        return out_dir

    def publish(
        self, root: Path, version: int, *, seed: int, fingerprint: str | None = None, **lora_kwargs: Any
    ) -> tuple[Path, str]:
        """Save, manifest and atomically publish version N under root; returns (directory, manifest digest)."""
        staging = root / f".tmp-v{version}-{uuid.uuid4().hex[:8]}"
        self.save(staging, seed=seed, **lora_kwargs)
        return publish_dir(staging, root, version, fingerprint or self.fingerprint)


def publish_dir(staging: Path, root: Path, version: int, fingerprint: str, step: int | None = None) -> tuple[Path, str]:
    manifest = build_manifest(staging, version=version, step=step if step is not None else version,
                              base_model_fingerprint=fingerprint)
    write_manifest(staging, manifest)
    fsync_tree(staging)
    final = version_dir(root, version)
    os.rename(staging, final)
    return final, manifest.digest()


def copy_adapter(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def edit_config(adapter_dir: Path, **changes: Any) -> None:
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def rewrite_tensors(adapter_dir: Path, change: Any) -> None:
    """Rewrite adapter_model.safetensors with `change(tensors)` applied (a dict of name -> tensor)."""
    from safetensors.torch import load_file, save_file

    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def add_manifest_entry(adapter_dir: Path, rel: str, sha256: str) -> str:
    """Add an entry to a published manifest as a hostile publisher would; returns the manifest's new digest.

    The model refuses such an entry when it validates, so it is added unvalidated, and the digest is
    the one a server that did not check entries would compare the trigger's sha256 with.
    """
    from grpo_api.adapters import MANIFEST_NAME, read_manifest

    manifest = read_manifest(adapter_dir)
    hostile = manifest.model_copy(update={"files": {**manifest.files, rel: sha256}})
    (adapter_dir / MANIFEST_NAME).write_text(json.dumps(hostile.model_dump(mode="json"), indent=2))
    return hostile.digest()
