"""spec.server.healthPath: the server answers its health check there too (probes and both executors look
there), and a path another endpoint holds is refused at start with exit code 2, naming the field."""

from __future__ import annotations

from pathlib import Path

import httpx

from grpo_api.exit_codes import EXIT_INVALID_SPEC
from tests.fixtures.server import start_server


def test_a_custom_health_path_answers_the_health_check_beside_the_default(tiny_model_dir: Path, tmp_path: Path):
    server = start_server(tmp_path, tiny_model_dir, server_overrides={"healthPath": "/ready/probe"})
    try:
        custom = httpx.get(f"{server.url}/ready/probe", timeout=10)
        default = httpx.get(f"{server.url}/health/", timeout=10)
        assert custom.status_code == default.status_code == 200, (custom.text, default.text)
        assert custom.json()["boot_id"] == default.json()["boot_id"]
        assert httpx.get(f"{server.url}/ready/elsewhere", timeout=10).status_code == 404
    finally:
        server.stop()


def test_a_health_path_another_endpoint_holds_is_refused_at_start(tiny_model_dir: Path, tmp_path: Path):
    server = start_server(tmp_path, tiny_model_dir, server_overrides={"healthPath": "/metrics"}, wait_healthy=False)
    try:
        code = server.proc.wait(timeout=120)
    finally:
        server.stop()
    assert code == EXIT_INVALID_SPEC, server.log_tail()
    assert "spec.server.healthPath '/metrics' is already an endpoint of the server" in server.log_tail()
