"""Fetching s3:// and https:// sources onto the volume: one folder per source, one folder per object version in it
(the hub's layout and records, `folders`), trusting no endpoint.

- s3://BUCKET/PREFIX through boto3 (`grpo_trainer.objectstore`): the objects at or under PREFIX/path are listed;
  their version is the digest of the listing (every name with its size and ETag), so an object changed later is
  fetched into a folder of its own. Each object is read with If-Match on its listed ETag (an object changed since
  the listing is a transient failure, listed again by the next try), into a temporary file that replaces nothing
  until it has exactly the listed size. Names that climb out of the folder are refused before any download.
- https://HOST/PATH through httpx: one file, at most `max_bytes`, every read and the whole download bounded in
  time, redirects only to https://; its version is its sha256, known once it is read, so it is read into a
  temporary file first.

Permanent failures (credentials refused, no such bucket, no object under the prefix, a file missing or too large)
fail the run at once, naming the field and the URI; transient ones (the network, a 5xx) fall back on the complete
copy fetched before, if any, else are retried by the initializer's Job.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_api.models import BucketLocation, https_file_name, parse_s3
from grpo_api.sources import ObjectFetch, s3_credential_env
from grpo_trainer.objectstore import classify_s3_error, credentials_from_env, s3_client
from grpo_trainer.prepare import folders
from grpo_trainer.prepare.errors import DownloadStopped, PrepareFailed
from grpo_trainer.prepare.folders import SourceFolder
from grpo_trainer.prepare.reporting import FetchProgress, Reporter

if TYPE_CHECKING:
    import httpx

#: Objects downloaded in parallel per source.
FETCH_WORKERS = 8
#: The most objects one s3:// source may fetch, and may list in all (folder markers, neighbours of its path such as
#: train.jsonl.bak beside train.jsonl): more is refused (narrow the prefix or the path).
MAX_OBJECTS = 10_000
MAX_LISTED = 100_000
#: Bytes read at a time.
CHUNK_BYTES = 1 << 20
#: https://: seconds to connect, and to wait for each read.
WEB_CONNECT_TIMEOUT_S = 10.0
WEB_READ_TIMEOUT_S = 60.0
#: https://: the whole download, however the file trickles in (each read is bounded apart).
WEB_DEADLINE_S = 3600.0
WEB_MAX_REDIRECTS = 5
#: Where a download is written before it replaces nothing (in the source's folder: the same file system).
INCOMING = ".cache/incoming"


def fetch_object_source(fetch: ObjectFetch, reporter: Reporter, *, workers: int = FETCH_WORKERS) -> str:
    """Fetch an s3:// prefix or an https:// file into the folder of its version (in fetch.local_dir); the version."""
    if fetch.uri.startswith("https://"):
        return fetch_web_file(fetch, reporter)
    return fetch_bucket(fetch, reporter, workers=workers)


def _folder(fetch: ObjectFetch) -> SourceFolder:
    return SourceFolder(Path(fetch.local_dir), dict(fetch.key.to_json()), fetch.label)


def _fall_back(fetch: ObjectFetch, failure: PrepareFailed, reporter: Reporter) -> str:
    """After a transient failure, the version of the complete copy fetched before; else the failure is raised."""
    version = None if failure.permanent else folders.complete_copy(_folder(fetch))
    if version is None:
        raise failure
    reporter.progress(f"{fetch.label}: unreachable; using the complete copy fetched before (version {version[:12]})")
    reporter.note(f"{failure}; using the complete copy in {_folder(fetch).snapshot(version)}")
    return version


def _ready(fetch: ObjectFetch, version: str, reporter: Reporter) -> bool:
    """Whether the version's folder is already complete (then it is the source's latest and is not touched)."""
    folder = _folder(fetch)
    folders.check_snapshot_owner(folder, version)
    if not folders.snapshot_complete(folder, version):
        return False
    folders.record_latest(folder, version, reporter)
    reporter.progress(f"{fetch.label}: ready in {folder.snapshot(version)} (version {version[:12]}, fetched before)")
    return True


