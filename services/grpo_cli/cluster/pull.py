"""`grpo pull`: a run's final adapter from its claim to a local directory, through the API alone.

The same path as `grpo stage`, the other way: a short-lived non-root pod mounts the run's claim
read-only, `pods/exec` runs the sender (`sender.py`) in it, which streams a tar of the newest
published version (its manifest first); each file is written here into a scratch directory beside
DEST, hashed on the way, and must match the manifest's digests (no file missing, none extra) before
DEST is replaced by it. The pod is deleted whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from pydantic import ValidationError
from websocket import WebSocketException

from grpo_api.adapters import MANIFEST_NAME, AdapterManifest, FileHasher
from grpo_api.runconfig import RunPaths
from grpo_stage import kube as stage_kube
from grpo_stage.errors import StageError
from grpo_stage.manifests import MOUNT_PATH, build_pod, exec_status

POD_PREFIX = "grpo-pull-"
SENDER_ENV = "GRPO_PULL_SENDER"
BOOTSTRAP = f"import os; exec(compile(os.environ[{SENDER_ENV!r}], 'grpo-pull-sender', 'exec'))"
LABELS = {"app.kubernetes.io/name": "grpo-pull", "app.kubernetes.io/managed-by": "grpo-cli"}
#: The sender's exit status when the run has published no adapter (sender.EXIT_NO_VERSION).
EXIT_NO_VERSION = 3
CHUNK = 1 << 20
STDOUT_CHANNEL, STDERR_CHANNEL, ERROR_CHANNEL = 1, 2, 3


class PullError(Exception):
    """A failure to report, naming the run, claim, pod or file."""


def sender_source() -> str:
    return resources.files("grpo_cli.cluster").joinpath("sender.py").read_text(encoding="utf-8")


def sender_command(adapters: str, version: int | None) -> list[str]:
    return ["python3", "-c", BOOTSTRAP, MOUNT_PATH, adapters, "latest" if version is None else str(version)]


@dataclass(frozen=True)
class Source:
    """Where a run's adapters are: its claim and the adapter root relative to the claim's root."""

    run: str
    namespace: str
    claim: str
    adapters: str


def source_of(run: dict[str, Any]) -> Source:
    """The claim and adapter directory of a GRPORun object (as the operator lays them out)."""
    meta, spec = run.get("metadata") or {}, run.get("spec") or {}
    name, namespace = meta.get("name", "?"), meta.get("namespace", "?")
    if (spec.get("trainer") or {}).get("tuning") == "full":
        raise PullError(
            f"GRPORun {name} in namespace {namespace} trains every weight (spec.trainer.tuning full): it "
            f"publishes no adapter; its model is in the checkpoints (checkpoints/{name}/ on its claim)"
        )
    storage = spec.get("storage") or {}
    claim = storage.get("existingClaim") or f"{name}-data"
    adapters = PurePosixPath(RunPaths.under("/", name).adapter_root).relative_to("/")
    return Source(run=name, namespace=namespace, claim=str(claim), adapters=str(adapters))


def check_dest(dest: Path, force: bool) -> None:
    """DEST may be absent or an empty directory; anything else only with --force (a directory)."""
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise PullError(f"{dest} exists and is not a directory")
    if dest.is_dir() and any(dest.iterdir()) and not force:
        raise PullError(f"{dest} is not empty (pass --force to replace what it holds)")
    if not dest.parent.is_dir():
        raise PullError(f"{dest.parent} is not a directory")


class PodApi(Protocol):
    def create(self, manifest: dict[str, Any]) -> None: ...
    def read_pod(self, namespace: str, name: str) -> dict[str, Any]: ...
    def delete_pod(self, namespace: str, name: str) -> None: ...
    def open_exec(self, namespace: str, name: str, command: list[str]) -> Any: ...


class ExecStdout:
    """The exec's stdout as a file to read (tarfile's stream mode); stderr and the status kept aside."""

    def __init__(self, ws: Any, deadline: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ws, self.deadline, self.clock = ws, deadline, clock
        self.buffer = bytearray()
        self.stderr = bytearray()
        self.error_channel = bytearray()
        self.received = 0

    def _take(self) -> None:
        for channel, into in ((STDOUT_CHANNEL, self.buffer), (STDERR_CHANNEL, self.stderr),
                              (ERROR_CHANNEL, self.error_channel)):
            data = self.ws.read_channel(channel, timeout=0)
            into += data.encode() if isinstance(data, str) else data

    def _more(self) -> bool:
        """Read what arrives next; False once the exec has ended and everything is taken."""
        if not self.ws.is_open():
            self._take()
            return False
        remaining = self.deadline - self.clock()
        if remaining <= 0:
            raise PullError("--timeout ran out while receiving")
        try:
            self.ws.sock.settimeout(remaining)
            self.ws.update(timeout=min(remaining, 5.0))
        except (WebSocketException, OSError):
            with contextlib.suppress(WebSocketException, OSError):
                self.ws.close()
        self._take()
        return True

    def read(self, size: int = -1) -> bytes:
        while (size < 0 or len(self.buffer) < size) and self._more():
            pass
        n = len(self.buffer) if size < 0 else min(size, len(self.buffer))
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        self.received += n
        return data

    def finish(self) -> None:
        """Read to the end (the exit status comes last)."""
        while self._more():
            self.buffer.clear()


@dataclass(frozen=True)
class Pulled:
    manifest: AdapterManifest
    files: int
    size: int


def _write(source: Any, target: Path, expected: str) -> tuple[str, int]:
    """Copy source into target, hashed as `expected` was (blake3, or sha256 for an earlier manifest)."""
    digest, size = FileHasher(like=expected), 0
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as out:
        while block := source.read(CHUNK):
            digest.update(block)
            out.write(block)
            size += len(block)
    return digest.result(), size


def receive(stream: ExecStdout, scratch: Path, where: str) -> Pulled:
    """Unpack the sender's stream into scratch; every file checked against the manifest (the first member)."""
    manifest: AdapterManifest | None = None
    digests: dict[str, str] = {}
    size = 0
    with tarfile.open(fileobj=stream, mode="r|") as tar:  # type: ignore[call-overload]
        for member in tar:
            if not member.isreg():
                raise PullError(f"{where}: the stream holds {member.name!r}, which is not a regular file")
            source = tar.extractfile(member)
            if manifest is None:
                if member.name != MANIFEST_NAME or source is None:
                    raise PullError(f"{where}: the stream does not begin with {MANIFEST_NAME}")
                data = source.read()
                try:
                    manifest = AdapterManifest.model_validate_json(data)
                except ValidationError as exc:
                    raise PullError(f"{where}: {MANIFEST_NAME} is not an adapter manifest: {exc}") from exc
                (scratch / MANIFEST_NAME).write_bytes(data)
                continue
            if member.name not in manifest.files or member.name in digests or source is None:
                raise PullError(f"{where}: the stream holds {member.name!r}, which the manifest does not name once")
            target = scratch.joinpath(*member.name.split("/"))
            target.parent.mkdir(parents=True, exist_ok=True)
            digests[member.name], written = _write(source, target, manifest.files[member.name])
            size += written
    if manifest is None:
        raise PullError(f"{where}: the stream ended before {MANIFEST_NAME}")
    problems = [f"{name}: missing" for name in sorted(set(manifest.files) - set(digests))]
    problems += [
        f"{name}: digest {digests[name]}, the manifest says {want}"
        for name, want in sorted(manifest.files.items())
        if name in digests and digests[name] != want
    ]
    if problems:
        raise PullError(f"{where}: the adapter v{manifest.version} does not match its manifest:\n  "
                        + "\n  ".join(problems[:20]))
    return Pulled(manifest=manifest, files=len(digests), size=size)


