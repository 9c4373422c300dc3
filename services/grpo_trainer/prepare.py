"""`grpo prepare`: the run's initializer, once per run before any server or trainer starts.

1. writes `spec.rewardCode.inline` into `sources.inline_rewards_dir` (`grpo run` only);
2. fetches every hf:// source (`sources.fetches`) onto the volume, resumably: files already complete
   (per huggingface_hub's local-dir metadata) are not downloaded again, a failed run keeps the files
   it finished; each source has a folder of its own (SOURCE_RECORD names the source) and in it one
   folder per commit (FETCH_RECORD names the commit), as huggingface_hub's cache: a moved branch is
   fetched into a new folder and a complete commit's folder is never written again, so no fetch
   changes files another run reads; a folder recorded for another source or commit is refused, never
   fetched over, and a folder of the layout before the escaped names (hub/<type>s/ORG/NAME/REVISION)
   is never read; the commit fetched is recorded for the run (`RunConfig.record_fetched_commits`),
   whose server and trainer read that commit's folder; one file failing stops the others at their
   next chunk; the endpoint is not trusted: a file list no repository has, a file going past the size
   the list announces, or a file not at the resolved commit fails the fetch, and the token is never
   sent to another host than the endpoint;
3. checks what the server and trainer will read, in their order: the model directory and its
   tokenizer, the dataset (as the trainer loads it), the reward functions (imported as the trainer
   imports them);
4. fingerprints the model (`grpo_api.fingerprint`: every weight byte hashed once) when its directory
   is writable, so the digests are cached beside the weights before the server and trainer need them;

and says so on stdout in the protocol of `grpo_api.prepare_protocol`. A failure is permanent (exit 2:
a configuration problem, the message names the field) or transient (exit 1: the network or the hub;
the Job retries and the download resumes).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath
from typing import IO, TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import urlsplit

from grpo_api import exit_codes
from grpo_api.fingerprint import model_fingerprint
from grpo_api.prepare_protocol import (
    DONE,
    EXIT_PERMANENT,
    EXIT_READY,
    EXIT_TRANSIENT,
    FAILED,
    PROGRESS,
    format_event,
)
from grpo_api.runconfig import RunConfig, RunConfigError, load_run_config
from grpo_api.sources import HubFetch, hub_snapshot_dir

if TYPE_CHECKING:
    import httpx

#: At most one throttled progress line per fetch this often (a finished file always gets one).
PROGRESS_INTERVAL_S = 5.0
#: Files downloaded in parallel per repository (huggingface_hub's snapshot_download uses 8 too).
FETCH_WORKERS = 8
#: In a source's folder (hub_dir): the source it holds, written before its first download, and the commit of its
#: latest complete fetch (lets a later run start while the hub is unreachable).
SOURCE_RECORD = ".cache/grpo-source.json"
#: In a commit's folder (hub_snapshot_dir): the source and commit it holds, written before its first download,
#: and, once complete, its files.
FETCH_RECORD = ".cache/grpo-fetch.json"
#: Read timeout of the file-list call (huggingface_hub sets none: an endpoint that never answers would hang the run).
HUB_API_TIMEOUT_S = 60.0
#: The whole file-list call, however its answer trickles in: the read timeout bounds each read only, so an
#: endpoint sending a byte a minute would hold the run forever.
HUB_API_DEADLINE_S = 180.0

_COMMIT = re.compile(r"[0-9a-f]{40}")
_T = TypeVar("_T")

_MODULE_FILE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,100}\.py")


class PrepareFailed(Exception):
    """The run cannot start; permanent: no retry fixes it (exit 2), else transient (exit 1)."""

    def __init__(self, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


class DownloadStopped(Exception):
    """Raised inside huggingface_hub's download of one file when another file of the repository failed."""


class HubAnswerRefused(Exception):
    """Raised inside huggingface_hub's download of one file: the endpoint's answer is refused (the message says
    why); permanent unless said otherwise."""

    def __init__(self, message: str, *, permanent: bool = True) -> None:
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class PrepareResult:
    model_dir: Path
    dataset_path: Path
    prompts: int
    rewards: int

    @property
    def message(self) -> str:
        return (
            f"sources ready: model {self.model_dir}, dataset {self.dataset_path} ({self.prompts} prompts), "
            f"{self.rewards} reward function{'s' if self.rewards != 1 else ''}"
        )


