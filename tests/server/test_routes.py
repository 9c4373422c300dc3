"""The server's routes: the endpoint list in grpo_server/app.py is every route, and spec.server.healthPath: the
server answers its health check there too (probes and both executors look
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


def test_the_endpoint_list_in_the_apps_doc_is_every_route(tiny_model_dir: Path, tmp_path: Path):
    """grpo_server/app.py's list of endpoints names each route the app serves, and nothing else."""
    import re

    from fastapi.routing import APIRoute

    import grpo_server.app as app_module
    from grpo_api.runconfig import load_run_config
    from grpo_server.service import GenerationService
    from grpo_server.settings import settings_from_config
    from tests.fixtures.server import write_server_run_config

    config, _, _ = write_server_run_config(tmp_path, tiny_model_dir, port=8000)
    settings = settings_from_config(load_run_config(config), host=None, port=None, engine=None, max_body_bytes=None,
                                    allow_chat_templates=None)
    app = app_module.create_app(GenerationService(settings))
    served = {(method, route.path) for route in app.routes if isinstance(route, APIRoute) for method in route.methods}
    listed = set()
    for method, paths in re.findall(r"^    (GET|POST) +(/[^\s,]+(?:, /[^\s,]+)*)", app_module.__doc__ or "", re.M):
        listed |= {(method, path) for path in paths.split(", ")}
    assert listed == served, f"not listed: {sorted(served - listed)}; listed but not served: {sorted(listed - served)}"
