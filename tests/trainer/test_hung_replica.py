"""A replica that stops answering: frozen (SIGSTOP) or a socket that accepts and never answers.

Real server processes (transformers engine, tiny model) on CPU. The hung replica may cost a sync at most
LAGGARD_SECONDS, its work goes to the healthy replica, it gets no work until it serves the current version
again, and the metric and the progress record name it with the time it fell behind.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from grpo_api.fingerprint import model_fingerprint
from grpo_api.lifecycle import HealthCheck, Observation, TrainerState, decide
from grpo_api.models import GRPORunSpec, GRPORunStatus, Phase
from grpo_api.protocol import HealthResponse, LaggingReplica, TrainingProgress
from grpo_api.runconfig import ServerEndpoints, load_run_config
from grpo_trainer.metrics import TrainerMetrics
from grpo_trainer.runner import run_training
from grpo_trainer.transport.activation import LAGGARD_SECONDS
from grpo_trainer.transport.adapter_store import AdapterStore
from grpo_trainer.transport.policy_sync import AdapterSync
from grpo_trainer.transport.replica_set import ReplicaSet, static_discovery
from grpo_trainer.transport.replicas import ServerPool
from grpo_trainer.transport.server_client import Completions
from tests.fixtures.server import RunningServer, free_port, start_server
from tests.fixtures.server_requests import completion_requests
from tests.fixtures.trainer_runs import read_progress, token_fraction, trainer_config
from tests.fixtures.waiting import wait_for
from tests.server.adapters import LoraMaker

#: What the generation timeout is in these tests: before the fix a hung replica cost each sync this much.
GENERATION_TIMEOUT = 60.0
#: Slack on a loaded CI machine (two CPU cores shared by two servers and the test).
SLACK_SECONDS = 10.0
LAGGING_METRIC = "grpo_trainer_server_replica_lagging_since_seconds"


class SilentServer:
    """Listens on a port, accepts every connection and never answers (a wedged process, a partitioned pod)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.accepted.append(self.sock.accept()[0])

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


def freeze(server: RunningServer) -> Callable[[], None]:
    """SIGSTOP the server's process group; returns how to thaw it."""
    os.killpg(server.proc.pid, signal.SIGSTOP)
    return lambda: os.killpg(server.proc.pid, signal.SIGCONT)


@pytest.fixture
def two_servers(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[RunningServer, RunningServer]]:
    """Two replicas on one volume (both read the adapters published there)."""
    work = tmp_path / "server"
    a = start_server(work, tiny_model_dir)
    b = start_server(work, tiny_model_dir, port=free_port())
    try:
        yield a, b
    finally:
        for server in (a, b):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.proc.pid, signal.SIGCONT)  # a stopped process would not take SIGTERM
            server.stop(timeout=10)


@pytest.fixture(autouse=True)
def _no_metrics_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPO_TRAINER_METRICS_PORT", "0")  # tests run beside other trainers


