"""Fetching hf:// sources onto the volume, resumably, one folder per source and commit, trusting no endpoint."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import urlsplit

from grpo_api.sources import MODEL_FALLBACK_WEIGHT_PATTERNS, MODEL_WEIGHT_PATTERNS, HubFetch
from grpo_trainer.prepare import folders
from grpo_trainer.prepare.errors import HubAnswerRefused, PrepareFailed, classify_hub_error
from grpo_trainer.prepare.folders import SourceFolder
from grpo_trainer.prepare.reporting import FetchProgress, Reporter

if TYPE_CHECKING:
    import httpx


#: Files downloaded in parallel per repository (huggingface_hub's snapshot_download uses 8 too).
FETCH_WORKERS = 8
#: Read timeout of the file-list call (huggingface_hub sets none: an endpoint that never answers would hang the run).
HUB_API_TIMEOUT_S = 60.0
#: The whole file-list call, however its answer trickles in: the read timeout bounds each read only, so an
#: endpoint sending a byte a minute would hold the run forever.
HUB_API_DEADLINE_S = 180.0

_COMMIT = re.compile(r"[0-9a-f]{40}")
_T = TypeVar("_T")


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



def _folder(fetch: HubFetch) -> SourceFolder:
    return SourceFolder(Path(fetch.local_dir), fetch.key.to_json(), _label(fetch))


def _snapshot(fetch: HubFetch, commit: str) -> Path:
    return _folder(fetch).snapshot(commit)


def check_folder_owner(fetch: HubFetch) -> None:
    """Refuse (permanent) to fetch into a folder whose record names another source (folders.check_folder_owner)."""
    folders.check_folder_owner(_folder(fetch))


def complete_copy(fetch: HubFetch) -> str | None:
    """The commit of the latest complete earlier fetch of this source, if its files are all still there."""
    return folders.complete_copy(_folder(fetch))


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
    folders.refuse_unsafe_names(label, endpoint, list(sizes), "repository")
    return sizes, limits


def selected_files(fetch: HubFetch, names: list[str]) -> list[str]:
    """The listed files the fetch downloads: those its allow patterns match and its ignore patterns do not, as
    snapshot_download selects them; the default of a model adds *.bin when no *.safetensors is listed. Refuses
    (permanent, naming the pattern fields and the source) patterns that select no file, or no weights of a model
    repository that has some."""
    from huggingface_hub.utils import filter_repo_objects

    def matching(patterns: tuple[str, ...] | list[str], among: list[str]) -> list[str]:
        return list(filter_repo_objects(among, allow_patterns=list(patterns)))

    allow = None if fetch.allow_patterns is None else list(fetch.allow_patterns)
    if allow is not None and fetch.default_patterns and not matching(("*.safetensors",), names):
        allow += MODEL_FALLBACK_WEIGHT_PATTERNS
    selected = list(filter_repo_objects(names, allow_patterns=allow, ignore_patterns=fetch.ignore_patterns or None))
    where = f"{fetch.patterns_field}: hf://{fetch.repo_id}@{fetch.revision}"
    if names and not selected:
        raise PrepareFailed(f"{where}: the patterns select none of the repository's {len(names)} files "
                            f"(allow {allow or ['*']}, ignore {fetch.ignore_patterns})", permanent=True)
    weights = matching(MODEL_WEIGHT_PATTERNS, names)
    if fetch.model_weights and weights and not matching(MODEL_WEIGHT_PATTERNS, selected):
        raise PrepareFailed(f"{where}: the patterns select no weight file ({', '.join(MODEL_WEIGHT_PATTERNS)}) of the "
                            f"repository's {len(weights)}, e.g. {weights[0]} (allow {allow or ['*']}, ignore "
                            f"{fetch.ignore_patterns})", permanent=True)
    return selected


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
    listed, listed_limits = _listed_files(label, endpoint, siblings)
    selected = selected_files(fetch, list(listed))
    sizes = {name: listed[name] for name in selected}
    limits = {name: listed_limits[name] for name in selected}
    progress = FetchProgress(label, sizes, reporter, limits=limits)
    folder = _folder(fetch)
    folders.check_snapshot_owner(folder, commit)
    if folders.snapshot_complete(folder, commit):  # a complete commit's files are never touched again: runs read them
        folders.record_latest(folder, commit, reporter)
        reporter.progress(f"{label}: ready in {_snapshot(fetch, commit)} (commit {commit[:12]}, fetched before)")
        return commit
    reporter.progress(progress.message())
    local_dir = folders.claim_snapshot(folder, commit)
    _download_files(fetch, local_dir, commit, progress, token, workers)
    folders.record_complete(folder, commit, list(sizes), reporter)
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

    folders.download_all(list(sizes), download, progress, workers,
                         lambda name, exc: hub_failure(fetch, exc, name))
