"""Resumable checkpoints: Hugging Face Trainer's `checkpoint-<step>` dirs plus a completion marker.

The Trainer writes adapter, optimizer, scheduler, RNG and trainer state into
`<checkpoint dir>/checkpoint-<step>/` but not atomically. After it returns, the
trainer fsyncs the directory and writes `grpo-complete.json` (tmp + rename): a
checkpoint without the marker was interrupted and is never resumed from.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
from pathlib import Path

from grpo_api.adapters import fsync_tree

COMPLETE_MARKER = "grpo-complete.json"
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_steps(root: Path) -> dict[int, Path]:
    """Every checkpoint directory under root by step, complete or not."""
    if not root.is_dir():
        return {}
    found = {}
    for child in root.iterdir():
        match = CHECKPOINT_DIR.match(child.name)
        if match and child.is_dir():
            found[int(match.group(1))] = child
    return found


def is_complete(checkpoint: Path) -> bool:
    return (checkpoint / COMPLETE_MARKER).is_file()


def latest_complete(root: Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    complete = {step: path for step, path in checkpoint_steps(root).items() if is_complete(path)}
    return complete[max(complete)] if complete else None


def remove_incomplete(root: Path) -> list[Path]:
    """Delete interrupted checkpoints so the Trainer never rotates or reads one; returns them."""
    removed = []
    for path in checkpoint_steps(root).values():
        if not is_complete(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def mark_complete(checkpoint: Path, *, step: int, attempt: int, adapter_version: int | None) -> None:
    """fsync the checkpoint, then atomically add the marker that makes it resumable."""
    fsync_tree(checkpoint)
    marker = {
        "step": step,
        "attempt": attempt,
        "adapter_version": adapter_version,
        "completed_at": dt.datetime.now(dt.UTC).isoformat(),
    }
    tmp = checkpoint / f".{COMPLETE_MARKER}.tmp"
    with tmp.open("w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, checkpoint / COMPLETE_MARKER)
    fd = os.open(checkpoint, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