class Reporter:
    """Protocol lines on stdout, plain notes on stderr; never a secret (hub tokens are masked)."""

    def __init__(self, out: IO[str] | None = None, err: IO[str] | None = None) -> None:
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self._secrets: list[str] = []
        self._lock = threading.Lock()

    def add_secret(self, value: str | None) -> None:
        if value and value not in self._secrets:
            self._secrets.append(value)

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _write(self, stream: IO[str], line: str) -> None:
        with self._lock:
            stream.write(line + "\n")
            stream.flush()

    def progress(self, message: str) -> None:
        self._write(self.out, format_event(PROGRESS, self.redact(message)))

    def note(self, message: str) -> None:
        self._write(self.err, f"grpo prepare: {self.redact(message)}")

    def final(self, message: str, *, failed: bool, permanent: bool = False) -> str:
        """Print the last line; returns it (the termination message)."""
        line = (
            format_event(FAILED, self.redact(message), permanent=permanent)
            if failed
            else format_event(DONE, self.redact(message))
        )
        self._write(self.out, line)
        return line


# ------------------------------------------------------------------------------------------ inline rewards


def write_inline_rewards(cfg: RunConfig, reporter: Reporter) -> None:
    """spec.rewardCode.inline into sources.inline_rewards_dir, each file atomically."""
    target = cfg.sources.inline_rewards_dir
    code = cfg.spec.reward_code
    if target is None or code is None or not code.inline:
        return
    directory = Path(target)
    for name in code.inline:
        if "/" in name or "\\" in name or ".." in name or not _MODULE_FILE.fullmatch(name):
            raise PrepareFailed(
                f"spec.rewardCode.inline: {name!r} is not a module file name such as my_rewards.py", permanent=True
            )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in code.inline.items():
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                os.replace(tmp, directory / name)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
    except OSError as exc:
        raise PrepareFailed(f"spec.rewardCode.inline: cannot write {directory}: {exc}", permanent=True) from exc
    reporter.progress(f"wrote {len(code.inline)} inline reward module(s) to {directory}")


# -------------------------------------------------------------------------------------------- hub fetch


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - loop returns


@dataclass(frozen=True)
class HubErrorInfo:
    permanent: bool
    reason: str
    status: int | None = None


