"""Base-model fingerprint: the server reports it, the trainer and adapters must match it.

A hash of the model's config.json and of its weight files' names and sizes:
cheap (no weight bytes are read), stable across copies of the same
checkpoint, and different for a different model or revision.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_fingerprint(model_dir: Path) -> str:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model directory")
    config = json.loads(config_path.read_text())
    weights = sorted(
        (p.relative_to(model_dir).as_posix(), p.stat().st_size)
        for p in model_dir.rglob("*")
        if p.is_file() and p.suffix in WEIGHT_SUFFIXES
    )
    payload = json.dumps({"config": config, "weights": weights}, sort_keys=True).encode()
    return "sha256:" + hashlib.sha256(payload).hexdigest()[:32]
