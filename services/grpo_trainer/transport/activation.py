"""A policy version made active on every replica, one round per sync: each replica's load on its own thread,
retried with backoff; the round ends once every replica confirmed, or LAGGARD_SECONDS after the first did, and the
replicas that did not confirm lag (`replica_set.ReplicaSet.lag`) and catch up in the background."""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Any

from grpo_trainer.errors import AdapterSyncFailed
from grpo_trainer.transport.policy_loaders import PolicyTarget, Unreachable
from grpo_trainer.transport.replica_set import Replica, ReplicaSet
from grpo_trainer.transport.server_client import AdapterRefused, backoff_delays

#: Refusals worth retrying: the server was busy loading another adapter.
RETRYABLE_REFUSALS = frozenset({"adapter_load_busy"})
#: Once one replica has a new version, how long the others may take before they are left behind (they lag:
#: no work until they caught up, in the background). A replica that lags already is not waited for.
LAGGARD_SECONDS = 20.0
#: A sync slower than this is logged with each replica's time (and the errors it was retried after).
SLOW_SYNC_SECONDS = 2.0


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


class PolicyActivation:
    """The activation rounds of one replica set."""

    def __init__(self, replica_set: ReplicaSet) -> None:
        self.replica_set = replica_set

    def activate(self, adapter: PolicyTarget, retry_seconds: float) -> int:
        """Make the version active on every replica; the most load triggers (or pushes) one replica took.

        Each replica's load runs on its own thread, retried with backoff until confirmed or `retry_seconds`
        are spent. The sync is done once every replica confirmed, or LAGGARD_SECONDS after the first did; a
        replica that lagged already, is still busy with an earlier load, or cannot be connected to is not
        waited for once another confirmed. The rest lag: their loads go on in the background and they get
        no work until they serve this version. None confirmed when the retry time is spent:
        AdapterSyncFailed. A refusal that is not "busy" fails at once: the adapter itself is bad.
        """
        replicas = self.replica_set
        started = time.monotonic()
        replicas.activating = adapter.version
        try:
            loads, busy = self._load_everywhere(adapter, started, started + retry_seconds)
            confirmed = [load for load in loads if load.took is not None]
            if not confirmed:
                errors = {load.replica.url: str(load.errors[-1]) if load.errors else "no answer" for load in loads}
                errors.update({replica.url: "still busy with an earlier load" for replica in busy})
                errors = errors or {replicas.base_url: "no replica found"}
                raise AdapterSyncFailed(self._sync_failure(adapter, errors))
            replicas.target = adapter
        finally:
            replicas.activating = None
        seconds = time.monotonic() - started
        tries = max(load.tries for load in loads)
        if tries > 1 or seconds > SLOW_SYNC_SECONDS:
            each = ", ".join(f"{load.replica.url} {load.took:.1f}s" for load in confirmed if load.took is not None)
            why = "; ".join(f"{load.replica.url}: {str(load.errors[-1])[:200]}" for load in confirmed if load.errors)
            replicas.log(f"{replicas.loader.kind} v{adapter.version}: confirmed by {len(confirmed)} replica(s) in "
                         f"{seconds:.1f}s, {tries} round(s) ({each})" + (f"; retried after {why}" if why else ""))
        for load in loads:
            if load.took is None:
                why = str(load.errors[-1]) if load.errors else f"no answer within {LAGGARD_SECONDS:g}s"
                replicas.lag(load.replica, f"missed {replicas.loader.kind} v{adapter.version}: {why}")
        for replica in busy:
            replicas.lag(replica, f"missed {replicas.loader.kind} v{adapter.version}: still busy with an earlier "
                                  "load")
        return tries

    def _load_everywhere(self, adapter: PolicyTarget, started: float, until: float
                         ) -> tuple[list[_Load], list[Replica]]:
        """Start the version's load on every replica found and wait as `activate` says; the loads, and the
        replicas still busy with an earlier one."""
        loads: dict[Replica, _Load] = {}
        busy: dict[Replica, concurrent.futures.Future[Any] | None] = {}
        searching = iter(backoff_delays(until - started))  # while no replica is found (a pod not Ready yet)
        while True:
            for replica in self.replica_set.refresh():
                if replica in loads:
                    continue
                load = _Load(replica, lagged=replica.lagging_since is not None)
                load.future = self.replica_set.start_job(replica, self._load_until, load, adapter, started, until)
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
                          and not (load.errors and isinstance(load.errors[-1], Unreachable))]
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
            error = self.replica_set.load(replica, adapter) if self.replica_set.check(replica) \
                else Unreachable(replica.trouble)
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
        replicas = self.replica_set
        newest = max((v for v in (replicas.activating, replicas.target.version if replicas.target else None)
                      if v is not None), default=None)
        return newest is not None and newest > adapter.version

    def _sync_failure(self, adapter: PolicyTarget, errors: dict[str, str]) -> str:
        detail = "; ".join(f"{url}: {e}" for url, e in errors.items()) if len(self.replica_set.replicas) > 1 \
            else next(iter(errors.values()), "no replica found")
        return (
            f"{adapter.label} could not be made active on {self.replica_set.base_url}: {detail}. "
            "Training stops rather than continue against a server with a stale policy."
        )