def _causes(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def classify_hub_error(exc: BaseException) -> HubErrorInfo:
    """Permanent (repository, revision, access, a non-Hub endpoint) or transient (network, 5xx, 429)."""
    import httpx
    from huggingface_hub.errors import (
        DisabledRepoError,
        FileMetadataError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    for error in _causes(exc):
        if isinstance(error, HubAnswerRefused):
            return HubErrorInfo(error.permanent, str(error))
        if isinstance(error, HfHubHTTPError):
            response = getattr(error, "response", None)
            status = getattr(response, "status_code", None)
            if isinstance(error, GatedRepoError):
                return HubErrorInfo(True, "gated repository: the token's account has not been granted access", status)
            if isinstance(error, RepositoryNotFoundError):
                if status == 401:
                    return HubErrorInfo(
                        True, "repository not found, or private and the request had no valid token", status
                    )
                return HubErrorInfo(True, "repository not found", status)
            if isinstance(error, RevisionNotFoundError):
                return HubErrorInfo(True, "revision not found (not a branch, tag or commit of the repository)", status)
            if isinstance(error, RemoteEntryNotFoundError):
                return HubErrorInfo(True, "a file the repository lists is missing on the endpoint", status)
            if isinstance(error, DisabledRepoError):
                return HubErrorInfo(True, "the repository is disabled", status)
            if status is not None:
                if status in (408, 429) or status >= 500:
                    return HubErrorInfo(False, "the endpoint is busy or failing", status)
                if status in (401, 403):
                    return HubErrorInfo(True, "access denied: check the token and its permissions", status)
                if status == 404:
                    return HubErrorInfo(True, "repository or revision not found", status)
                if status == 400:
                    return HubErrorInfo(True, "request refused (is the revision a valid branch, tag or commit?)",
                                        status)
                return HubErrorInfo(True, "request refused", status)
        if isinstance(error, FileMetadataError):
            return HubErrorInfo(True, f"the endpoint does not answer like a Hugging Face hub ({error})")
        if isinstance(error, OfflineModeIsEnabled):
            return HubErrorInfo(True, "HF_HUB_OFFLINE is set in the environment")
        if isinstance(error, httpx.TimeoutException):
            return HubErrorInfo(False, f"timed out ({type(error).__name__})")
        if isinstance(error, TimeoutError):
            return HubErrorInfo(False, f"timed out ({error})")
        if isinstance(error, httpx.ConnectError):
            return HubErrorInfo(False, f"cannot connect ({error})")
        if isinstance(error, httpx.TransportError):
            return HubErrorInfo(False, f"network error ({type(error).__name__}: {error})")
        if isinstance(error, HFValidationError):
            return HubErrorInfo(True, f"invalid repository id or revision ({error})")
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                                                          errno.EPERM):
            return HubErrorInfo(True, f"cannot write the files ({error})")
    return HubErrorInfo(False, f"{type(exc).__name__}: {exc}")


def _endpoint(fetch: HubFetch) -> str:
    from huggingface_hub import constants

    return (fetch.endpoint or constants.ENDPOINT).rstrip("/")


def _label(fetch: HubFetch) -> str:
    return f"{fetch.field} hf://{fetch.repo_id}@{fetch.revision}"


def hub_failure(fetch: HubFetch, exc: BaseException, file: str | None = None) -> PrepareFailed:
    info = classify_hub_error(exc)
    what = f"{file}: " if file else ""
    status = f" (HTTP {info.status})" if info.status is not None else ""
    return PrepareFailed(f"{_label(fetch)}: {what}{info.reason} at {_endpoint(fetch)}{status}",
                         permanent=info.permanent)


def token_for(fetch: HubFetch) -> str | bool | None:
    """The fetch's token; without one, a custom endpoint gets no token at all (never the ambient hub login)."""
    if fetch.token_env:
        token = os.environ.get(fetch.token_env, "").strip()
        if not token:
            section = fetch.field.rsplit(".", 1)[0]
            raise PrepareFailed(
                f"{section}.hub.tokenSecretRef: the token is empty, or its Secret or key does not exist "
                f"(environment variable {fetch.token_env})",
                permanent=True,
            )
        return token
    return False if fetch.endpoint else None


#: Each hub token and the hosts it may be sent to (its endpoint's): huggingface_hub sends the token wherever a
#: Xet refresh route or a redirect to a Hugging Face host points, both of which the endpoint chooses.
_TOKEN_HOSTS: dict[str, frozenset[str]] = {}
_TOKEN_HOSTS_LOCK = threading.Lock()


def _token_hosts(endpoint: str) -> frozenset[str]:
    from huggingface_hub import constants

    host = (urlsplit(endpoint).hostname or "").lower()
    return frozenset(constants.HF_URL_HOSTS) if host in constants.HF_URL_HOSTS else frozenset({host})


def _refuse_token_elsewhere(request: httpx.Request) -> None:
    """A request hook on huggingface_hub's HTTP client: a request carrying a fetch's token to another host than
    that fetch's endpoint is not sent."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return
    with _TOKEN_HOSTS_LOCK:
        hosts = _TOKEN_HOSTS.get(token)
    host = (request.url.host or "").lower()
    if hosts is not None and host not in hosts:
        raise HubAnswerRefused(f"the endpoint sends the client, with the token, to another host ({host}); refused")


def _guard_token(token: str, endpoint: str) -> None:
    from huggingface_hub.utils import get_session

    with _TOKEN_HOSTS_LOCK:
        _TOKEN_HOSTS[token] = _TOKEN_HOSTS.get(token, frozenset()) | _token_hosts(endpoint)
    hooks = get_session().event_hooks["request"]
    if _refuse_token_elsewhere not in hooks:
        hooks.append(_refuse_token_elsewhere)


class FetchProgress:
    """Files and bytes done of one repository; a progress line at each finished file and at most every
    PROGRESS_INTERVAL_S in between."""

    def __init__(
        self,
        label: str,
        sizes: dict[str, int | None],
        reporter: Reporter,
        *,
        interval: float = PROGRESS_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        limits: dict[str, int | None] | None = None,
    ) -> None:
        self.label = label
        self.sizes = sizes
        #: the most bytes a file may have: what the file list announces (None: unknown, no bound)
        self.limits = limits if limits is not None else {}
        self.reporter = reporter
        self.interval = interval
        self.clock = clock
        self.received: dict[str, int] = dict.fromkeys(sizes, 0)
        self.done: set[str] = set()
        self._lock = threading.Lock()
        self._last = clock()
        self.stopped = threading.Event()

    def stop(self) -> None:
        """Every download still running stops at its next chunk (raises DownloadStopped from its bar)."""
        self.stopped.set()

    @property
    def total_bytes(self) -> int | None:
        sizes = list(self.sizes.values())
        return None if any(s is None for s in sizes) else sum(s or 0 for s in sizes)

    def message(self) -> str:
        done = sum(self.received.values())
        total = self.total_bytes
        size = f"{human_bytes(done)} / {human_bytes(total)}" if total is not None else human_bytes(done)
        return f"{self.label}: {len(self.done)}/{len(self.sizes)} files, {size}"

    def _emit(self) -> None:
        self._last = self.clock()
        self.reporter.progress(self.message())

    def add(self, name: str, n: float) -> None:
        with self._lock:
            self.received[name] = max(0, self.received.get(name, 0) + int(n))
            if self.clock() - self._last >= self.interval:
                self._emit()

    def finish(self, name: str) -> None:
        with self._lock:
            self.done.add(name)
            size = self.sizes.get(name)
            if size is not None:
                self.received[name] = size
            self._emit()

    def bar(self, name: str) -> type[_FileBar]:
        """A tqdm stand-in for hf_hub_download(tqdm_class=...) that counts one file's bytes.

        A class, not a partial: huggingface_hub looks for `update_transfer` on it to route Xet's network
        bytes into the same bar (they are not counted: the written bytes are)."""
        progress = self

        class Bar(_FileBar):
            def __init__(self, **kwargs: Any) -> None:
                super().__init__(progress, name, **kwargs)

        return Bar


class _FileBar:
    """The tqdm surface huggingface_hub 1.33 uses in http_get and xet_get. It sees every chunk before it is
    written, so it stops a file that goes on past the size the file list announces."""

    def __init__(self, progress: FetchProgress, name: str, *, total: int | None = None, initial: int = 0,
                 **_: Any) -> None:
        self.progress = progress
        self.name = name
        self.total = total
        self.n = initial
        self.format_dict: dict[str, Any] = {}
        self.limit = progress.limits.get(name)
        if self.limit is not None and total is not None and total > self.limit:
            raise HubAnswerRefused(f"the endpoint sends {total} bytes, more than the {self.limit} bytes its file "
                                   "list announces")
        if initial:
            progress.add(name, initial)

    def __enter__(self) -> _FileBar:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def update(self, n: float | None = 1) -> None:
        if self.progress.stopped.is_set():
            raise DownloadStopped("another file of the repository failed")
        self.n += int(n or 0)
        if self.limit is not None and self.n > self.limit:
            raise HubAnswerRefused(f"the endpoint sends more than the {self.limit} bytes its file list announces")
        self.progress.add(self.name, n or 0)

    def update_transfer(self, n: float | None = 1) -> None:
        return None

    def close(self) -> None:
        return None

    def refresh(self, *_: Any, **__: Any) -> None:
        return None

    def set_postfix_str(self, *_: Any, **__: Any) -> None:
        return None

    def set_transfer_postfix_str(self, *_: Any, **__: Any) -> None:
        return None

    def set_description(self, *_: Any, **__: Any) -> None:
        return None


def _write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read_json(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _source_record(fetch: HubFetch) -> Path:
    return Path(fetch.local_dir) / SOURCE_RECORD


def _snapshot(fetch: HubFetch, commit: str) -> Path:
    return Path(hub_snapshot_dir(fetch.local_dir, commit))


def _snapshot_record(fetch: HubFetch, commit: str) -> Path:
    return _snapshot(fetch, commit) / FETCH_RECORD


def _refuse_another_source(fetch: HubFetch, record_path: Path, wanted: dict[str, Any]) -> None:
    """Refuse (permanent) a folder whose record names another source or commit than `wanted`."""
    record = _read_json(record_path)
    if not record:
        return
    recorded = {name: record.get(name) for name in wanted}
    if recorded != wanted:
        other = ", ".join(f"{name} {value!r}" for name, value in recorded.items())
        raise PrepareFailed(
            f"{_label(fetch)}: {record_path.parent.parent} holds a fetch of another source ({other}; its record "
            f"is {record_path}); refusing to fetch over it. Each hub source has a folder of its own: remove this "
            "one if nothing uses it",
            permanent=True,
        )


def check_folder_owner(fetch: HubFetch) -> None:
    """Refuse (permanent) to fetch into a folder whose record names another source: every source has a folder of
    its own (`grpo_api.sources.hub_dir`), so such a record means the folder was copied or renamed by hand, or two
    sources were given one folder; fetching over it would change files another run may be serving."""
    _refuse_another_source(fetch, _source_record(fetch), fetch.key.to_json())


def check_snapshot_owner(fetch: HubFetch, commit: str) -> None:
    """The same for the folder of one commit, whose record also names the commit."""
    _refuse_another_source(fetch, _snapshot_record(fetch, commit), {**fetch.key.to_json(), "commit": commit})


def _snapshot_complete(fetch: HubFetch, commit: str) -> bool:
    record = _read_json(_snapshot_record(fetch, commit))
    if {name: record.get(name) for name in (*fetch.key.to_json(), "commit")} != {**fetch.key.to_json(),
                                                                                 "commit": commit}:
        return False
    files, snapshot = record.get("files"), _snapshot(fetch, commit)
    return isinstance(files, list) and all(isinstance(f, str) and (snapshot / f).is_file() for f in files)


def complete_copy(fetch: HubFetch) -> str | None:
    """The commit of the latest complete earlier fetch of this source, if its files are all still there."""
    record = _read_json(_source_record(fetch))
    if {name: record.get(name) for name in fetch.key.to_json()} != fetch.key.to_json():
        return None
    commit = record.get("commit")
    if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
        return None
    return commit if _snapshot_complete(fetch, commit) else None


def _record_source(fetch: HubFetch, latest_complete: str | None) -> None:
    """The source folder's record: its source, and the commit of its latest complete fetch (None: none yet), as
    huggingface_hub's refs/<branch> names the commit a branch had."""
    _write_json(_source_record(fetch), {**fetch.key.to_json(), "commit": latest_complete})


def _record_snapshot(fetch: HubFetch, commit: str, files: list[str] | None) -> None:
    """The commit folder's record names the source and commit from the first download on; `files` None: not
    complete yet."""
    _write_json(_snapshot_record(fetch, commit), {**fetch.key.to_json(), "commit": commit, "files": files})


def _claim_snapshot(fetch: HubFetch, commit: str) -> Path:
    """Create the commit's folder and record it (source, then commit) before its first file; returns it."""
    snapshot = _snapshot(fetch, commit)
    try:
        snapshot.mkdir(parents=True, exist_ok=True)
        if not _source_record(fetch).exists():
            _record_source(fetch, None)
        _record_snapshot(fetch, commit, None)
    except OSError as exc:
        raise PrepareFailed(f"{_label(fetch)}: cannot create {snapshot} or its record: {exc}",
                            permanent=True) from exc
    return snapshot


def _download_metadata(local_dir: Path, name: str) -> str | None:
    """huggingface_hub's metadata of one file of local_dir (its commit, etag and time, one a line), read as is:
    huggingface_hub's reader ignores it when the file's mtime is ahead of it (a file server's clock)."""
    from huggingface_hub._local_folder import get_local_download_paths

    try:
        return get_local_download_paths(local_dir, name).metadata_path.read_text()
    except (OSError, ValueError):
        return None


def _listed_files(
    label: str, endpoint: str, siblings: list[Any]
) -> tuple[dict[str, int | None], dict[str, int | None]]:
    """The files a repository's listing names and their sizes, and the most bytes each may have; refuses
    (permanent) a listing no repository has: a malformed entry, a name outside the local dir, in its bookkeeping
    folder (.cache/: huggingface_hub's metadata and FETCH_RECORD; the Hub refuses such files) or that the local
    file system cannot hold."""
    sizes: dict[str, int | None] = {}
    limits: dict[str, int | None] = {}
    for sibling in siblings:
        name, size = getattr(sibling, "rfilename", None), getattr(sibling, "size", None)
        lfs_size = getattr(getattr(sibling, "lfs", None), "size", None)
        if not isinstance(name, str) or not all(v is None or (type(v) is int and v >= 0) for v in (size, lfs_size)):
            raise PrepareFailed(f"{label}: the endpoint {endpoint} lists a malformed file entry (name {name!r}, "
                                f"size {size!r})", permanent=True)
        sizes[name] = size
        known = [v for v in (size, lfs_size) if v is not None]
        limits[name] = max(known) if known else None
    folders = {"/".join(name.split("/")[:i]) for name in sizes for i in range(1, name.count("/") + 1)}
    for name in sizes:
        parts = name.split("/")
        if (not name or name.startswith("/") or "\\" in name or ".." in parts
                or any(PureWindowsPath(part).drive for part in parts)):
            raise PrepareFailed(f"{label}: the endpoint {endpoint} lists a file outside the repository: {name!r}",
                                permanent=True)
        why = ("its name has a NUL byte" if "\0" in name
               else "it is in .cache/, where the local copy keeps its records" if parts[0] == ".cache"
               else "a file and a folder cannot have one name" if name in folders
               else None)
        if why:
            raise PrepareFailed(f"{label}: the endpoint {endpoint} lists a file no repository can have ({why}): "
                                f"{name!r}", permanent=True)
    return sizes, limits


def _within_deadline(call: Callable[[], _T], seconds: float, what: str) -> _T:
    """call() in a thread of its own, waited for at most `seconds`; TimeoutError (transient) past them. The thread
    is left to its read timeout (huggingface_hub's client cannot be interrupted): it is a daemon, and the
    initializer exits on the failure."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="hub-call", daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        raise TimeoutError(f"{what} did not arrive within {seconds:g} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return cast(_T, value)


def fetch_repository(fetch: HubFetch, reporter: Reporter, *, workers: int = FETCH_WORKERS) -> str:
    """Download one hf:// repository into the folder of the commit its revision resolves to (in fetch.local_dir);
    the commit. Files already there are kept; a complete commit's folder is not touched at all."""
    from huggingface_hub import HfApi

    token = token_for(fetch)
    if isinstance(token, str):
        reporter.add_secret(token)
        _guard_token(token, _endpoint(fetch))
    label, endpoint = _label(fetch), _endpoint(fetch)
    check_folder_owner(fetch)
    reporter.progress(f"{label}: resolving at {endpoint}")
    api = HfApi(endpoint=endpoint, token=token)
    try:
        info = _within_deadline(lambda: api.repo_info(fetch.repo_id, revision=fetch.revision, repo_type=fetch.repo_type,
                                                      files_metadata=True, timeout=HUB_API_TIMEOUT_S),
                                HUB_API_DEADLINE_S, "the file list")
    except Exception as exc:
        failure = hub_failure(fetch, exc)
        commit = None if failure.permanent else complete_copy(fetch)
        if commit is None:
            raise failure from exc
        reporter.progress(f"{label}: hub unreachable; using the complete copy fetched before (commit {commit[:12]})")
        reporter.note(f"{failure}; using the complete copy in {_snapshot(fetch, commit)}")
        return commit
    commit = info.sha
    siblings = getattr(info, "siblings", None)
    if not commit or not isinstance(commit, str) or not isinstance(siblings, list):
        raise PrepareFailed(
            f"{label}: the endpoint {endpoint} answered without a commit or a file list; is it a Hugging Face hub?",
            permanent=True,
        )
    if not _COMMIT.fullmatch(commit):  # it names the commit's folder on the volume
        raise PrepareFailed(f"{label}: the endpoint {endpoint} answered with {commit!r}, not a commit (40 lowercase "
                            "hex digits)", permanent=True)
    if _COMMIT.fullmatch(fetch.revision) and commit != fetch.revision:
        raise PrepareFailed(f"{label}: the endpoint {endpoint} answers that commit with another one, {commit}",
                            permanent=True)
    sizes, limits = _listed_files(label, endpoint, siblings)
    progress = FetchProgress(label, sizes, reporter, limits=limits)
    check_snapshot_owner(fetch, commit)
    if _snapshot_complete(fetch, commit):  # a complete commit's files are never touched again: runs read them
        _record_latest(fetch, commit, reporter)
        reporter.progress(f"{label}: ready in {_snapshot(fetch, commit)} (commit {commit[:12]}, fetched before)")
        return commit
    reporter.progress(progress.message())
    local_dir = _claim_snapshot(fetch, commit)
    _download_files(fetch, local_dir, commit, progress, token, workers)
    try:
        _record_snapshot(fetch, commit, list(sizes))
    except OSError as exc:
        reporter.note(f"{label}: cannot record the complete fetch in {local_dir}: {exc}")
    _record_latest(fetch, commit, reporter)
    reporter.progress(f"{label}: ready in {local_dir} (commit {commit[:12]}, {len(sizes)} files)")
    return commit


def _download_files(fetch: HubFetch, local_dir: Path, commit: str, progress: FetchProgress, token: str | bool | None,
                    workers: int) -> None:
    """Every listed file into local_dir, `workers` at a time; the first failure stops new downloads and is raised
    (a permanent one first)."""
    from huggingface_hub import hf_hub_download

    endpoint, sizes = _endpoint(fetch), progress.sizes

    def download(name: str) -> None:
        before = _download_metadata(local_dir, name)
        hf_hub_download(
            fetch.repo_id,
            name,
            repo_type=fetch.repo_type,
            revision=commit,
            local_dir=local_dir,
            endpoint=endpoint,
            token=token,
            tqdm_class=cast(Any, progress.bar(name)),
        )
        # huggingface_hub keeps the file on disk, whatever its commit, when the endpoint does not answer for it
        after = _download_metadata(local_dir, name)
        served = after.split("\n", 1)[0].strip() if after else None
        if served != commit:
            if served and after != before:
                raise HubAnswerRefused(f"the endpoint serves it at commit {served[:12]}, not at {commit[:12]}, the "
                                       f"commit it resolved {fetch.revision} to")
            raise HubAnswerRefused(f"the endpoint did not confirm it at commit {commit[:12]}; the file on the "
                                   "volume is of another commit", permanent=False)
        progress.finish(name)

    errors: list[tuple[str, BaseException]] = []
    if sizes:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(sizes))), thread_name_prefix="fetch") as pool:
            futures: dict[Future[None], str] = {pool.submit(download, name): name for name in sizes}
            _, pending = wait(futures, return_when=FIRST_EXCEPTION)
            # One failed: start no new file, and stop those in flight at their next chunk (what they have is kept
            # for the next attempt), so the failure is told now, not once the largest file is done.
            progress.stop()
            for future in pending:
                future.cancel()
            wait(futures)
            errors = [(name, error) for f, name in futures.items()
                      if not f.cancelled() and (error := f.exception()) is not None
                      and not any(isinstance(cause, DownloadStopped) for cause in _causes(error))]
    if errors:
        failures = [(hub_failure(fetch, exc, name), exc) for name, exc in errors]
        failure, cause = next(((f, e) for f, e in failures if f.permanent), failures[0])
        raise failure from cause