def _open_folder(fetch: ObjectFetch, reporter: Reporter, doing: str) -> SourceFolder:
    """The source's folder, refused (permanent) when its record names another source; says what is done now."""
    folder = _folder(fetch)
    folders.check_folder_owner(folder)
    reporter.progress(f"{fetch.label}: {doing}")
    return folder


def _incoming(fetch: ObjectFetch) -> Path:
    path = Path(fetch.local_dir) / INCOMING / f"{uuid.uuid4().hex}.part"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _place(snapshot: Path, name: str, temporary: Path) -> None:
    """Move a complete download to snapshot/name, creating its folders; no symbolic link on the way is followed,
    so nothing lands outside the version's folder."""
    where = snapshot
    for part in name.split("/")[:-1]:
        where = where / part
        if where.is_symlink():
            raise PrepareFailed(f"{snapshot}: {part!r} is a symbolic link; refusing to write through it",
                                permanent=True)
        where.mkdir(exist_ok=True)
    target = where / name.rsplit("/", 1)[-1]
    if target.is_symlink() or target.is_dir():
        raise PrepareFailed(f"{target} is a symbolic link or a folder; refusing to replace it", permanent=True)
    os.replace(temporary, target)


# ------------------------------------------------------------------------------------------------- s3://


def _endpoint(fetch: ObjectFetch) -> str:
    return fetch.endpoint or "AWS"


def s3_failure(fetch: ObjectFetch, exc: BaseException, name: str | None = None) -> PrepareFailed:
    if isinstance(exc, PrepareFailed):
        return exc
    info = classify_s3_error(exc)
    what = f"{name}: " if name else ""
    status = f" (HTTP {info.status})" if info.status is not None else ""
    return PrepareFailed(f"{fetch.label}: {what}{info.reason} at {_endpoint(fetch)}{status}", permanent=info.permanent)


def _client(fetch: ObjectFetch, reporter: Reporter) -> Any:
    credentials = None
    if fetch.credentials_role is not None:
        credentials = credentials_from_env(s3_credential_env(fetch.credentials_role))
        if credentials is None:
            raise PrepareFailed(f"{fetch.credentials_field}: the Secret, or its key accessKeyId or secretAccessKey, "
                                f"does not exist or is empty ({fetch.label})", permanent=True)
        reporter.add_secret(credentials.secret_access_key)
        reporter.add_secret(credentials.session_token)
    return s3_client(endpoint=fetch.endpoint, region=fetch.region, credentials=credentials)


def _list(fetch: ObjectFetch, location: BucketLocation, client: Any) -> dict[str, tuple[str, int, str]]:
    """name (relative to the source's prefix) -> (key, size, ETag) of every object at or under PREFIX/select;
    folder markers (keys ending in '/') are left out."""
    base = f"{location.prefix}/" if location.prefix else ""
    wanted = base + fetch.select
    listed: dict[str, tuple[str, int, str]] = {}
    seen = 0
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=wanted)
    for page in pages:
        for entry in page.get("Contents", []):
            seen += 1
            if seen > MAX_LISTED:
                raise PrepareFailed(f"{fetch.label}: more than {MAX_LISTED} keys start with s3://{location.bucket}/"
                                    f"{wanted}; narrow the prefix or the path", permanent=True)
            key, size, etag = entry.get("Key"), entry.get("Size"), entry.get("ETag")
            if not isinstance(key, str) or type(size) is not int or size < 0 or not isinstance(etag, str):
                raise PrepareFailed(f"{fetch.label}: the endpoint {_endpoint(fetch)} lists a malformed object "
                                    f"(key {key!r}, size {size!r})", permanent=True)
            if key.endswith("/") or (fetch.select and key != wanted and not key.startswith(wanted + "/")):
                continue
            listed[key[len(base):]] = (key, size, etag)
            if len(listed) > MAX_OBJECTS:
                raise PrepareFailed(f"{fetch.label}: more than {MAX_OBJECTS} objects under s3://{location.bucket}/"
                                    f"{wanted}; narrow the prefix or the path", permanent=True)
    folders.refuse_unsafe_names(fetch.label, _endpoint(fetch), list(listed), "prefix")
    if not listed:
        raise PrepareFailed(f"{fetch.label}: no such key: no object at or under s3://{location.bucket}/{wanted} at "
                            f"{_endpoint(fetch)}", permanent=True)
    return listed


