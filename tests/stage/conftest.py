"""Helpers shared by the grpo stage tests: a small tree of local files to stage."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model-like directory: files at the top, a nested directory, an executable and an empty dir."""
    root = tmp_path / "src" / "my-model"
    (root / "tokenizer").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "config.json").write_text('{"model_type": "qwen2"}\n')
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 4096)  # 1 MiB, several chunks
    (root / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0"}\n')
    script = root / "run.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    return root


@pytest.fixture
def dataset_file(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"prompt": "1+1="}\n{"prompt": "2+2="}\n')
    return path