def _record_latest(fetch: HubFetch, commit: str, reporter: Reporter) -> None:
    try:
        _record_source(fetch, commit)
    except OSError as exc:
        reporter.note(f"{_label(fetch)}: cannot record the latest complete fetch in {fetch.local_dir}: {exc}")


# ----------------------------------------------------------------------------------------------- checks


def _model_field(cfg: RunConfig) -> str:
    model = cfg.spec.model
    if model.source:
        return f"spec.model.source {model.source}"
    return "spec.model.path" if model.path else "spec.model.name"


def check_sources(cfg: RunConfig, reporter: Reporter) -> PrepareResult:
    """What the trainer does before its first step, without loading the weights."""
    from transformers import AutoConfig, AutoTokenizer

    from grpo_trainer.data import load_prompts
    from grpo_trainer.errors import TrainingFailed
    from grpo_trainer.launch import world_size
    from grpo_trainer.rewards import RewardContext, build_rewards

    spec = cfg.spec
    trainer = spec.trainer
    try:
        model_dir = cfg.model_dir()
    except RunConfigError as exc:
        raise PrepareFailed(str(exc), permanent=True) from exc
    reporter.progress(f"checking the model in {model_dir}")
    field = _model_field(cfg)
    try:
        AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:
        raise PrepareFailed(
            f"{field}: {model_dir}/config.json does not load ({type(exc).__name__}: {exc})", permanent=True
        ) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        sample = tokenizer("The quick brown fox")["input_ids"]
    except Exception as exc:
        raise PrepareFailed(
            f"{field}: the tokenizer in {model_dir} does not load ({type(exc).__name__}: {exc})", permanent=True
        ) from exc
    if not sample or len(tokenizer) < 2:
        # transformers builds an empty tokenizer from config.json alone rather than failing
        raise PrepareFailed(
            f"{field}: the tokenizer in {model_dir} is empty ({len(tokenizer)} tokens): the directory has no "
            "tokenizer files (tokenizer.json, tokenizer.model or vocab files)",
            permanent=True,
        )

    dataset_path = cfg.dataset_path()
    reporter.progress(f"checking the dataset {dataset_path}")
    try:
        dataset = load_prompts(
            dataset_path,
            spec.dataset,
            tokenizer=tokenizer,
            max_prompt_length=trainer.max_prompt_length,
            # the prompts of one step of all the trainer's processes, as the trainer (runner) asks
            min_rows=trainer.generation_batch_size * world_size(trainer) // trainer.num_generations,
        )
    except TrainingFailed as exc:  # its message names the spec.dataset field, the file and the line
        raise PrepareFailed(str(exc), permanent=True) from exc
    except Exception as exc:
        raise PrepareFailed(
            f"spec.dataset: {dataset_path} does not load ({type(exc).__name__}: {exc})", permanent=True
        ) from exc

    reporter.progress(f"checking {len(spec.rewards)} reward function(s)")
    try:
        funcs, _ = build_rewards(
            spec.rewards,
            RewardContext(
                max_completion_length=trainer.max_completion_length, dataset_columns=tuple(dataset.column_names)
            ),
            cfg.reward_search_paths(),
        )
    except TrainingFailed as exc:  # its message names spec.rewards[i], and the module's file and line
        raise PrepareFailed(str(exc), permanent=True) from exc
    return PrepareResult(model_dir=model_dir, dataset_path=dataset_path, prompts=len(dataset), rewards=len(funcs))


