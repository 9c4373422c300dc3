"""Server process lifecycle: 503 then 200, boot ids, SIGTERM, a model that cannot load, progress relay."""

from __future__ import annotations

import datetime as dt
import shutil
import signal
import threading
import time

import httpx
import pytest

from grpo_api.fingerprint import model_fingerprint
from grpo_api.protocol import TrainingProgress
from tests.fixtures.server import start_server


def test_health_is_503_while_the_engine_loads_then_200(server_factory, tiny_model_dir):
    server = server_factory(tiny_model_dir, wait_healthy=False)
    statuses: list[tuple[int, dict]] = []
    generation_while_loading = None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            response = httpx.get(server.url + "/health/", timeout=5)
        except httpx.HTTPError:
            time.sleep(0.02)
            continue
        statuses.append((response.status_code, response.json()))
        if response.status_code == 503 and generation_while_loading is None:
            generation_while_loading = httpx.post(server.url + "/v1/completions", timeout=30,
                                                  json={"prompt": [[1, 2]], "max_tokens": 1})
        if response.status_code == 200:
            break
        time.sleep(0.02)
    codes = [code for code, _ in statuses]
    assert codes[-1] == 200 and 503 in codes and codes.index(503) < codes.index(200)
    loading = next(body for code, body in statuses if code == 503)
    assert loading["status"] == "loading" and loading["boot_id"] == statuses[-1][1]["boot_id"]
    assert generation_while_loading is not None and generation_while_loading.status_code == 503
    assert generation_while_loading.json()["error"] == "engine_not_ready"


def test_boot_id_changes_across_restarts_and_fingerprint_matches_the_model(server_factory, tiny_model_dir, tmp_path):
    work_dir = tmp_path / "same-run"
    first = server_factory(tiny_model_dir, work_dir=work_dir)
    first_health = first.health()
    assert first.stop() in (0, -signal.SIGTERM)
    second = server_factory(tiny_model_dir, work_dir=work_dir, port=first.port)
    second_health = second.health()
    assert first_health["boot_id"] != second_health["boot_id"]
    expected = model_fingerprint(tiny_model_dir)
    assert first_health["model_fingerprint"] == second_health["model_fingerprint"] == expected


def test_sigterm_lets_in_flight_requests_finish_and_exits_promptly(server_factory, tiny_model_dir):
    server = server_factory(tiny_model_dir)
    results: dict[str, httpx.Response] = {}

    def long_request() -> None:
        results["response"] = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "prompt": [[5, 6, 7]], "n": 8, "max_tokens": 200, "ignore_eos": True})

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 30
    while "grpo_server_requests_in_flight 1.0" not in httpx.get(server.url + "/metrics").text:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    worker.join(timeout=120)
    assert results["response"].status_code == 200
    assert len(results["response"].json()["choices"]) == 8
    server.proc.wait(timeout=60)
    assert time.monotonic() - started < 45
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health/", timeout=5)


def test_a_model_that_cannot_load_never_turns_healthy_and_exits_nonzero(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    server = start_server(tmp_path / "work", broken, wait_healthy=False)
    try:
        assert server.proc.wait(timeout=180) == 1
        assert "engine transformers failed to start" in server.log_tail(20000)
    finally:
        server.stop(timeout=5)


def test_health_relays_progress_and_generation_auth_is_a_setting(server_factory, tiny_model_dir, tmp_path):
    progress_file = tmp_path / "progress" / "run.json"
    server = server_factory(tiny_model_dir, progress_file=progress_file,
                            server_overrides={"authenticateGeneration": True})
    assert server.health()["progress"] is None
    progress_file.parent.mkdir(parents=True)
    progress = TrainingProgress(step=3, max_steps=10, reward_mean=0.25, adapter_version=3,
                                updated_at=dt.datetime.now(dt.UTC))
    progress_file.write_text(progress.model_dump_json())
    relayed = TrainingProgress.model_validate(server.health()["progress"])
    assert relayed == progress
    progress_file.write_text("{half a file")
    assert server.health()["progress"] is None and server.health()["status"] == "ok"

    body = {"prompt": [[1, 2]], "max_tokens": 2}
    for path in ("/v1/completions", "/generate/"):
        payload = body if path != "/generate/" else {"prompts": [[1, 2]], "max_tokens": 2}
        denied = httpx.post(server.url + path, json=payload, timeout=30)
        assert denied.status_code == 401 and denied.json()["error"] == "unauthorized"
        assert httpx.post(server.url + path, json=payload, headers=server.auth, timeout=60).status_code == 200
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 401
    assert httpx.get(server.url + "/health/").status_code == 200  # health stays open


def test_serve_refuses_a_bad_run_config_with_a_clear_error(tmp_path):
    import subprocess
    import sys

    config = tmp_path / "run.yaml"
    config.write_text("apiVersion: grpo.dev/v1alpha1\nkind: GRPORun\nmetadata: {name: x}\nspec:\n"
                      "  model: {name: m, path: does-not-exist}\n  dataset: {path: d.jsonl}\n"
                      "  rewards: [{function: exact_match}]\n")
    done = subprocess.run([sys.executable, "-m", "grpo_cli.main", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "spec.model.path" in done.stderr and "does-not-exist" in done.stderr
