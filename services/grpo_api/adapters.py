"""Adapter publication format on the shared volume: `<adapter root>/v<N>/` plus a manifest.

The trainer writes a version into a temporary directory, fsyncs it, writes
`grpo-manifest.json` (a digest of every file, step, version, base-model
fingerprint) and renames the directory atomically to `v<N>`. The server
verifies the manifest before it loads anything. Both sides use this module.

File digests are BLAKE3 (the `blake3` package), written `blake3:<hex>`: the server verifies every
byte of an adapter before it serves it, on the sync's path, and BLAKE3 is faster than sha256 and
spreads a large buffer over threads (the 74 MB r=32 adapter of a 1.5B model read and hashed on an H100
host: 0.038 s against 0.088 s, bench/manifest_digest.py). A bare 64-hex digest is sha256, which manifests
written before carry: both verify. The manifest's own digest (the load trigger's `sha256`) stays sha256.

A version directory holds regular files and directories only, and the manifest names
them by plain relative paths: no symbolic link (to anywhere), no absolute or `..` entry,
so every file an adapter names or holds lies inside its directory, and the server never
reads, hashes or reports on a file outside it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

MANIFEST_NAME = "grpo-manifest.json"
VERSION_DIR = re.compile(r"^v(\d+)$")
#: Error type of a manifest entry that is not a plain relative path inside the directory.
ENTRY_OUTSIDE = "adapter_file_outside"
#: The notation of a file digest new manifests carry; a bare hex digest is sha256.
BLAKE3_PREFIX = "blake3:"
FILE_DIGEST = re.compile(r"^(blake3:)?[0-9a-f]{64}$")
#: Bytes read at once when a file is hashed (large enough for BLAKE3 to use its threads).
HASH_CHUNK = 1 << 24


#: LoRA targets a served adapter may not touch (vLLM cannot load them as plain LoRA).
FORBIDDEN_TARGETS = ("lm_head", "embed_tokens")


def plain_lora_problems(config: dict[str, Any]) -> list[str]:
    """Why an adapter_config.json is not a plain LoRA vLLM can serve (DoRA, bias, modules_to_save, lm_head or
    embedding targets); empty when it is. The trainer checks what it publishes and a warm-start adapter with it."""
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type is {config.get('peft_type')}, not LORA")
    if config.get("use_dora"):
        problems.append("use_dora is set")
    if config.get("bias", "none") != "none":
        problems.append(f"bias is {config.get('bias')!r}, not 'none'")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save is {config.get('modules_to_save')}")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    bad = [t for t in targets if any(f in str(t) for f in FORBIDDEN_TARGETS)]
    if bad:
        problems.append(f"target_modules include {bad}")
    return problems


def entry_problem(rel: str) -> str | None:
    """Why a manifest entry is not a plain relative path of a file inside its directory; None if it is."""
    parts = rel.split("/")
    if rel.startswith("/"):
        return "an absolute path"
    if "\\" in rel or "\0" in rel:
        return "not a plain relative path (backslash or NUL)"
    if any(part in ("", ".", "..") for part in parts):
        return "not a normalized relative path (empty, '.' or '..' segments)"
    if rel == MANIFEST_NAME:
        return "the manifest itself"
    return None


class AdapterManifest(BaseModel):
    """What a published adapter version contains."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=1, description="Adapter version N.")
    step: int = Field(ge=0, description="Optimizer step the adapter was saved at.")
    base_model_fingerprint: str = Field(description="Fingerprint of the base model it was trained on.")
    files: dict[str, str] = Field(
        description="Relative file path -> digest: `blake3:<64 hex>`, or 64 hex for sha256 (earlier manifests)."
    )
    created_at: dt.datetime = Field(description="When it was published.")

    @field_validator("files")
    @classmethod
    def _entries_inside(cls, files: dict[str, str]) -> dict[str, str]:
        for rel in files:
            problem = entry_problem(rel)
            if problem is not None:
                raise PydanticCustomError(
                    ENTRY_OUTSIDE,
                    "files: {entry} is {problem}; entries are relative paths inside the version directory",
                    {"entry": repr(rel), "problem": problem},
                )
        bad = sorted(rel for rel, digest in files.items() if not FILE_DIGEST.match(digest))
        if bad:
            raise ValueError(f"files: the digest of {bad[0]!r} is neither blake3:<64 hex> nor 64 hex (sha256)")
        return files

    def digest(self) -> str:
        """Digest of the manifest itself: identifies the version's exact contents."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()


class ManifestError(ValueError):
    """The directory does not match its manifest."""


class ManifestPathError(ManifestError):
    """A manifest entry or a file of the directory that could lead outside it (absolute, `..`, a symlink)."""


class FileHasher:
    """A file's digest in the manifest's notation, fed in parts: BLAKE3, or sha256 to check a bare hex digest.

    `FileHasher()` makes the digests new manifests carry; `FileHasher(like=expected)` hashes the way
    `expected` was made, so an earlier manifest's sha256 entries still verify. Both release the GIL
    while they hash a large part; BLAKE3 also spreads one over threads.
    """

    def __init__(self, like: str | None = None) -> None:
        import blake3  # here, not at the top: the operator imports this module and has no blake3

        self._sha256 = like is not None and not like.startswith(BLAKE3_PREFIX)
        self._hash: Any = hashlib.sha256() if self._sha256 else blake3.blake3(max_threads=blake3.blake3.AUTO)

    def update(self, data: bytes | memoryview) -> None:
        self._hash.update(data)

    def result(self) -> str:
        return self._hash.hexdigest() if self._sha256 else BLAKE3_PREFIX + self._hash.hexdigest()


def file_digest(path: Path, like: str | None = None) -> str:
    """A regular file's digest (FileHasher); the last component is not followed if it is a symlink (OSError ELOOP)."""
    hasher = FileHasher(like)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with open(fd, "rb", buffering=0) as f:
        while block := f.read(HASH_CHUNK):
            hasher.update(block)
    return hasher.result()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a regular file (exports report it); the last component is not followed if it is a symlink."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with open(fd, "rb", buffering=0) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def directory_files(directory: Path) -> list[str]:
    """Relative posix paths of the files under directory (the manifest excluded), sorted; no link is followed.

    ManifestPathError for a symbolic link anywhere below directory (whatever it points to: a
    version directory holds none); ManifestError for anything but regular files and directories
    (a FIFO would block the reader). Messages name the entry, never what a link points to.
    """
    found: list[str] = []
    pending = [""]
    while pending:
        prefix = pending.pop()
        with os.scandir(directory / prefix if prefix else directory) as entries:
            for entry in entries:
                rel = prefix + entry.name
                if entry.is_symlink():
                    raise ManifestPathError(
                        f"{directory / rel} is a symbolic link: a version directory holds regular files only"
                    )
                if entry.is_dir(follow_symlinks=False):
                    pending.append(rel + "/")
                elif entry.is_file(follow_symlinks=False):
                    if rel != MANIFEST_NAME:
                        found.append(rel)
                else:
                    raise ManifestError(f"{directory / rel} is not a regular file or directory")
    return sorted(found)