# ------------------------------------------------------------------------------------------------- entry


def prepare(cfg: RunConfig, reporter: Reporter) -> PrepareResult:
    """Inline rewards, fetches, checks; raises PrepareFailed."""
    check_image(cfg)
    write_inline_rewards(cfg, reporter)
    commits = {fetch.local_dir: fetch_repository(fetch, reporter) for fetch in cfg.sources.fetches}
    if commits:
        try:
            cfg.record_fetched_commits(commits)
        except OSError as exc:
            raise PrepareFailed(f"cannot record the fetched commits in {cfg.paths.fetched_commits_file}: {exc}",
                                permanent=True) from exc
    result = check_sources(cfg, reporter)
    warm_fingerprint(result.model_dir, reporter)
    return result


def check_image(cfg: RunConfig) -> None:
    """This image (the trainer's) can run the spec: a run it could not execute fails here, before any server
    exists, for good (`image_capabilities`)."""
    from grpo_trainer.errors import UnsupportedSetting
    from grpo_trainer.image_capabilities import check_trainer_image

    try:
        check_trainer_image(cfg.spec)
    except UnsupportedSetting as exc:
        raise PrepareFailed(str(exc), permanent=True) from exc


def warm_fingerprint(model_dir: Path, reporter: Reporter) -> None:
    """Hash the weights into the fingerprint cache beside them, where the server and the trainer look first.

    Only where the cache can sit beside the model directory (else it would be cached in this pod's home,
    which no other pod reads); a failure only costs the server the time to hash them itself.
    """
    if not os.access(model_dir.parent, os.W_OK):
        return
    reporter.progress(f"fingerprinting the weights in {model_dir}")
    try:
        model_fingerprint(model_dir)
    except (OSError, ValueError) as exc:
        reporter.note(f"the model fingerprint is not cached ({type(exc).__name__}: {exc}); the server computes it")


