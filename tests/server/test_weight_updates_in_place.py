"""WeightUpdates with an in-place receiver (vLLM's engine: it loads into the live model) on CPU.

A GenerationService with a fake engine and a fake in-place receiver: every receiver call checks that
no generation runs, generations asked for during an update wait for its end, and an update that does
not finish (a failed transfer, a start over it, no call for the idle timeout) has the checkpoint
restored (version 0) or, if even that fails, stops the server serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from grpo_api.models import ServerSpec
from grpo_api.weight_transfer import WeightTransferInit, WeightUpdateInfo
from grpo_server.engines.base import (
    AdapterHandle,
    Completion,
    PromptResult,
    SamplingOptions,
    WeightTransferError,
)
from grpo_server.errors import ApiError
from grpo_server.sampling import Limits
from grpo_server.service import GenerationService
from grpo_server.settings import ServerSettings
from grpo_server.weight_updates import WeightUpdates

PARAMS = {"a.weight": ((2, 2), "float32"), "b.weight": ((3,), "float32")}


class FakeInPlaceReceiver:
    """Records its calls; each asserts that no generation runs (what vLLM's layerwise reload needs)."""

    backend = "ipc"
    in_place = True

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.calls: list[str] = []
        self.fail_receive_at: int | None = None  # the receive call (1-based) that fails
        self.fail_restore = False
        self.model = "disk"  # what the served model holds: disk, updating, or the committed update
        self._receives = 0
        self.receiving = asyncio.Event()  # set when a receive has started
        #: What an update must carry (vLLM's receiver: the whole checkpoint); most tests send parts.
        self.needs: frozenset[str] = frozenset()

    def _quiet(self, call: str) -> None:
        assert self.engine.running == 0, f"{call} while {self.engine.running} generation(s) run"
        self.calls.append(call)

    def parameters(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return PARAMS

    def required(self) -> frozenset[str]:
        return self.needs

    async def join(self, init: WeightTransferInit, timeout: float) -> None:
        self.calls.append("join")

    async def start(self) -> None:
        self._quiet("start")
        self.model = "updating"

    async def receive(self, update: WeightUpdateInfo, timeout: float) -> None:
        self._quiet("receive")
        self._receives += 1
        self.receiving.set()
        await asyncio.sleep(0.05)  # a transfer takes time: a generation asked for now must wait
        if self._receives == self.fail_receive_at:
            raise WeightTransferError("the trainer went away half way")

    async def commit(self) -> int:
        self._quiet("commit")
        self.model = f"update{self._receives}"
        return self._receives

    async def restore(self) -> None:
        self._quiet("restore")
        if self.fail_restore:
            raise WeightTransferError("the checkpoint is gone")
        self.model = "disk"

    def discard(self) -> None:
        pass

    def close(self) -> None:
        pass


class FakeEngine:
    """Generates a token naming the receiver's model state; counts running generations."""

    name = "fake"

    def __init__(self) -> None:
        self.running = 0
        self.receiver = FakeInPlaceReceiver(self)
        self.seen: list[str] = []

    def healthy(self) -> bool:
        return True

    def weight_receiver(self) -> FakeInPlaceReceiver:
        return self.receiver

    async def generate(self, prompts: list[list[int]], options: SamplingOptions,
                       adapter: AdapterHandle | None) -> list[PromptResult]:
        self.running += 1
        try:
            assert self.receiver.model != "updating", "a generation ran on half-replaced weights"
            self.seen.append(self.receiver.model)
            await asyncio.sleep(0.05)
            return [PromptResult(p, [Completion([1], [0.0], [[(1, 0.0)]], "x", "length")]) for p in prompts]
        finally:
            self.running -= 1


def make_service(tmp_path: Path, idle_timeout: float = 60.0) -> tuple[GenerationService, FakeEngine]:
    settings = ServerSettings(
        served_model_name="m", model_dir=tmp_path, adapter_root=tmp_path, progress_file=tmp_path / "p.json",
        token="t", engine="transformers", server=ServerSpec(), host="127.0.0.1", port=0, max_body_bytes=1 << 20,
        run_name="t",
    )
    service = GenerationService(settings, engine_kind="transformers")
    engine = FakeEngine()
    service.engine = engine  # type: ignore[assignment]
    service.ready = True
    service.limits = Limits(max_model_len=64, vocab_size=100)
    service.weights = WeightUpdates(service._exclusive, lambda: len(service.registry.loaded), idle_timeout=idle_timeout)
    return service, engine


def update_info(*names: str) -> WeightUpdateInfo:
    handle = {"dtype": "float32", "device_index": 0, "storage_handle": "AAAA", "storage_size_bytes": 64,
              "storage_offset_bytes": 0, "ref_counter_handle": "AAAA", "ref_counter_offset": 0, "tensor_offset": 0}
    shapes = [list(PARAMS[n][0]) for n in names]
    return WeightUpdateInfo.model_validate({
        "names": list(names), "dtype_names": ["float32"] * len(names), "shapes": shapes,
        "ipc_handles": [{"GPU-0": {**handle, "size": s, "stride": [s[1], 1] if len(s) == 2 else [1]}}
                        for s in shapes]})


def generate(service: GenerationService) -> Awaitable[Any]:
    return service.generate(None, [[1, 2, 3]], SamplingOptions(max_tokens=1))


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


async def open_update(service: GenerationService, engine: FakeEngine) -> None:
    receiver = engine.receiver
    await service.weights.join(receiver, WeightTransferInit())
    await service.weights.start(receiver)


def test_an_update_runs_while_no_generation_runs_and_generations_asked_meanwhile_get_the_new_version(tmp_path):
    async def scenario() -> None:
        service, engine = make_service(tmp_path)
        receiver = engine.receiver
        await open_update(service, engine)
        assert receiver.calls == ["join"]  # start touches nothing: the model is held only from the first tensor
        assert (await generate(service)).weights_version == 0

        running = asyncio.ensure_future(generate(service))
        await asyncio.sleep(0.01)
        assert engine.running == 1
        await service.weights.update(receiver, update_info("a.weight"))  # waits for the running generation
        assert (await running).weights_version == 0
        waiting = asyncio.ensure_future(generate(service))  # asked while the update is open: waits
        second = await service.weights.update(receiver, update_info("b.weight"))
        assert second.tensors == 1 and not waiting.done()
        done = await service.weights.finish(receiver, None)
        assert done.weights_version == 1 and done.tensors == 2
        assert (await waiting).weights_version == 1
        assert receiver.calls == ["join", "start", "receive", "receive", "commit"]
        assert engine.seen == ["disk", "disk", "update2"]
        assert service.health()[1].weights_version == 1

    run(scenario)


def test_a_transfer_that_fails_half_way_restores_the_checkpoint_and_reports_version_0(tmp_path):
    async def scenario() -> None:
        service, engine = make_service(tmp_path)
        receiver = engine.receiver
        await open_update(service, engine)
        await service.weights.update(receiver, update_info("a.weight"))
        await service.weights.finish(receiver, 7)
        assert service.weights.version == 7 and receiver.model == "update1"

        receiver.fail_receive_at = 3
        await service.weights.start(receiver)
        await service.weights.update(receiver, update_info("a.weight"))
        waiting = asyncio.ensure_future(generate(service))
        with pytest.raises(ApiError) as failed:
            await service.weights.update(receiver, update_info("b.weight"))
        assert failed.value.status_code == 503 and failed.value.error == "weight_transfer_failed"
        assert "went away" in failed.value.message and "version 0" in failed.value.message
        assert receiver.calls[-2:] == ["receive", "restore"] and receiver.model == "disk"
        assert (await waiting).weights_version == 0  # ran after the restore, on the checkpoint
        assert service.weights.version == 0 and service.health()[0] == 200

        with pytest.raises(ApiError) as again:
            await service.weights.update(receiver, update_info("b.weight"))
        assert again.value.error == "weight_update_failed"
        with pytest.raises(ApiError) as finished:
            await service.weights.finish(receiver, None)
        assert finished.value.status_code == 409 and finished.value.error == "weight_update_failed"
        assert "version 0" in finished.value.message
        assert receiver.calls.count("restore") == 1
        receiver.backend = "nccl"  # a group backend must join again after a failure
        with pytest.raises(ApiError) as not_joined:
            await service.weights.start(receiver)
        assert not_joined.value.error == "weight_transfer_not_initialized"
        receiver.backend = "ipc"  # ipc has no group: starting again is enough (vLLM needs no init either)
        await service.weights.start(receiver)

        # versions still move forward: the next update is above 7, not 1
        receiver.fail_receive_at = None
        await service.weights.update(receiver, update_info("a.weight"))
        assert (await service.weights.finish(receiver, None)).weights_version == 8
        with pytest.raises(ApiError) as stale:
            await service.weights.start(receiver)
            await service.weights.update(receiver, update_info("a.weight"))
            await service.weights.finish(receiver, 8)
        assert stale.value.error == "weights_version_stale"

    run(scenario)


def test_a_stale_version_leaves_the_update_open_for_a_good_one(tmp_path):
    async def scenario() -> None:
        service, engine = make_service(tmp_path)
        receiver = engine.receiver
        await open_update(service, engine)
        await service.weights.update(receiver, update_info("a.weight"))
        await service.weights.finish(receiver, 5)
        await service.weights.start(receiver)
        await service.weights.update(receiver, update_info("b.weight"))
        with pytest.raises(ApiError) as stale:
            await service.weights.finish(receiver, 5)
        assert stale.value.status_code == 409 and stale.value.error == "weights_version_stale"
        assert "restore" not in receiver.calls and receiver.model == "updating"
        waiting = asyncio.ensure_future(generate(service))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # still held: the model is mid-update
        assert (await service.weights.finish(receiver, 6)).weights_version == 6
        assert (await waiting).weights_version == 6

    run(scenario)


def test_a_start_or_init_over_an_open_update_restores_the_checkpoint(tmp_path):
    async def scenario() -> None:
        service, engine = make_service(tmp_path)
        receiver = engine.receiver
        await open_update(service, engine)
        await service.weights.update(receiver, update_info("a.weight"))
        await service.weights.finish(receiver, None)
        await service.weights.start(receiver)
        await service.weights.update(receiver, update_info("a.weight"))
        await service.weights.start(receiver)  # begins again: the half update is undone
        assert receiver.calls[-1] == "restore" and service.weights.version == 0
        assert (await generate(service)).weights_version == 0  # not held any more
        await service.weights.update(receiver, update_info("b.weight"))
        await open_update(service, engine)  # an init over an open update undoes it too
        assert receiver.calls.count("restore") == 2 and receiver.model == "disk"
        await service.weights.start(receiver)  # nothing received: nothing to undo
        await service.weights.start(receiver)
        assert receiver.calls.count("restore") == 2

    run(scenario)


def test_an_abandoned_update_is_undone_after_the_idle_timeout(tmp_path):
    async def scenario() -> None:
        service, engine = make_service(tmp_path, idle_timeout=0.3)
        receiver = engine.receiver
        await open_update(service, engine)
        await service.weights.update(receiver, update_info("a.weight"))
        waiting = asyncio.ensure_future(generate(service))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        assert (await waiting).weights_version == 0  # the trainer never came back: restored, then served
        assert receiver.calls[-1] == "restore" and receiver.model == "disk"
        with pytest.raises(ApiError) as finished:
            await service.weights.finish(receiver, None)
        assert finished.value.error == "weight_update_failed" and "abandoned" in finished.value.message

    run(scenario)


def test_a_restore_that_fails_stops_serving(tmp_path):
    async def scenario() -> None:
        service, engine = make_service(tmp_path)
        receiver = engine.receiver
        receiver.fail_receive_at, receiver.fail_restore = 1, True
        await open_update(service, engine)
        waiting = asyncio.ensure_future(generate(service))
        await asyncio.sleep(0.01)
        assert engine.running == 1
        later: asyncio.Future[Any] | None = None

        async def ask_during_the_update() -> None:
            nonlocal later
            await receiver.receiving.wait()  # the running generation finished; the receive runs
            assert receiver.calls[-1] == "receive" and engine.running == 0
            later = asyncio.ensure_future(generate(service))

        asker = asyncio.ensure_future(ask_during_the_update())
        with pytest.raises(ApiError) as failed:
            await service.weights.update(receiver, update_info("a.weight"))
        await asker
        assert "restarted" in failed.value.message
        assert (await waiting).weights_version == 0  # admitted before the update
        assert later is not None
        with pytest.raises(ApiError) as refused:  # waited at admission; the weights are unknown now
            await later
        assert refused.value.status_code == 503 and refused.value.error == "engine_not_ready"
        assert "unusable" in refused.value.message
        status, health = service.health()
        assert status == 503 and health.status == "unhealthy"
        with pytest.raises(ApiError):
            service.weight_receiver()
        assert engine.seen == ["disk"]

    run(scenario)


def test_the_backend_decides_what_init_info_and_update_info_may_carry(tmp_path):
    async def scenario() -> None:
        service, engine = make_service(tmp_path)
        receiver = engine.receiver
        with pytest.raises(ApiError) as refused:
            await service.weights.join(receiver, WeightTransferInit(master_address="h", master_port=5))
        assert refused.value.status_code == 400
        assert "init_info.master_address" in refused.value.message and "init_info.master_port" in refused.value.message
        await service.weights.start(receiver)  # ipc: no group, no init needed (as in vLLM)
        joined = await service.weights.join(receiver, WeightTransferInit(timeout_seconds=5))
        assert "ipc" in joined.message
        await service.weights.start(receiver)
        bare = WeightUpdateInfo(names=["a.weight"], dtype_names=["float32"], shapes=[[2, 2]])
        with pytest.raises(ApiError) as missing:
            await service.weights.update(receiver, bare)
        assert missing.value.status_code == 400 and "update_info.ipc_handles" in missing.value.message
        assert "start" not in receiver.calls  # refused before the model was touched

        receiver.backend = "nccl"
        with pytest.raises(ApiError) as needs_group:
            await service.weights.join(receiver, WeightTransferInit())
        assert needs_group.value.status_code == 400
        assert all(f"init_info.{f}" in needs_group.value.message
                   for f in ("master_address", "master_port", "rank_offset", "world_size"))
        await service.weights.join(receiver, WeightTransferInit(master_address="h", master_port=5, rank_offset=1,
                                                                world_size=2))
        await service.weights.start(receiver)
        with pytest.raises(ApiError) as foreign:
            await service.weights.update(receiver, update_info("a.weight"))
        assert foreign.value.status_code == 400 and "update_info.ipc_handles" in foreign.value.message
        assert "nccl" in foreign.value.message

    run(scenario)


def test_an_update_that_lacks_a_required_tensor_is_undone_and_refused_and_a_whole_one_then_serves(tmp_path):
    """vLLM rebuilds a layer given part of its tensors from uninitialised memory (found on the H200 with a
    merged sync that pushed weights without their biases): such an update must never serve."""

    async def scenario() -> None:
        service, engine = make_service(tmp_path)
        receiver = engine.receiver
        receiver.needs = frozenset(PARAMS)
        await open_update(service, engine)
        await service.weights.update(receiver, update_info("a.weight"))
        with pytest.raises(ApiError) as refused:
            await service.weights.finish(receiver, 3)
        assert refused.value.status_code == 409 and refused.value.error == "weight_update_incomplete"
        assert "1 were not sent (b.weight)" in refused.value.message and "version 0" in refused.value.message
        assert receiver.calls[-1] == "restore" and receiver.model == "disk" and "commit" not in receiver.calls
        assert service.weights.version == 0 and not service.weights.updating
        assert (await generate(service)).weights_version == 0

        await service.weights.start(receiver)  # the names of the undone update do not count for the next
        await service.weights.update(receiver, update_info("b.weight"))
        with pytest.raises(ApiError, match=r"\(a\.weight\)"):
            await service.weights.finish(receiver, 3)
        await service.weights.start(receiver)
        await service.weights.update(receiver, update_info("a.weight", "b.weight"))
        done = await service.weights.finish(receiver, 3)
        assert done.weights_version == 3 and receiver.model == "update3"  # the third receive
        assert (await generate(service)).weights_version == 3

    run(scenario)
