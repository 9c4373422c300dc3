"""The receiver of `grpo stage`: the program the staging pod runs, `python3 -c <source> ROOT ID DEST...`.

It reads a tar stream from stdin and writes it into ROOT/.grpo-stage-ID/new/ (regular files and
directories only, every name checked: relative, no `..`, under one of the DESTs), hashing and
fsyncing each file as it is written. The stream ends with a trailer member, TRAILER, holding the
sender's {path: {size, sha256}}: the receiver installs nothing unless its own checksums match it
(a stream cut short or corrupted never replaces anything). Then, for each DEST, it moves any old
ROOT/DEST aside and renames the new one into place (`os.replace`, so a reader sees the old copy or
the new one, never half of one), fsyncs the parent directories, removes the old copies and prints
its manifest as one JSON line on stdout. Refusals go to stderr with exit status 2.

Only the standard library, and Python 3.8+: it runs in whatever image the pod uses. It does not
wait for stdin's end: the tar stream's trailer and end-of-archive blocks end the reading.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tarfile
from typing import IO

STAGING_PREFIX = ".grpo-stage-"
#: The last member of every stream: the sender's manifest, checked before anything is installed.
TRAILER = ".grpo-stage-manifest.json"
MAX_TRAILER_BYTES = 256 << 20
CHUNK = 1 << 20


class Refused(Exception):
    """The stream or the arguments are not acceptable; nothing was installed."""


def relative_parts(name: str, what: str) -> list[str]:
    """The parts of a relative path; refuses absolute paths, `..`, `.` and empty parts."""
    if not name or name.startswith("/") or "\x00" in name:
        raise Refused(f"{what} {name!r} is not a relative path")
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise Refused(f"{what} {name!r} has an empty, '.' or '..' part")
    return parts


def check_dests(dests: list[str]) -> None:
    if not dests:
        raise Refused("no destination given")
    for dest in dests:
        parts = relative_parts(dest, "destination")
        if parts[0].startswith(STAGING_PREFIX):
            raise Refused(f"destination {dest!r} uses the reserved prefix {STAGING_PREFIX}")
    for a in dests:
        for b in dests:
            if a != b and (b + "/").startswith(a + "/"):
                raise Refused(f"destinations {a!r} and {b!r} overlap")
    if len(set(dests)) != len(dests):
        raise Refused("a destination is given twice")


def check_member(member: tarfile.TarInfo, dests: list[str]) -> list[str]:
    """The member's path parts, if it is a file or directory under one of the destinations."""
    parts = relative_parts(member.name, "member")
    if not any(member.name == d or member.name.startswith(d + "/") for d in dests):
        raise Refused(f"member {member.name!r} is not under a destination ({', '.join(dests)})")
    if not (member.isreg() or member.isdir()):
        raise Refused(f"member {member.name!r} is neither a regular file nor a directory")
    return parts


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_member(tar: tarfile.TarFile, member: tarfile.TarInfo, target: str) -> dict[str, object]:
    source = tar.extractfile(member)
    if source is None:
        raise Refused(f"member {member.name!r} has no data")
    mode = 0o755 if member.mode & 0o100 else 0o644
    # O_EXCL: a name given twice is refused; the staging directory holds no links to follow.
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    digest = hashlib.sha256()
    size = 0
    with os.fdopen(fd, "wb") as out:
        while True:
            block = source.read(CHUNK)
            if not block:
                break
            digest.update(block)
            out.write(block)
            size += len(block)
        out.flush()
        os.fsync(out.fileno())
    if size != member.size:
        raise Refused(f"member {member.name!r} ended after {size} of {member.size} bytes")
    os.utime(target, (member.mtime, member.mtime))
    return {"size": size, "sha256": digest.hexdigest()}


def read_trailer(tar: tarfile.TarFile, member: tarfile.TarInfo) -> dict[str, object]:
    if not member.isreg() or member.size > MAX_TRAILER_BYTES:
        raise Refused(f"the trailer {TRAILER} is not a regular file of at most {MAX_TRAILER_BYTES} bytes")
    source = tar.extractfile(member)
    data = source.read() if source is not None else b""
    try:
        expected = json.loads(data.decode("utf-8"))
    except ValueError as exc:
        raise Refused(f"the trailer {TRAILER} is not JSON: {exc}") from None
    if not isinstance(expected, dict):
        raise Refused(f"the trailer {TRAILER} is not a JSON object")
    return expected


