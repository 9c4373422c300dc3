"""Publishing adapter versions on the shared volume: `<adapter root>/v<N>/` + manifest.

A version is written into a hidden temporary directory under the adapter root,
checked (vLLM must be able to serve it as a plain LoRA), given a manifest,
fsynced and renamed atomically to `v<N>`: the server never sees a half-written
version. A sync may rename first and flush while the server loads the version
(`publish(flush=False)`, then `flush`): the rename alone keeps a half-written
version out of sight (the server reads what was written, and verifies every byte
against the manifest), the flush only makes it outlast a crash, and the sync is
done only once both are. It holds regular files only (the server refuses
symlinks and special files). The format itself is `grpo_api.adapters`, shared with the server. A
process of an attempt that has ended neither publishes nor prunes
(`checkpoints.AttemptFence`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from grpo_api.adapters import (
    ManifestError,
    build_manifest,
    fsync_tree,
    list_versions,
    plain_lora_problems,
    read_manifest,
    version_dir,
    write_manifest,
)
from grpo_trainer.checkpoints import AttemptFence
from grpo_trainer.errors import TrainingFailed
from grpo_trainer.transport.adapter_files import ADAPTER_CONFIG

TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class PublishedAdapter:
    """One adapter version, complete on the volume."""

    version: int
    step: int
    path: Path
    sha256: str
    size_bytes: int
    #: Seconds per phase: save (wait for the snapshot's copy, write and hash the files), manifest, fsync (the
    #: files and directories), rename; with `publish(flush=False)` the fsync is `flush`'s, after the rename.
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"adapter v{self.version} ({self.path})"


def check_servable(adapter_dir: Path) -> None:
    """Refuse an adapter vLLM cannot serve as plain LoRA (DoRA, bias, modules_to_save, lm_head/embeddings)."""
    config_path = adapter_dir / ADAPTER_CONFIG
    if not config_path.is_file():
        raise TrainingFailed(f"{config_path} missing: the saved adapter is not a PEFT LoRA adapter")
    problems = plain_lora_problems(json.loads(config_path.read_text()))
    if problems:
        raise TrainingFailed(f"{adapter_dir}: adapter cannot be served by vLLM as plain LoRA: {'; '.join(problems)}")


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AdapterStore:
    """The adapter root of a run: publishes new versions and prunes old ones."""

    def __init__(self, root: Path, base_model_fingerprint: str, *, fence: AttemptFence | None = None) -> None:
        """fence: the attempt's claim on the root, checked before a version is published and before pruning."""
        self.root = root
        self.base_model_fingerprint = base_model_fingerprint
        self.fence = fence
        self._steps: dict[int, int] = {}
        #: Highest version known elsewhere (the server's active one): never publish at or below it.
        self.floor = 0

    def next_version(self) -> int:
        """One above every version on the volume or known to the server (names are never reused)."""
        known = list_versions(self.root)
        return max([self.floor, *known, *self._steps]) + 1

    def publish(
        self, save: Callable[[Path], Mapping[str, str] | None], step: int, *, flush: bool = True
    ) -> PublishedAdapter:
        """Save via `save(dir)`, check, write the manifest, fsync, rename to v<N>.

        `save` may return the digests of files it hashed while writing them; those are not read back.
        `flush=False` renames before anything is fsynced: the caller must call `flush(adapter)` before it
        counts the version as published (a crash before that may leave it incomplete on the volume).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        version = self.next_version()
        tmp = self.root / f"{TMP_PREFIX}v{version}-{uuid.uuid4().hex[:8]}"
        phases: dict[str, float] = {}
        clock = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            phases[name] = now - clock
            clock = now

        try:
            known = save(tmp)
            lap("save")
            check_servable(tmp)
            try:
                manifest = build_manifest(
                    tmp, version=version, step=step, base_model_fingerprint=self.base_model_fingerprint, known=known
                )
            except ManifestError as exc:  # a symlink or special file: the server would refuse the version
                raise TrainingFailed(f"{tmp}: the saved adapter cannot be published: {exc}") from exc
            write_manifest(tmp, manifest)
            lap("manifest")
            if flush:
                fsync_tree(tmp)
                lap("fsync")
            final = version_dir(self.root, version)
            if self.fence is not None:
                self.fence.check(f"publish adapter v{version}")
            os.rename(tmp, final)
            if flush:
                _fsync_dir(self.root)
            lap("rename")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._steps[version] = step
        return PublishedAdapter(
            version=version, step=step, path=final, sha256=manifest.digest(), size_bytes=_dir_size(final),
            phases=phases,
        )

    def flush(self, adapter: PublishedAdapter) -> None:
        """fsync a version published with `flush=False` (its files, its directory, the rename); records the
        seconds as its "fsync" phase. TrainingFailed names the version when the volume refuses."""
        started = time.perf_counter()
        try:
            fsync_tree(adapter.path)
            _fsync_dir(self.root)
        except OSError as exc:
            raise TrainingFailed(
                f"{adapter.path}: adapter v{adapter.version} could not be flushed to the volume "
                f"({exc.strerror or type(exc).__name__})"
            ) from exc
        adapter.phases["fsync"] = time.perf_counter() - started

    def step_of(self, version: int) -> int | None:
        """Optimizer step a version was saved at (from memory, else its manifest); None if unknown."""
        if version in self._steps:
            return self._steps[version]
        try:
            step = read_manifest(version_dir(self.root, version)).step
        except ManifestError:
            return None
        self._steps[version] = step
        return step

    def prune(self, keep_from: int) -> list[int]:
        """Delete versions below keep_from and leftover temporary directories; returns the versions deleted."""
        if self.fence is not None:
            self.fence.check(f"prune adapter versions below v{keep_from}")
        removed = []
        for version in list_versions(self.root):
            if version < keep_from:
                shutil.rmtree(version_dir(self.root, version), ignore_errors=True)
                removed.append(version)
        if self.root.is_dir():
            for child in self.root.iterdir():
                if child.name.startswith(TMP_PREFIX) and child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
        return removed
