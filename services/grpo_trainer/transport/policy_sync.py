"""Policy sync: publish a version, make the server serve it, confirm it.

`PolicySync` holds what every kind shares: one sync at a time, in the background, in order, its
failure raised at the next point that depends on it. `AdapterSync` (LoRA) publishes an adapter
version to the shared volume, makes the server load it and prunes one sync late;
`weight_sync.WeightSync` (full fine-tuning) pushes the whole policy with vLLM's weight transfer.

A version counts as synced only when the load trigger answered with it AND
`/health/` reports it active on the same boot, on every replica the pool reaches
(see activation.py: once one confirmed, the others have LAGGARD_SECONDS; one that
lags gets no work and catches up in the background). A trigger that fails is
retried with backoff; when the retries are spent with no replica confirming, the
run fails with the reason: the trainer never keeps training against a server that
serves a stale policy.

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
from typing import Any, Generic, Protocol, TypeVar

from grpo_api.adapters import read_manifest
from grpo_api.protocol import LaggingReplica
from grpo_trainer.metrics import TrainerMetrics
from grpo_trainer.transport.adapter_files import ADAPTER_WEIGHTS, snapshot_peft_adapter
from grpo_trainer.transport.adapter_store import AdapterStore, PublishedAdapter
from grpo_trainer.transport.replicas import ServerPool
from grpo_trainer.transport.server_client import Completions


class Versioned(Protocol):
    @property
    def version(self) -> int: ...


class SyncOutcome(Protocol):
    """What a sync reports: the version made active, how long it took, the rounds of triggers it used."""

    @property
    def version(self) -> int: ...

    @property
    def seconds(self) -> float: ...

    @property
    def attempts(self) -> int: ...


@dataclass(frozen=True)
class SyncResult:
    adapter: PublishedAdapter
    seconds: float
    attempts: int
    #: Seconds from the version's publication until every replica confirmed it loaded.
    load_seconds: float = 0.0

    @property
    def version(self) -> int:
        return self.adapter.version


Payload = TypeVar("Payload")
Result = TypeVar("Result", bound=SyncOutcome)


class PolicySync(Generic[Payload, Result]):
    """One sync at a time, in order, in the background or not; `active` is the version the server serves.

    A subclass says what a payload is (`take`: the policy's state as of now, independent of the
    still-training model), how a version is published and made active (`_sync`), and how versions map to
    steps and to the answers of the server.
    """

    #: What messages call the versions ("adapter", "weights").
    kind = "policy"

    def __init__(self, metrics: TrainerMetrics) -> None:
        self.metrics = metrics
        self.active: Versioned | None = None
        #: The server's replicas (None: no server to sync, e.g. colocate).
        self.pool: ServerPool | None = None
        # Starts its one thread at the first background sync.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grpo-sync")
        self._pending: concurrent.futures.Future[Result] | None = None

    # ------------------------------------------------------------------------------- what subclasses say

    def take(self, model: Any, dtype: str) -> Payload:
        """The policy's state now, in the serving dtype, safe to publish while the model trains on."""
        raise NotImplementedError

    def _sync(self, payload: Payload, step: int) -> Result:
        raise NotImplementedError

    def step_of(self, version: int) -> int | None:
        """The optimizer step a version was taken at (None: not known here)."""
        raise NotImplementedError

    def version_of(self, result: Completions) -> int | None:
        """The version that generated an answer (None: the weights the server started with)."""
        raise NotImplementedError

    def describe(self, result: Result, step: int, reason: str, note: str) -> str:
        """The log line of a finished sync (`note`: how it ran, blocking or in the background)."""
        raise NotImplementedError

    def publish_final(self, model: Any, dtype: str, step: int) -> str | None:
        """At the end of training, publish what the sync did not (a log line), or None."""
        return None

    # ---------------------------------------------------------------------------------------- shared

    def sync(self, payload: Payload, step: int) -> Result:
        """Publish `payload` as a new version and make it active on the server."""
        self.wait()
        return self._sync(payload, step)

    def start(self, payload: Payload, step: int, done: Callable[[Result], None] = lambda result: None) -> None:
        """Run `sync(payload, step)` in the background, then `done(result)` there.

        Waits for the previous background sync first (raising its failure), so versions activate in order.
        """
        self.wait()
        self._pending = self._pool.submit(self._sync_then, payload, step, done)

    def wait(self) -> Result | None:
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

    def lagging_replicas(self) -> list[LaggingReplica]:
        """The server replicas that lag now: they get no work until they serve the active version."""
        return self.pool.lagging() if self.pool is not None else []

    def close(self) -> None:
        """Let a background sync finish (its files complete or removed); never raises its failure."""
        self._pool.shutdown(wait=True)

    def _sync_then(self, payload: Payload, step: int, done: Callable[[Result], None]) -> Result:
        result = self._sync(payload, step)
        done(result)
        return result


