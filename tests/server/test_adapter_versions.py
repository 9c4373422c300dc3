"""Adapter versions over HTTP: within one boot they only move forward, and a number names one content."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from grpo_api.protocol import ADAPTER_VERSION_HEADER
from tests.fixtures.server import RunningServer, start_server
from tests.fixtures.server_requests import Versions, active_version, complete, ours, trigger
from tests.server.adapters import LoraMaker

MAX_LORAS = 1  # every new version evicts the one before (once no request holds it)


@pytest.fixture(scope="module")
def server(served_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("version-server"), served_model_dir,
                           server_overrides={"maxLoraRank": 8, "maxLoras": MAX_LORAS})
    yield running
    running.stop(timeout=10)


@pytest.fixture(scope="module")
def maker(served_model_dir: Path) -> LoraMaker:
    return LoraMaker(served_model_dir)


@pytest.fixture(scope="module")
def next_version() -> Versions:
    return Versions()


def publish(server: RunningServer, maker: LoraMaker, version: int, seed: int | None = None) -> dict[str, object]:
    path, digest = maker.publish(server.adapter_root, version, seed=version if seed is None else seed)
    return ours(path, version, digest)


def loaded_names(server: RunningServer) -> list[str]:
    ids = [card["id"] for card in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]]
    return [i for i in ids if i.startswith("policy-v")]


def assert_serving(server: RunningServer, version: int) -> None:
    assert active_version(server) == version
    generated = complete(server)
    assert generated.status_code == 200, generated.text
    assert generated.headers[ADAPTER_VERSION_HEADER] == str(version)


def test_an_older_version_is_refused_with_409_naming_the_active_version(server, maker, next_version):
    older, newer = next_version(), next_version()
    first = publish(server, maker, older)
    assert trigger(server, first).status_code == 200
    assert trigger(server, publish(server, maker, newer)).status_code == 200

    again = trigger(server, first)  # loaded before, same contents: still a step back
    assert again.status_code == 409 and again.json()["error"] == "adapter_version_stale", again.text
    assert f"v{newer} is active" in again.json()["message"]
    never_seen = next_version()
    next_version.last += 1
    published = publish(server, maker, never_seen)
    assert trigger(server, publish(server, maker, never_seen + 1)).status_code == 200
    late = trigger(server, published)
    assert late.status_code == 409 and late.json()["error"] == "adapter_version_stale"
    assert f"v{never_seen + 1} is active" in late.json()["message"]
    assert_serving(server, never_seen + 1)
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'grpo_server_adapter_load_failures_total{reason="adapter_version_stale"} 2.0' in metrics


def test_resending_the_active_version_with_the_same_contents_is_an_idempotent_success(server, maker, next_version):
    version = next_version()
    body = publish(server, maker, version)
    answers = [trigger(server, body) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert {a.json()["adapter"]["name"] for a in answers} == {f"policy-v{version}"}
    assert loaded_names(server) == [f"policy-v{version}"]
    assert_serving(server, version)


def test_a_version_stays_bound_to_its_contents_even_after_it_is_evicted(server, maker, next_version):
    version, newer = next_version(), next_version()
    assert trigger(server, publish(server, maker, version, seed=1)).status_code == 200
    assert trigger(server, publish(server, maker, newer)).status_code == 200
    assert f"policy-v{version}" not in loaded_names(server)  # evicted: maxLoras is 1

    shutil.rmtree(server.adapter_root / f"v{version}")
    impostor = trigger(server, publish(server, maker, version, seed=2))
    assert impostor.status_code == 409 and impostor.json()["error"] == "adapter_version_conflict", impostor.text
    assert "publish a new version" in impostor.json()["message"]
    assert f"policy-v{version}" not in loaded_names(server)
    assert_serving(server, newer)


def test_after_a_clear_the_next_version_must_still_be_higher(server, maker, next_version):
    below, version = next_version(), next_version()  # `below` is never loaded
    assert trigger(server, publish(server, maker, version)).status_code == 200
    cleared = httpx.post(server.url + "/clear_lora_adapter/", headers=server.auth, timeout=30)
    assert cleared.status_code == 200 and active_version(server) is None

    stale = trigger(server, publish(server, maker, below))
    assert stale.status_code == 409 and stale.json()["error"] == "adapter_version_stale"
    assert "no adapter is active" in stale.json()["message"]
    assert active_version(server) is None
    higher = next_version()
    assert trigger(server, publish(server, maker, higher)).status_code == 200
    assert_serving(server, higher)


def fire(server: RunningServer, bodies: list[tuple[float, dict[str, object]]]) -> list[httpx.Response]:
    """POST each trigger from its own thread after its delay (seconds); the answers in the same order."""
    answers: list[httpx.Response | None] = [None] * len(bodies)

    def send(index: int, delay: float, body: dict[str, object]) -> None:
        time.sleep(delay)
        answers[index] = trigger(server, body)

    threads = [threading.Thread(target=send, args=(i, delay, body)) for i, (delay, body) in enumerate(bodies)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert all(answer is not None for answer in answers)
    return [answer for answer in answers if answer is not None]


@pytest.mark.parametrize("order", ["higher first", "lower first", "together"])
def test_concurrent_triggers_end_with_the_highest_version_active(server, maker, next_version, order):
    for _ in range(2):
        lower, higher = next_version(), next_version()
        low, high = publish(server, maker, lower), publish(server, maker, higher)
        # half a second: a thread (and its client) that starts late under a loaded CI machine must still
        # leave the first trigger ahead; 50 ms let the lower one win the lock 2 times in 15 under load
        delays = {"higher first": (0.5, 0.0), "lower first": (0.0, 0.5), "together": (0.0, 0.0)}[order]
        low_answer, high_answer = fire(server, [(delays[0], low), (delays[1], high)])
        assert high_answer.status_code == 200, high_answer.text
        if order == "higher first":  # accepted before the lower one ran, or while it waited for the lock
            assert low_answer.status_code == 409 and low_answer.json()["error"] == "adapter_version_stale"
        else:
            assert low_answer.status_code in (200, 409), low_answer.text
        assert_serving(server, higher)
