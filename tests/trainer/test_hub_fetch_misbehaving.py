"""`grpo prepare`'s hub fetch against an endpoint that misbehaves on purpose: it chooses the file list, the names,
the sizes, the headers, the bodies and the redirects. Each test drives the real huggingface_hub client against a
local HTTP server (tests/fixtures/hub.py's FakeHub, with the hostile answers added here)."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from grpo_api.sources import HubFetch, hub_snapshot_dir
from grpo_trainer.prepare import hub as prepare_hub
from grpo_trainer.prepare.errors import PrepareFailed
from grpo_trainer.prepare.hub import fetch_repository
from grpo_trainer.prepare.reporting import Reporter
from tests.fixtures.hub import FakeHub, Repo, Request, etag_of, make_handler, running_hub

TOKEN = "hf_hostile_TOKEN_0123456789"
TOKEN_ENV = "GRPO_TEST_HUB_TOKEN"
MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def online_to_the_fake_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """hack/test.sh sets HF_HUB_OFFLINE=1; these tests reach only local servers, as an initializer pod would."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)


@dataclass
class HostileHub(FakeHub):
    """A FakeHub with the answers of a hostile endpoint switched on per test."""

    listing: list[Any] | None = None  # the API's "siblings", verbatim
    sha: Any = None  # the API's "sha", instead of the repository's commit
    aliases: dict[str, str] = field(default_factory=dict)  # revision asked -> revision answered
    fail_head: dict[str, int] = field(default_factory=dict)  # file -> how many HEADs answer 500
    redirect_head: dict[str, str] = field(default_factory=dict)  # file -> where its HEAD redirects (302)
    file_headers: dict[str, dict[str, str]] = field(default_factory=dict)  # file -> headers set on HEAD and GET
    oversize: dict[str, tuple[int, bool]] = field(default_factory=dict)  # file -> (bytes a GET sends, chunked)
    sent: dict[str, int] = field(default_factory=dict)  # file -> bytes the oversized GET got out
    hang_api: threading.Event | None = None  # set: API calls get no answer until it is set
    slow: dict[str, float] = field(default_factory=dict)  # file -> seconds per MiB its GET takes
    drip_api: float | None = None  # seconds between the bytes of an API answer


def hostile_handler(hub: HostileHub) -> type:
    class Handler(make_handler(hub)):  # type: ignore[misc]
        path: str
        _extra: dict[str, str]

        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
            super()._send(status, body, {**(headers or {}), **self._extra})

        def _handle(self) -> None:
            self._extra = {}
            raw = urlsplit(self.path).path
            for asked, answered in hub.aliases.items():
                self.path = self.path.replace(f"/revision/{asked}", f"/revision/{answered}")
            if raw.startswith("/api/") and (hub.hang_api is not None or hub.listing is not None or hub.sha
                                            or hub.drip_api is not None):
                with hub.lock:
                    hub.requests.append(Request(self.command, raw, self.headers.get("Authorization"), None))
                if hub.hang_api is not None:
                    hub.hang_api.wait(30)
                    self.close_connection = True
                    return None
                repo = next(iter(hub.repos.values()))
                siblings = hub.listing if hub.listing is not None else [
                    {"rfilename": name, "size": len(data)} for name, data in repo.files.items()]
                body = json.dumps({"id": repo.repo_id, "sha": hub.sha or repo.commit, "siblings": siblings})
                if hub.drip_api is not None:
                    return self._drip(body.encode() + b" " * 100, hub.drip_api)
                return self._send(200, body.encode(), {"Content-Type": "application/json"})
            super()._handle()

        def _file(self, repo: Repo, name: str) -> None:
            self._extra = hub.file_headers.get(name, {})
            if self.command == "HEAD":
                with hub.lock:
                    failing = hub.fail_head.get(name, 0) > 0
                    if failing:
                        hub.fail_head[name] -= 1
                if failing:
                    return self._error(500, message="Internal Error")
                if name in hub.redirect_head:
                    return self._send(302, b"", {"Location": hub.redirect_head[name]})
            elif name in hub.oversize:
                return self._oversized(repo, name, *hub.oversize[name])
            elif name in hub.slow and not self.headers.get("Range"):
                return self._slowly(repo, name, hub.slow[name])
            return super()._file(repo, name)

        def _drip(self, body: bytes, seconds: float) -> None:
            """The whole answer announced, then a byte every `seconds`: each read is quick, the answer never ends."""
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                for i in range(len(body)):
                    self.wfile.write(body[i:i + 1])
                    self.wfile.flush()
                    time.sleep(seconds)
            except OSError:  # the client hung up
                pass
            self.close_connection = True

        def _slowly(self, repo: Repo, name: str, seconds_per_mib: float) -> None:
            """The file's bytes, a MiB every `seconds_per_mib` (a large file on a slow link)."""
            data = repo.files[name]
            self.send_response(200)
            for key, value in {"ETag": f'"{etag_of(data)}"', "X-Repo-Commit": repo.commit,
                               "Content-Length": str(len(data)), "Accept-Ranges": "bytes"}.items():
                self.send_header(key, value)
            self.end_headers()
            try:
                for start in range(0, len(data), MiB):
                    self.wfile.write(data[start:start + MiB])
                    with hub.lock:
                        hub.sent[name] = start + MiB
                    time.sleep(seconds_per_mib)
            except OSError:  # the client hung up
                pass
            self.close_connection = True

        def _oversized(self, repo: Repo, name: str, total: int, chunked: bool) -> None:
            """A GET that sends `total` bytes of a file the listing and the HEAD announce far smaller."""
            self.send_response(200)
            self.send_header("ETag", f'"{etag_of(repo.files[name])}"')
            self.send_header("X-Repo-Commit", repo.commit)
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(total))
            self.end_headers()
            block, sent = b"x" * MiB, 0
            try:
                while sent < total:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block) if chunked else block)
                    sent += len(block)
                    with hub.lock:
                        hub.sent[name] = sent
                if chunked:
                    self.wfile.write(b"0\r\n\r\n")
            except OSError:  # the client hung up
                pass
            self.close_connection = True

    return Handler


