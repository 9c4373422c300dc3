"""The progress file on the volume, read by the operator, the local runner and the server's health."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from grpo_api.protocol import TrainingProgress
from grpo_api.runconfig import history_file_for


def write_progress(path: Path, progress: TrainingProgress) -> None:
    """Write atomically (tmp + rename) so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(progress.model_dump_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def append_history(progress_file: Path, progress: TrainingProgress) -> None:
    """One JSON line per logged step beside the progress file (the local runner's reward curve)."""
    path = history_file_for(progress_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(progress.model_dump_json() + "\n")
