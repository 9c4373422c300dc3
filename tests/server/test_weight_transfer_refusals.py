"""vLLM's weight-transfer routes under hostile senders and interleavings, on the transformers engine (gloo, CPU).

A real server over HTTP; the trainer (rank 0 of the gloo group, host of the rendezvous) is a thread of
this process that broadcasts whatever tensors a test gives it, so a test can send values no sane
trainer sends. What tests/server/test_weight_transfer.py covers (field refusals, a sender that dies
half way, stale versions, adapters loaded before a start) is not repeated here.
"""

from __future__ import annotations

import datetime as dt
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from grpo_api.weight_transfer import WEIGHTS_VERSION_HEADER
from grpo_server.engines.gloo_weights import STORE_PREFIX
from tests.fixtures.server import RunningServer, start_server
from tests.fixtures.server_requests import post
from tests.server.adapters import LoraMaker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(served_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("weights-hostile"), served_model_dir,
                           server_overrides={"maxLoraRank": 8, "maxLoras": 2})
    yield running
    running.stop(timeout=10)


def sampled(server: RunningServer, **extra: Any) -> httpx.Response:
    """A sampled (not greedy) completion: sampling is what non-finite logits break."""
    body: dict[str, Any] = {"prompt": [[5, 6, 7, 8]], "max_tokens": 4, "temperature": 1.0, "seed": 3,
                            "ignore_eos": True, "return_token_ids": True, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=180)


def checkpoint(model_dir: Path, names: list[str]) -> dict[str, Any]:
    """The checkpoint's own tensors (float32), by name."""
    from safetensors import safe_open

    with safe_open(str(next(model_dir.glob("*.safetensors"))), "pt") as weights:
        return {name: weights.get_tensor(name).float() for name in names}


def last_mlp(model_dir: Path) -> str:
    last = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"] - 1
    return f"model.layers.{last}.mlp.down_proj.weight"


class Trainer:
    """Rank 0 of a gloo group of two, in this process: hosts the rendezvous, broadcasts what it is given."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._limit = dt.timedelta(seconds=60)
        self._group: Any = None
        self._joined = threading.Event()
        # a port the kernel picks, bound before the server is asked to join (one chosen beforehand could be
        # taken by another process's connection first); the group forms on a thread once the server joins
        store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=self._limit, wait_for_workers=False)
        self._store = store
        self.port = int(store.port)

        def host() -> None:
            self._group = dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), 0, 2, self._limit)
            self._joined.set()

        threading.Thread(target=host, daemon=True).start()

    def init(self, server: RunningServer) -> httpx.Response:
        response = post(server, "/init_weight_transfer_engine", {"init_info": {
            "master_address": "127.0.0.1", "master_port": self.port, "rank_offset": 1, "world_size": 2}})
        assert response.status_code == 200, response.text
        assert self._joined.wait(30)
        return response

    def update(self, server: RunningServer, tensors: dict[str, Any]) -> httpx.Response:
        """`/update_weights` naming `tensors` while this trainer broadcasts them, as TRL's client does."""
        errors: list[BaseException] = []

        def send() -> None:
            try:
                for tensor in tensors.values():
                    self._group.broadcast(tensor.contiguous(), 0, self._limit).wait()
            except BaseException as exc:
                errors.append(exc)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        response = post(server, "/update_weights", {"update_info": {
            "names": list(tensors), "dtype_names": ["float32"] * len(tensors),
            "shapes": [list(t.shape) for t in tensors.values()]}})
        sender.join(90)
        assert not sender.is_alive() and not errors, (errors, response.text)
        return response


def test_non_finite_weights_are_refused_naming_the_tensor_and_never_serve(server, served_model_dir):
    """A trainer that diverged pushes NaN or inf: served, every sampled generation would fail (multinomial
    of NaN probabilities), as the adapter checks say of non-finite adapter weights."""
    before = sampled(server)
    assert before.status_code == 200, before.text
    version = before.headers[WEIGHTS_VERSION_HEADER]
    mlp = last_mlp(served_model_dir)
    for poison in (float("nan"), float("inf")):
        tensors = checkpoint(served_model_dir, [mlp, "model.norm.weight"])
        tensors["model.norm.weight"][3] = poison
        trainer = Trainer()
        trainer.init(server)
        assert post(server, "/start_weight_update").status_code == 200
        update = trainer.update(server, tensors)
        assert update.status_code == 400, update.text
        assert "update_info.names[1]" in update.json()["message"], update.text
        finish = post(server, "/finish_weight_update")
        assert finish.status_code == 409 and finish.json()["error"] == "weight_update_failed", finish.text
        after = sampled(server)
        assert after.status_code == 200, after.text
        assert after.headers[WEIGHTS_VERSION_HEADER] == version
        assert after.json()["choices"][0]["token_ids"] == before.json()["choices"][0]["token_ids"]
    assert server.health()["_status_code"] == 200


def test_an_adapter_load_under_way_at_start_is_not_mixed_with_the_pushed_weights(server, served_model_dir):
    """An adapter load checks for replaced weights first, then waits for the engine (here behind a long
    generation); a start meanwhile sees no adapter loaded. Whichever lands, the pushed weights must not
    serve under an adapter trained on the checkpoint's."""
    trainer = Trainer()
    trainer.init(server)
    answers: dict[str, httpx.Response] = {}

    def long_generation() -> None:
        answers["long"] = httpx.post(server.url + "/v1/completions", json={
            "prompt": [[5, 6, 7, 8]], "n": 128, "max_tokens": 500, "temperature": 1.0, "ignore_eos": True},
            timeout=300)

    maker = LoraMaker(served_model_dir)
    path = maker.save(server.adapter_root / "race-v1", seed=4)

    def load_adapter() -> None:
        answers["load"] = post(server, "/v1/load_lora_adapter", {"lora_name": "race-v1", "lora_path": str(path)})

    generating = threading.Thread(target=long_generation, daemon=True)
    generating.start()
    deadline = time.monotonic() + 30
    while "grpo_server_requests_in_flight 1.0" not in httpx.get(server.url + "/metrics", timeout=10).text:
        assert time.monotonic() < deadline, "the long generation never started"
        time.sleep(0.05)
    loading = threading.Thread(target=load_adapter, daemon=True)
    loading.start()
    time.sleep(1.0)  # past its check (small reads), waiting for the engine's worker
    started = post(server, "/start_weight_update")
    assert loading.is_alive() and generating.is_alive(), "the adapter load was not under way at the start"
    assert started.status_code == 200, started.text
    update = trainer.update(server, checkpoint(served_model_dir, ["model.norm.weight"]))
    assert update.status_code == 200, update.text
    assert post(server, "/pause", timeout=60).status_code == 200  # mode abort: the worker is free sooner
    assert post(server, "/resume").status_code == 200
    finish = post(server, "/finish_weight_update")
    loading.join(300)
    generating.join(300)
    assert answers["long"].status_code in (200, 503), answers["long"].text
    assert answers["load"].status_code == 200, answers["load"].text  # it was checked before the start
    health = server.health()
    assert health["adapter"]["version"] == 1 and health["weights_version"] == 0, (health, finish.text)
    assert finish.status_code == 409 and finish.json()["error"] == "adapters_loaded", finish.text
    assert post(server, "/clear_lora_adapter/").status_code == 200
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "race-v1"}).status_code == 200


def test_a_rendezvous_that_accepts_and_never_answers_is_given_up_after_timeout_seconds(server):
    """torch's TCPStore client waits for the master's answer to its ping without a deadline: a host that
    takes the connection and stays silent (a stopped trainer process: the kernel still accepts) held the
    call, and with it every weight-transfer route, for ever."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes connections; nothing ever reads or answers them
    try:
        started = time.monotonic()
        try:
            answer = post(server, "/init_weight_transfer_engine", {"init_info": {
                "master_address": "127.0.0.1", "master_port": silent.getsockname()[1], "rank_offset": 1,
                "world_size": 2, "timeout_seconds": 2}}, timeout=40)
        except httpx.ReadTimeout:
            pytest.fail("no answer within 40s to an init with timeout_seconds 2")
        assert answer.status_code == 503 and answer.json()["error"] == "weight_transfer_failed", answer.text
        assert "init_info" in answer.json()["message"] and time.monotonic() - started < 20
        refused = post(server, "/start_weight_update", timeout=10)
        assert refused.status_code == 409 and refused.json()["error"] == "weight_transfer_not_initialized"
        Trainer().init(server)  # the routes are free again: a live trainer joins
    finally:
        silent.close()
