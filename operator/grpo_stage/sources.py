"""The local side: what each SRC:DEST argument sends (regular files and directories only)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from grpo_stage.errors import StageError
from grpo_stage.paths import Mapping


@dataclass(frozen=True)
class Entry:
    """One member of the stream: a directory (source None) or a regular file, named as on the claim."""

    name: str
    source: Path | None
    size: int
    mode: int
    mtime: float

    @property
    def is_dir(self) -> bool:
        return self.source is None


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


def _checked_name(name: str, path: str) -> str:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise StageError(f"{path}: the name is not valid UTF-8; rename it before staging") from None
    return name


def _file_entry(path: str, name: str, real_top: str, top: Path, dereference: bool) -> Entry:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        target = os.path.realpath(path)
        if not dereference and not _within(target, real_top):
            raise StageError(
                f"{path} is a symbolic link to {target}, outside {top}: copy the files out first "
                "(cp -rL) or pass --dereference to send the files the links point to"
            )
        try:
            st = os.stat(path)
        except OSError:
            raise StageError(f"{path} is a broken symbolic link (to {target})") from None
    if not stat.S_ISREG(st.st_mode):
        raise StageError(f"{path} is neither a regular file nor a directory")
    return Entry(name=_checked_name(name, path), source=Path(path), size=st.st_size, mode=st.st_mode, mtime=st.st_mtime)


def _walk(mapping: Mapping, dereference: bool) -> Iterator[Entry]:
    top = mapping.source
    real_top = os.path.realpath(top)

    def fail(exc: OSError) -> None:
        raise StageError(f"cannot read {exc.filename}: {exc.strerror} (argument {mapping})")

    for directory, dirnames, filenames in os.walk(top, onerror=fail):
        dirnames.sort()
        filenames.sort()
        rel = os.path.relpath(directory, top)
        prefix = mapping.dest if rel == "." else mapping.dest + "/" + rel.replace(os.sep, "/")
        for dirname in dirnames:
            path = os.path.join(directory, dirname)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                raise StageError(
                    f"{path} is a symbolic link to a directory ({os.path.realpath(path)}): "
                    "only regular files and directories are staged"
                )
            yield Entry(
                name=_checked_name(f"{prefix}/{dirname}", path), source=None, size=0, mode=st.st_mode, mtime=st.st_mtime
            )
        for filename in filenames:
            yield _file_entry(os.path.join(directory, filename), f"{prefix}/{filename}", real_top, top, dereference)


def collect(mappings: list[Mapping], dereference: bool = False) -> list[Entry]:
    """Every member to send, parents before children, in a stable order; StageError naming the path."""
    entries: list[Entry] = []
    for mapping in mappings:
        source = mapping.source
        if not source.exists():
            raise StageError(f"SRC {source} does not exist (argument {mapping})")
        st = source.stat()
        if stat.S_ISREG(st.st_mode):
            entries.append(Entry(name=mapping.dest, source=source, size=st.st_size, mode=st.st_mode, mtime=st.st_mtime))
        elif stat.S_ISDIR(st.st_mode):
            entries.append(Entry(name=mapping.dest, source=None, size=0, mode=st.st_mode, mtime=st.st_mtime))
            entries.extend(_walk(mapping, dereference))
        else:
            raise StageError(f"SRC {source} is neither a regular file nor a directory (argument {mapping})")
    return entries
