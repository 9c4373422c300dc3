"""vLLM's weight-transfer routes over HTTP on the transformers engine, with a real sender process over gloo.

The sender (tests/server/weight_sender.py) plays the trainer: it hosts the rendezvous and broadcasts
the tensors an update names while `/update_weights` runs, as TRL's `WeightTransferClient` does.
"""

from __future__ import annotations

import base64
import json
import math
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from grpo_api.weight_transfer import WEIGHTS_VERSION_HEADER
from grpo_server.engines.gloo_weights import STORE_PREFIX
from tests.fixtures.models import mlp_and_norm_names
from tests.fixtures.server import RunningServer, free_port, start_server
from tests.fixtures.server_requests import complete, post, token_ids
from tests.server.adapters import LoraMaker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(served_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("weights"), served_model_dir,
                           server_overrides={"maxLoraRank": 8, "maxLoras": 2})
    yield running
    running.stop(timeout=10)


def shapes(server: RunningServer, model_dir: Path, names: list[str]) -> list[list[int]]:
    from safetensors import safe_open

    with safe_open(str(next(model_dir.glob("*.safetensors"))), "pt") as weights:
        return [list(weights.get_slice(name).get_shape()) for name in names]


def push(server: RunningServer, model_dir: Path, kind: str, names: list[str], *, dtype: str = "float32",
         version: int | None = None) -> tuple[httpx.Response, httpx.Response, httpx.Response]:
    """One update by a fresh sender: init, start, update (while it broadcasts), finish; their answers.

    The server is asked to join only once the sender says where it hosts the rendezvous: a sender still
    importing torch on a loaded machine would otherwise outlast the server's rendezvous deadline."""
    sender = subprocess.Popen(
        [sys.executable, "-m", "tests.server.weight_sender", "--model", str(model_dir),
         "--kind", kind, "--names", json.dumps(names), "--dtype", dtype],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        port = hosted_port(sender)
        init = post(server, "/init_weight_transfer_engine", {"init_info": {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}})
        assert init.status_code == 200, (init.text, sender.stdout.read() if sender.poll() is not None else "")
        assert post(server, "/start_weight_update", {"is_checkpoint_format": True}).status_code == 200
        update = post(server, "/update_weights", {"update_info": {
            "names": names, "dtype_names": [dtype] * len(names), "shapes": shapes(server, model_dir, names)}})
        finish = post(server, "/finish_weight_update", {} if version is None else {"version": version})
        return init, update, finish
    finally:
        sender.wait(60)


def hosted_port(sender: subprocess.Popen[str]) -> int:
    """The port of the sender's store, from its `hosting PORT` line (what it printed before, if it died)."""
    assert sender.stdout is not None
    seen = []
    for line in sender.stdout:
        if line.startswith("hosting "):
            return int(line.split()[1])
        seen.append(line)
    raise AssertionError(f"the sender exited ({sender.wait()}) before hosting its rendezvous: {''.join(seen)[-2000:]}")


def test_the_routes_need_the_token_and_an_initialised_group(server):
    for path in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update"):
        assert post(server, path, {}, auth=False).status_code == 401
    started = post(server, "/start_weight_update")
    assert started.status_code == 409 and started.json()["error"] == "weight_transfer_not_initialized"
    info = httpx.get(server.url + "/server_info", params={"config_format": "json"}, timeout=30).json()
    assert info["vllm_config"]["weight_transfer_config"] == {"backend": "gloo"}
    assert info["vllm_config"]["lora_config"]["max_loras"] >= 1  # this engine still runs adapters (on the checkpoint)
    bad = post(server, "/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1; rm -rf /", "master_port": 70000, "rank_offset": 0, "world_size": 1}})
    assert bad.status_code in (400, 422)
    for field in ("master_address", "master_port", "rank_offset", "world_size"):
        assert field in bad.text
    empty = post(server, "/init_weight_transfer_engine", {"init_info": {}})  # ipc's init_info: gloo needs a group
    assert empty.status_code == 400, empty.text
    for field in ("master_address", "master_port", "rank_offset", "world_size"):
        assert f"init_info.{field}: required by the gloo backend" in empty.json()["message"]
    nobody = post(server, "/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
        "timeout_seconds": 3}})
    assert nobody.status_code == 503 and nobody.json()["error"] == "weight_transfer_failed", nobody.text


def test_no_update_while_an_adapter_is_loaded(server, served_model_dir):
    maker = LoraMaker(served_model_dir)
    path = maker.save(server.adapter_root / "x-v1", seed=1)
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "x-v1", "lora_path": str(path)}).status_code == 200
    join(server)
    refused = post(server, "/start_weight_update")
    assert refused.status_code == 409 and refused.json()["error"] == "adapters_loaded", refused.text
    assert post(server, "/clear_lora_adapter/").status_code == 200
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "x-v1"}).status_code == 200


def host_rendezvous() -> int:
    """A trainer that joins and never sends (the group is all `init` needs): its store's port.

    The store binds a port the kernel picks, before the server is asked to join (a port chosen beforehand
    could be taken by another process's connection first); the group forms on a thread once the server joins."""
    import datetime as dt

    import torch.distributed as dist

    limit = dt.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=limit, wait_for_workers=False)

    def hold() -> None:
        dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), 0, 2, limit)
        threading.Event().wait(60)

    threading.Thread(target=hold, daemon=True).start()
    return int(store.port)


