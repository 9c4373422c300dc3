"""A fetched source's folder on the volume and its records, for every kind fetched (hf://, s3://, https://).

Each source has a folder of its own (`grpo_api.sources.hub_dir`, `object_dir`), and in it one folder per commit or
object version (`snapshots/<version>`), as huggingface_hub's cache keeps them: SOURCE_RECORD names the source and
its latest complete version, FETCH_RECORD in a version's folder names the source, the version and, once complete,
its files. A folder whose record names another source is refused, never fetched over; a complete version's folder
is never written again, so no fetch changes files another run reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath
from typing import Any

from grpo_api.sources import hub_snapshot_dir
from grpo_trainer.prepare.errors import DownloadStopped, PrepareFailed, causes
from grpo_trainer.prepare.reporting import FetchProgress, Reporter

#: In a source's folder: the source it holds, written before its first download, and the version of its latest
#: complete fetch (lets a later run start while the source is unreachable).
SOURCE_RECORD = ".cache/grpo-source.json"
#: In a version's folder: the source and version it holds, written before its first download, and, once complete,
#: its files.
FETCH_RECORD = ".cache/grpo-fetch.json"

_VERSION = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class SourceFolder:
    """One fetched source's folder: where it is, the record that names the source, and how errors name it."""

    local_dir: Path
    record: dict[str, Any]
    label: str

    def snapshot(self, version: str) -> Path:
        return Path(hub_snapshot_dir(str(self.local_dir), version))

    @property
    def source_record(self) -> Path:
        return self.local_dir / SOURCE_RECORD

    def snapshot_record(self, version: str) -> Path:
        return self.snapshot(version) / FETCH_RECORD


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_json(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def refuse_unsafe_names(label: str, endpoint: str, names: list[str], holder: str) -> None:
    """Refuse (permanent) a listing no `holder` (repository, prefix) has: a name outside the local folder (absolute,
    a '..' segment, a backslash, a drive), with a NUL byte or an empty or '.' segment, in the folder's bookkeeping
    folder (.cache/: the records; the Hub refuses such files), or the name of both a file and a folder."""
    folders = {"/".join(name.split("/")[:i]) for name in names for i in range(1, name.count("/") + 1)}
    for name in names:
        parts = name.split("/")
        if (not name or name.startswith("/") or "\\" in name or ".." in parts
                or any(PureWindowsPath(part).drive for part in parts)):
            raise PrepareFailed(f"{label}: the endpoint {endpoint} lists a file outside the {holder}: {name!r}",
                                permanent=True)
        why = ("its name has a NUL byte" if "\0" in name
               else "it has an empty or '.' path segment" if any(part in ("", ".") for part in parts)
               else "it is in .cache/, where the local copy keeps its records" if parts[0] == ".cache"
               else "a file and a folder cannot have one name" if name in folders
               else None)
        if why:
            raise PrepareFailed(f"{label}: the endpoint {endpoint} lists a file no {holder} can have ({why}): "
                                f"{name!r}", permanent=True)


def _refuse_another_source(folder: SourceFolder, record_path: Path, wanted: dict[str, Any]) -> None:
    """Refuse (permanent) a folder whose record names another source or version than `wanted`."""
    record = read_json(record_path)
    if not record:
        return
    recorded = {name: record.get(name) for name in wanted}
    if recorded != wanted:
        other = ", ".join(f"{name} {value!r}" for name, value in recorded.items())
        raise PrepareFailed(
            f"{folder.label}: {record_path.parent.parent} holds a fetch of another source ({other}; its record "
            f"is {record_path}); refusing to fetch over it. Each source has a folder of its own: remove this "
            "one if nothing uses it",
            permanent=True,
        )


def check_folder_owner(folder: SourceFolder) -> None:
    """Refuse (permanent) to fetch into a folder whose record names another source: every source has a folder of
    its own, so such a record means the folder was copied or renamed by hand, or two sources were given one
    folder; fetching over it would change files another run may be reading."""
    _refuse_another_source(folder, folder.source_record, folder.record)


def check_snapshot_owner(folder: SourceFolder, version: str) -> None:
    """The same for the folder of one version, whose record also names the version."""
    _refuse_another_source(folder, folder.snapshot_record(version), {**folder.record, "commit": version})


def snapshot_complete(folder: SourceFolder, version: str) -> bool:
    """The version's folder names this source and version and holds every file its record lists."""
    record = read_json(folder.snapshot_record(version))
    wanted = {**folder.record, "commit": version}
    if {name: record.get(name) for name in wanted} != wanted:
        return False
    files, snapshot = record.get("files"), folder.snapshot(version)
    return isinstance(files, list) and all(isinstance(f, str) and (snapshot / f).is_file() for f in files)


def complete_copy(folder: SourceFolder) -> str | None:
    """The version of the latest complete earlier fetch of this source, if its files are all still there."""
    record = read_json(folder.source_record)
    if {name: record.get(name) for name in folder.record} != folder.record:
        return None
    version = record.get("commit")
    if not isinstance(version, str) or not _VERSION.fullmatch(version):
        return None
    return version if snapshot_complete(folder, version) else None


def record_source(folder: SourceFolder, latest_complete: str | None) -> None:
    """The source folder's record: its source, and the version of its latest complete fetch (None: none yet), as
    huggingface_hub's refs/<branch> names the commit a branch had."""
    write_json(folder.source_record, {**folder.record, "commit": latest_complete})


def record_snapshot(folder: SourceFolder, version: str, files: list[str] | None) -> None:
    """The version folder's record names the source and version from the first download on; `files` None: not
    complete yet."""
    write_json(folder.snapshot_record(version), {**folder.record, "commit": version, "files": files})


def claim_snapshot(folder: SourceFolder, version: str) -> Path:
    """Create the version's folder and record it (source, then version) before its first file; returns it."""
    snapshot = folder.snapshot(version)
    try:
        snapshot.mkdir(parents=True, exist_ok=True)
        if not folder.source_record.exists():
            record_source(folder, None)
        record_snapshot(folder, version, None)
    except OSError as exc:
        raise PrepareFailed(f"{folder.label}: cannot create {snapshot} or its record: {exc}", permanent=True) from exc
    return snapshot


def record_latest(folder: SourceFolder, version: str, reporter: Reporter) -> None:
    try:
        record_source(folder, version)
    except OSError as exc:
        reporter.note(f"{folder.label}: cannot record the latest complete fetch in {folder.local_dir}: {exc}")


def record_complete(folder: SourceFolder, version: str, files: list[str], reporter: Reporter) -> None:
    """The version's folder is complete with `files`, and is the source's latest."""
    try:
        record_snapshot(folder, version, files)
    except OSError as exc:
        reporter.note(f"{folder.label}: cannot record the complete fetch in {folder.snapshot(version)}: {exc}")
    record_latest(folder, version, reporter)


def download_all(names: list[str], download: Callable[[str], None], progress: FetchProgress, workers: int,
                 failure: Callable[[str, BaseException], PrepareFailed]) -> None:
    """download(name) for every name, `workers` at a time; the first failure stops new downloads and those in
    flight at their next chunk (what they have is kept for the next attempt), so it is told now, not once the
    largest file is done; raised as failure(name, error), a permanent one first."""
    errors: list[tuple[str, BaseException]] = []
    if names:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(names))), thread_name_prefix="fetch") as pool:
            futures: dict[Future[None], str] = {pool.submit(download, name): name for name in names}
            _, pending = wait(futures, return_when=FIRST_EXCEPTION)
            progress.stop()
            for future in pending:
                future.cancel()
            wait(futures)
            errors = [(name, error) for f, name in futures.items()
                      if not f.cancelled() and (error := f.exception()) is not None
                      and not any(isinstance(cause, DownloadStopped) for cause in causes(error))]
    if errors:
        failures = [(failure(name, exc), exc) for name, exc in errors]
        first, cause = next(((f, e) for f, e in failures if f.permanent), failures[0])
        raise first from cause