@pytest.fixture
def hub() -> Iterator[HostileHub]:
    fake = HostileHub()
    with running_hub(hub=fake, handler=hostile_handler(fake)):
        try:
            yield fake
        finally:
            if fake.hang_api is not None:
                fake.hang_api.set()


@pytest.fixture
def other_host() -> Iterator[FakeHub]:
    """Another server, on another host than the endpoint (127.0.0.2): it must never see the token."""
    with running_hub(host="127.0.0.2") as other:
        yield other


def hub_fetch(hub: FakeHub, tmp_path: Path, *, repo: str = "org/m", revision: str = "main") -> HubFetch:
    return HubFetch(field="spec.model.source", repo_id=repo, revision=revision, repo_type="model",
                    local_dir=str(tmp_path / "hub" / repo / revision), token_env=TOKEN_ENV, endpoint=hub.url)


def commit_dir(target: HubFetch, commit: str) -> Path:
    return Path(hub_snapshot_dir(target.local_dir, commit))


def fetch(target: HubFetch) -> Reporter:
    reporter = Reporter(out=io.StringIO(), err=io.StringIO())
    fetch_repository(target, reporter)
    return reporter


def failure(target: HubFetch) -> PrepareFailed:
    with pytest.raises(PrepareFailed) as info:
        fetch(target)
    assert info.value.args[0].startswith(f"spec.model.source hf://{target.repo_id}@{target.revision}: ")
    assert TOKEN not in str(info.value)
    return info.value


FILES = {"config.json": b'{"model_type": "x"}', "weights.bin": b"w" * 4096}


# ------------------------------------------------------------------------------------------------ the file list


def test_a_listed_file_in_the_local_bookkeeping_folder_is_refused_and_cannot_forge_the_record(
    hub: HostileHub, tmp_path: Path,
) -> None:
    """`.cache/` of the local dir holds huggingface_hub's metadata and the record of a complete copy (which a run
    trusts when the hub is unreachable); a hub never lists files there (huggingface_hub refuses to upload them)."""
    target = hub_fetch(hub, tmp_path)
    forged = {"repoId": "org/m", "repoType": "model", "revision": "main", "commit": "f" * 40, "files": []}
    hub.add("org/m", {**FILES, ".cache/grpo-fetch.json": json.dumps(forged).encode()})
    hub.fail_get["weights.bin"] = 100

    first = failure(target)
    assert first.permanent, first
    assert "'.cache/grpo-fetch.json'" in str(first)
    assert hub.file_requests() == []
    hub.api_status = 503  # the hub is now unreachable: only a complete copy on record may stand in for it
    assert not failure(target).permanent


@pytest.mark.parametrize(
    ("listing", "shown"),
    [
        ([{"rfilename": "config.json", "size": 2}, {"rfilename": "we\x00ights.bin", "size": 1}], r"'we\x00ights.bin'"),
        ([{"rfilename": "config.json", "size": 2}, {"rfilename": "C:weights.bin", "size": 1}], "'C:weights.bin'"),
        ([{"rfilename": "config.json", "size": 2}, {"rfilename": "config.json/x", "size": 1}], "'config.json'"),
        ([{"rfilename": "config.json", "size": 2}, {"rfilename": 5, "size": 1}], "5"),
        ([{"rfilename": "config.json", "size": "big"}], "'big'"),
    ],
    ids=["NUL", "drive", "file and folder", "name not text", "size not a number"],
)
def test_a_file_list_that_names_no_repository_file_is_permanent_before_any_download(
    hub: HostileHub, tmp_path: Path, listing: list[Any], shown: str,
) -> None:
    hub.add("org/m", {"config.json": b"{}", "config.json/x": b"x", "C:weights.bin": b"w", "we\x00ights.bin": b"w"})
    hub.listing = listing

    failed = failure(hub_fetch(hub, tmp_path))

    assert failed.permanent, failed
    assert shown in str(failed) and hub.url in str(failed)
    assert hub.file_requests() == []


def test_an_answer_whose_commit_is_not_text_is_permanent(hub: HostileHub, tmp_path: Path) -> None:
    hub.add("org/m", FILES)
    hub.sha = 1234

    failed = failure(hub_fetch(hub, tmp_path))

    assert failed.permanent, failed
    assert "answered without a commit or a file list" in str(failed)
    assert hub.file_requests() == []


# -------------------------------------------------------------------------------------------------- the token


@pytest.mark.parametrize("route", ["xet refresh route", "redirect to a Hugging Face host"])
def test_the_token_never_goes_to_another_host(
    hub: HostileHub, other_host: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str,
) -> None:
    repo = hub.add("org/m", FILES)
    if route == "xet refresh route":
        # huggingface_hub asks the refresh route for a Xet access token, with the request's headers. It takes the
        # Xet route only where it finds hf_xet (a dependency of it on x86_64 and arm64), which one CI run's worker
        # did not (it fell back to plain HTTP from the endpoint, and the fetch succeeded): the route is taken here.
        import hf_xet  # noqa: F401 - what the Xet route needs
        import huggingface_hub.file_download

        monkeypatch.setattr(huggingface_hub.file_download, "is_xet_available", lambda: True)
        hub.file_headers["weights.bin"] = {"X-Xet-Hash": "ab" * 32,
                                           "X-Xet-Refresh-Route": f"{other_host.url}/api/models/org/m/xet-read-token"}
    else:
        # huggingface_hub follows a HEAD redirect to a Hugging Face host with the token; 127.0.0.2 plays one here
        import huggingface_hub.constants

        monkeypatch.setattr(huggingface_hub.constants, "HF_URL_HOSTS",
                            huggingface_hub.constants.HF_URL_HOSTS | {"127.0.0.2"})
        other_host.add("org/m", FILES)
        hub.redirect_head["weights.bin"] = f"{other_host.url}/org/m/resolve/{repo.commit}/weights.bin"

    try:
        fetch(hub_fetch(hub, tmp_path))
    except PrepareFailed as exc:
        failed: PrepareFailed | None = exc
    else:
        failed = None

    assert [r for r in other_host.requests if r.authorization] == []
    assert failed is not None and failed.permanent, failed
    assert "weights.bin" in str(failed) and "127.0.0.2" in str(failed)
    assert all(r.authorization == f"Bearer {TOKEN}" for r in hub.requests)


# ------------------------------------------------------------------------------------------------------ sizes


@pytest.mark.parametrize("chunked", [True, False], ids=["endless chunked body", "larger Content-Length"])
def test_a_body_larger_than_the_file_list_announces_is_cut_off(
    hub: HostileHub, tmp_path: Path, chunked: bool,
) -> None:
    """The file list is the hub's word on each size: a model of hundreds of GB is announced as such; a file that
    goes on past its announced size must not fill the volume (which the runs of the claim share)."""
    repo = hub.add("org/m", FILES)
    hub.oversize["weights.bin"] = (64 * MiB, chunked)
    target = hub_fetch(hub, tmp_path)

    failed = failure(target)

    assert failed.permanent, failed
    assert "weights.bin: " in str(failed) and "4096 bytes" in str(failed)
    assert hub.sent.get("weights.bin", 0) < 48 * MiB  # the client hung up, long before the end
    assert not (commit_dir(target, repo.commit) / "weights.bin").exists()
    config = commit_dir(target, repo.commit) / "config.json"  # stopped in flight or done: never partly in place
    assert not config.exists() or config.read_bytes() == FILES["config.json"]


# ---------------------------------------------------------------------------------------------------- commits


def test_a_moved_branch_takes_no_file_from_the_old_commits_folder_and_leaves_it_as_it_was(
    hub: HostileHub, tmp_path: Path,
) -> None:
    """A branch moved; the HEAD of a changed file fails: huggingface_hub falls back to a file on disk when the
    endpoint does not answer for it. The new commit has a folder of its own, so there is none to fall back to, and
    the old commit's folder, which a run may be serving, is not touched."""
    old_commit = hub.add("org/m", FILES).commit
    target = hub_fetch(hub, tmp_path)
    fetch(target)
    old_files = local_files(target, old_commit)
    moved = {**FILES, "config.json": b'{"model_type": "y"}'}
    new_commit = hub.add("org/m", moved).commit
    hub.fail_head["config.json"] = 1

    with contextlib.suppress(PrepareFailed):
        fetch(target)  # huggingface_hub may retry the HEAD; a failure here is the transient kind
    fetch(target)

    assert (commit_dir(target, new_commit) / "config.json").read_bytes() == moved["config.json"]
    assert prepare_hub.complete_copy(target) == new_commit
    assert local_files(target, old_commit) == old_files


def local_files(target: HubFetch, commit: str | None = None) -> dict[str, bytes]:
    root = commit_dir(target, commit) if commit else Path(target.local_dir)
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("first_complete", [True, False], ids=["complete", "interrupted"])
@pytest.mark.parametrize(("repo", "revision"), [("org/other", "main"), ("org/m", "refs/pr/1")])
def test_a_folder_recorded_for_another_source_is_refused_not_fetched_over(
    hub: HostileHub, tmp_path: Path, first_complete: bool, repo: str, revision: str,
) -> None:
    """Each source has a folder of its own (grpo_api.sources.hub_dir); a folder whose record names another source
    (copied or renamed by hand, or two sources given one folder) is refused before anything is fetched into it,
    even while the first fetch is unfinished: the record names the source from the first download on."""
    hub.add("org/m", FILES)
    first = hub_fetch(hub, tmp_path)
    if first_complete:
        fetch(first)
    else:
        hub.fail_get["weights.bin"] = 100
        assert not failure(first).permanent
    before = local_files(first)
    assert json.loads(before[".cache/grpo-source.json"])["repoId"] == "org/m"
    hub.add(repo, {"config.json": b'{"model_type": "other"}', "weights.bin": b"o" * 4096})
    hub.requests.clear()
    second = first.model_copy(update={"repo_id": repo, "revision": revision})

    refused = failure(second)

    assert refused.permanent, refused
    assert f"{first.local_dir} holds a fetch of another source (repoType 'model', repoId 'org/m', " in str(refused)
    assert "refusing to fetch over it" in str(refused)
    assert hub.requests == []  # not even resolved
    assert local_files(first) == before


