"""Helpers shared by the grpo stage tests: a small tree of local files to stage."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


@pytest.fixture
def swap_for_link_when_read(monkeypatch: pytest.MonkeyPatch) -> Callable[[Path, Path], list[Path]]:
    """swap(directory, target): the first time grpo stage opens or lists `directory` (os.open, os.scandir or
    os.listdir naming it, by path or by name beside a descriptor), it is first moved away and a symbolic link to
    `target` put in its place: the race between listing a directory and reading it, made to happen every time.
    The reads are real; the list returned holds the directory once it was swapped."""
    swapped: list[Path] = []
    watched: list[tuple[Path, Path]] = []

    def hook(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(path, int):
                name = os.fsdecode(os.fspath(path))
                for directory, target in watched:
                    if directory not in swapped and (name == str(directory) or name == directory.name):
                        directory.rename(directory.with_name(directory.name + ".moved"))
                        directory.symlink_to(target, target_is_directory=True)
                        swapped.append(directory)
            return real(path, *args, **kwargs)

        return call

    for function in ("open", "scandir", "listdir"):
        monkeypatch.setattr(os, function, hook(getattr(os, function)))

    def swap(directory: Path, target: Path) -> list[Path]:
        watched.append((directory, target))
        return swapped

    return swap
