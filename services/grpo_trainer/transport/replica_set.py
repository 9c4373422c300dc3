"""The server's replicas as the trainer knows them: found by discovery, checked by `/health/` on each boot, loaded
with the policy one at a time, caught up in the background, and which of them lag (get no work) since when.

`ReplicaSet` holds the state the pool's other parts share (the replicas, the target policy, the version being
made active, the threads); `activation.PolicyActivation` and `dispatch.GenerationDispatch` act through it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime as dt
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from grpo_api.protocol import HealthResponse, LaggingReplica
from grpo_trainer.errors import ServerUnavailable
from grpo_trainer.metrics import TrainerMetrics
from grpo_trainer.transport.policy_loaders import AdapterLoader, PolicyLoader, PolicyTarget, Unconfirmed, Unreachable
from grpo_trainer.transport.server_client import (
    BACKOFF_CAP_SECONDS,
    BACKOFF_START_SECONDS,
    AdapterRefused,
    ServerClient,
)

Discover = Callable[[], list[str]]


def dns_discovery(name: str, port: int) -> Discover:
    """The addresses behind a DNS name (a headless Service lists its Ready pods), as base URLs."""

    def discover() -> list[str]:
        try:
            infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            return []
        addresses = sorted({str(info[4][0]) for info in infos})
        return [f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}" for a in addresses]

    return discover


def static_discovery(urls: Sequence[str]) -> Discover:
    fixed = [u.rstrip("/") for u in urls]
    return lambda: list(fixed)


@dataclass(eq=False)
class Replica:
    url: str
    client: ServerClient
    #: Boot id of the server behind the address, as last seen; None before the first answer.
    boot_id: str | None = None
    #: The policy version confirmed active on boot_id (None: the weights it started with).
    version: int | None = None
    #: Confirmed on this boot (health checked: same base model, adapter as recorded).
    checked: bool = False
    #: Why it got no work last time ("" when it may get work).
    trouble: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Its load or catch-up running in the background (one at a time), if any.
    job: concurrent.futures.Future[Any] | None = None
    #: When a failed catch-up may be tried again (time.monotonic), and the backoff that set it.
    retry_at: float = 0.0
    backoff: float = 0.0
    #: Generation requests of finished batches it has not answered yet: it gets no work until it has.
    unanswered: int = 0
    #: Since when it has not served the current version (None: it does), and why, as last seen.
    lagging_since: dt.datetime | None = None
    lag_reason: str = ""


class ReplicaSet:
    """The replicas discovery lists, their boots, health and policy versions, and which of them lag."""

    def __init__(
        self,
        discover: Discover,
        *,
        expected: int,
        describe: str,
        token: str | None,
        generation_timeout: float,
        metrics: TrainerMetrics,
        log: Callable[[str], None] = print,
        loader: PolicyLoader | None = None,
        attempt: int | None = None,
    ) -> None:
        self.discover = discover
        #: The trainer's attempt, on every request (a server of a later attempt refuses it).
        self.attempt = attempt
        self.loader: PolicyLoader = loader if loader is not None else AdapterLoader()
        self.expected = max(1, expected)
        #: How the replicas are found, for messages (a DNS name, or the addresses).
        self.base_url = describe
        self.token = token
        self.generation_timeout = generation_timeout
        self.metrics = metrics
        self.fingerprint: str | None = None
        #: The policy version every replica should serve (None: the weights they started with).
        self.target: Any = None
        self.replicas: dict[str, Replica] = {}
        #: Boot ids of replicas that left discovery (a pod replaced comes back at another address).
        self._departed: list[str] = []
        #: The version a sync is making active now: a replica that confirmed it may get work already.
        self.activating: int | None = None
        self._started = False
        self.log = log
        self.lock = threading.Lock()
        # Threads are started as needed. A hung replica holds at most its one background load and the
        # requests it has not answered (it gets no more work), so the healthy ones always find a thread.
        self.threads = concurrent.futures.ThreadPoolExecutor(
            max(16, 4 * self.expected), thread_name_prefix="grpo-replica"
        )

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
        for replica in self.replicas.values():
            replica.client.close()

    # ------------------------------------------------------------------------------------- discovery

    def refresh(self) -> list[Replica]:
        """The replicas discovery lists now (new ones added, vanished ones dropped), in address order."""
        urls = self.discover()
        with self.lock:
            for url in urls:
                if url not in self.replicas:
                    self.replicas[url] = Replica(url, ServerClient(
                        url, token=self.token, generation_timeout=self.generation_timeout,
                        on_retry=self.metrics.generation_retries.inc, attempt=self.attempt,
                    ))
            for url in [u for u in self.replicas if u not in urls]:
                gone = self.replicas.pop(url)
                self.log(f"server replica {url} left discovery (boot {gone.boot_id})")
                if gone.boot_id is not None:
                    self._departed.append(gone.boot_id)
                if gone.lagging_since is not None:
                    with contextlib.suppress(KeyError):
                        self.metrics.server_replica_lagging_since.remove(url)
            replicas = [self.replicas[u] for u in sorted(self.replicas)]
        self.metrics.server_replicas.set(len(replicas))
        return replicas

    def wait_ready(self, timeout: float) -> list[tuple[str, HealthResponse]]:
        """Wait until `expected` replicas answer `/health/`; their addresses and answers."""
        deadline = time.monotonic() + timeout
        delay, last_error = 0.5, "no replica found"
        while True:
            replicas = self.refresh()
            answers: list[tuple[str, HealthResponse]] = []
            # All at once: a replica that does not answer holds up no other.
            for replica, health in zip(replicas, self.threads.map(self._probe, replicas), strict=True):
                if isinstance(health, HealthResponse):
                    answers.append((replica.url, health))
                else:
                    last_error = f"{replica.url}: {health}"
            if len(answers) >= self.expected:
                for url, health in answers:
                    replica = self.replicas[url]
                    replica.boot_id, replica.checked = health.boot_id, True
                    replica.version = self.loader.served(health)
                self._started = True
                return answers
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                found = f"{len(answers)} of {self.expected} replicas" if self.expected > 1 else "no answer"
                raise ServerUnavailable(
                    f"generation server {self.base_url} did not answer GET /health/ within {timeout:g}s "
                    f"(trainer.generationTimeoutSeconds): {found}; last error: {last_error}"
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 5.0)

    @staticmethod
    def _probe(replica: Replica) -> HealthResponse | str:
        """A replica's `/health/`, or why it gave none."""
        try:
            return replica.client.health()
        except httpx.HTTPStatusError as exc:
            return f"HTTP {exc.response.status_code}: {exc.response.text[:200]}"
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"

    # ---------------------------------------------------------------------------- one replica's policy

    def load(self, replica: Replica, adapter: PolicyTarget) -> Exception | None:
        """One load trigger (or push) on one replica, confirmed by its /health/; the error, or None when
        confirmed."""
        with replica.lock:
            try:
                if replica.version is not None and replica.version >= adapter.version and replica.checked:
                    return None  # caught up already (by another thread)
                boot_id = self.loader.load(replica.client, adapter)
            except AdapterRefused as exc:
                self.metrics.sync_failures.labels(exc.error).inc()
                return exc
            except httpx.TransportError as exc:
                self.metrics.sync_failures.labels("unreachable").inc()
                return Unreachable(f"{type(exc).__name__}: {exc}")
            except (httpx.HTTPError, Unconfirmed) as exc:
                reason = "unconfirmed" if isinstance(exc, Unconfirmed) else "unreachable"
                self.metrics.sync_failures.labels(reason).inc()
                return Unconfirmed(f"{type(exc).__name__}: {exc}")
            self.note_boot(replica, boot_id)
            replica.version, replica.checked, replica.trouble = adapter.version, True, ""
            return None

    def note_boot(self, replica: Replica, boot_id: str) -> bool:
        """Record a replica's boot id; True if it changed (the server behind the address restarted)."""
        changed = replica.boot_id is not None and boot_id != replica.boot_id
        if changed:
            self.metrics.server_restarts.inc()
            self.log(f"server restarted: boot id {replica.boot_id} -> {boot_id} ({replica.url})")
            replica.version, replica.checked = None, False
        replica.boot_id = boot_id
        return changed

    def _joined(self, replica: Replica, boot_id: str) -> None:
        """A replica found after training started: a replaced one (new address) or a new one."""
        self.metrics.server_restarts.inc()
        if self._departed:
            self.log(f"server restarted: boot id {self._departed.pop(0)} -> {boot_id} ({replica.url}, a new "
                     "address)")
        else:
            self.log(f"server replica {replica.url} joined (boot {boot_id})")

    def check(self, replica: Replica) -> bool:
        """Ask a replica not checked on its current boot for its health: same base model? which adapter?"""
        if replica.checked:
            return True
        try:
            health = replica.client.health()
        except httpx.HTTPError as exc:
            replica.trouble = f"unreachable: {type(exc).__name__}: {exc}"
            return False
        if self.fingerprint is not None and health.model_fingerprint != self.fingerprint:
            replica.trouble = (f"serves model {health.model!r} with fingerprint {health.model_fingerprint}, "
                               f"not the trainer's base model ({self.fingerprint})")
            return False
        if replica.boot_id is None and self._started:
            self._joined(replica, health.boot_id)
        self.note_boot(replica, health.boot_id)
        replica.version = self.loader.served(health)
        replica.checked = True
        return True

    def catch_up(self, replica: Replica) -> bool:
        """Make the replica serve the target policy; True when it may get work."""
        target = self.target
        if not self.check(replica):
            return False
        if target is None:
            if replica.version is None:
                replica.trouble = ""
                return True
            replica.trouble = (f"already serves {self.loader.kind} v{replica.version} before the trainer "
                               "published one")
            return False
        if replica.version == target.version:
            replica.trouble = ""
            return True
        error = self.load(replica, target)
        if error is None:
            self.log(f"server replica {replica.url} caught up to {self.loader.kind} v{target.version}")
            return True
        replica.trouble = f"could not load {self.loader.kind} v{target.version}: {error}"
        return False

    def _catch_up_job(self, replica: Replica) -> bool:
        """`catch_up` in the background; after a failure the next try waits (backoff)."""
        if self.catch_up(replica):
            replica.backoff, replica.retry_at = 0.0, 0.0
            return True
        replica.backoff = min(max(2 * replica.backoff, BACKOFF_START_SECONDS), BACKOFF_CAP_SECONDS)
        replica.retry_at = time.monotonic() + replica.backoff
        return False

    def start_job(self, replica: Replica, work: Callable[..., Any], *args: Any
                  ) -> concurrent.futures.Future[Any] | None:
        """Run `work(*args)` as the replica's background job; None when it has one running already."""
        with self.lock:
            if replica.job is not None and not replica.job.done():
                return None
            job = self.threads.submit(work, *args)
            replica.job = job
        job.add_done_callback(lambda done: self._job_done(replica, done))
        return job

    def _job_done(self, replica: Replica, job: concurrent.futures.Future[Any]) -> None:
        error = None if job.cancelled() else job.exception()
        if error is not None:
            replica.trouble = f"{type(error).__name__}: {error}"
        if self.serves(replica):
            self.serving(replica)
        elif replica.lagging_since is not None and replica.trouble:
            replica.lag_reason = replica.trouble

    # ------------------------------------------------------------------------------------ lagging

    def serves(self, replica: Replica) -> bool:
        """It may get work: checked on its boot, every request answered, serving the target (or the version
        a sync is making active, which it confirmed)."""
        versions = {self.target.version if self.target is not None else None}
        if self.activating is not None:
            versions.add(self.activating)
        return replica.checked and replica.unanswered == 0 and replica.version in versions

    def _wanted(self) -> str:
        return f"{self.loader.kind} v{self.target.version}" if self.target is not None else "the base weights"

    def lag(self, replica: Replica, why: str) -> None:
        """The replica does not serve the target: it gets no work; metric, log and progress say since when."""
        if self.serves(replica):
            return
        with self.lock:
            replica.lag_reason = why
            if replica.lagging_since is not None:
                return
            replica.lagging_since = dt.datetime.now(dt.UTC)
        self.metrics.server_replica_lagging_since.labels(replica.url).set(replica.lagging_since.timestamp())
        self.log(f"server replica {replica.url} lags ({why}): it gets no work until it serves {self._wanted()}, "
                 "and is caught up in the background")

    def serving(self, replica: Replica) -> None:
        with self.lock:
            since = replica.lagging_since
            if since is None:
                return
            replica.lagging_since, replica.lag_reason = None, ""
        with contextlib.suppress(KeyError):  # gone already: the replica left discovery
            self.metrics.server_replica_lagging_since.remove(replica.url)
        lagged = (dt.datetime.now(dt.UTC) - since).total_seconds()
        self.log(f"server replica {replica.url} serves {self._wanted()} again (lagged {lagged:.0f}s)")

    def lagging(self) -> list[LaggingReplica]:
        """The replicas that get no work now (they do not serve the target), with since when and why."""
        with self.lock:
            replicas = [self.replicas[u] for u in sorted(self.replicas)]
        return [LaggingReplica(url=r.url, since=r.lagging_since, reason=r.lag_reason[:500])
                for r in replicas if r.lagging_since is not None]

    def _behind(self, replica: Replica) -> str:
        if replica.unanswered:
            return f"{replica.unanswered} generation request(s) not answered"
        if not replica.checked:
            return "not checked on its current boot yet"
        served = f"{self.loader.kind} v{replica.version}" if replica.version is not None else "the base weights"
        return f"serves {served}, not {self._wanted()}"

    def server_info(self) -> dict[str, Any]:
        """vLLM-style `/server_info` of a replica that serves (the replicas of a run share one configuration)."""
        replicas = sorted(self.refresh(), key=lambda r: not self.serves(r))
        if not replicas:
            raise ServerUnavailable(f"no replica of {self.base_url} found")
        for replica in replicas[:-1]:
            try:
                return replica.client.server_info()
            except httpx.HTTPError as exc:
                self.log(f"server replica {replica.url}: /server_info failed ({type(exc).__name__}: {exc})")
        return replicas[-1].client.server_info()

    def ready(self) -> list[Replica]:
        """The replicas that serve the target policy now. One that does not lags: it is caught up in the
        background, never on a batch's time (a hung replica would take all of it), and gets work once it serves
        the target."""
        ready = []
        for replica in self.refresh():
            if self.serves(replica):
                self.serving(replica)
                ready.append(replica)
                continue
            if replica.unanswered == 0 and time.monotonic() >= replica.retry_at:
                self.start_job(replica, self._catch_up_job, replica)
            self.lag(replica, replica.trouble or self._behind(replica))
        return ready
