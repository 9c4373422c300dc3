"""The server's replicas, used as one server: found, kept in step with the policy, fed in parallel.

- **Found, not listed by hand.** On a cluster the replicas are the A records of the run's headless
  Service (only Ready pods are listed), looked up again whenever the pool needs a replica; `grpo run`
  hands the addresses of the processes it started. A replica that appears later is checked (same
  base model) before it gets any work.
- **Every replica serves the policy.** A policy version (an adapter loaded from the shared volume, or,
  with full fine-tuning, whole weights pushed by vLLM's weight transfer: the pool's `loader`) is made
  active on every replica the pool can reach, each load confirmed by the replica's `/health/` on the
  same boot. Each replica's load runs on its own thread: once one replica confirmed, the others get
  LAGGARD_SECONDS, and a replica that lags already is not waited for at all.
- **A replica that lags gets no work.** One that missed a version (hung, unreachable, restarted, newly
  found) or has not answered a generation request it was sent lags: it gets no work until it serves the
  current version again, and is caught up in the background (one load at a time per replica, with
  backoff), never on a batch's time. `grpo_trainer_server_replica_lagging_since_seconds` and the progress
  file (`lagging_replicas`) name it and say since when. A restarted replica is one whose answers carry a
  new boot id; its batch is thrown away and generated again.
- **A batch is spread, prompts stay whole.** The unique prompts of a batch are split into one
  contiguous group per ready replica; all completions of a prompt come from one replica (they share
  its prefix cache). A group whose replica fails is sent to another; a group that lags far behind
  the others is also sent to a replica that is done, and the first good answer wins. The whole batch
  has the generation timeout, not each attempt; the batch fails only when no replica can serve it.

With one replica this is the single server of before: same requests, same seed, same retries.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime as dt
import functools
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from grpo_api.protocol import HealthResponse, LaggingReplica, SetAdapterRequest
from grpo_trainer.client import (
    BACKOFF_CAP_SECONDS,
    BACKOFF_START_SECONDS,
    AdapterRefused,
    Completions,
    ServerClient,
    backoff_delays,
)
from grpo_trainer.errors import AdapterSyncFailed, ServerUnavailable, TrainingFailed
from grpo_trainer.metrics import TrainerMetrics
from grpo_trainer.publish import PublishedAdapter

#: Refusals worth retrying: the server was busy loading another adapter.
RETRYABLE_REFUSALS = frozenset({"adapter_load_busy"})
#: Once one replica has a new version, how long the others may take before they are left behind (they lag:
#: no work until they caught up, in the background). A replica that lags already is not waited for.
LAGGARD_SECONDS = 20.0
#: A sync slower than this is logged with each replica's time (and the errors it was retried after).
SLOW_SYNC_SECONDS = 2.0
#: A group still running this long after the slowest finished group (and at least HEDGE_FLOOR_SECONDS)
#: is also sent to a replica that is done.
HEDGE_FACTOR = 2.0
HEDGE_FLOOR_SECONDS = 5.0
#: With no group finished yet to compare with (fewer groups than replicas), a group still running this long is
#: also sent to a replica that got none.
HEDGE_UNFINISHED_SECONDS = 20.0

Discover = Callable[[], list[str]]


class PolicyTarget(Protocol):
    """A policy version the replicas should serve."""

    @property
    def version(self) -> int: ...

    @property
    def label(self) -> str:
        """How messages name it, e.g. `adapter v3 (/adapters/v3)`."""
        ...


class PolicyLoader(Protocol):
    """How a policy version is made active on one replica, and read back from its `/health/`."""

    #: What messages call the policy's versions ("adapter", "weights").
    kind: str

    def served(self, health: HealthResponse) -> int | None:
        """The policy version a replica's `/health/` reports (None: the weights it started with)."""
        ...

    def load(self, client: ServerClient, target: Any) -> str:
        """Make `target` active on the replica and confirm it by `/health/` on the same boot; the boot id.

        Raises AdapterRefused (the server refused it), Unconfirmed, or httpx errors."""
        ...


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


def split_groups(count: int, parts: int) -> list[range]:
    """count prompts in `parts` contiguous groups whose sizes differ by at most one (no empty group)."""
    parts = max(1, min(parts, count))
    size, extra = divmod(count, parts)
    groups, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        groups.append(range(start, end))
        start = end
    return groups


def group_seed(sampling: dict[str, Any], group: int) -> dict[str, Any]:
    """Group 0 keeps the request's seed (one replica samples as one server did); the others get their own."""
    if group == 0 or sampling.get("seed") is None:
        return sampling
    return {**sampling, "seed": (int(sampling["seed"]) + 7919 * group) % (2**31)}


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


class _Restarted(Exception):
    pass


class Unconfirmed(Exception):
    """The server did not (yet) report the version just loaded."""


class _Unreachable(Unconfirmed):
    """No connection: once another replica has the version, this one is not waited for."""


@dataclass(eq=False)
class _Load:
    """One replica's load of one version during a sync; its thread fills it in as it goes."""

    replica: Replica
    #: The replica lagged already when the sync began: not waited for once another confirmed.
    lagged: bool
    future: concurrent.futures.Future[Exception | None] | None = None
    tries: int = 0
    #: The errors it was retried after, in order; the last one is why it is not confirmed (yet).
    errors: list[Exception] = field(default_factory=list)
    #: Seconds from the sync's start to its confirmation.
    took: float | None = None


class ServerPool:
    """The trainer's view of the run's server replicas."""

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
        self._activating: int | None = None
        self._started = False
        self._log = log
        self._lock = threading.Lock()
        # Threads are started as needed. A hung replica holds at most its one background load and the
        # requests it has not answered (it gets no more work), so the healthy ones always find a thread.
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max(16, 4 * self.expected), thread_name_prefix="grpo-replica"
        )

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        for replica in self.replicas.values():
            replica.client.close()

    # ------------------------------------------------------------------------------------- discovery

    def refresh(self) -> list[Replica]:
        """The replicas discovery lists now (new ones added, vanished ones dropped), in address order."""
        urls = self.discover()
        with self._lock:
            for url in urls:
                if url not in self.replicas:
                    self.replicas[url] = Replica(url, ServerClient(
                        url, token=self.token, generation_timeout=self.generation_timeout,
                        on_retry=self.metrics.generation_retries.inc, attempt=self.attempt,
                    ))
            for url in [u for u in self.replicas if u not in urls]:
                gone = self.replicas.pop(url)
                self._log(f"server replica {url} left discovery (boot {gone.boot_id})")
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
            for replica, health in zip(replicas, self._threads.map(self._probe, replicas), strict=True):
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

    # -------------------------------------------------------------------------------------- adapters

    def activate(self, adapter: PolicyTarget, retry_seconds: float) -> int:
        """Make the version active on every replica; the most load triggers (or pushes) one replica took.

        Each replica's load runs on its own thread, retried with backoff until confirmed or `retry_seconds`
        are spent. The sync is done once every replica confirmed, or LAGGARD_SECONDS after the first did; a
        replica that lagged already, is still busy with an earlier load, or cannot be connected to is not
        waited for once another confirmed. The rest lag: their loads go on in the background and they get
        no work until they serve this version. None confirmed when the retry time is spent:
        AdapterSyncFailed. A refusal that is not "busy" fails at once: the adapter itself is bad.
        """
        started = time.monotonic()
        self._activating = adapter.version
        try:
            loads, busy = self._load_everywhere(adapter, started, started + retry_seconds)
            confirmed = [load for load in loads if load.took is not None]
            if not confirmed:
                errors = {load.replica.url: str(load.errors[-1]) if load.errors else "no answer" for load in loads}
                errors.update({replica.url: "still busy with an earlier load" for replica in busy})
                raise AdapterSyncFailed(self._sync_failure(adapter, errors or {self.base_url: "no replica found"}))
            self.target = adapter
        finally:
            self._activating = None
        seconds = time.monotonic() - started
        tries = max(load.tries for load in loads)
        if tries > 1 or seconds > SLOW_SYNC_SECONDS:
            each = ", ".join(f"{load.replica.url} {load.took:.1f}s" for load in confirmed if load.took is not None)
            why = "; ".join(f"{load.replica.url}: {str(load.errors[-1])[:200]}" for load in confirmed if load.errors)
            self._log(f"{self.loader.kind} v{adapter.version}: confirmed by {len(confirmed)} replica(s) in "
                      f"{seconds:.1f}s, {tries} round(s) ({each})" + (f"; retried after {why}" if why else ""))
        for load in loads:
            if load.took is None:
                why = str(load.errors[-1]) if load.errors else f"no answer within {LAGGARD_SECONDS:g}s"
                self._lag(load.replica, f"missed {self.loader.kind} v{adapter.version}: {why}")
        for replica in busy:
            self._lag(replica, f"missed {self.loader.kind} v{adapter.version}: still busy with an earlier load")
        return tries

    def _load_everywhere(self, adapter: PolicyTarget, started: float, until: float
                         ) -> tuple[list[_Load], list[Replica]]:
        """Start the version's load on every replica found and wait as `activate` says; the loads, and the
        replicas still busy with an earlier one."""
        loads: dict[Replica, _Load] = {}
        busy: dict[Replica, concurrent.futures.Future[Any] | None] = {}
        searching = iter(backoff_delays(until - started))  # while no replica is found (a pod not Ready yet)
        while True:
            for replica in self.refresh():
                if replica in loads:
                    continue
                load = _Load(replica, lagged=replica.lagging_since is not None)
                load.future = self._start_job(replica, self._load_until, load, adapter, started, until)
                if load.future is None:
                    busy[replica] = replica.job
                else:
                    loads[replica] = load
                    busy.pop(replica, None)
            for load in loads.values():
                assert load.future is not None
                # A load's own failure (e.g. a server that takes no weights) is raised here.
                error = load.future.result() if load.future.done() else None
                if isinstance(error, AdapterRefused) and error.error not in RETRYABLE_REFUSALS:
                    raise AdapterSyncFailed(self._sync_failure(adapter, {load.replica.url: str(error)}))
            running = [load for load in loads.values() if load.future is not None and not load.future.done()]
            confirmed = [started + load.took for load in loads.values() if load.took is not None]
            now = time.monotonic()
            waited: list[concurrent.futures.Future[Any]]
            if confirmed:
                left = min(confirmed) + LAGGARD_SECONDS - now
                waited = [load.future for load in running if load.future is not None and not load.lagged
                          and not (load.errors and isinstance(load.errors[-1], _Unreachable))]
                if left <= 0 or not waited:
                    return list(loads.values()), list(busy)
                timeout = min(left, 1.0)
            else:
                waited = [load.future for load in running if load.future is not None]
                waited += [job for job in busy.values() if job is not None and not job.done()]
                if not waited and (loads or now >= until):
                    return list(loads.values()), list(busy)  # every load gave up
                if not waited:
                    delay = next(searching, None)
                    if delay is None:
                        return [], list(busy)
                    time.sleep(delay)
                    continue
                timeout = 1.0  # then look for replicas found since
            concurrent.futures.wait(waited, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def _load_until(self, load: _Load, adapter: PolicyTarget, started: float, until: float) -> Exception | None:
        """One replica's load of the version, retried with backoff until confirmed, refused for good, the time
        is up or a newer version is on its way; the last error, or None when confirmed."""
        replica = load.replica
        delays = iter(backoff_delays(max(until - time.monotonic(), 0.0)))
        while True:
            load.tries += 1
            error = self._load(replica, adapter) if self._check(replica) else _Unreachable(replica.trouble)
            if error is None:
                load.took = time.monotonic() - started
                return None
            load.errors.append(error)
            if isinstance(error, AdapterRefused) and error.error not in RETRYABLE_REFUSALS:
                return error
            delay = next(delays, None)
            if delay is None or time.monotonic() + delay > until or self._superseded(adapter):
                return error
            time.sleep(delay)

    def _superseded(self, adapter: PolicyTarget) -> bool:
        newest = max((v for v in (self._activating, self.target.version if self.target else None)
                      if v is not None), default=None)
        return newest is not None and newest > adapter.version

    def _sync_failure(self, adapter: PolicyTarget, errors: dict[str, str]) -> str:
        detail = "; ".join(f"{url}: {e}" for url, e in errors.items()) if len(self.replicas) > 1 \
            else next(iter(errors.values()), "no replica found")
        return (
            f"{adapter.label} could not be made active on {self.base_url}: {detail}. "
            "Training stops rather than continue against a server with a stale policy."
        )

    def _load(self, replica: Replica, adapter: PolicyTarget) -> Exception | None:
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
                return _Unreachable(f"{type(exc).__name__}: {exc}")
            except (httpx.HTTPError, Unconfirmed) as exc:
                reason = "unconfirmed" if isinstance(exc, Unconfirmed) else "unreachable"
                self.metrics.sync_failures.labels(reason).inc()
                return Unconfirmed(f"{type(exc).__name__}: {exc}")
            self._note_boot(replica, boot_id)
            replica.version, replica.checked, replica.trouble = adapter.version, True, ""
            return None

    def _note_boot(self, replica: Replica, boot_id: str) -> bool:
        """Record a replica's boot id; True if it changed (the server behind the address restarted)."""
        changed = replica.boot_id is not None and boot_id != replica.boot_id
        if changed:
            self.metrics.server_restarts.inc()
            self._log(f"server restarted: boot id {replica.boot_id} -> {boot_id} ({replica.url})")
            replica.version, replica.checked = None, False
        replica.boot_id = boot_id
        return changed

    def _joined(self, replica: Replica, boot_id: str) -> None:
        """A replica found after training started: a replaced one (new address) or a new one."""
        self.metrics.server_restarts.inc()
        if self._departed:
            self._log(f"server restarted: boot id {self._departed.pop(0)} -> {boot_id} ({replica.url}, a new "
                      "address)")
        else:
            self._log(f"server replica {replica.url} joined (boot {boot_id})")

    def _check(self, replica: Replica) -> bool:
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
        self._note_boot(replica, health.boot_id)
        replica.version = self.loader.served(health)
        replica.checked = True
        return True

    def catch_up(self, replica: Replica) -> bool:
        """Make the replica serve the target policy; True when it may get work."""
        target = self.target
        if not self._check(replica):
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
        error = self._load(replica, target)
        if error is None:
            self._log(f"server replica {replica.url} caught up to {self.loader.kind} v{target.version}")
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

    def _start_job(self, replica: Replica, work: Callable[..., Any], *args: Any
                   ) -> concurrent.futures.Future[Any] | None:
        """Run `work(*args)` as the replica's background job; None when it has one running already."""
        with self._lock:
            if replica.job is not None and not replica.job.done():
                return None
            job = self._threads.submit(work, *args)
            replica.job = job
        job.add_done_callback(lambda done: self._job_done(replica, done))
        return job

    def _job_done(self, replica: Replica, job: concurrent.futures.Future[Any]) -> None:
        error = None if job.cancelled() else job.exception()
        if error is not None:
            replica.trouble = f"{type(error).__name__}: {error}"
        if self._serves(replica):
            self._serving(replica)
        elif replica.lagging_since is not None and replica.trouble:
            replica.lag_reason = replica.trouble

    # ------------------------------------------------------------------------------------ lagging

    def _serves(self, replica: Replica) -> bool:
        """It may get work: checked on its boot, every request answered, serving the target (or the version
        a sync is making active, which it confirmed)."""
        versions = {self.target.version if self.target is not None else None}
        if self._activating is not None:
            versions.add(self._activating)
        return replica.checked and replica.unanswered == 0 and replica.version in versions

    def _wanted(self) -> str:
        return f"{self.loader.kind} v{self.target.version}" if self.target is not None else "the base weights"

    def _lag(self, replica: Replica, why: str) -> None:
        """The replica does not serve the target: it gets no work; metric, log and progress say since when."""
        if self._serves(replica):
            return
        with self._lock:
            replica.lag_reason = why
            if replica.lagging_since is not None:
                return
            replica.lagging_since = dt.datetime.now(dt.UTC)
        self.metrics.server_replica_lagging_since.labels(replica.url).set(replica.lagging_since.timestamp())
        self._log(f"server replica {replica.url} lags ({why}): it gets no work until it serves {self._wanted()}, "
                  "and is caught up in the background")

    def _serving(self, replica: Replica) -> None:
        with self._lock:
            since = replica.lagging_since
            if since is None:
                return
            replica.lagging_since, replica.lag_reason = None, ""
        with contextlib.suppress(KeyError):  # gone already: the replica left discovery
            self.metrics.server_replica_lagging_since.remove(replica.url)
        lagged = (dt.datetime.now(dt.UTC) - since).total_seconds()
        self._log(f"server replica {replica.url} serves {self._wanted()} again (lagged {lagged:.0f}s)")

    def lagging(self) -> list[LaggingReplica]:
        """The replicas that get no work now (they do not serve the target), with since when and why."""
        with self._lock:
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
        replicas = sorted(self.refresh(), key=lambda r: not self._serves(r))
        if not replicas:
            raise ServerUnavailable(f"no replica of {self.base_url} found")
        for replica in replicas[:-1]:
            try:
                return replica.client.server_info()
            except httpx.HTTPError as exc:
                self._log(f"server replica {replica.url}: /server_info failed ({type(exc).__name__}: {exc})")
        return replicas[-1].client.server_info()

    # ------------------------------------------------------------------------------------ generation

    def ready(self) -> list[Replica]:
        """The replicas that serve the target policy now. One that does not lags: it is caught up in the
        background, never on a batch's time (a hung replica would take all of it), and gets work once it serves
        the target."""
        ready = []
        for replica in self.refresh():
            if self._serves(replica):
                self._serving(replica)
                ready.append(replica)
                continue
            if replica.unanswered == 0 and time.monotonic() >= replica.retry_at:
                self._start_job(replica, self._catch_up_job, replica)
            self._lag(replica, replica.trouble or self._behind(replica))
        return ready

    def completions(
        self, *, model: str, prompts: Sequence[Sequence[int]], n: int, sampling: dict[str, Any]
    ) -> Completions:
        """n completions per prompt from the target policy, spread over the ready replicas."""
        started = time.monotonic()
        deadline = started + self.generation_timeout
        ready = self._wait_for_ready(deadline)
        groups = split_groups(len(prompts), len(ready))
        return self._merge(self._spread(ready, groups, deadline, model, prompts, n, sampling), started)

    def _wait_for_ready(self, deadline: float) -> list[Replica]:
        delay = 0.5
        while True:
            ready = self.ready()
            self.metrics.server_replicas_ready.set(len(ready))
            if ready:
                return ready
            if time.monotonic() >= deadline:
                troubles = "; ".join(f"{r.url}: {r.trouble or r.lag_reason}" for r in self.replicas.values())
                raise ServerUnavailable(
                    f"no replica of {self.base_url} could generate within {self.generation_timeout:g}s "
                    f"(trainer.generationTimeoutSeconds): {troubles or 'none found'}"
                )
            wait = min(delay, max(deadline - time.monotonic(), 0.05))
            jobs = [r.job for r in self.replicas.values() if r.job is not None and not r.job.done()]
            if jobs:  # a catch-up that finishes wakes us at once
                concurrent.futures.wait(jobs, timeout=wait, return_when=concurrent.futures.FIRST_COMPLETED)
            else:
                time.sleep(wait)
            delay = min(delay * 2, 5.0)

    @staticmethod
    def _merge(answers: list[Completions], started: float) -> Completions:
        """The groups' answers in prompt order; the batch counts as generated by its oldest policy."""
        def oldest(versions: list[int | None]) -> int | None:
            return None if None in versions else min(v for v in versions if v is not None)

        return Completions(
            completion_ids=[ids for a in answers for ids in a.completion_ids],
            logprobs=[lp for a in answers for lp in a.logprobs],
            boot_id="",
            adapter_version=oldest([a.adapter_version for a in answers]),
            seconds=time.monotonic() - started,
            weights_version=oldest([a.weights_version or None for a in answers]),
        )

    def _checked(
        self, replica: Replica, boot: str | None, model: str, prompts: Sequence[Sequence[int]], n: int,
        sampling: dict[str, Any], timeout: float,
    ) -> Completions:
        """One try of one group on one replica; raises _Restarted when the answer came from a new boot."""
        answer = replica.client.completions(model=model, prompts=prompts, n=n, sampling=sampling, retry=False,
                                            timeout=timeout)
        if boot is not None and answer.boot_id and answer.boot_id != boot:
            self.metrics.discarded_batches.labels("server_restarted").inc()
            self._log(f"discarded a generated batch (server_restarted: boot {answer.boot_id}, adapter "
                      f"v{answer.adapter_version}, from {replica.url})")
            self._note_boot(replica, answer.boot_id)
            raise _Restarted(f"{replica.url} restarted (boot {boot} -> {answer.boot_id})")
        return answer

    def _spread(
        self, ready: list[Replica], groups: list[range], deadline: float, model: str,
        prompts: Sequence[Sequence[int]], n: int, sampling: dict[str, Any],
    ) -> list[Completions]:
        done: dict[int, Completions] = {}
        busy: dict[concurrent.futures.Future[Completions], tuple[int, Replica, float]] = {}
        failed: dict[int, str] = {}

        def send(group: int, replica: Replica) -> None:
            remaining = max(deadline - time.monotonic(), 0.1)
            part = [prompts[i] for i in groups[group]]
            future = self._threads.submit(self._checked, replica, replica.boot_id, model, part, n,
                                          group_seed(sampling, group), remaining)
            busy[future] = (group, replica, time.monotonic())

        try:
            self._gather(ready, groups, deadline, done, busy, failed, send)
        finally:
            self._abandon(busy)
        return [done[g] for g in range(len(groups))]

    def _gather(
        self, ready: list[Replica], groups: list[range], deadline: float, done: dict[int, Completions],
        busy: dict[concurrent.futures.Future[Completions], tuple[int, Replica, float]], failed: dict[int, str],
        send: Callable[[int, Replica], None],
    ) -> None:
        idle: list[Replica] = list(ready[len(groups):])  # more replicas than prompts: the rest got no group
        finish_times: list[float] = []
        for group, replica in zip(range(len(groups)), ready, strict=False):
            send(group, replica)
        while len(done) < len(groups):
            now = time.monotonic()
            if now >= deadline:
                missing = [g for g in range(len(groups)) if g not in done]
                raise ServerUnavailable(
                    f"generation on {self.base_url} did not finish within {self.generation_timeout:g}s "
                    f"(trainer.generationTimeoutSeconds): groups {missing} unanswered; "
                    + "; ".join(failed.values())
                )
            wait = min(deadline - now, 1.0)
            finished, _ = concurrent.futures.wait(list(busy), timeout=wait,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                group, replica, sent = busy.pop(future)
                try:
                    answer = future.result()
                except (TrainingFailed, _Restarted, httpx.HTTPError) as exc:
                    if isinstance(exc, TrainingFailed) and not isinstance(exc, ServerUnavailable):
                        raise  # the request itself was refused (4xx): no replica would take it
                    failed[group] = f"group {group} on {replica.url}: {exc}"
                    self.metrics.generation_retries.inc()
                    replica.trouble = str(exc)
                    replica.checked = False  # its health is asked again before it gets more work
                    if group not in done and not any(g == group for g, _, _ in busy.values()):
                        self._reissue(group, replica, ready, idle, send, deadline)
                    continue
                finish_times.append(time.monotonic() - sent)
                if not replica.trouble:
                    idle.append(replica)
                if group not in done:
                    done[group] = answer
            self._hedge(busy, done, idle, finish_times, send)

    def _abandon(self, busy: dict[concurrent.futures.Future[Completions], tuple[int, Replica, float]]) -> None:
        """Requests still running when their batch is done (lost to a hedge) or failed: their replica gets no
        work until it answered, so a hung replica does not take each batch's hedge delay again."""
        for future, (group, replica, sent) in busy.items():
            if future.done():
                continue  # answered just now: nothing to wait for
            with self._lock:
                replica.unanswered += 1
            self._lag(replica, f"generation group {group} not answered in {time.monotonic() - sent:.0f}s")
            future.add_done_callback(functools.partial(self._answered, replica))

    def _answered(self, replica: Replica, future: concurrent.futures.Future[Completions]) -> None:
        with self._lock:
            replica.unanswered -= 1
        error = None if future.cancelled() else future.exception()
        if error is not None:
            replica.trouble = f"{type(error).__name__}: {error}"
            replica.checked = False  # its health is asked again before it gets more work
        elif self._serves(replica):
            self._serving(replica)

    def _reissue(self, group: int, failed: Replica, ready: list[Replica], idle: list[Replica],
                 send: Callable[[int, Replica], None], deadline: float) -> None:
        """Send a failed group to another replica: an idle one, else another good one, else whichever is
        ready (found again, health checked, caught up) first, the failed one included once it recovers."""
        candidates = [r for r in idle if r is not failed] or [
            r for r in ready if r is not failed and self._serves(r) and not r.trouble and r in self.replicas.values()
        ]
        if not candidates:
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
            candidates = self._wait_for_ready(deadline)
        target = candidates[0]
        if target in idle:
            idle.remove(target)
        self._log(f"re-issued generation group {group} from {failed.url} to {target.url}")
        send(group, target)

    def _hedge(self, busy: dict[concurrent.futures.Future[Completions], tuple[int, Replica, float]],
               done: dict[int, Completions], idle: list[Replica], finish_times: list[float],
               send: Callable[[int, Replica], None]) -> None:
        """A group lagging far behind the finished ones is also sent to an idle replica."""
        if not idle:
            return
        limit = max(HEDGE_FLOOR_SECONDS, HEDGE_FACTOR * max(finish_times)) if finish_times \
            else HEDGE_UNFINISHED_SECONDS
        hedged = {g for g, _, _ in busy.values() if sum(1 for h, _, _ in busy.values() if h == g) > 1}
        for group, replica, sent in list(busy.values()):
            if group in done or group in hedged or time.monotonic() - sent < limit or not idle:
                continue
            helper = idle.pop(0)
            self._log(f"generation group {group} on {replica.url} is slow ({time.monotonic() - sent:.0f}s); "
                      f"also sent to {helper.url}")
            hedged.add(group)
            send(group, helper)


class AdapterLoader:
    """LoRA: the replica loads the published version from the shared volume (`/set_lora_adapter/`)."""

    kind = "adapter"

    def served(self, health: HealthResponse) -> int | None:
        return health.adapter.version if health.adapter else None

    def load(self, client: ServerClient, target: PublishedAdapter) -> str:
        request = SetAdapterRequest(path=str(target.path), version=target.version, sha256=target.sha256)
        response = client.set_adapter(request)
        if response.adapter.version != target.version:
            raise Unconfirmed(f"load trigger answered version {response.adapter.version}")
        confirm(client, response.boot_id, target.version, self)
        return response.boot_id


def confirm(client: ServerClient, boot_id: str, version: int, loader: PolicyLoader) -> None:
    """The replica's `/health/`, on the boot that answered the load, reports `version`."""
    health = client.health()
    if health.boot_id != boot_id:
        raise Unconfirmed(f"server restarted during the load (boot {health.boot_id})")
    shown = loader.served(health)
    if shown != version:
        raise Unconfirmed(f"/health/ reports {loader.kind} version {shown}")