def _listing_version(listed: dict[str, tuple[str, int, str]]) -> str:
    """The version of a listing: 40 hex digits of the sha256 of every name with its size and ETag."""
    canonical = json.dumps(sorted((name, size, etag) for name, (_, size, etag) in listed.items()),
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:40]


def fetch_bucket(fetch: ObjectFetch, reporter: Reporter, *, workers: int = FETCH_WORKERS) -> str:
    """Download the objects of an s3:// source into the folder of their listing's version; the version. Files
    already there (an earlier try of this version) are kept; a complete version's folder is not touched at all."""
    location = parse_s3(fetch.uri)
    if location is None:
        raise PrepareFailed(f"{fetch.label}: not an s3://BUCKET[/PREFIX] URI", permanent=True)
    folder = _open_folder(fetch, reporter, f"listing at {_endpoint(fetch)}")
    client = _client(fetch, reporter)
    try:
        listed = _list(fetch, location, client)
    except Exception as exc:
        return _fall_back(fetch, s3_failure(fetch, exc), reporter)
    version = _listing_version(listed)
    if _ready(fetch, version, reporter):
        return version
    sizes: dict[str, int | None] = {name: size for name, (_, size, _) in listed.items()}
    progress = FetchProgress(fetch.label, sizes, reporter, limits=dict(sizes))
    reporter.progress(progress.message())
    snapshot = folders.claim_snapshot(folder, version)

    def download(name: str) -> None:
        key, size, etag = listed[name]
        target = snapshot / name
        if target.is_file() and not target.is_symlink() and target.stat().st_size == size:
            progress.finish(name)  # an earlier try of this version read it whole
            return
        temporary = _incoming(fetch)
        try:
            body = client.get_object(Bucket=location.bucket, Key=key, IfMatch=etag)["Body"]
            received = 0
            with temporary.open("wb") as out:
                for chunk in body.iter_chunks(CHUNK_BYTES):
                    if progress.stopped.is_set():
                        raise DownloadStopped("another object of the source failed")
                    received += len(chunk)
                    if received > size:
                        raise PrepareFailed(f"{fetch.label}: {name}: the endpoint sends more than the {size} bytes "
                                            "its listing says", permanent=True)
                    out.write(chunk)
                    progress.add(name, len(chunk))
            if received != size:
                raise PrepareFailed(f"{fetch.label}: {name}: the endpoint sent {received} of its {size} bytes",
                                    permanent=False)
            _place(snapshot, name, temporary)
        finally:
            temporary.unlink(missing_ok=True)
        progress.finish(name)

    folders.download_all(list(listed), download, progress, workers, lambda name, exc: s3_failure(fetch, exc, name))
    folders.record_complete(folder, version, list(listed), reporter)
    reporter.progress(f"{fetch.label}: ready in {snapshot} (version {version[:12]}, {len(listed)} files)")
    return version


# ---------------------------------------------------------------------------------------------- https://


def _refuse_plain_http(request: httpx.Request) -> None:
    if request.url.scheme != "https":
        raise PrepareFailed(f"the server redirects to {request.url.scheme}://{request.url.host}; only https:// is "
                            "followed", permanent=True)


