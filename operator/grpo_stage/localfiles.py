"""How `grpo stage` reads local files: one rule for --claim and --configmap alike.

It reads regular files (and, onto a claim, walks directories). A symbolic link, whether given as SRC
or met inside a SRC directory, is refused, naming it and where it points, unless -L/--dereference is
given: then the file it points to is read, wherever it lies (a Hugging Face cache snapshot links
into ../../blobs). A link that leads out of the folder would otherwise send a file the user never
meant to stage (a private key beside the prompts), which is why no link is followed unasked.

Listing and reading are two moments: a file is opened without following a link (unless it was
listed through one) and must be the very file that was listed (device and inode), so a file
swapped for a link or for another file in between is refused, not read. Beneath a SRC directory
nothing is reached by path: each directory is opened from its parent's descriptor without following
a link, so a directory swapped for a link (to anywhere) while grpo stage lists or reads is refused,
not walked or read through.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from grpo_stage.errors import StageError

#: What every refusal of a link adds: the rule and the two ways past it.
LINK_RULE = (
    "grpo stage reads only regular files inside the folders it is given, never through a link unasked: "
    "copy the files out first (cp -rL) or pass -L/--dereference to send the files links point to"
)


@dataclass(frozen=True)
class FileId:
    """Which file was listed at a path, so that reading it later reads that file and no other."""

    device: int
    inode: int
    via_link: bool  # listed through a symbolic link that -L/--dereference allowed

    @classmethod
    def of(cls, st: os.stat_result, via_link: bool) -> FileId:
        return cls(device=st.st_dev, inode=st.st_ino, via_link=via_link)


def link_target(path: Path | str) -> str:
    """Where a link leads, for messages (resolved in full, as far as it resolves)."""
    return os.path.realpath(path)


def status(path: Path | str, *, dereference: bool, dir_fd: int | None = None) -> tuple[os.stat_result, bool]:
    """The status of what grpo stage would read at `path`, and whether that is through a link.

    With `dir_fd`, `path` is looked up by its last element in that directory (no link on the way).
    A link is refused (StageError naming it and its target) unless `dereference`; then it stands for
    what it points to, and a broken one is refused. Raises OSError (FileNotFoundError for a missing
    path) for the caller to name the argument."""
    name = os.path.basename(path) if dir_fd is not None else path
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        return st, False
    if not dereference:
        raise StageError(f"{path} is a symbolic link to {link_target(path)}: {LINK_RULE}")
    try:
        return os.stat(name, dir_fd=dir_fd), True
    except OSError:
        raise StageError(f"{path} is a broken symbolic link (to {link_target(path)})") from None


def open_listed(path: Path, file_id: FileId, top: Path | None = None) -> BinaryIO:
    """Open the file listed at `path` for reading; StageError if the path now leads elsewhere.

    `top`: the SRC directory it was listed in; every directory between it and the file is opened from its
    parent's descriptor without following a link, so a directory swapped for a link since the listing is
    refused. O_NOFOLLOW: a file that became a link is not opened at all; O_NONBLOCK: a path that became a
    FIFO does not hang the open (it has no effect on a regular file)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if file_id.via_link else os.O_NOFOLLOW)
    dir_fd = None if top is None else _open_parent(top, path)
    try:
        fd = os.open(path if dir_fd is None else path.name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if not file_id.via_link and stat.S_ISLNK(_lstat_mode(path, dir_fd)):
            raise StageError(f"{path} became a symbolic link (to {link_target(path)}) after it was listed: "
                             f"{LINK_RULE}") from None
        raise StageError(f"cannot read {path}: {exc.strerror}") from exc
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or FileId.of(st, file_id.via_link) != file_id:
            raise StageError(f"{path} is no longer the file that was listed (it was replaced while grpo stage ran): "
                             "stage it again")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _lstat_mode(path: Path, dir_fd: int | None) -> int:
    try:
        return os.stat(path if dir_fd is None else path.name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return 0


def open_directory_beneath(dir_fd: int, name: str, path: Path | str) -> int:
    """The directory `name` of the directory open at dir_fd, opened without following a link; StageError naming
    `path` when it is a link (or no longer a directory)."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as exc:
        if stat.S_ISLNK(_lstat_mode(Path(name), dir_fd)):
            raise StageError(f"{path} became a symbolic link (to {link_target(path)}) while grpo stage ran: "
                             f"{LINK_RULE}") from None
        raise StageError(f"cannot read directory {path}: {exc.strerror}") from exc


def _open_parent(top: Path, path: Path) -> int:
    """The directory holding `path`, reached from `top` one element at a time without following a link."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    current = top
    try:
        for part in path.parent.relative_to(top).parts:
            current = current / part
            next_fd = open_directory_beneath(fd, part, current)
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd
