"""A server refuses a request of an earlier attempt of its run (`X-GRPO-Attempt` below its `$GRPO_ATTEMPT`).

Each attempt gets a fresh server, on the same port under `grpo run` and behind the same Service on a cluster:
a trainer process that outlived its attempt took the new server for its own restarted one and loaded its
adapters into it (issue 33). Now it is refused, with a 409 naming both attempts, before anything changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from grpo_api.protocol import ATTEMPT_HEADER, SetAdapterRequest
from grpo_trainer.transport.server_client import AdapterRefused, ServerClient
from tests.fixtures.server import RunningServer, start_server
from tests.server.adapters import LoraMaker

SERVER_ATTEMPT = 3

#: Every route that changes the server, with a body it accepts.
MUTATING: list[tuple[str, dict[str, Any] | None]] = [
    ("/set_lora_adapter/", {"lora_path": "/nowhere", "version": 1}),
    ("/clear_lora_adapter/", None),
    ("/reset_prefix_cache", None),
    ("/v1/load_lora_adapter", {"lora_name": "policy-v1", "lora_path": "/nowhere"}),
    ("/v1/unload_lora_adapter", {"lora_name": "policy-v1"}),
    ("/pause", None),
    ("/resume", None),
    ("/init_weight_transfer_engine", {"init_info": {}}),
    ("/start_weight_update", None),
    ("/update_weights", {"update_info": {}}),
    ("/finish_weight_update", None),
]


@pytest.fixture(scope="module")
def server(served_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("attempt-server"), served_model_dir,
                           extra_env={"GRPO_ATTEMPT": str(SERVER_ATTEMPT)})
    yield running
    running.stop(timeout=10)


def post(server: RunningServer, path: str, body: dict[str, Any] | None, attempt: str | None,
         token: bool = True) -> httpx.Response:
    headers = {**(server.auth if token else {}), **({ATTEMPT_HEADER: attempt} if attempt is not None else {})}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30)


def complete(server: RunningServer, attempt: str | None) -> httpx.Response:
    body = {"prompt": [[5, 6, 7, 8]], "max_tokens": 4, "temperature": 0.0, "return_token_ids": True}
    headers = {ATTEMPT_HEADER: attempt} if attempt is not None else {}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(("path", "body"), MUTATING, ids=[p for p, _ in MUTATING])
def test_every_mutating_route_refuses_an_earlier_attempt_naming_both(
    server: RunningServer, path: str, body: dict[str, Any] | None,
) -> None:
    response = post(server, path, body, attempt=str(SERVER_ATTEMPT - 1))
    assert response.status_code == 409, response.text
    assert response.json()["error"] == "attempt_superseded"
    message = response.json()["message"]
    assert f"attempt {SERVER_ATTEMPT}" in message and f"attempt {SERVER_ATTEMPT - 1}" in message, message
    assert post(server, path, body, attempt="1", token=False).status_code == 401, "the token is checked first"


def test_the_current_attempt_and_untagged_clients_pass_and_a_malformed_tag_is_refused(server: RunningServer) -> None:
    """Past the check, the route does its own work (here: no such adapter, 404). An untagged request comes
    from a client written for vLLM (TRL's AsyncGRPOTrainer, curl): every trainer of ours tags its requests."""
    body = {"lora_path": "/nowhere", "version": 1}
    for attempt in (str(SERVER_ATTEMPT), str(SERVER_ATTEMPT + 1), None):
        response = post(server, "/set_lora_adapter/", body, attempt=attempt)
        assert response.json()["error"] != "attempt_superseded", (attempt, response.text)
    for bad in ("x", "-1", "1" * 12):
        response = post(server, "/set_lora_adapter/", body, attempt=bad)
        assert response.status_code == 400 and ATTEMPT_HEADER in response.json()["message"], response.text


def test_generation_refuses_an_earlier_attempt_and_serves_the_current_one(server: RunningServer) -> None:
    refused = complete(server, str(SERVER_ATTEMPT - 1))
    assert refused.status_code == 409 and refused.json()["error"] == "attempt_superseded", refused.text
    assert complete(server, str(SERVER_ATTEMPT)).status_code == 200
    assert complete(server, None).status_code == 200


def test_an_earlier_attempt_s_trainer_client_cannot_load_a_good_adapter_the_current_one_can(
    server: RunningServer, served_model_dir: Path,
) -> None:
    """The trainer's own client tags its requests: attempt 2's load of a valid adapter is refused and the
    server stays as it was; attempt 3's load of the same adapter succeeds."""
    path, digest = LoraMaker(served_model_dir).publish(server.adapter_root, 7, seed=1)
    request = SetAdapterRequest(path=str(path), version=7, sha256=digest)
    old = ServerClient(server.url, token=server.token, generation_timeout=60, attempt=SERVER_ATTEMPT - 1)
    current = ServerClient(server.url, token=server.token, generation_timeout=60, attempt=SERVER_ATTEMPT)
    try:
        before = server.health()["adapter"]
        with pytest.raises(AdapterRefused, match="attempt_superseded") as refused:
            old.set_adapter(request)
        assert refused.value.status == 409
        assert server.health()["adapter"] == before
        assert current.set_adapter(request).adapter.version == 7
        assert server.health()["adapter"]["version"] == 7
    finally:
        old.close()
        current.close()


def test_a_server_started_without_an_attempt_checks_none(served_model_dir: Path, tmp_path: Path) -> None:
    """A server started by hand (no $GRPO_ATTEMPT) belongs to no attempt: any tag passes."""
    plain = start_server(tmp_path, served_model_dir)
    try:
        response = post(plain, "/set_lora_adapter/", {"lora_path": "/nowhere", "version": 1}, attempt="1")
        assert response.json()["error"] != "attempt_superseded", response.text
    finally:
        plain.stop(timeout=10)
