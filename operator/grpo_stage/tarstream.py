"""The tar stream: the entries' members, then a trailer with their checksums, written in chunks.

Each file is read once: its bytes are hashed while tarfile copies them into the stream, so the
trailer (and the comparison with the receiver's manifest) checks exactly what was sent. Nothing
holds more than one chunk in memory.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO, Protocol, cast

from grpo_stage.errors import StageError
from grpo_stage.localfiles import open_listed
from grpo_stage.receiver import TRAILER
from grpo_stage.sources import Entry

#: Bytes per write to the sink (one websocket frame each).
CHUNK = 256 << 10
#: Owner of the members (the staging pod's user; the receiver does not chown anyway).
MEMBER_UID = 1000


@dataclass(frozen=True)
class FileDigest:
    size: int
    sha256: str

    def to_json(self) -> dict[str, int | str]:
        return {"size": self.size, "sha256": self.sha256}


class Sink(Protocol):
    def write(self, data: bytes, /) -> object: ...


class _HashingReader:
    """The file as tarfile reads it, hashed and counted on the way."""

    def __init__(self, raw: BinaryIO, on_read: Callable[[int], None]) -> None:
        self._raw = raw
        self._on_read = on_read
        self.digest = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self.digest.update(data)
        self._on_read(len(data))
        return data


class _Guard:
    """The sink until the stream fails; then nothing (tarfile flushes its buffer when collected)."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.failed = False

    def write(self, data: bytes) -> int:
        if not self.failed:
            self.sink.write(data)
        return len(data)


def _info(entry: Entry) -> tarfile.TarInfo:
    info = tarfile.TarInfo(entry.name)
    info.mtime = int(entry.mtime)
    info.uid = info.gid = MEMBER_UID
    info.uname = info.gname = ""
    if entry.is_dir:
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
    else:
        info.size = entry.size
        info.mode = 0o755 if entry.mode & 0o100 else 0o644
    return info


def trailer_bytes(digests: dict[str, FileDigest]) -> bytes:
    return json.dumps({name: d.to_json() for name, d in digests.items()}, sort_keys=True).encode("utf-8")


def write_tar(
    entries: Sequence[Entry], sink: Sink, on_read: Callable[[str, int], None] | None = None
) -> dict[str, FileDigest]:
    """Write the stream to sink; the sha256 and size of every file sent, by member name.

    The stream ends with the trailer and tarfile's end-of-archive blocks, padded to a whole record,
    so a receiver reading in stream mode stops at its end without waiting for EOF. On an error
    nothing more is written (no end-of-archive: the receiver then installs nothing).
    """
    guard = _Guard(sink)
    try:
        return _write(entries, guard, on_read)
    except BaseException:
        guard.failed = True
        raise


def _write(entries: Sequence[Entry], sink: _Guard, on_read: Callable[[str, int], None] | None) -> dict[str, FileDigest]:
    digests: dict[str, FileDigest] = {}
    # No `with`: closing on an error would finish the stream; the guard drops what tarfile flushes later.
    tar = tarfile.open(fileobj=cast(BinaryIO, sink), mode="w|", format=tarfile.PAX_FORMAT, bufsize=CHUNK)  # noqa: SIM115
    tar.copybufsize = CHUNK  # type: ignore[attr-defined]  # (not in typeshed) read and hash a chunk at a time
    for entry in entries:
        info = _info(entry)
        if entry.source is None:
            tar.addfile(info)
            continue
        name = entry.name

        def count(n: int, name: str = name) -> None:
            if on_read is not None:
                on_read(name, n)

        assert entry.file_id is not None  # a file entry always records which file was listed
        try:
            with open_listed(entry.source, entry.file_id, entry.top) as raw:
                reader = _HashingReader(raw, count)
                tar.addfile(info, reader)
                changed = os.fstat(raw.fileno()).st_size != entry.size
        except OSError as exc:
            raise StageError(f"{entry.source}: {exc} (did it change while it was being sent?)") from exc
        if changed:
            raise StageError(f"{entry.source} changed size while it was being sent")
        digests[name] = FileDigest(size=entry.size, sha256=reader.digest.hexdigest())
    trailer = trailer_bytes(digests)
    info = tarfile.TarInfo(TRAILER)
    info.size = len(trailer)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(trailer))
    tar.close()
    return digests