def write_termination_message(line: str, reporter: Reporter) -> None:
    """The final line into the termination log: $GRPO_TERMINATION_LOG (created), else /dev/termination-log
    when it exists and is writable (Kubernetes)."""
    try:
        exit_codes.write_termination_message(line)
    except OSError as exc:
        reporter.note(f"cannot write the termination message to {exit_codes.termination_log_path()}: {exc}")


def run_prepare(config_path: str | Path | None, reporter: Reporter | None = None) -> int:
    """Load the run-config, prepare, print the final line; the exit code."""
    reporter = reporter or Reporter()
    try:
        cfg = load_run_config(config_path)
        result = prepare(cfg, reporter)
    except RunConfigError as exc:
        failure = PrepareFailed(str(exc), permanent=True)
    except PrepareFailed as exc:
        failure = exc
    except Exception as exc:  # an unforeseen error: let the Job retry (bounded by its backoffLimit)
        failure = PrepareFailed(f"unexpected error: {type(exc).__name__}: {exc}", permanent=False)
    else:
        write_termination_message(reporter.final(result.message, failed=False), reporter)
        return EXIT_READY
    reporter.note(f"{'permanent' if failure.permanent else 'transient'} failure: {failure}")
    line = reporter.final(str(failure), failed=True, permanent=failure.permanent)
    write_termination_message(line, reporter)
    return EXIT_PERMANENT if failure.permanent else EXIT_TRANSIENT
