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
    top: Path | None = None  # the SRC directory it was listed in, read beneath without following a link


    @property
    def is_dir(self) -> bool:
        return self.source is None


def _checked_name(name: str, path: str) -> str:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise StageError(f"{path}: the name is not valid UTF-8; rename it before staging") from None
    return name


def _file_entry(path: str, name: str, dereference: bool, dir_fd: int, top: Path) -> Entry:
    st, via_link = status(path, dereference=dereference, dir_fd=dir_fd)
    if not stat.S_ISREG(st.st_mode):
        raise StageError(f"{path} is neither a regular file nor a directory")
    return Entry(
        name=_checked_name(name, path), source=Path(path), size=st.st_size, mode=st.st_mode, mtime=st.st_mtime,
        file_id=FileId.of(st, via_link), top=top,
    )


def _open_top(top: Path, listed_as: FileId) -> int:
    """The SRC directory that was listed, opened (through a link only where -L allowed it when it was listed)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | (0 if listed_as.via_link else os.O_NOFOLLOW)
    try:
        fd = os.open(top, flags)
    except OSError as exc:
        raise StageError(f"cannot read directory {top} (did it become a symbolic link?): {exc.strerror}") from exc
    if FileId.of(os.fstat(fd), listed_as.via_link) != listed_as:
        os.close(fd)
        raise StageError(f"{top} is no longer the directory that was listed (it was replaced while grpo stage ran): "
                         "stage it again")
    return fd


def _walk(mapping: Mapping, listed_as: FileId, dereference: bool) -> Iterator[Entry]:
    """The members under a SRC directory. os.fwalk lists each directory through a descriptor of it and looks its
    entries up there, so no lookup passes through a link; a directory it does not walk after listing it (one
    swapped for a link in between: fwalk skips what is no longer the directory it listed) is refused."""
    top = mapping.source
    listed, walked = {"."}, set()

    def fail(exc: OSError) -> None:
        raise StageError(f"cannot read {os.path.join(top, exc.filename or '')}: {exc.strerror} (argument {mapping})")

    top_fd = _open_top(top, listed_as)
    try:
        # follow_symlinks=False: a link to a directory is listed among the directories and not entered.
        for directory, dirnames, filenames, dir_fd in os.fwalk(".", onerror=fail, follow_symlinks=False,
                                                               dir_fd=top_fd):
            dirnames.sort()
            filenames.sort()
            rel = os.path.normpath(directory)
            walked.add(rel)
            yield from _listed_here(mapping, rel, dirnames, filenames, dir_fd, dereference)
            listed.update(os.path.normpath(os.path.join(rel, d)) for d in dirnames)
    finally:
        os.close(top_fd)
    if unwalked := sorted(listed - walked):
        path = os.path.join(top, unwalked[0])
        raise StageError(f"{path} is no longer the directory that was listed (swapped for a symbolic link to "
                         f"{link_target(path)}?) while grpo stage ran: {LINK_RULE}")


def _listed_here(mapping: Mapping, rel: str, dirnames: list[str], filenames: list[str], dir_fd: int,
                 dereference: bool) -> Iterator[Entry]:
    """The members of one directory of the walk (rel to the SRC), looked up through its descriptor."""
    top = mapping.source
    directory = top if rel == "." else top / rel
    prefix = mapping.dest if rel == "." else mapping.dest + "/" + rel.replace(os.sep, "/")
    for dirname in dirnames:
        path = os.path.join(directory, dirname)
        st = os.stat(dirname, dir_fd=dir_fd, follow_symlinks=False)
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
        yield _file_entry(os.path.join(directory, filename), f"{prefix}/{filename}", dereference, dir_fd, top)


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
            entries.extend(_walk(mapping, FileId.of(st, via_link), dereference))
        else:
            raise StageError(f"SRC {source} is neither a regular file nor a directory (argument {mapping})")
    return entries