def test_a_file_served_at_another_commit_than_resolved_is_refused(hub: HostileHub, tmp_path: Path) -> None:
    repo = hub.add("org/m", FILES)
    hub.file_headers["weights.bin"] = {"X-Repo-Commit": "e" * 40}
    target = hub_fetch(hub, tmp_path)

    failed = failure(target)

    assert failed.permanent, failed
    assert "weights.bin: " in str(failed) and "e" * 12 in str(failed) and repo.commit[:12] in str(failed)
    record = commit_dir(target, repo.commit) / ".cache" / "grpo-fetch.json"
    assert json.loads(record.read_text())["files"] is None
    assert prepare_hub.complete_copy(target) is None


def test_a_pinned_commit_resolved_to_another_commit_is_refused(hub: HostileHub, tmp_path: Path) -> None:
    repo = hub.add("org/m", FILES)
    pinned = "c" * 40
    hub.aliases[pinned] = "main"  # the endpoint answers the pinned commit with main's

    failed = failure(hub_fetch(hub, tmp_path, revision=pinned))

    assert failed.permanent, failed
    assert repo.commit in str(failed)
    assert hub.file_requests() == []


# ---------------------------------------------------------------------------------------------------- silence


def test_a_failed_file_stops_the_downloads_in_flight_instead_of_waiting_for_the_largest(
    hub: HostileHub, tmp_path: Path,
) -> None:
    """One listed file is missing on the endpoint (permanent) while a 96 MiB file comes at 10 MiB/s: the failure is
    told within about a chunk of the large file (huggingface_hub writes 10 MB at a time), not after its 10 s; the
    next attempt fetches it whole."""
    big = bytes(range(256)) * (96 * MiB // 256)
    repo = hub.add("org/m", {"big.bin": big, "config.json": b"{}"})
    hub.listing = [{"rfilename": "big.bin", "size": len(big)}, {"rfilename": "missing.bin", "size": 1},
                   {"rfilename": "config.json", "size": 2}]
    hub.slow["big.bin"] = 0.1
    target = hub_fetch(hub, tmp_path)

    started = time.monotonic()
    failed = failure(target)
    elapsed = time.monotonic() - started

    assert failed.permanent and "missing.bin: a file the repository lists is missing" in str(failed), failed
    assert elapsed < 5, f"the failure waited {elapsed:.1f} s for the large file"
    assert hub.sent["big.bin"] < len(big)
    hub.listing, hub.slow = None, {}
    fetch(target)
    assert (commit_dir(target, repo.commit) / "big.bin").read_bytes() == big


def test_an_endpoint_that_never_answers_the_file_list_is_transient_not_a_hang(
    hub: HostileHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub.add("org/m", FILES)
    hub.hang_api = threading.Event()
    monkeypatch.setattr(prepare_hub, "HUB_API_TIMEOUT_S", 1.0, raising=False)  # absent before the fix
    outcome: list[BaseException] = []

    def attempt() -> None:
        try:
            fetch(hub_fetch(hub, tmp_path))
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(15)
    hub.hang_api.set()

    assert not worker.is_alive(), "the fetch hangs on an endpoint that accepts the connection and never answers"
    assert len(outcome) == 1 and isinstance(outcome[0], PrepareFailed), outcome
    assert not outcome[0].permanent
    assert "timed out" in str(outcome[0])


def test_a_file_list_that_trickles_in_is_transient_within_the_deadline_not_a_hang(
    hub: HostileHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A byte of the file list every 0.2 s: no read waits past the 1 s read timeout, yet the answer would take half a
    minute; the call as a whole is bounded (HUB_API_DEADLINE_S)."""
    hub.add("org/m", FILES)
    hub.drip_api = 0.2
    monkeypatch.setattr(prepare_hub, "HUB_API_TIMEOUT_S", 1.0)
    monkeypatch.setattr(prepare_hub, "HUB_API_DEADLINE_S", 2.0, raising=False)  # absent before the fix
    outcome: list[BaseException] = []

    def attempt() -> None:
        try:
            fetch(hub_fetch(hub, tmp_path))
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    started = time.monotonic()
    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(15)

    assert not worker.is_alive(), "the fetch waits as long as the endpoint trickles"
    assert time.monotonic() - started < 8
    assert len(outcome) == 1 and isinstance(outcome[0], PrepareFailed), outcome
    assert not outcome[0].permanent
    assert "timed out (the file list did not arrive within 2 s)" in str(outcome[0])