#: What AdapterSync publishes: a function writing the adapter's files into a directory (a snapshot's `write`).
SaveAdapter = Callable[[Path], Mapping[str, str] | None]


class AdapterSync(PolicySync[SaveAdapter, SyncResult]):
    """LoRA: owns the active adapter, the version the server's replicas serve (the pool tracks each one).

    A payload (`save`) must not read the model, which trains on: pass a snapshot's `write`.
    """

    kind = "adapter"

    def __init__(
        self,
        store: AdapterStore,
        pool: ServerPool | None,
        metrics: TrainerMetrics,
        *,
        retry_seconds: float,
    ) -> None:
        super().__init__(metrics)
        self.store = store
        self.pool = pool
        self.retry_seconds = retry_seconds
        self.active: PublishedAdapter | None = None

    def take(self, model: Any, dtype: str) -> SaveAdapter:
        return snapshot_peft_adapter(model, dtype=dtype).write

    def step_of(self, version: int) -> int | None:
        return self.store.step_of(version)

    def version_of(self, result: Completions) -> int | None:
        return result.adapter_version

    def describe(self, result: SyncResult, step: int, reason: str, note: str) -> str:
        adapter = result.adapter
        weights = read_manifest(adapter.path).files.get(ADAPTER_WEIGHTS, "?")
        written = {name: seconds for name, seconds in adapter.phases.items() if name != "fsync"}
        phases = ", ".join(f"{name} {seconds * 1000:.0f} ms" for name, seconds in written.items())
        fsync = adapter.phases.get("fsync", 0.0)
        phases += f", fsync {fsync * 1000:.0f} ms beside load {result.load_seconds * 1000:.0f} ms"
        return (f"published adapter v{adapter.version} (step {step}, {reason}): {adapter.size_bytes} bytes, "
                f"{result.seconds:.2f}s {note} ({phases}), weights {weights}")

    def _sync(self, save: SaveAdapter, step: int) -> SyncResult:
        started = time.monotonic()
        adapter = self.store.publish(save, step, flush=False)
        published = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as flusher:  # the fsync beside the server's load
            flushed = flusher.submit(self.store.flush, adapter)
            attempts = self.activate(adapter) if self.pool is not None else 0
            loaded = time.monotonic()
            flushed.result()  # the version counts as published only once it is on the volume for good
        seconds = time.monotonic() - started
        self.active = adapter
        # Requests admitted just before this sync may still use v(N-1): keep it, drop everything older.
        self.store.prune(adapter.version - 1)
        self.metrics.sync_seconds.observe(seconds)
        self.metrics.sync_last_bytes.set(adapter.size_bytes)
        self.metrics.sync_bytes_total.inc(adapter.size_bytes)
        self.metrics.syncs.inc()
        self.metrics.adapter_version.set(adapter.version)
        return SyncResult(adapter=adapter, seconds=seconds, attempts=attempts, load_seconds=loaded - published)

    def activate(self, adapter: PublishedAdapter) -> int:
        """Load the version on the server's replicas until confirmed; returns the rounds of triggers used."""
        assert self.pool is not None
        return self.pool.activate(adapter, self.retry_seconds)
