"""The server's replicas, used as one server: found, kept in step with the policy, fed in parallel.

- **Found, not listed by hand.** On a cluster the replicas are the A records of the run's headless
  Service (only Ready pods are listed), looked up again whenever the pool needs a replica; `grpo run`
  hands the addresses of the processes it started. A replica that appears later is checked (same
  base model) before it gets any work.
- **Every replica serves the policy.** A policy version (an adapter loaded from the shared volume, or,
  with full fine-tuning, whole weights pushed by vLLM's weight transfer: the pool's `loader`) is made
  active on every replica the pool can reach, each load confirmed by the replica's `/health/` on the
  same boot. A replica that missed a
  version (unreachable, restarted, newly found) gets no work until it has caught up: before its next
  batch the current version is loaded on it. A restarted replica is one whose answers carry a new
  boot id; its batch is thrown away and generated again.
- **A batch is spread, prompts stay whole.** The unique prompts of a batch are split into one
  contiguous group per ready replica; all completions of a prompt come from one replica (they share
  its prefix cache). A group whose replica fails is sent to another; a group that lags far behind
  the others is also sent to a replica that is done, and the first good answer wins. The whole batch
  has the generation timeout, not each attempt.

With one replica this is the single server of before: same requests, same seed, same retries.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from grpo_api.protocol import HealthResponse, SetAdapterRequest
from grpo_trainer.client import AdapterRefused, Completions, ServerClient, backoff_delays
from grpo_trainer.errors import AdapterSyncFailed, ServerUnavailable, TrainingFailed
from grpo_trainer.metrics import TrainerMetrics
from grpo_trainer.publish import PublishedAdapter

#: Refusals worth retrying: the server was busy loading another adapter.
RETRYABLE_REFUSALS = frozenset({"adapter_load_busy"})
#: Once one replica has a new version, how long the others may take before they are left behind (they
#: catch up before their next batch).
LAGGARD_SECONDS = 20.0
#: A sync slower than this is logged with each replica's time (and the errors it was retried after).
SLOW_SYNC_SECONDS = 2.0
#: A group still running this long after the slowest finished group (and at least HEDGE_FLOOR_SECONDS)
#: is also sent to a replica that is done.
HEDGE_FACTOR = 2.0
HEDGE_FLOOR_SECONDS = 5.0

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


class _Restarted(Exception):
    pass


class Unconfirmed(Exception):
    """The server did not (yet) report the version just loaded."""


class _Unreachable(Unconfirmed):
    """No connection: once another replica has the version, this one is not waited for."""


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
    ) -> None:
        self.discover = discover
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
        self._started = False
        self._log = log
        self._lock = threading.Lock()
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max(4, 2 * self.expected), thread_name_prefix="grpo-replica"
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
                        on_retry=self.metrics.generation_retries.inc,
                    ))
            for url in [u for u in self.replicas if u not in urls]:
                gone = self.replicas.pop(url)
                self._log(f"server replica {url} left discovery (boot {gone.boot_id})")
                if gone.boot_id is not None:
                    self._departed.append(gone.boot_id)
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
            for replica in replicas:
                try:
                    answers.append((replica.url, replica.client.health()))
                except httpx.HTTPStatusError as exc:
                    last_error = f"{replica.url}: HTTP {exc.response.status_code}: {exc.response.text[:200]}"
                except httpx.HTTPError as exc:
                    last_error = f"{replica.url}: {type(exc).__name__}: {exc}"
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

    # -------------------------------------------------------------------------------------- adapters

    def activate(self, adapter: PolicyTarget, retry_seconds: float) -> int:
        """Make the version active on every replica; the rounds of load triggers (or pushes) it took.

        Retries (backoff) until every replica confirmed it, or until LAGGARD_SECONDS after the first did
        (the rest catch up before their next batch; one that cannot be connected to is not waited for once
        another confirmed), or the retry time is spent with none confirmed: AdapterSyncFailed. A refusal
        that is not "busy" fails at once: the adapter itself is bad.
        """
        started = time.monotonic()
        pending = self.refresh()
        delays = backoff_delays(retry_seconds)
        errors: dict[str, str] = {}
        retried_after: dict[str, str] = {}  # the errors of replicas that confirmed later, for the log
        took: dict[str, float] = {}
        confirmed: list[Replica] = []
        first_confirmed: float | None = None
        rounds = 0
        for attempt in range(len(delays) + 1):
            if attempt:
                time.sleep(delays[attempt - 1])
                pending = [r for r in self.refresh() if r not in confirmed]
            rounds += 1
            if not pending and not confirmed:
                # None found (a replaced pod is not Ready yet, so not in DNS): look again after the delay.
                errors[self.base_url] = "no replica found"
                continue
            errors.pop(self.base_url, None)
            outcomes = list(self._threads.map(lambda r: self._load(r, adapter) if self._check(r)
                                              else _Unreachable(r.trouble), pending))
            unreachable = set()
            for replica, error in zip(pending, outcomes, strict=True):
                if error is None:
                    confirmed.append(replica)
                    took[replica.url] = time.monotonic() - started
                    if replica.url in errors:
                        retried_after[replica.url] = errors.pop(replica.url)
                    continue
                errors[replica.url] = str(error)
                if isinstance(error, _Unreachable):
                    unreachable.add(replica.url)
                if isinstance(error, AdapterRefused) and error.error not in RETRYABLE_REFUSALS:
                    raise AdapterSyncFailed(self._sync_failure(adapter, {replica.url: str(error)}))
            left_behind = [r for r in pending if confirmed and r.url in unreachable]
            pending = [r for r in pending if r not in confirmed and r not in left_behind]
            if confirmed and first_confirmed is None:
                first_confirmed = time.monotonic()
            if not pending or (first_confirmed is not None and time.monotonic() - first_confirmed >= LAGGARD_SECONDS):
                break
        if not confirmed:
            raise AdapterSyncFailed(self._sync_failure(adapter, errors))
        self.target = adapter
        if rounds > 1 or time.monotonic() - started > SLOW_SYNC_SECONDS:
            each = ", ".join(f"{url} {seconds:.1f}s" for url, seconds in took.items())
            why = "; ".join(f"{url}: {e[:200]}" for url, e in retried_after.items())
            self._log(f"{self.loader.kind} v{adapter.version}: confirmed by {len(confirmed)} replica(s) in "
                      f"{time.monotonic() - started:.1f}s, {rounds} round(s) ({each})"
                      + (f"; retried after {why}" if why else ""))
        behind = [r for r in self.replicas.values() if r not in confirmed and r.url in errors]
        for replica in behind:
            replica.trouble = (f"missed {self.loader.kind} v{adapter.version}: "
                               f"{errors.get(replica.url, 'unconfirmed')}")
            self._log(f"server replica {replica.url} {replica.trouble}; it catches up before its next batch")
        return rounds

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

    def server_info(self) -> dict[str, Any]:
        """vLLM-style `/server_info` of the first replica (the replicas of a run share one configuration)."""
        replicas = self.refresh()
        if not replicas:
            raise ServerUnavailable(f"no replica of {self.base_url} found")
        return replicas[0].client.server_info()

    # ------------------------------------------------------------------------------------ generation

    def ready(self) -> list[Replica]:
        """The replicas that serve the target policy now (catching up those that fell behind)."""
        replicas = self.refresh()
        want = self.target.version if self.target is not None else None
        behind = [r for r in replicas if not (r.checked and r.version == want)]
        ok = dict(zip(behind, self._threads.map(self.catch_up, behind), strict=True)) if behind else {}
        return [r for r in replicas if ok.get(r, True)]

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
                troubles = "; ".join(f"{r.url}: {r.trouble}" for r in self.replicas.values()) or "none found"
                raise ServerUnavailable(
                    f"no replica of {self.base_url} could generate within {self.generation_timeout:g}s "
                    f"(trainer.generationTimeoutSeconds): {troubles}"
                )
            time.sleep(min(delay, max(deadline - time.monotonic(), 0.05)))
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
        idle: list[Replica] = []
        finish_times: list[float] = []

        def send(group: int, replica: Replica) -> None:
            remaining = max(deadline - time.monotonic(), 0.1)
            part = [prompts[i] for i in groups[group]]
            future = self._threads.submit(self._checked, replica, replica.boot_id, model, part, n,
                                          group_seed(sampling, group), remaining)
            busy[future] = (group, replica, time.monotonic())

        for group, replica in enumerate(ready):
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
        return [done[g] for g in range(len(groups))]

    def _reissue(self, group: int, failed: Replica, ready: list[Replica], idle: list[Replica],
                 send: Callable[[int, Replica], None], deadline: float) -> None:
        """Send a failed group to another replica: an idle one, else another good one, else whichever is
        ready (found again, health checked, caught up) first, the failed one included once it recovers."""
        candidates = [r for r in idle if r is not failed] or [
            r for r in ready if r is not failed and r.checked and not r.trouble and r in self.replicas.values()
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
        if not idle or not finish_times:
            return
        limit = max(HEDGE_FLOOR_SECONDS, HEDGE_FACTOR * max(finish_times))
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
