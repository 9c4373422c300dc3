"""vLLM's weight transfer on the vllm engine over ipc: a real server and a real sender sharing one GPU.

The server runs vLLM with `weight_transfer_config {backend: ipc}` (through extraEngineArgs, which the
engine honours whatever the run's tuning; a full fine-tuning run sets it from server.weightTransfer).
The sender (tests/server/weight_ipc_sender.py) plays the trainer: it puts the tensors on the GPU,
writes their JSON IPC handles (`grpo_trainer.transport.weight_ipc.ipc_update_info`) and keeps them alive while
the test drives the routes, on a server that loads them layerwise (vLLM's path) and on one that loads them
in place (`GRPO_SERVER_WEIGHT_LOADS=in-place`). Skipped unless CUDA and vLLM are importable. One command (the model is
any safetensors checkpoint vLLM serves, e.g. bench/gpu/session.sh's /tmp/m15; default the tiny model):

    GRPO_TEST_SERVER_MODEL_DIR=/tmp/m15 python -m pytest tests/server/test_weight_transfer_vllm.py \\
        -q -p no:cacheprovider -o addopts="" --timeout 900 -rfEs

GRPO_TEST_SERVER_OVERRIDES (JSON, merged into spec.server) is honoured; the test adds the ipc backend
and, unless given, gpuMemoryUtilization 0.4 so the sender has room on the GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from grpo_api.weight_transfer import WEIGHTS_VERSION_HEADER
from tests.fixtures.models import mlp_and_norm_names
from tests.fixtures.server import ENV_OVERRIDES, RunningServer, start_server
from tests.fixtures.server_requests import token_ids


def cuda_and_vllm() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


pytestmark = [pytest.mark.slow, pytest.mark.skipif(not cuda_and_vllm(), reason="needs a CUDA GPU and vLLM")]

ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update")


def server_overrides() -> dict[str, Any]:
    given = json.loads(os.environ.get(ENV_OVERRIDES, "{}"))
    extra = {**given.get("extraEngineArgs", {}), "weight_transfer_config": {"backend": "ipc"}}
    return {"gpuMemoryUtilization": 0.4, "maxModelLen": 2048, **given, "engine": "vllm",
            # the prefix cache stays on: an update that did not reset it would serve the old weights' KV
            "enablePrefixCaching": True, "extraEngineArgs": extra}


@pytest.fixture(scope="module", params=["layerwise", "in-place"])
def server(request: pytest.FixtureRequest, served_model_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server for each way it loads pushed weights (GRPO_SERVER_WEIGHT_LOADS): vLLM's layerwise reload, and
    the server's worker extension copying into the live parameters."""
    running = start_server(tmp_path_factory.mktemp("vllm-ipc"), served_model_dir,
                           server_overrides=server_overrides(), timeout=900,
                           extra_env={"GRPO_SERVER_WEIGHT_LOADS": request.param})
    yield running
    running.stop(timeout=60)


def complete(server: RunningServer) -> httpx.Response:
    """Greedy completions of two prompts; the first spans full KV blocks, which the prefix cache keeps (an
    update must drop them, or a later request would reuse KV computed with other weights)."""
    body = {"prompt": [list(range(5, 45)), [50, 60]], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def post(server: RunningServer, path: str, body: dict[str, Any] | None = None, auth: bool = True) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.auth if auth else {}, timeout=600)