def lagging_since(metrics: TrainerMetrics, url: str) -> float | None:
    return metrics.registry.get_sample_value(LAGGING_METRIC, {"replica": url})


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sigstop", "silent_socket"])
def test_a_hung_replica_costs_one_sync_the_laggard_bound_and_its_work_goes_to_the_other(
    fault: str, two_servers: tuple[RunningServer, RunningServer], tiny_model_dir: Path,
):
    a, b = two_servers
    fingerprint = model_fingerprint(tiny_model_dir)
    metrics = TrainerMetrics()
    logs: list[str] = []
    pool = ServerPool(ReplicaSet(static_discovery([a.url, b.url]), expected=2, describe="two replicas", token=a.token,
                                 generation_timeout=GENERATION_TIMEOUT, metrics=metrics, log=logs.append))
    sync = AdapterSync(AdapterStore(a.adapter_root, fingerprint), pool, metrics, retry_seconds=GENERATION_TIMEOUT)
    maker = LoraMaker(tiny_model_dir)
    model = a.health()["model"]
    silent: list[SilentServer] = []
    thaw: list[Callable[[], None]] = []

    def publish(step: int) -> float:
        def save(directory: Path) -> None:
            maker.save(directory, seed=step)

        started = time.monotonic()
        sync.sync(save, step)
        return time.monotonic() - started

    def generate() -> tuple[Completions, float]:
        started = time.monotonic()
        answer = pool.completions(model=model, prompts=[[5, 6, 7], [8, 9, 10]], n=2,
                                  sampling={"max_tokens": 4, "temperature": 1.0, "seed": 0})
        return answer, time.monotonic() - started

    try:
        pool.wait_ready(60)
        pool.fingerprint = fingerprint
        publish(1)
        assert a.health()["adapter"]["version"] == b.health()["adapter"]["version"] == 1
        before = completion_requests(b)
        generate()
        assert completion_requests(b) > before, "both replicas generate while both answer"
        assert lagging_since(metrics, b.url) is None

        if fault == "sigstop":
            thaw.append(freeze(b))
        else:
            b.kill()
            silent.append(SilentServer(b.port))
        hung_at = time.time()

        took = publish(2)
        assert took <= LAGGARD_SECONDS + SLACK_SECONDS, f"the sync of v2 took {took:.0f}s"
        assert a.health()["adapter"]["version"] == 2
        answer, took = generate()
        assert answer.adapter_version == 2 and took <= SLACK_SECONDS, (answer.adapter_version, took)
        since = lagging_since(metrics, b.url)
        assert since is not None and hung_at - 1 <= since <= time.time(), since
        assert [(r.url, r.since.timestamp()) for r in pool.lagging()] == [(b.url, since)]
        # Known to lag: the next sync does not wait for it at all.
        took = publish(3)
        assert took <= SLACK_SECONDS, f"the sync of v3 took {took:.0f}s with the hung replica known to lag"
        answer, took = generate()
        assert answer.adapter_version == 3 and took <= SLACK_SECONDS, (answer.adapter_version, took)
        assert lagging_since(metrics, b.url) == since  # since when: the first sync it missed
        assert any(re.search(rf"server replica {re.escape(b.url)} .*lags", line) for line in logs), logs

        if fault == "sigstop":
            # Thawed, it answers what was queued (a load of v2, refused or superseded), catches up in the
            # background and gets work again, serving v3: never an older version.
            thaw.pop()()
            deadline = time.monotonic() + GENERATION_TIMEOUT + 2 * SLACK_SECONDS
            while lagging_since(metrics, b.url) is not None:
                assert time.monotonic() < deadline, "the thawed replica never caught up:\n" + "\n".join(logs)
                answer, _ = generate()
                assert answer.adapter_version == 3
                time.sleep(0.5)
            assert b.health()["adapter"]["version"] == 3
            before = completion_requests(b)
            answer, _ = generate()
            assert answer.adapter_version == 3 and completion_requests(b) > before
            assert pool.lagging() == []
    finally:
        for resume in thaw:
            resume()
        for server in silent:
            server.close()
        sync.close()
        pool.close()


