"""Adapter publication format on the shared volume: `<adapter root>/v<N>/` plus a manifest.

The trainer writes a version into a temporary directory, fsyncs it, writes
`grpo-manifest.json` (sha256 of every file, step, version, base-model
fingerprint) and renames the directory atomically to `v<N>`. The server
verifies the manifest before it loads anything. Both sides use this module.
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

from pydantic import BaseModel, ConfigDict, Field

MANIFEST_NAME = "grpo-manifest.json"
VERSION_DIR = re.compile(r"^v(\d+)$")


class AdapterManifest(BaseModel):
    """What a published adapter version contains."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=1, description="Adapter version N.")
    step: int = Field(ge=0, description="Optimizer step the adapter was saved at.")
    base_model_fingerprint: str = Field(description="Fingerprint of the base model it was trained on.")
    files: dict[str, str] = Field(description="Relative file path -> sha256 hex digest.")
    created_at: dt.datetime = Field(description="When it was published.")

    def digest(self) -> str:
        """Digest of the manifest itself: identifies the version's exact contents."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()


class ManifestError(ValueError):
    """The directory does not match its manifest."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb", buffering=0) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_file_durably(path: Path, *parts: bytes | memoryview) -> str:
    """Write the parts, in order, to a new file, fsync it, and return the file's sha256.

    The digest is computed from memory (never read back), in a thread while the bytes are
    written: hashlib and os.write both release the GIL.
    """

    def digest() -> str:
        h = hashlib.sha256()
        for part in parts:
            h.update(part)
        return h.hexdigest()

    with ThreadPoolExecutor(max_workers=1) as pool:
        hashed = pool.submit(digest)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
            os.fsync(fd)
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
    """Manifest of every file under directory; `known` digests (hashed while writing) are not re-read."""
    known = known or {}
    files = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST_NAME:
            rel = p.relative_to(directory).as_posix()
            files[rel] = known.get(rel) or sha256_file(p)
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
    except ValueError as exc:
        raise ManifestError(f"{path} is malformed: {exc}") from exc


def verify_manifest(directory: Path) -> AdapterManifest:
    """Check every file against the manifest; raise ManifestError naming the first bad file."""
    manifest = read_manifest(directory)
    verify_files(directory, manifest)
    return manifest


def verify_files(directory: Path, manifest: AdapterManifest) -> None:
    """The directory holds exactly the manifest's files with its digests; ManifestError names the first bad one."""
    for rel, expected in manifest.files.items():
        path = directory / rel
        if not path.is_file():
            raise ManifestError(f"{path} is listed in the manifest but missing")
        actual = sha256_file(path)
        if actual != expected:
            raise ManifestError(f"{path}: sha256 {actual} does not match the manifest's {expected}")
    extra = sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME and p.relative_to(directory).as_posix() not in manifest.files
    )
    if extra:
        raise ManifestError(f"{directory}: files not in the manifest: {', '.join(extra)}")
