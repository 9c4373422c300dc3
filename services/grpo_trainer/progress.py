"""The progress file on the volume, read by the operator, the local runner and the server's health."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from grpo_api.protocol import TrainingProgress


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
