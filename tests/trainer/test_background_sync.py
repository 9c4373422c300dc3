"""The background adapter sync: in order, one at a time, failures re-raised, generation held behind it."""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest

from grpo_api.adapters import list_versions
from grpo_trainer.errors import TrainingFailed
from grpo_trainer.generation import GenerationBackend, StalenessBound
from grpo_trainer.metrics import TrainerMetrics
from grpo_trainer.transport.adapter_store import AdapterStore, PublishedAdapter
from grpo_trainer.transport.policy_sync import AdapterSync, SyncResult
from grpo_trainer.transport.replica_set import ReplicaSet, static_discovery
from grpo_trainer.transport.replicas import ServerPool
from grpo_trainer.transport.server_client import Completions

LORA_CONFIG = {"peft_type": "LORA", "r": 8, "bias": "none", "use_dora": False, "modules_to_save": None,
               "target_modules": ["q_proj", "v_proj"]}


def saver(payload: bytes, gate: threading.Event | None = None, entered: threading.Event | None = None):
    def save(directory: Path) -> None:
        if entered is not None:
            entered.set()
        if gate is not None:
            assert gate.wait(10), "the test never opened the gate"
        directory.mkdir(parents=True)
        (directory / "adapter_config.json").write_text(json.dumps(LORA_CONFIG))
        (directory / "adapter_model.safetensors").write_bytes(payload)

    return save


@pytest.fixture
def sync(tmp_path: Path):
    sync = AdapterSync(AdapterStore(tmp_path / "adapters", "fp"), None, TrainerMetrics(), retry_seconds=1)
    yield sync
    sync.close()


def test_background_syncs_activate_in_order_and_report_each_result(sync: AdapterSync):
    done: list[SyncResult] = []
    gate, entered = threading.Event(), threading.Event()
    sync.start(saver(b"one", gate, entered), step=1, done=done.append)
    assert entered.wait(5)
    assert sync.active is None  # still writing: the previous policy is the active one
    gate.set()
    sync.start(saver(b"two"), step=2, done=done.append)  # waits for v1 first
    assert [r.adapter.version for r in done] == [1]
    result = sync.wait()
    assert result is not None and result.adapter.version == 2 and sync.active is not None
    assert [(r.adapter.version, r.adapter.step) for r in done] == [(1, 1), (2, 2)]
    assert sync.active.version == 2
    assert list_versions(sync.store.root) == [1, 2]  # pruned one sync late


def test_a_failed_background_sync_is_raised_by_every_later_wait_start_and_sync(sync: AdapterSync):
    def broken(directory: Path) -> None:
        raise TrainingFailed("disk full while writing the adapter")

    sync.start(broken, step=1)
    for attempt in (sync.wait, lambda: sync.start(saver(b"x"), step=2), lambda: sync.sync(saver(b"x"), step=2)):
        with pytest.raises(TrainingFailed, match="disk full"):
            attempt()
    assert sync.active is None and list_versions(sync.store.root) == []  # nothing half-published


def test_a_generation_request_is_sent_only_after_the_sync_in_flight_is_done(sync: AdapterSync, tmp_path: Path):
    sent: list[int | None] = []

    class Pool(ServerPool):
        def completions(self, **kwargs) -> Completions:  # the server's view: the adapter active when it arrives
            sent.append(sync.active.version if sync.active else None)
            return Completions([[1]], [[-0.1]], boot_id="b1", adapter_version=sent[-1], seconds=0.01)

    pool = Pool(ReplicaSet(static_discovery(["http://127.0.0.1:9"]), expected=1, describe="test", token=None,
                           generation_timeout=1, metrics=sync.metrics))
    gen = GenerationBackend(pool, sync, sync.metrics, model_name="m", num_generations=1,
                            bound=StalenessBound(1, 1),
                            seed=0, current_step=lambda: 1)
    gate, entered = threading.Event(), threading.Event()
    sync.start(saver(b"one", gate, entered), step=1)
    assert entered.wait(5)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        request = pool.submit(gen.generate, [[5, 6]])
        with pytest.raises(concurrent.futures.TimeoutError):
            request.result(timeout=0.3)  # held while v1 is being published
        assert sent == []
        gate.set()
        assert request.result(timeout=5).adapter_version == 1
    assert sent == [1]


class Flushing(AdapterSync):
    """Activation without a server: it waits, as the test says, for the version's flush to have started."""

    def __init__(self, store: AdapterStore, activation: Callable[[PublishedAdapter], None]) -> None:
        super().__init__(store, cast(ServerPool, object()), TrainerMetrics(), retry_seconds=1)
        self.activation = activation

    def activate(self, adapter: PublishedAdapter) -> int:
        self.activation(adapter)
        return 1


def test_the_version_is_flushed_beside_the_server_s_load_and_the_sync_ends_after_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The load is triggered on the renamed version before its fsync ends, and the sync waits for the fsync:
    the flush waits for the load to start and the load for the flush to start, so only side by side they end."""
    flush_started, load_started, flush_done = threading.Event(), threading.Event(), threading.Event()
    store = AdapterStore(tmp_path / "adapters", "fp")
    real_flush = store.flush

    def flush(adapter: PublishedAdapter) -> None:
        flush_started.set()
        assert load_started.wait(5), "the server's load did not start while the version was being flushed"
        real_flush(adapter)
        flush_done.set()

    monkeypatch.setattr(store, "flush", flush)

    def activation(adapter: PublishedAdapter) -> None:
        assert adapter.path.is_dir() and not flush_done.is_set()  # renamed, not yet flushed
        load_started.set()
        assert flush_started.wait(5), "the flush did not start beside the load"

    sync = Flushing(store, activation)
    try:
        result = sync.sync(saver(b"one"), step=1)
    finally:
        sync.close()
    assert flush_done.is_set() and result.attempts == 1 and sync.active is not None
    assert set(result.adapter.phases) == {"save", "manifest", "rename", "fsync"}
    line = sync.describe(result, 1, "sync", "in the background")
    assert re.search(r"\(save \d+ ms, manifest \d+ ms, rename \d+ ms, fsync \d+ ms beside load \d+ ms\), weights ",
                     line), line


def test_a_version_the_volume_cannot_flush_fails_the_sync_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    loaded: list[int] = []
    sync = Flushing(AdapterStore(tmp_path / "adapters", "fp"), lambda adapter: loaded.append(adapter.version))

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    try:
        with pytest.raises(TrainingFailed, match=r"adapter v1 could not be flushed to the volume \(No space left"):
            sync.sync(saver(b"one"), step=1)
    finally:
        sync.close()
    assert sync.active is None  # never counted as the active version, though the server was asked to load it
    assert loaded == [1]