@pytest.mark.slow
def test_a_run_with_a_frozen_replica_finishes_on_the_other_and_reports_the_laggard_in_its_progress(
    two_servers: tuple[RunningServer, RunningServer], tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
):
    """Frozen at step 2 and thawed at step 6 of 10: every step trains, no sync waits past the laggard bound,
    the progress file names the frozen replica meanwhile, and at the end both replicas serve the last adapter."""
    a, b = two_servers
    volume = Path(load_run_config(a.run_config_path).paths.volume_root)
    assert volume.is_dir()
    cfg, _ = trainer_config(
        a, tmp_path / "run", dataset=tiny_dataset, rewards=[token_fraction(tiny_model_dir)],
        trainer={"maxSteps": 10, "syncInterval": 1, "checkpointInterval": 10,
                 "generationTimeoutSeconds": GENERATION_TIMEOUT},
    )
    cfg = cfg.model_copy(update={"server_endpoints": ServerEndpoints(replicas=2, urls=[a.url, b.url])})
    progress_file = Path(cfg.paths.progress_file)
    seen: list[Any] = []
    errors: list[BaseException] = []
    thaw: list[Callable[[], None]] = []

    def chaos() -> None:
        try:
            wait_for(lambda: progress_file.is_file() and read_progress(cfg).step >= 2, 300, interval=0.1,
                     what="step 2")
            thaw.append(freeze(b))
            frozen_at = time.time()
            wait_for(lambda: read_progress(cfg).step >= 6, 300, interval=0.1, what="step 6")
            seen.append((frozen_at, read_progress(cfg)))
            thaw.pop()()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=chaos, daemon=True)
    thread.start()
    try:
        progress = run_training(cfg, attempt=1)
    finally:
        thread.join(60)
        for resume in thaw:
            resume()
    assert not errors, errors
    out = capsys.readouterr().out
    print("\n" + "\n".join(line for line in out.splitlines()
                           if re.match(r"(server|re-issued|generation group|discarded|adapter v|published)", line)))
    assert (progress.step, progress.done) == (10, True)
    syncs = [float(s) for s in re.findall(r"^published adapter v\d+ .*?: \d+ bytes, ([\d.]+)s", out, re.M)]
    assert len(syncs) == 10 and max(syncs) <= LAGGARD_SECONDS + SLACK_SECONDS, syncs
    assert sum(s > SLACK_SECONDS for s in syncs) <= 1, f"only the first sync after the freeze waits: {syncs}"
    assert "discarded a generated batch (stale_adapter" not in out
    frozen_at, during = seen[0]
    assert [r.url for r in during.lagging_replicas] == [b.url], during
    assert frozen_at - 1 <= during.lagging_replicas[0].since.timestamp() <= time.time()
    assert progress.lagging_replicas == [] or [r.url for r in progress.lagging_replicas] == [b.url]
    wait_for(lambda: b.health()["adapter"]["version"] >= progress.adapter_version - 1, 60, interval=0.1,
             what="the thawed replica to catch up")


def test_the_lagging_replicas_of_the_progress_file_reach_the_run_status():
    """The operator and `grpo run` copy the trainer's progress into status.progress: the lagging replicas too."""
    t0 = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
    spec = GRPORunSpec.model_validate({"model": {"name": "tiny"}, "dataset": {"path": "/data/prompts.jsonl"},
                                       "rewards": [{"function": "token_fraction"}]})
    training = GRPORunStatus(phase=Phase.TRAINING, attempt=1, attempt_started_at=t0, start_time=t0)
    training.sources.ready, training.server.boot_id, training.server.ready = True, "boot-1", True
    health = HealthCheck(reachable=True, status_code=200, body=HealthResponse(
        status="ok", boot_id="boot-1", model="tiny", model_fingerprint="f", engine="transformers",
        uptime_seconds=1.0))
    since = t0 + dt.timedelta(seconds=12)
    lagging = LaggingReplica(url="http://10.0.0.7:8000", since=since, reason="missed adapter v3: ReadTimeout")
    progress = TrainingProgress(step=5, max_steps=9, lagging_replicas=[lagging], updated_at=t0)

    def observe(seconds: float, progress: TrainingProgress) -> Observation:
        return Observation(now=t0 + dt.timedelta(seconds=seconds), health=health, trainer=TrainerState.ACTIVE,
                           progress=progress)

    decision = decide(spec, training, observe(30, progress))
    assert decision.status.to_wire()["progress"]["laggingReplicas"] == [
        {"url": "http://10.0.0.7:8000", "since": "2026-01-01T12:00:12Z", "reason": "missed adapter v3: ReadTimeout"}]
    caught_up = progress.model_copy(update={"lagging_replicas": [], "step": 6})
    assert decide(spec, decision.status, observe(40, caught_up)).status.progress.lagging_replicas == []
