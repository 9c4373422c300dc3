"""The sender of `grpo pull`: the program its pod runs, `python3 -c <source> ROOT ADAPTERS VERSION`.

It picks the adapter version under ROOT/ADAPTERS (the highest `v<N>` that holds a manifest, or
VERSION), and writes a tar stream to stdout: the version's `grpo-manifest.json` first, then every
file the manifest names, read without following a link. It hashes nothing: the client checks every
file against the manifest's digests. Refusals go to stderr with exit status 2; no version at all is
exit status 3.

Only the standard library, and Python 3.8+: it runs in whatever image the pod uses.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import sys
import tarfile

MANIFEST = "grpo-manifest.json"
VERSION_DIR = re.compile(r"^v(\d+)$")
MAX_MANIFEST_BYTES = 16 << 20
EXIT_REFUSED = 2
EXIT_NO_VERSION = 3


class Refused(Exception):
    """Nothing can be sent; the message says why, naming the path on the volume."""


class NoVersion(Refused):
    """The adapter root holds no published version (yet)."""


def versions(root: str) -> list[int]:
    """Published versions: v<N> directories (not links) with a manifest."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        match = VERSION_DIR.match(name)
        path = os.path.join(root, name)
        if match and stat.S_ISDIR(os.lstat(path).st_mode) and os.path.isfile(os.path.join(path, MANIFEST)):
            found.append(int(match.group(1)))
    return sorted(found)


def relative(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and "\\" not in rel and "\0" not in rel and all(
        part not in ("", ".", "..") for part in parts
    ) and rel != MANIFEST


def open_regular(path: str) -> int:
    """A descriptor of the regular file at path; a link at its last part (ELOOP) or anything else is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise Refused(f"{path}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Refused(f"{path} is not a regular file")
    return fd


def add(tar: tarfile.TarFile, name: str, path: str) -> None:
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as source:
        info = tarfile.TarInfo(name)
        info.size = os.fstat(source.fileno()).st_size
        info.mode = 0o644
        tar.addfile(info, source)


def send(root: str, adapters: str, wanted: str) -> int:
    top = os.path.join(root, adapters)
    found = versions(top)
    if wanted == "latest":
        if not found:
            raise NoVersion(f"no adapter version with a {MANIFEST} under {top}")
        version = found[-1]
    else:
        version = int(wanted)
        if version not in found:
            listed = ", ".join(f"v{v}" for v in found) or "none"
            raise NoVersion(f"no adapter v{version} with a {MANIFEST} under {top} (published: {listed})")
    directory = os.path.join(top, f"v{version}")
    fd = open_regular(os.path.join(directory, MANIFEST))
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise Refused(f"{directory}/{MANIFEST} is over {MAX_MANIFEST_BYTES} bytes")
    try:
        manifest = json.loads(data.decode("utf-8"))
        files = manifest["files"]
        assert isinstance(files, dict)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise Refused(f"{directory}/{MANIFEST} is not an adapter manifest") from None
    for rel in files:
        if not relative(rel):
            raise Refused(f"{directory}/{MANIFEST} names {rel!r}, which is not a plain relative path")
    out = sys.stdout.buffer
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(MANIFEST)
        info.size = len(data)
        info.mode = 0o644
        tar.addfile(info, io.BytesIO(data))
        for rel in sorted(files):
            add(tar, rel, os.path.join(directory, *rel.split("/")))
    out.flush()
    return version


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not (argv[2] == "latest" or argv[2].isdigit()):
        sys.stderr.write("usage: sender ROOT ADAPTERS latest|N\n")
        return EXIT_REFUSED
    try:
        send(*argv)
    except NoVersion as exc:
        sys.stderr.write(f"grpo pull sender: {exc}\n")
        return EXIT_NO_VERSION
    except Refused as exc:
        sys.stderr.write(f"grpo pull sender: refused: {exc}\n")
        return EXIT_REFUSED
    except (OSError, tarfile.TarError) as exc:
        sys.stderr.write(f"grpo pull sender: failed: {type(exc).__name__}: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