def extract(
    stream: IO[bytes], staging: str, dests: list[str]
) -> tuple[dict[str, dict[str, object]], dict[str, object]]:
    """Write the stream's members under staging; (what was written, the sender's trailer)."""
    written: dict[str, dict[str, object]] = {}
    trailer: dict[str, object] | None = None
    data_filter = getattr(tarfile, "data_filter", None)  # Python 3.12+, 3.11.4+: a second opinion
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            if trailer is not None:
                raise Refused(f"member {member.name!r} follows the trailer")
            if member.name == TRAILER:
                trailer = read_trailer(tar, member)
                continue
            parts = check_member(member, dests)
            if data_filter is not None:
                try:
                    data_filter(member, staging)
                except tarfile.TarError as exc:
                    raise Refused(f"member {member.name!r}: {exc}") from None
            target = os.path.join(staging, *parts)
            if member.isdir():
                os.makedirs(target, mode=0o755, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            written[member.name] = write_member(tar, member, target)
    if trailer is None:
        raise Refused(f"the stream ended before its trailer {TRAILER} (cut short?)")
    return written, trailer


def compare(written: dict[str, dict[str, object]], expected: dict[str, object]) -> list[str]:
    problems = []
    for name in sorted(set(expected) | set(written)):
        if name not in written:
            problems.append(f"{name}: sent but not received")
        elif name not in expected:
            problems.append(f"{name}: received but not in the sender's manifest")
        elif written[name] != expected[name]:
            problems.append(f"{name}: wrote {written[name]}, the sender sent {expected[name]}")
    return problems


def inside(root: str, path: str) -> bool:
    real_root = os.path.realpath(root)
    return os.path.realpath(path).startswith(real_root + os.sep)


def check_parents(root: str, dest: str) -> None:
    """The directories above ROOT/DEST are directories (or absent) and stay on the volume."""
    parts = dest.split("/")
    for i in range(1, len(parts)):
        above = os.path.join(root, *parts[:i])
        if os.path.lexists(above) and not os.path.isdir(above):
            raise Refused(f"{'/'.join(parts[:i])} on the volume is not a directory: {dest!r} cannot go under it")
    parent = os.path.dirname(os.path.join(root, dest))
    if parent != root and not inside(root, parent):
        raise Refused(f"the parent of {dest!r} leads outside the volume (a symbolic link?)")


def install(root: str, staging: str, trash: str, dests: list[str]) -> None:
    """Move each staged DEST into place; an old ROOT/DEST goes to trash first."""
    for dest in dests:
        if not os.path.lexists(os.path.join(staging, dest)):
            raise Refused(f"the stream held nothing for destination {dest!r}")
        check_parents(root, dest)
    os.makedirs(trash, mode=0o700, exist_ok=True)
    for index, dest in enumerate(dests):
        final = os.path.join(root, dest)
        parent = os.path.dirname(final)
        os.makedirs(parent, mode=0o755, exist_ok=True)
        if os.path.lexists(final):
            os.rename(final, os.path.join(trash, str(index)))
        os.replace(os.path.join(staging, dest), final)
        fsync_path(parent)


def fsync_tree(top: str) -> None:
    for directory, _, _ in os.walk(top):
        fsync_path(directory)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        sys.stderr.write("usage: receiver ROOT ID DEST...\n")
        return 2
    root, stage_id, dests = argv[0], argv[1], argv[2:]
    base = os.path.join(root, STAGING_PREFIX + stage_id)
    try:
        check_dests(dests)
        if not stage_id.isalnum():
            raise Refused(f"the stage id {stage_id!r} is not alphanumeric")
        os.mkdir(base, 0o700)  # fails if another stage uses this id: never clean up what is not ours
    except (Refused, OSError) as exc:
        sys.stderr.write(f"grpo stage receiver: refused: {exc}\n")
        return 2
    try:
        staging = os.path.join(base, "new")
        os.mkdir(staging, 0o755)
        # Raw stdin: a read returns what has arrived, so nothing waits for more than the stream holds.
        stdin = getattr(sys.stdin.buffer, "raw", sys.stdin.buffer)
        written, expected = extract(stdin, staging, dests)
        problems = compare(written, expected)
        if problems:
            raise Refused("the files differ from what was sent:\n  " + "\n  ".join(problems[:20]))
        fsync_tree(staging)
        install(root, staging, os.path.join(base, "old"), dests)
    except Refused as exc:
        sys.stderr.write(f"grpo stage receiver: refused: {exc}\n")
        return 2
    except (OSError, tarfile.TarError) as exc:
        sys.stderr.write(f"grpo stage receiver: failed: {type(exc).__name__}: {exc}\n")
        return 1
    finally:
        shutil.rmtree(base, ignore_errors=True)
    sys.stdout.write(json.dumps(written, sort_keys=True) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