def install(scratch: Path, dest: Path) -> None:
    """Put the verified scratch directory at DEST; an old DEST goes only once the new one is in place."""
    if dest.exists():
        old = dest.with_name(f".{dest.name}.grpo-pull-old-{secrets.token_hex(4)}")
        dest.rename(old)
        scratch.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        scratch.rename(dest)


@dataclass(frozen=True)
class PodSettings:
    image: str
    image_pull_policy: str
    start_timeout: float
    lifetime_seconds: int


def pull(api: PodApi, source: Source, dest: Path, version: int | None, settings: PodSettings, deadline: float,
         say: Callable[[str], None]) -> Pulled:
    """Copy the adapter version (the newest: None) of the run to DEST, verified; the pod is always deleted."""
    pod = f"{POD_PREFIX}{secrets.token_hex(4)}"
    where = f"pod {pod} in namespace {source.namespace}"
    scratch = dest.with_name(f".{dest.name}.grpo-pull-{secrets.token_hex(4)}")
    api.create(build_pod(
        name=pod, namespace=source.namespace, claim=source.claim, image=settings.image,
        image_pull_policy=settings.image_pull_policy, lifetime_seconds=settings.lifetime_seconds,
        program_env={SENDER_ENV: sender_source()}, read_only=True, labels=LABELS,
    ))
    try:
        say(f"started {where} (image {settings.image}, claim {source.claim} read-only); waiting for it to run")
        try:
            stage_kube.wait_running(api, source.namespace, pod,  # type: ignore[arg-type]
                                    min(settings.start_timeout, max(1.0, deadline - time.monotonic())))
        except StageError as exc:
            raise PullError(str(exc).replace("staging pod", "pull pod")) from exc
        ws = api.open_exec(source.namespace, pod, sender_command(source.adapters, version))
        scratch.mkdir(mode=0o755)
        try:
            stream = ExecStdout(ws, deadline)
            pulled: Pulled | None = None
            failure: Exception | None = None
            try:
                pulled = receive(stream, scratch, where)
            except (PullError, tarfile.TarError) as exc:
                failure = exc
            stream.finish()
            code, message = exec_status(stream.error_channel.decode("utf-8", "replace"))
            said = stream.stderr.decode("utf-8", "replace").strip()
            if code == EXIT_NO_VERSION:
                raise PullError(f"GRPORun {source.run} in namespace {source.namespace} has published no adapter "
                                f"{'yet' if version is None else f'v{version}'}: {said}")
            if code != 0:
                status = f"exit code {code}" if code is not None else message or "no exit status"
                raise PullError(f"the sender in {where} failed ({status}), reading claim {source.claim}:\n"
                                f"{said or message or 'no message'}")
            if failure is not None or pulled is None:
                raise PullError(str(failure) if isinstance(failure, PullError) else f"{where}: {failure}")
            install(scratch, dest)
            return pulled
        finally:
            with contextlib.suppress(Exception):
                ws.close()
            shutil.rmtree(scratch, ignore_errors=True)
    finally:
        say(f"deleting {where}")
        try:
            api.delete_pod(source.namespace, pod)
        except StageError as exc:
            say(f"warning: {exc}")