def write_file_hashed(path: Path, *parts: bytes | memoryview) -> str:
    """Write the parts, in order, to a new file and return the file's digest (FileHasher's notation).

    Not flushed: the caller fsyncs the directory it publishes (`fsync_tree`), once for all its files.

    The digest is computed from memory (never read back), in a thread while the bytes are
    written: the hash and os.write both release the GIL.
    """

    def digest() -> str:
        hasher = FileHasher()
        for part in parts:
            hasher.update(part)
        return hasher.result()

    with ThreadPoolExecutor(max_workers=1) as pool:
        hashed = pool.submit(digest)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
        finally:
            os.close(fd)
        return hashed.result()


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version}"


def list_versions(root: Path) -> list[int]:
    """Published versions under root, ascending (temporary directories are ignored)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = VERSION_DIR.match(child.name)
        if match and child.is_dir():
            found.append(int(match.group(1)))
    return sorted(found)


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under path, then path itself."""
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def build_manifest(
    directory: Path,
    *,
    version: int,
    step: int,
    base_model_fingerprint: str,
    known: Mapping[str, str] | None = None,
) -> AdapterManifest:
    """Manifest of every file under directory; `known` digests (hashed while writing) are not re-read.

    ManifestError (ManifestPathError for a symlink) if the directory holds anything the server would refuse.
    """
    known = known or {}
    files = {rel: known.get(rel) or file_digest(directory / rel) for rel in directory_files(directory)}
    return AdapterManifest(
        version=version,
        step=step,
        base_model_fingerprint=base_model_fingerprint,
        files=files,
        created_at=dt.datetime.now(dt.UTC),
    )


def write_manifest(directory: Path, manifest: AdapterManifest) -> None:
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest.model_dump(mode="json"), indent=2))


def read_manifest(directory: Path) -> AdapterManifest:
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{path} is missing")
    try:
        return AdapterManifest.model_validate_json(path.read_text())
    except ValidationError as exc:
        outside = [e["msg"] for e in exc.errors() if e["type"] == ENTRY_OUTSIDE]
        if outside:
            raise ManifestPathError(f"{path}: {outside[0]}") from exc
        raise ManifestError(f"{path} is malformed: {exc}") from exc
    except ValueError as exc:
        raise ManifestError(f"{path} is malformed: {exc}") from exc


def verify_manifest(directory: Path) -> AdapterManifest:
    """Check every file against the manifest; raise ManifestError naming the first bad file."""
    manifest = read_manifest(directory)
    verify_files(directory, manifest)
    return manifest


def verify_files(directory: Path, manifest: AdapterManifest) -> None:
    """The directory holds exactly the manifest's files with its digests; ManifestError names the first bad one.

    Only files found inside the directory (no link followed) are opened: an entry of the manifest
    is never resolved on its own, so no message says anything about a file outside the directory.
    """
    present = set(directory_files(directory))
    for rel, expected in manifest.files.items():
        path = directory / rel
        if rel not in present:
            raise ManifestError(f"{path} is listed in the manifest but missing")
        try:
            actual = file_digest(path, like=expected)
        except OSError as exc:  # replaced by a link or removed since the listing
            raise ManifestError(f"{path} cannot be read as a regular file ({exc.strerror})") from exc
        if actual != expected:
            raise ManifestError(f"{path}: digest {actual} does not match the manifest's {expected}")
    extra = sorted(present - manifest.files.keys())
    if extra:
        raise ManifestError(f"{directory}: files not in the manifest: {', '.join(extra)}")


def linear_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """(out, in) of every 2-D `<module>.weight` in the model's safetensors files, read from their headers.

    Empty when the model has no safetensors weights (the shape check is then skipped).
    """
    from safetensors import safe_open  # here, not at the top: the operator imports this module

    shapes: dict[str, tuple[int, int]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                shape = handle.get_slice(key).get_shape()
                if key.endswith(".weight") and len(shape) == 2:
                    shapes[key.removesuffix(".weight")] = (int(shape[0]), int(shape[1]))
    return shapes
