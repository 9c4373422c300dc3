"""`grpo stage --configmap`: SRC[:KEY] arguments, the files they name, their checks and the ConfigMap
manifest (pure but for reading those files; the API calls are in `kube`)."""

from __future__ import annotations

import base64
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_stage.errors import StageError
from grpo_stage.localfiles import FileId, open_listed, status
from grpo_stage.progress import human_bytes

#: The API server's rule for ConfigMap keys.
KEY_PATTERN = re.compile(r"[-._a-zA-Z0-9]+")
MAX_KEY_LENGTH = 253
#: A DNS-1123 subdomain: the rule for ConfigMap names.
NAME_PATTERN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
MAX_NAME_LENGTH = 253
#: A ConfigMap holds at most 1 MiB (1048576 bytes, counted on the serialized object): keys plus values
#: (binaryData counted base64-encoded) above this are refused before anything is sent.
SIZE_LIMIT = 1_000_000
MANAGED_BY = "app.kubernetes.io/managed-by"
LABELS = {MANAGED_BY: "grpo-stage", "app.kubernetes.io/part-of": "grpo-operator"}


@dataclass(frozen=True)
class Source:
    """One SRC[:KEY] argument: a local file (or directory) and the key it goes to (None: its name)."""

    path: Path
    key: str | None

    def __str__(self) -> str:
        return str(self.path) if self.key is None else f"{self.path}:{self.key}"


@dataclass(frozen=True)
class File:
    """One key of the ConfigMap and the local file that fills it."""

    key: str
    path: Path
    size: int
    file_id: FileId  # which file was listed at path: the one read
    top: Path | None = None  # the SRC directory it was listed in, read beneath without following a link


@dataclass(frozen=True)
class Item:
    """One staged key: the file's size and whether it went to binaryData."""

    key: str
    size: int
    binary: bool


@dataclass(frozen=True)
class Payload:
    """The ConfigMap's `data` (UTF-8 text) and `binaryData` (base64), and what went where."""

    data: dict[str, str]
    binary_data: dict[str, str]
    items: list[Item]

    @property
    def file_bytes(self) -> int:
        return sum(item.size for item in self.items)

    @property
    def stored_size(self) -> int:
        """Keys plus values, binaryData counted base64-encoded (what SIZE_LIMIT bounds)."""
        text = sum(len(k) + len(v.encode("utf-8")) for k, v in self.data.items())
        return text + sum(len(k) + len(v) for k, v in self.binary_data.items())


def key_problem(key: str) -> str | None:
    """Why `key` cannot be a ConfigMap key, or None when it can."""
    if not KEY_PATTERN.fullmatch(key):
        return "a ConfigMap key has only letters, digits, '-', '_' and '.'"
    if len(key) > MAX_KEY_LENGTH:
        return f"a ConfigMap key has at most {MAX_KEY_LENGTH} characters"
    if key in (".", ".."):
        return "a ConfigMap key may not be '.' or '..'"
    return None


def validate_name(name: str) -> str:
    """A ConfigMap name (DNS-1123 subdomain); ValueError if not acceptable."""
    if len(name) > MAX_NAME_LENGTH or not NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a ConfigMap name: lower-case letters, digits, '-' and '.', "
            f"starting and ending with a letter or digit, at most {MAX_NAME_LENGTH} characters"
        )
    return name


def parse_source(text: str) -> Source:
    """`SRC` or `SRC:KEY` (split at the last ':', so SRC may contain colons); ValueError if malformed."""
    source, sep, key = text.rpartition(":")
    if not sep:
        return Source(path=Path(text), key=None)
    if not source:
        raise ValueError(f"{text!r} has an empty SRC")
    problem = key_problem(key)
    if problem:
        raise ValueError(
            f"KEY {key!r} of {text!r}: {problem} (SRC:KEY is split at the last ':'; "
            "when SRC contains ':' give the KEY explicitly)"
        )
    return Source(path=Path(source), key=key)


def _too_large(size: int) -> StageError:
    return StageError(
        f"the files come to {size:,} bytes ({human_bytes(size)}) of ConfigMap keys and values (binaryData "
        f"counted base64-encoded), more than the {SIZE_LIMIT:,} bytes grpo stage puts into a ConfigMap "
        "(which holds at most 1 MiB): stage larger data onto a PersistentVolumeClaim with --claim"
    )