def web_failure(fetch: ObjectFetch, exc: BaseException) -> PrepareFailed:
    import httpx

    if isinstance(exc, PrepareFailed):
        return PrepareFailed(f"{fetch.label}: {exc}", permanent=exc.permanent)
    if isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
        if status in (404, 410):
            return PrepareFailed(f"{fetch.label}: no such file (HTTP {status})", permanent=True)
        if status in (401, 403):
            return PrepareFailed(f"{fetch.label}: access denied (HTTP {status})", permanent=True)
        busy = status in (408, 429) or status >= 500
        return PrepareFailed(f"{fetch.label}: {'the server is busy or failing' if busy else 'request refused'} "
                             f"(HTTP {status})", permanent=not busy)
    if isinstance(exc, httpx.TooManyRedirects):
        return PrepareFailed(f"{fetch.label}: more than {WEB_MAX_REDIRECTS} redirects", permanent=True)
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return PrepareFailed(f"{fetch.label}: timed out ({type(exc).__name__})", permanent=False)
    if isinstance(exc, httpx.ConnectError):
        return PrepareFailed(f"{fetch.label}: cannot connect ({exc})", permanent=False)
    if isinstance(exc, httpx.TransportError):
        return PrepareFailed(f"{fetch.label}: network error ({type(exc).__name__}: {exc})", permanent=False)
    return PrepareFailed(f"{fetch.label}: {type(exc).__name__}: {exc}", permanent=False)


def _read_web_file(fetch: ObjectFetch, name: str, temporary: Path, reporter: Reporter) -> str:
    """The file into `temporary`, at most fetch.max_bytes; its sha256."""
    import httpx

    limit = fetch.max_bytes
    timeout = httpx.Timeout(WEB_READ_TIMEOUT_S, connect=WEB_CONNECT_TIMEOUT_S)
    deadline = time.monotonic() + WEB_DEADLINE_S
    digest = hashlib.sha256()
    with httpx.Client(timeout=timeout, follow_redirects=True, max_redirects=WEB_MAX_REDIRECTS,
                      event_hooks={"request": [_refuse_plain_http]}) as client, \
            client.stream("GET", fetch.uri) as response:
        response.raise_for_status()
        announced = response.headers.get("content-length")
        size = int(announced) if announced and announced.isdigit() else None
        if limit is not None and size is not None and size > limit:
            raise PrepareFailed(f"the file has {size} bytes, more than the {limit} a {fetch.field} may have",
                                permanent=True)
        progress = FetchProgress(fetch.label, {name: size}, reporter)
        received = 0
        with temporary.open("wb") as out:
            for chunk in response.iter_bytes(CHUNK_BYTES):
                received += len(chunk)
                if limit is not None and received > limit:
                    raise PrepareFailed(f"the file has more than the {limit} bytes a {fetch.field} may have",
                                        permanent=True)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the download took longer than {WEB_DEADLINE_S:g} s")
                out.write(chunk)
                digest.update(chunk)
                progress.add(name, len(chunk))
        if size is not None and received != size:
            raise PrepareFailed(f"the server sent {received} of the {size} bytes it announced", permanent=False)
        progress.finish(name)
    return digest.hexdigest()


def fetch_web_file(fetch: ObjectFetch, reporter: Reporter) -> str:
    """Download an https:// file into the folder of its content's version (its sha256); the version. The same
    content fetched before is kept as it was, and the download dropped."""
    name = https_file_name(fetch.uri)
    if name is None:
        raise PrepareFailed(f"{fetch.label}: not an https://HOST/PATH URL", permanent=True)
    folder = _open_folder(fetch, reporter, "downloading")
    temporary = _incoming(fetch)
    try:
        try:
            version = _read_web_file(fetch, name, temporary, reporter)[:40]
        except Exception as exc:
            return _fall_back(fetch, web_failure(fetch, exc), reporter)
        if _ready(fetch, version, reporter):
            return version
        snapshot = folders.claim_snapshot(folder, version)
        _place(snapshot, name, temporary)
    finally:
        temporary.unlink(missing_ok=True)
    folders.record_complete(folder, version, [name], reporter)
    reporter.progress(f"{fetch.label}: ready in {snapshot} (version {version[:12]}, 1 file)")
    return version
