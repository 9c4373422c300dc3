"""Resumable checkpoints: Hugging Face Trainer's `checkpoint-<step>` dirs plus a completion marker.

The Trainer writes adapter, optimizer, scheduler, RNG and trainer state into
`<checkpoint dir>/checkpoint-<step>/` but not atomically. After it returns, the
trainer fsyncs the directory and writes `grpo-complete.json` (tmp + rename): a
checkpoint without the marker was interrupted and is never resumed from.

The checkpoint folder and the adapter root belong to one attempt at a time (`AttemptFence`): each
attempt's trainer records itself in `grpo-attempt.json` when it starts, and a process of an earlier
attempt that is still alive (a lost node's pod, a rank that escaped its launcher) finds another
attempt there before it writes, and stops. Without this it would write checkpoints the next attempt
resumes from, or publish and prune adapter versions under its feet.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from grpo_api.adapters import fsync_tree
from grpo_trainer.errors import AttemptSuperseded

COMPLETE_MARKER = "grpo-complete.json"
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
#: In the checkpoint folder and the adapter root: the attempt that owns them now.
ATTEMPT_RECORD = "grpo-attempt.json"


@dataclass(frozen=True)
class AttemptClaim:
    """Which attempt of which run object owns a folder. The uid tells apart a run re-created under the same
    name, and each `grpo run` of one directory, whose attempts count from 1 again."""

    run_uid: str
    attempt: int

    def describe(self) -> str:
        return f"attempt {self.attempt}" + (f" of run uid {self.run_uid}" if self.run_uid else "")


class UnreadableClaim(ValueError):
    """The attempt record exists but is not one this trainer wrote."""


def read_claim(folder: Path) -> AttemptClaim | None:
    """The claim recorded in folder; None when there is none. Raises UnreadableClaim."""
    path = folder / ATTEMPT_RECORD
    try:
        data = json.loads(path.read_text())
        return AttemptClaim(run_uid=str(data["runUid"]), attempt=int(data["attempt"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UnreadableClaim(f"{path}: not an attempt record ({type(exc).__name__}: {exc})") from exc


def _write_claim(folder: Path, claim: AttemptClaim) -> None:
    """Atomically (tmp + fsync + rename): a reader sees the old claim or the new one, never a torn file."""
    folder.mkdir(parents=True, exist_ok=True)
    record = {"runUid": claim.run_uid, "attempt": claim.attempt, "host": socket.gethostname(),
              "claimedAt": dt.datetime.now(dt.UTC).isoformat()}
    _write_json_atomically(folder / ATTEMPT_RECORD, record,
                           tmp_name=f".{ATTEMPT_RECORD}.{socket.gethostname()}.{os.getpid()}.tmp")


@dataclass(frozen=True)
class AttemptFence:
    """The folders of the volume an attempt writes (checkpoints, adapters) and its claim on them.

    `claim` when the attempt starts (every rank: the claim is the same); `check` before each write a later
    attempt could read. A claim of the same run with a later attempt refuses this one: an attempt that
    starts late may not take the folders back. Any other claim (none, another run object's, unreadable) is
    replaced, since the executor starts an attempt only once the previous one has ended. Without a run uid
    (a run-config written by hand) attempts of different runs cannot be told apart, so none refuses another.
    """

    run_uid: str
    attempt: int
    folders: tuple[Path, ...]

    @property
    def own(self) -> AttemptClaim:
        return AttemptClaim(self.run_uid, self.attempt)

    def claim(self) -> None:
        for folder in self.folders:
            try:
                recorded = read_claim(folder)
            except UnreadableClaim:
                recorded = None
            if (recorded is not None and self.run_uid and recorded.run_uid == self.run_uid
                    and recorded.attempt > self.attempt):
                raise AttemptSuperseded(
                    f"attempt {self.attempt} started after {recorded.describe()} had claimed {folder} "
                    f"({ATTEMPT_RECORD}): this attempt is over and may not write there"
                )
            _write_claim(folder, self.own)

    def check(self, action: str) -> None:
        """Raise AttemptSuperseded, naming `action`, unless every folder is still this attempt's."""
        for folder in self.folders:
            try:
                recorded = read_claim(folder)
            except UnreadableClaim as exc:
                raise AttemptSuperseded(
                    f"{self.own.describe()} may not {action}: {exc}; cannot tell that this attempt still owns "
                    f"{folder}"
                ) from exc
            if recorded is not None and recorded != self.own:
                raise AttemptSuperseded(
                    f"{self.own.describe()} may not {action}: {recorded.describe()} has claimed {folder} "
                    f"({ATTEMPT_RECORD}) since; this process belongs to an attempt that has ended"
                )


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
    """fsync the checkpoint, then atomically add the marker that makes it resumable; refused (AttemptSuperseded)
    when the checkpoint folder records another attempt (a later one started meanwhile)."""
    fsync_tree(checkpoint)
    try:
        recorded = read_claim(checkpoint.parent)
    except UnreadableClaim as exc:
        raise AttemptSuperseded(f"attempt {attempt} may not mark {checkpoint} complete: {exc}") from exc
    if recorded is not None and recorded.attempt != attempt:
        raise AttemptSuperseded(
            f"attempt {attempt} may not mark {checkpoint} complete: {recorded.describe()} has claimed "
            f"{checkpoint.parent} ({ATTEMPT_RECORD}) since; this process belongs to an attempt that has ended"
        )
    marker = {
        "step": step,
        "attempt": attempt,
        "adapter_version": adapter_version,
        "completed_at": dt.datetime.now(dt.UTC).isoformat(),
    }
    _write_json_atomically(checkpoint / COMPLETE_MARKER, marker, tmp_name=f".{COMPLETE_MARKER}.tmp")


def _write_json_atomically(path: Path, data: Mapping[str, object], *, tmp_name: str) -> None:
    """Write data as JSON into tmp_name beside path, fsync it, rename it over path and fsync the folder."""
    tmp = path.parent / tmp_name
    with tmp.open("w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
