"""LoRA sync: publish a version, make the server load it, confirm it, prune one sync late.

A version counts as synced only when the load trigger answered with it AND
`/health/` reports it active on the same boot, on every replica the pool reaches
(see replicas.py: one that lags catches up before its next batch). A trigger that
fails is retried with backoff; when the retries are spent with no replica
confirming, the run fails with the reason: the trainer never keeps training
against a server that serves a stale policy.

`start` runs a sync in the background (one at a time, in order) while the next
step trains; `wait` blocks until it is done and re-raises its failure, every time
it is asked, so a failed sync stops the run at the next point that depends on it.
Generation requests call `wait` before they are sent: no request races a trigger,
and which adapter generates which batch is the same as with a blocking sync.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from grpo_trainer.metrics import TrainerMetrics
from grpo_trainer.publish import AdapterStore, PublishedAdapter
from grpo_trainer.replicas import ServerPool


@dataclass(frozen=True)
class SyncResult:
    adapter: PublishedAdapter
    seconds: float
    attempts: int


class AdapterSync:
    """Owns the active adapter: the version the server's replicas serve (the pool tracks each one)."""

    def __init__(
        self,
        store: AdapterStore,
        pool: ServerPool | None,
        metrics: TrainerMetrics,
        *,
        retry_seconds: float,
    ) -> None:
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self.retry_seconds = retry_seconds
        self.active: PublishedAdapter | None = None
        # Starts its one thread at the first background sync.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grpo-sync")
        self._pending: concurrent.futures.Future[SyncResult] | None = None

    def sync(self, save: Callable[[Path], Mapping[str, str] | None], step: int) -> SyncResult:
        """Publish the adapter saved by `save` as a new version and make it active on the server."""
        self.wait()
        return self._sync(save, step)

    def start(
        self,
        save: Callable[[Path], Mapping[str, str] | None],
        step: int,
        done: Callable[[SyncResult], None] = lambda result: None,
    ) -> None:
        """Run `sync(save, step)` in the background, then `done(result)` there.

        `save` must not read the model (it trains on): pass a snapshot's `write`. Waits for the
        previous background sync first (raising its failure), so versions activate in order.
        """
        self.wait()
        self._pending = self._pool.submit(self._sync_then, save, step, done)

    def wait(self) -> SyncResult | None:
        """Block until the background sync is done; its result, or None if none was started.

        A failed sync raises here every time: the run must not go on past it.
        """
        pending = self._pending
        if pending is None:
            return None
        if pending.done():
            return pending.result()
        started = time.monotonic()
        result = pending.result()
        self.metrics.sync_wait_seconds.observe(time.monotonic() - started)
        return result

    def close(self) -> None:
        """Let a background sync finish (its files complete or removed); never raises its failure."""
        self._pool.shutdown(wait=True)

    def _sync_then(
        self, save: Callable[[Path], Mapping[str, str] | None], step: int, done: Callable[[SyncResult], None]
    ) -> SyncResult:
        result = self._sync(save, step)
        done(result)
        return result

    def _sync(self, save: Callable[[Path], Mapping[str, str] | None], step: int) -> SyncResult:
        started = time.monotonic()
        adapter = self.store.publish(save, step)
        attempts = self.activate(adapter) if self.pool is not None else 0
        seconds = time.monotonic() - started
        self.active = adapter
        # Requests admitted just before this sync may still use v(N-1): keep it, drop everything older.
        self.store.prune(adapter.version - 1)
        self.metrics.sync_seconds.observe(seconds)
        self.metrics.sync_last_bytes.set(adapter.size_bytes)
        self.metrics.sync_bytes_total.inc(adapter.size_bytes)
        self.metrics.syncs.inc()
        self.metrics.adapter_version.set(adapter.version)
        return SyncResult(adapter=adapter, seconds=seconds, attempts=attempts)

    def activate(self, adapter: PublishedAdapter) -> int:
        """Load the version on the server's replicas until confirmed; returns the rounds of triggers used."""
        assert self.pool is not None
        return self.pool.activate(adapter, self.retry_seconds)
