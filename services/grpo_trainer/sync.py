"""LoRA sync: publish a version, make the server load it, confirm it, prune one sync late.

A version counts as synced only when the load trigger answered with it AND
`/health/` reports it active on the same boot. A trigger that fails is retried
with backoff; when the retries are spent the run fails with the reason: the
trainer never keeps training against a server that serves a stale policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from grpo_api.protocol import SetAdapterRequest
from grpo_trainer.client import AdapterRefused, ServerClient, backoff_delays
from grpo_trainer.errors import AdapterSyncFailed
from grpo_trainer.metrics import TrainerMetrics
from grpo_trainer.publish import AdapterStore, PublishedAdapter

#: Refusals worth retrying: the server was busy loading another adapter.
RETRYABLE_REFUSALS = frozenset({"adapter_load_busy"})


@dataclass(frozen=True)
class SyncResult:
    adapter: PublishedAdapter
    seconds: float
    attempts: int


class AdapterSync:
    """Owns what the trainer believes about the server: its boot id and the active adapter."""

    def __init__(
        self,
        store: AdapterStore,
        client: ServerClient | None,
        metrics: TrainerMetrics,
        *,
        boot_id: str | None,
        retry_seconds: float,
        log: Callable[[str], None] = print,
    ) -> None:
        self.store = store
        self.client = client
        self.metrics = metrics
        self.boot_id = boot_id
        self.retry_seconds = retry_seconds
        self.active: PublishedAdapter | None = None
        self._log = log

    def sync(self, save: Callable[[Path], Mapping[str, str] | None], step: int) -> SyncResult:
        """Publish the adapter saved by `save` as a new version and make it active on the server."""
        started = time.monotonic()
        adapter = self.store.publish(save, step)
        attempts = self.activate(adapter) if self.client is not None else 0
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
        """POST the load trigger until the server confirms the version; returns the attempts used."""
        assert self.client is not None
        request = SetAdapterRequest(path=str(adapter.path), version=adapter.version, sha256=adapter.sha256)
        delays = backoff_delays(self.retry_seconds)
        last_error = ""
        for attempt in range(len(delays) + 1):
            if attempt:
                time.sleep(delays[attempt - 1])
            try:
                response = self.client.set_adapter(request)
                if response.adapter.version != adapter.version:
                    raise _Unconfirmed(f"load trigger answered version {response.adapter.version}")
                health = self.client.health()
                if health.boot_id != response.boot_id:
                    raise _Unconfirmed(f"server restarted during the load (boot {health.boot_id})")
                if health.adapter is None or health.adapter.version != adapter.version:
                    shown = health.adapter.version if health.adapter else None
                    raise _Unconfirmed(f"/health/ reports adapter version {shown}")
            except AdapterRefused as exc:
                self.metrics.sync_failures.labels(exc.error).inc()
                last_error = str(exc)
                if exc.error not in RETRYABLE_REFUSALS:
                    break
                continue
            except (httpx.HTTPError, _Unconfirmed) as exc:
                reason = "unconfirmed" if isinstance(exc, _Unconfirmed) else "unreachable"
                self.metrics.sync_failures.labels(reason).inc()
                last_error = f"{type(exc).__name__}: {exc}"
                continue
            self.note_boot(response.boot_id)
            return attempt + 1
        raise AdapterSyncFailed(
            f"adapter v{adapter.version} ({adapter.path}) could not be made active on {self.client.base_url}: "
            f"{last_error}. Training stops rather than continue against a server with a stale policy."
        )

    def note_boot(self, boot_id: str) -> bool:
        """Record the server's boot id; True if it changed (the server restarted)."""
        changed = self.boot_id is not None and boot_id != self.boot_id
        if changed:
            self.metrics.server_restarts.inc()
            self._log(f"server restarted: boot id {self.boot_id} -> {boot_id}")
        self.boot_id = boot_id
        return changed


class _Unconfirmed(Exception):
    """The server did not (yet) report the version just loaded."""
