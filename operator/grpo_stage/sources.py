"""The local side: what each SRC:DEST argument sends (regular files and directories only; links
under the rule of `localfiles`)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from grpo_stage.errors import StageError
from grpo_stage.localfiles import LINK_RULE, FileId, link_target, status
from grpo_stage.paths import Mapping


@dataclass(frozen=True)
class Entry:
    """One member of the stream: a directory (source None) or a regular file, named as on the claim."""

    name: str
    source: Path | None
    size: int
    mode: int
    mtime: float
    file_id: FileId | None  # which file was listed at source (None for a directory)

    @property
    def is_dir(self) -> bool:
        return self.source is None


def _checked_name(name: str, path: str) -> str:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise StageError(f"{path}: the name is not valid UTF-8; rename it before staging") from None
    return name


def _file_entry(path: str, name: str, dereference: bool) -> Entry:
    st, via_link = status(path, dereference=dereference)
    if not stat.S_ISREG(st.st_mode):
        raise StageError(f"{path} is neither a regular file nor a directory")
    return Entry(
        name=_checked_name(name, path), source=Path(path), size=st.st_size, mode=st.st_mode, mtime=st.st_mtime,
        file_id=FileId.of(st, via_link),
    )


def _walk(mapping: Mapping, dereference: bool) -> Iterator[Entry]:
    top = mapping.source

    def fail(exc: OSError) -> None:
        raise StageError(f"cannot read {exc.filename}: {exc.strerror} (argument {mapping})")

    # followlinks=False: os.walk lists a link to a directory among the directories and does not enter it.
    for directory, dirnames, filenames in os.walk(top, onerror=fail):
        dirnames.sort()
        filenames.sort()
        rel = os.path.relpath(directory, top)
        prefix = mapping.dest if rel == "." else mapping.dest + "/" + rel.replace(os.sep, "/")
        for dirname in dirnames:
            path = os.path.join(directory, dirname)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                # Not even with -L: a walk that follows directory links can leave the folder or loop.
                raise StageError(
                    f"{path} is a symbolic link to a directory ({link_target(path)}): {LINK_RULE} "
                    "(-L follows links to files only; give a linked directory as a SRC of its own)"
                )
            yield Entry(
                name=_checked_name(f"{prefix}/{dirname}", path), source=None, size=0, mode=st.st_mode,
                mtime=st.st_mtime, file_id=None,
            )
        for filename in filenames:
            yield _file_entry(os.path.join(directory, filename), f"{prefix}/{filename}", dereference)


def collect(mappings: list[Mapping], dereference: bool = False) -> list[Entry]:
    """Every member to send, parents before children, in a stable order; StageError naming the path.

    A symbolic link, as SRC or inside one, is refused unless `dereference` (see `localfiles`)."""
    entries: list[Entry] = []
    for mapping in mappings:
        source = mapping.source
        try:
            st, via_link = status(source, dereference=dereference)
        except FileNotFoundError:
            raise StageError(f"SRC {source} does not exist (argument {mapping})") from None
        except OSError as exc:
            raise StageError(f"cannot read SRC {source}: {exc.strerror} (argument {mapping})") from exc
        if stat.S_ISREG(st.st_mode):
            entries.append(Entry(
                name=mapping.dest, source=source, size=st.st_size, mode=st.st_mode, mtime=st.st_mtime,
                file_id=FileId.of(st, via_link),
            ))
        elif stat.S_ISDIR(st.st_mode):
            entries.append(
                Entry(name=mapping.dest, source=None, size=0, mode=st.st_mode, mtime=st.st_mtime, file_id=None)
            )
            entries.extend(_walk(mapping, dereference))
        else:
            raise StageError(f"SRC {source} is neither a regular file nor a directory (argument {mapping})")
    return entries