def _list_directory(directory: Path, listed_as: FileId, dereference: bool) -> list[tuple[Path, os.stat_result, bool]]:
    """Each entry of the SRC directory and its status, looked up through a descriptor of the directory that was
    listed (a SRC swapped for a link since is refused, not read through)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | (0 if listed_as.via_link else os.O_NOFOLLOW)
    try:
        dir_fd = os.open(directory, flags)
    except OSError as exc:
        raise StageError(f"cannot read directory {directory} (did it become a symbolic link?): {exc.strerror}") from exc
    try:
        if FileId.of(os.fstat(dir_fd), listed_as.via_link) != listed_as:
            raise StageError(f"{directory} is no longer the directory that was listed (it was replaced while grpo "
                             "stage ran): stage it again")
        listed = []
        for name in sorted(os.listdir(dir_fd)):
            path = directory / name
            st, via_link = status(path, dereference=dereference, dir_fd=dir_fd)
            listed.append((path, st, via_link))
        return listed
    except OSError as exc:
        raise StageError(f"cannot read {exc.filename or directory}: {exc.strerror}") from exc
    finally:
        os.close(dir_fd)


def _directory_files(source: Source, listed_as: FileId, dereference: bool) -> list[File]:
    """The regular files at the top of a SRC directory (not recursive); StageError on anything else,
    a symbolic link included unless `dereference` (see `localfiles`)."""
    directory = source.path
    if source.key is not None:
        raise StageError(f"SRC {directory} is a directory: give KEY only for a file (argument {source})")
    listed = _list_directory(directory, listed_as, dereference)
    subdirectories = [path.name for path, st, _ in listed if stat.S_ISDIR(st.st_mode)]
    if subdirectories:
        raise StageError(
            f"SRC directory {directory} has subdirectories ({', '.join(subdirectories)}): only the files at its "
            "top level go into a ConfigMap; give them as SRC arguments of their own, or use --claim"
        )
    files = []
    for path, st, via_link in listed:
        if not stat.S_ISREG(st.st_mode):
            raise StageError(f"{path} is not a regular file: only regular files go into a ConfigMap")
        problem = key_problem(path.name)
        if problem:
            raise StageError(f"{path}: its name is not a ConfigMap key ({problem}); rename it or give it as SRC:KEY")
        files.append(File(key=path.name, path=path, size=st.st_size, file_id=FileId.of(st, via_link), top=directory))
    if not files:
        raise StageError(f"SRC directory {directory} holds no files")
    return files


def _file(source: Source, st: os.stat_result, via_link: bool) -> File:
    key = source.key if source.key is not None else source.path.name
    problem = key_problem(key)
    if problem:
        raise StageError(f"the name of {source.path} is not a ConfigMap key ({problem}): give one as {source.path}:KEY")
    return File(key=key, path=source.path, size=st.st_size, file_id=FileId.of(st, via_link))


def collect_files(sources: list[Source], dereference: bool = False) -> list[File]:
    """The files to stage, one per key, in argument order; StageError naming the file or key.

    A symbolic link, as SRC or inside a SRC directory, is refused unless `dereference` (the rule of
    `localfiles`, as with --claim). Refuses duplicate keys and, from the files' sizes alone, anything
    that cannot fit (the values only grow when encoded)."""
    files: list[File] = []
    for source in sources:
        try:
            st, via_link = status(source.path, dereference=dereference)
        except FileNotFoundError:
            raise StageError(f"SRC {source.path} does not exist (argument {source})") from None
        except OSError as exc:
            raise StageError(f"cannot read SRC {source.path}: {exc.strerror} (argument {source})") from exc
        if stat.S_ISDIR(st.st_mode):
            files.extend(_directory_files(source, FileId.of(st, via_link), dereference))
        elif stat.S_ISREG(st.st_mode):
            files.append(_file(source, st, via_link))
        else:
            raise StageError(f"SRC {source.path} is neither a regular file nor a directory (argument {source})")
    seen: dict[str, Path] = {}
    for f in files:
        if f.key in seen:
            raise StageError(f"key {f.key} is given twice: by {seen[f.key]} and by {f.path}")
        seen[f.key] = f.path
    least = sum(len(f.key) + f.size for f in files)
    if least > SIZE_LIMIT:
        raise _too_large(least)
    return files


def read_payload(files: list[File]) -> Payload:
    """Read the files: valid UTF-8 to `data`, anything else to `binaryData`; StageError past SIZE_LIMIT."""
    data: dict[str, str] = {}
    binary_data: dict[str, str] = {}
    items: list[Item] = []
    for f in files:
        try:
            with open_listed(f.path, f.file_id, f.top) as stream:
                # One byte past the limit is enough to refuse a file that grew since it was listed.
                content = stream.read(SIZE_LIMIT + 1)
        except OSError as exc:
            raise StageError(f"cannot read {f.path}: {exc.strerror}") from exc
        try:
            data[f.key] = content.decode("utf-8")
            binary = False
        except UnicodeDecodeError:
            binary_data[f.key] = base64.b64encode(content).decode("ascii")
            binary = True
        items.append(Item(key=f.key, size=len(content), binary=binary))
    payload = Payload(data=data, binary_data=binary_data, items=items)
    if payload.stored_size > SIZE_LIMIT:
        raise _too_large(payload.stored_size)
    return payload


def build_configmap(*, name: str, namespace: str, payload: Payload) -> dict[str, Any]:
    manifest: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(LABELS)},
        "data": dict(payload.data),
    }
    if payload.binary_data:
        manifest["binaryData"] = dict(payload.binary_data)
    return manifest


def is_managed(existing: dict[str, Any]) -> bool:
    """Whether grpo stage made this ConfigMap (its label says so)."""
    labels = (existing.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(MANAGED_BY) == LABELS[MANAGED_BY])


def replacement(existing: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest`'s keys, all of them (the others go), on the existing object's metadata (its
    resourceVersion for optimistic concurrency, its other labels and annotations kept)."""
    old = existing.get("metadata") or {}
    metadata = {k: v for k, v in old.items() if k != "managedFields"}
    metadata["labels"] = {**(old.get("labels") or {}), **manifest["metadata"]["labels"]}
    replaced = {k: v for k, v in manifest.items() if k != "metadata"}
    replaced["metadata"] = metadata
    return replaced