def push(server: RunningServer, model_dir: Path, work: Path, kind: str, names: list[str], *,
         version: int | None = None, bad_uuid: bool = False, split_last: bool = False,
         separate: bool = False) -> dict[str, Any]:
    """One update from a fresh sender process: init, start, /update_weights (one call, or with
    `split_last` a second call for the last tensor), finish; the answers by route ("update": a list).
    The sender packs its tensors into one buffer as the trainer does, or with `separate` shares each alone."""
    out = work / f"update-{kind}-{version}-{bad_uuid}-{split_last}-{separate}.json"
    sender = subprocess.Popen(
        [sys.executable, "-m", "tests.server.weight_ipc_sender", "--model", str(model_dir), "--kind", kind,
         "--names", json.dumps(names), "--out", str(out), *(["--bad-uuid"] if bad_uuid else []),
         *(["--separate"] if separate else [])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    assert sender.stdin is not None and sender.stdout is not None
    answers: dict[str, Any] = {}
    try:
        lines = []
        for line in sender.stdout:  # EOF if it died: its output is in the assertion
            lines.append(line)
            if line.strip() == "ready":
                break
        assert lines and lines[-1].strip() == "ready", "".join(lines)[-4000:]
        info = json.loads(out.read_text())
        answers["init"] = post(server, "/init_weight_transfer_engine", {"init_info": {}})
        answers["start"] = post(server, "/start_weight_update", {"is_checkpoint_format": True})
        parts = [slice(0, -1), slice(-1, None)] if split_last else [slice(None)]
        answers["update"] = [
            post(server, "/update_weights", {"update_info": {key: values[part] for key, values in info.items()}})
            for part in parts
        ]
        answers["finish"] = post(server, "/finish_weight_update", {} if version is None else {"version": version})
    finally:
        sender.stdin.close()  # the server is done with the tensors: the sender frees them and exits
        sender.wait(120)
    left = sender.stdout.read()
    if all(answer.status_code == 200 for answer in [answers["start"], *answers["update"], answers["finish"]]):
        # nothing the server read stays allocated in the sender: torch's IPC reference counts came back to 0
        # (a packed buffer shared under one counter slot for all its views never did: OOM after 8 pushes)
        assert "done allocated=0" in left, left[-4000:]
    return answers


def every_name(model_dir: Path) -> list[str]:
    """Every tensor of the checkpoint, the ones `scaled` changes last (a split update fails on the final norm):
    a vllm server takes only whole updates (it reloads layers in place from all of their tensors)."""
    from grpo_server.engines.vllm_weights import checkpoint_tensors

    changed = mlp_and_norm_names(model_dir)
    return [name for name in checkpoint_tensors(model_dir) if name not in changed] + changed


def version_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.headers[WEIGHTS_VERSION_HEADER]


def test_the_routes_need_the_token_and_ipc_takes_no_group(server):
    for path in ROUTES:
        assert post(server, path, {}, auth=False).status_code == 401
    info = httpx.get(server.url + "/server_info", params={"config_format": "json"}, timeout=30).json()
    assert info["vllm_config"]["weight_transfer_config"] == {"backend": "ipc"}
    assert info["vllm_config"]["lora_config"] is None  # LoRA is off while weights are pushed, as vLLM reports it
    group = post(server, "/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}})
    assert group.status_code == 400 and "init_info.master_address" in group.json()["message"], group.text
    assert post(server, "/start_weight_update").status_code == 200  # ipc needs no init (nor does vLLM's)
    assert post(server, "/init_weight_transfer_engine", {"init_info": {}}).status_code == 200
    assert post(server, "/start_weight_update").status_code == 200
    bare = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[1]]}
    missing = post(server, "/update_weights", {"update_info": bare})
    assert missing.status_code == 400 and "update_info.ipc_handles" in missing.text, missing.text
    pickled = post(server, "/update_weights", {"update_info": {**bare, "ipc_handles_pickled": "Y29zCnN5c3RlbQo="}})
    assert pickled.status_code == 400 and "ipc_handles_pickled" in pickled.text, pickled.text
    assert complete(server).status_code == 200  # nothing was received: nothing held, nothing changed


@pytest.mark.parametrize("separate", [False, True], ids=["packed", "separate"])
def test_pushed_weights_serve_with_their_version_and_the_originals_come_back_exactly(
    server, served_model_dir, tmp_path, separate,
):
    """Packed (views of one buffer sharing one handle, as the trainer sends them) or each tensor alone. Versions
    only move forward on a server: the separate case, which runs second, names versions above the packed case's."""
    base = 10 if separate else 0
    before = complete(server)
    assert version_of(before) == "0"  # the packed case ends with the checkpoint restored from disk
    names = every_name(served_model_dir)

    scaled = push(server, served_model_dir, tmp_path, "scaled", names, version=base + 1, separate=separate)
    [update] = scaled["update"]
    assert update.status_code == 200 and update.json()["tensors"] == len(names), update.text
    assert scaled["finish"].status_code == 200 and scaled["finish"].json()["weights_version"] == base + 1, \
        scaled["finish"].text
    changed = complete(server)
    assert version_of(changed) == str(base + 1)
    assert token_ids(changed) != token_ids(before)
    assert httpx.get(server.url + "/health/", timeout=30).json()["weights_version"] == base + 1

    original = push(server, served_model_dir, tmp_path, "original", names, version=base + 5,
                    separate=separate)
    assert original["finish"].status_code == 200 and original["finish"].json()["weights_version"] == base + 5, \
        original["finish"].text
    back = complete(server)
    assert version_of(back) == str(base + 5)
    assert token_ids(back) == token_ids(before)  # the checkpoint's own tensors: bit for bit the same weights

    stale = push(server, served_model_dir, tmp_path, "scaled", names, version=base + 5, separate=separate)
    assert stale["update"][0].status_code == 200, stale["update"][0].text
    assert stale["finish"].status_code == 409 and stale["finish"].json()["error"] == "weights_version_stale"
    # the update stays open for a good version (generation waits); starting again undoes it from disk
    again = post(server, "/start_weight_update")
    assert again.status_code == 200 and again.json()["weights_version"] == 0, again.text
    restored = complete(server)
    assert version_of(restored) == "0" and token_ids(restored) == token_ids(before)
    assert httpx.get(server.url + "/health/", timeout=30).json()["weights_version"] == 0


def test_a_transfer_that_fails_half_way_never_serves(server, served_model_dir, tmp_path):
    before = complete(server)
    names = every_name(served_model_dir)
    # two calls: the MLP tensors load into the live model (scaled); then the norm's handle names a GPU
    # that is not there, vLLM's worker refuses that call, and the half-replaced model must not serve
    failed = push(server, served_model_dir, tmp_path, "scaled", names, bad_uuid=True, split_last=True)
    loaded, refused = failed["update"]
    assert loaded.status_code == 200 and loaded.json()["tensors"] == len(names) - 1, loaded.text
    assert refused.status_code == 503 and refused.json()["error"] == "weight_transfer_failed", refused.text
    assert "version 0" in refused.json()["message"]
    finish = failed["finish"]
    assert finish.status_code == 409 and finish.json()["error"] == "weight_update_failed", finish.text
    after = complete(server)
    assert version_of(after) == "0" and token_ids(after) == token_ids(before)  # the checkpoint, from disk
    health = httpx.get(server.url + "/health/", timeout=30)
    assert health.status_code == 200 and health.json()["weights_version"] == 0
    assert post(server, "/start_weight_update").status_code == 200  # ipc: no group to join again

    # an update without every tensor is undone and refused: vLLM would rebuild a partly given layer on
    # uninitialised memory (the MLP's weights alone are whole layers, but the rule is the whole model)
    partial = push(server, served_model_dir, tmp_path, "scaled", mlp_and_norm_names(served_model_dir))
    assert partial["update"][0].status_code == 200, partial["update"][0].text
    assert partial["finish"].status_code == 409 and partial["finish"].json()["error"] == "weight_update_incomplete"
    assert token_ids(complete(server)) == token_ids(before)

    # updates serve again (above every version served before: 16 after the test above)
    good = push(server, served_model_dir, tmp_path, "scaled", names)
    assert good["finish"].status_code == 200, good["finish"].text
    served = good["finish"].json()["weights_version"]
    assert served >= 1 and version_of(complete(server)) == str(served)
