"""vLLM's runtime-LoRA and RL routes over HTTP: `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`,
`/pause`, `/resume`, `/is_paused`, with the token as Bearer or as the password of Basic auth."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from grpo_api.protocol import ADAPTER_VERSION_HEADER
from tests.fixtures.server import RunningServer, start_server
from tests.fixtures.server_requests import complete
from tests.fixtures.waiting import consistently
from tests.server.adapters import LoraMaker


@pytest.fixture(scope="module")
def server(served_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("rl-routes"), served_model_dir,
                           server_overrides={"maxLoraRank": 8, "maxLoras": 4})
    yield running
    running.stop(timeout=10)


@pytest.fixture(scope="module")
def maker(served_model_dir: Path) -> LoraMaker:
    return LoraMaker(served_model_dir)


def basic(login: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{login}:{password}".encode()).decode()}


def load(server: RunningServer, name: str, path: Path | str, auth: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      headers=server.auth if auth is None else auth, timeout=120)


def unload(server: RunningServer, name: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=server.auth,
                      timeout=60)


def model_ids(server: RunningServer) -> list[str]:
    return [card["id"] for card in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]]


def long_generation(server: RunningServer, answers: list[httpx.Response]) -> threading.Thread:
    """A generation of a few seconds in a thread, returned once the server counts it in flight."""
    body = {"prompt": [[5, 6, 7]], "max_tokens": 500, "ignore_eos": True, "temperature": 1.0}
    thread = threading.Thread(target=lambda: answers.append(
        httpx.post(server.url + "/v1/completions", json=body, timeout=120)))
    thread.start()
    deadline = time.monotonic() + 30
    while "grpo_server_requests_in_flight 1.0" not in httpx.get(server.url + "/metrics", timeout=30).text:
        assert time.monotonic() < deadline, "the generation never started"
        time.sleep(0.05)
    return thread


def test_the_routes_need_the_token_as_bearer_or_as_the_basic_password(server, maker):
    path = maker.save(server.adapter_root / "trl" / "auth-v1", seed=1)
    for headers in ({}, basic("grpo", "wrong"), basic("test-token", ""), {"Authorization": "Basic !!!"},
                    {"Authorization": "Bearer wrong"}):
        assert load(server, "auth-v1", path, headers).status_code == 401
        assert httpx.post(server.url + "/pause", headers=headers, timeout=30).status_code == 401
        assert httpx.post(server.url + "/resume", headers=headers, timeout=30).status_code == 401
    assert httpx.get(server.url + "/is_paused", timeout=30).json() == {"is_paused": False}  # read-only: open
    loaded = load(server, "auth-v1", path, basic("any-login", server.token))  # what requests sends from a netrc
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["adapter"]["version"] == 1


def test_a_versioned_name_loads_that_version_serves_by_that_name_and_unloads(server, maker):
    first = maker.save(server.adapter_root / "trl" / "trl-policy-v2", seed=2)
    second = maker.save(server.adapter_root / "trl" / "trl-policy-v3", seed=3)
    assert load(server, "trl-policy-v2", first).status_code == 200
    answer = load(server, "trl-policy-v3", second)
    assert answer.status_code == 200, answer.text
    assert answer.json()["adapter"]["version"] == 3
    assert {"trl-policy-v2", "trl-policy-v3"} <= set(model_ids(server))
    on_two, on_three = complete(server, model="trl-policy-v2"), complete(server, model="trl-policy-v3")
    assert on_two.headers[ADAPTER_VERSION_HEADER] == "2" and on_three.headers[ADAPTER_VERSION_HEADER] == "3"
    assert on_two.json()["choices"][0]["token_ids"] != on_three.json()["choices"][0]["token_ids"]
    assert complete(server).headers[ADAPTER_VERSION_HEADER] == "3"  # the newest load is active

    stale = load(server, "trl-policy-v2", first)
    assert stale.status_code == 409 and stale.json()["error"] == "adapter_version_stale", stale.text
    active = unload(server, "trl-policy-v3")
    assert active.status_code == 409 and active.json()["error"] == "adapter_active"
    gone = unload(server, "trl-policy-v2")
    assert gone.status_code == 200 and gone.json()["version"] == 2, gone.text
    assert "trl-policy-v2" not in model_ids(server)
    missing = complete(server, model="trl-policy-v2")
    assert missing.status_code == 404 and "not loaded" in missing.json()["message"]
    assert unload(server, "trl-policy-v2").status_code == 404


def test_the_same_checks_as_set_lora_adapter_apply(server, maker, tmp_path):
    outside = maker.save(tmp_path / "outside-v9", seed=9)
    refused = load(server, "outside-v9", outside)
    assert refused.status_code == 403 and refused.json()["error"] == "adapter_outside_root", refused.text
    bad_rank = maker.save(server.adapter_root / "trl" / "wide-v9", seed=9, r=16)
    wide = load(server, "wide-v9", bad_rank)
    assert wide.status_code == 422 and wide.json()["error"] == "adapter_rank_too_large", wide.text
    assert "wide-v9" not in model_ids(server)


def test_pause_holds_new_generations_until_resume_and_wait_returns_once_running_ones_end(server):
    paused = httpx.post(server.url + "/pause", params={"mode": "keep"}, headers=server.auth, timeout=30)
    assert paused.status_code == 200 and paused.json()["status"] == "paused"
    assert httpx.get(server.url + "/is_paused", timeout=30).json() == {"is_paused": True}
    assert "grpo_server_paused 1.0" in httpx.get(server.url + "/metrics", timeout=30).text
    answers: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: answers.append(complete(server)))
    waiting.start()
    consistently(lambda: not answers, 1.5, what="no generation while paused")
    assert httpx.post(server.url + "/resume", headers=server.auth, timeout=30).json()["status"] == "resumed"
    waiting.join(60)
    assert answers and answers[0].status_code == 200

    long_one: list[httpx.Response] = []
    running = long_generation(server, long_one)
    waited = httpx.post(server.url + "/pause", params={"mode": "wait"}, headers=server.auth, timeout=120)
    assert waited.status_code == 200 and waited.json()["requests"] == 1, waited.text
    running.join(5)
    assert long_one and long_one[0].status_code == 200  # it finished before /pause answered
    httpx.post(server.url + "/resume", headers=server.auth, timeout=30)


def test_pause_abort_stops_running_generations_with_a_503_naming_the_pause(server):
    aborted: list[httpx.Response] = []
    running = long_generation(server, aborted)
    started = time.monotonic()
    answer = httpx.post(server.url + "/pause", params={"mode": "abort"}, headers=server.auth, timeout=60)
    assert answer.status_code == 200 and answer.json()["requests"] == 1, answer.text
    running.join(30)
    assert aborted[0].status_code == 503 and aborted[0].json()["error"] == "generation_aborted", aborted[0].text
    assert time.monotonic() - started < 10
    assert httpx.post(server.url + "/pause", params={"mode": "later"}, headers=server.auth,
                      timeout=30).status_code in (400, 422)
    httpx.post(server.url + "/resume", headers=server.auth, timeout=30)
    assert complete(server).status_code == 200