def join(server: RunningServer) -> None:
    """The server joins a group hosted here (`host_rendezvous`), the precondition of the tests below. A second
    group is offered once when the first mesh fails to connect (gloo's `connectFullMesh ... Connection closed by
    peer`, seen once in a CI run between two in-process groups); the trainer likewise joins again at its next push."""
    answers = []
    for _ in range(2):
        init = post(server, "/init_weight_transfer_engine", {"init_info": {
            "master_address": "127.0.0.1", "master_port": host_rendezvous(), "rank_offset": 1, "world_size": 2}})
        if init.status_code == 200:
            return
        answers.append(init.text)
        assert init.status_code == 503 and init.json()["error"] == "weight_transfer_failed", init.text
    raise AssertionError(f"the server joined no group: {answers}")


def test_pushed_weights_serve_from_the_next_request_with_their_version_and_the_originals_restore_them(
    server, served_model_dir,
):
    before = complete(server)
    assert before.status_code == 200 and before.headers[WEIGHTS_VERSION_HEADER] == "0"
    names = mlp_and_norm_names(served_model_dir)

    _, update, finish = push(server, served_model_dir, "scaled", names)
    assert update.status_code == 200 and update.json()["tensors"] == len(names), update.text
    assert finish.status_code == 200 and finish.json()["weights_version"] == 1, finish.text
    changed = complete(server)
    assert changed.headers[WEIGHTS_VERSION_HEADER] == "1"
    assert token_ids(changed) != token_ids(before)
    assert httpx.get(server.url + "/health/", timeout=30).json()["weights_version"] == 1

    _, _, restored = push(server, served_model_dir, "original", names, dtype="bfloat16", version=5)
    assert restored.status_code == 200 and restored.json()["weights_version"] == 5, restored.text
    back = complete(server)
    assert back.headers[WEIGHTS_VERSION_HEADER] == "5"
    # bf16 on the wire rounds the originals: the greedy tokens of the tiny model are as before
    assert token_ids(back) == token_ids(before)

    _, _, stale = push(server, served_model_dir, "original", names, version=5)
    assert stale.status_code == 409 and stale.json()["error"] == "weights_version_stale"

    maker = LoraMaker(served_model_dir)
    path = maker.save(server.adapter_root / "late-v9", seed=9)
    late = post(server, "/v1/load_lora_adapter", {"lora_name": "late-v9", "lora_path": str(path)})
    assert late.status_code == 409 and late.json()["error"] == "adapter_base_model_mismatch", late.text
    assert "weight transfer" in late.json()["message"]


def ipc_handle(shape: list[int]) -> dict[str, object]:
    """A well-formed CUDA IPC handle (JSON form) of a contiguous float32 tensor of `shape`."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return {"dtype": "float32", "size": shape, "stride": strides, "tensor_offset": 0, "device_index": 0,
            "storage_handle": base64.b64encode(bytes(64)).decode(), "storage_size_bytes": 4 * math.prod(shape),
            "storage_offset_bytes": 0, "ref_counter_handle": base64.b64encode(b"/torch_1").decode(),
            "ref_counter_offset": 0}


def test_a_refused_or_failed_update_never_serves(server, served_model_dir):
    before = complete(server)
    version = before.headers[WEIGHTS_VERSION_HEADER]
    names = mlp_and_norm_names(served_model_dir)
    join(server)
    assert post(server, "/start_weight_update").status_code == 200
    good_shapes = shapes(server, served_model_dir, names)
    for info, field in (
        ({"names": ["model.nothing.weight"], "dtype_names": ["float32"], "shapes": [[2]]}, "update_info.names[0]"),
        ({"names": names[:1], "dtype_names": ["float32"], "shapes": [[3, 3]]}, "update_info.shapes[0]"),
        ({"names": names[:1], "dtype_names": ["float32"], "shapes": good_shapes[:1], "packed": True},
         "update_info.packed"),
        ({"names": names[:1], "dtype_names": ["int8"], "shapes": good_shapes[:1]}, "dtype_names"),
        ({"names": names[:2], "dtype_names": ["float32"], "shapes": good_shapes[:2]}, "one entry per tensor"),
        ({"names": [names[0], names[0]], "dtype_names": ["float32"] * 2, "shapes": [good_shapes[0]] * 2},
         "appears twice"),
        ({"names": names[:1], "dtype_names": ["float32"], "shapes": good_shapes[:1],
          "ipc_handles": [{"GPU-0": ipc_handle(good_shapes[0])}]}, "update_info.ipc_handles: the gloo backend"),
        ({"names": names[:1], "dtype_names": ["float32"], "shapes": good_shapes[:1],
          "ipc_handles_pickled": base64.b64encode(b"cos\nsystem\n").decode()}, "ipc_handles_pickled"),
    ):
        refused = post(server, "/update_weights", {"update_info": info})
        assert refused.status_code in (400, 422) and field in refused.text, (field, refused.text)
    empty = post(server, "/finish_weight_update")
    assert empty.status_code == 409 and empty.json()["error"] == "weight_update_empty"

    _, update, finish = push(server, served_model_dir, "die-after-one", names)
    assert update.status_code == 503 and update.json()["error"] == "weight_transfer_failed", update.text
    assert finish.status_code == 409 and finish.json()["error"] == "weight_update_failed", finish.text
    after = complete(server)
    assert after.headers[WEIGHTS_VERSION_HEADER] == version and token_ids(after) == token_ids(before)
    again = post(server, "/start_weight_update")
    assert again.status_code == 409 and again.json()["error"] == "weight_transfer_not_initialized"
