"""The ipc backend's JSON handles on CPU: the wire model's bounds, the backend-aware init_info, the
server's rebuild of vLLM's `ipc_handles` (classes and dtype from its allowlist, never from the request), and
the plain values an in-place load sends vLLM's workers instead, with the calls such a receiver makes.

The trainer's encoder (`grpo_trainer.transport.weight_ipc`) is checked against the server's rebuild with what
torch's `reduce_tensor` gives for a CUDA tensor, faked here (no GPU): the arguments the server hands
vLLM are the ones torch produced, field for field.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import pickle
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from grpo_api.weight_transfer import (
    MAX_IPC_DEVICES,
    MAX_STORAGE_HANDLE_BYTES,
    CudaIpcHandle,
    InitWeightTransferRequest,
    UpdateWeightsRequest,
    WeightTransferInit,
    WeightUpdateInfo,
)
from grpo_server.engines import vllm_weights
from grpo_server.errors import ApiError
from grpo_server.weight_updates import check_update

UUID = "GPU-5f1c2e3a-0000-1111-2222-333344445555"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def handle(**changes: Any) -> dict[str, Any]:
    """A valid handle of a float32 [4, 8] tensor at element 16 of a 160-byte storage."""
    base = {"dtype": "float32", "size": [4, 8], "stride": [8, 1], "tensor_offset": 8, "device_index": 0,
            "storage_handle": b64(bytes(range(64))), "storage_size_bytes": 160, "storage_offset_bytes": 512,
            "ref_counter_handle": b64(b"/torch_1234_5678_0"), "ref_counter_offset": 3,
            "event_handle": b64(b"e" * 64), "event_sync_required": True}
    return {**base, **changes}


def info(count: int = 1, **changes: Any) -> dict[str, Any]:
    body = {"names": [f"w{i}" for i in range(count)], "dtype_names": ["float32"] * count,
            "shapes": [[4, 8]] * count, "ipc_handles": [{UUID: handle()} for _ in range(count)]}
    return {**body, **changes}


def refusal(model: type[Any], body: Any) -> str:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return str(caught.value)


def test_a_valid_handle_round_trips_through_json():
    parsed = CudaIpcHandle.model_validate(handle())
    assert parsed.storage_handle == bytes(range(64)) and parsed.ref_counter_handle == b"/torch_1234_5678_0"
    assert CudaIpcHandle.model_validate_json(json.dumps(parsed.model_dump(mode="json"))) == parsed
    assert CudaIpcHandle.model_validate(handle(event_handle=None, event_sync_required=False)).event_handle is None


@pytest.mark.parametrize(("changes", "named"), [
    ({"dtype": "int8"}, "dtype"),
    ({"dtype": "float64"}, "dtype"),
    ({"size": [4, -1]}, "size"),
    ({"size": [2**31, 1]}, "size"),
    ({"size": [1] * 9, "stride": [1] * 9}, "size"),
    ({"stride": [8]}, "stride"),
    ({"stride": [-8, 1]}, "stride"),
    ({"tensor_offset": -1}, "tensor_offset"),
    ({"tensor_offset": 2**80}, "tensor_offset"),
    ({"device_index": 1024}, "device_index"),
    ({"storage_size_bytes": 0}, "storage_size_bytes"),
    ({"storage_size_bytes": 2**48}, "storage_size_bytes"),
    ({"storage_offset_bytes": -1}, "storage_offset_bytes"),
    ({"ref_counter_offset": 2**48}, "ref_counter_offset"),
    ({"storage_handle": ""}, "storage_handle"),
    ({"storage_handle": "not base64!"}, "storage_handle"),
    ({"storage_handle": "QUJD"[:3]}, "storage_handle"),  # bad padding
    ({"storage_handle": "QU JD"}, "storage_handle"),  # whitespace is not base64
    ({"storage_handle": "\udc80AAA"}, "storage_handle"),
    ({"storage_handle": 12}, "storage_handle"),
    ({"storage_handle": [1, 2]}, "storage_handle"),
    ({"storage_handle": b64(b"x" * (MAX_STORAGE_HANDLE_BYTES + 1))}, "storage_handle"),
    ({"ref_counter_handle": b64(b"x" * 1025)}, "ref_counter_handle"),
    ({"event_handle": b64(b"x" * 257)}, "event_handle"),
    ({"event_handle": None}, "event_handle"),  # event_sync_required without one
    ({"storage_size_bytes": 159}, "storage_size_bytes"),  # the view reaches byte 160
    ({"tensor_offset": 9}, "tensor_offset"),
    ({"stride": [9, 1]}, "stride"),
    ({"dtype": "bfloat16", "storage_size_bytes": 79}, "storage_size_bytes"),
])
def test_every_handle_field_is_typed_and_bounded(changes, named):
    assert named in refusal(CudaIpcHandle, handle(**changes))


def test_a_handle_of_a_view_that_fits_its_storage_is_accepted():
    assert CudaIpcHandle.model_validate(handle(dtype="bfloat16", storage_size_bytes=80))
    assert CudaIpcHandle.model_validate(handle(size=[0, 8], storage_size_bytes=1))  # no element: nothing read
    assert CudaIpcHandle.model_validate(handle(stride=[0, 0], tensor_offset=0, storage_size_bytes=4))  # broadcast


ODD = ("null", "true", "-1", "1e400", "NaN", str(2**80), '""', '"\\u0000"', '"\\udc80"', "[]", "[null]", "{}",
       '{"a": 1}', "[" * 100 + "]" * 100, json.dumps("A" * 40_000))


def test_odd_json_values_in_any_handle_field_are_validation_errors_and_nothing_else():
    accepted = []
    for field in handle():
        rest = json.dumps({k: v for k, v in handle().items() if k != field})
        for value in ODD:
            text = rest[:-1] + ", " + json.dumps(field) + ": " + value + "}"
            try:
                CudaIpcHandle.model_validate_json(text)
                accepted.append((field, value))
            except ValidationError:
                pass
    # only `true`, which pydantic's lax mode reads as 1 for the integers (offsets and indexes, harmless)
    assert {value for _, value in accepted} == {"true"}, accepted


def test_ipc_handles_match_the_tensors_one_for_one():
    assert WeightUpdateInfo.model_validate(info(3)).ipc_handles is not None
    assert "one entry per tensor" in refusal(WeightUpdateInfo, info(2, ipc_handles=[{UUID: handle()}]))
    assert "ipc_handles[0]: dtype" in refusal(WeightUpdateInfo, info(1, dtype_names=["bfloat16"]))
    assert "ipc_handles[0]: size" in refusal(WeightUpdateInfo, info(1, shapes=[[8, 4]]))
    assert "ipc_handles" in refusal(WeightUpdateInfo, info(1, ipc_handles=[{}]))
    many = {f"GPU-{i}": handle() for i in range(MAX_IPC_DEVICES + 1)}
    assert "ipc_handles" in refusal(WeightUpdateInfo, info(1, ipc_handles=[many]))
    for uuid in ("", "GPU 0", "x" * 65, "../0", "GPU-0\u0000"):
        assert "ipc_handles" in refusal(WeightUpdateInfo, info(1, ipc_handles=[{uuid: handle()}]))
    two_gpus = WeightUpdateInfo.model_validate(info(1, ipc_handles=[{UUID: handle(), "GPU-other": handle()}]))
    assert two_gpus.ipc_handles is not None and len(two_gpus.ipc_handles[0]) == 2


def test_vllm_s_pickled_handles_are_refused_naming_the_field():
    pickled = b64(pickle.dumps([{UUID: ("anything",)}]))
    text = refusal(UpdateWeightsRequest, {"update_info": info(1, ipc_handles=None, ipc_handles_pickled=pickled)})
    assert "ipc_handles_pickled" in text and "refused" in text
    text = refusal(UpdateWeightsRequest, {"update_info": {**info(1), "ipc_handles_pickled": pickled}})
    assert "ipc_handles_pickled" in text


def test_the_backend_decides_which_init_info_fields_are_wanted():
    group = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
    ipc = InitWeightTransferRequest.model_validate({"init_info": {}}).init_info
    assert ipc.problems("ipc") == []
    assert [p.split(":")[0] for p in ipc.problems("nccl")] == [f"init_info.{f}" for f in group]
    full = WeightTransferInit.model_validate(group)
    assert full.problems("nccl") == full.problems("gloo") == []
    assert full.rendezvous().master_port == 29500
    # vLLM's IPCWeightTransferInitInfo takes no field: a rendezvous sent to an ipc server is refused, by name
    assert [p.split(":")[0] for p in full.problems("ipc")] == [f"init_info.{f}" for f in group]
    assert WeightTransferInit(timeout_seconds=3).problems("ipc") == []  # our own extension is fine anywhere
    partial = WeightTransferInit.model_validate({"master_address": "h", "world_size": 2})
    assert [p.split(":")[0] for p in partial.problems("nccl")] == ["init_info.master_port", "init_info.rank_offset"]
    with pytest.raises(ValueError, match=r"init_info\.master_port"):
        partial.rendezvous()
    assert "rank_offset" in WeightTransferInit.model_validate({**group, "rank_offset": 2}).problems("nccl")[0]
    for field, value in (("master_address", "a b"), ("master_port", 0), ("rank_offset", 0), ("world_size", 1)):
        assert field in refusal(WeightTransferInit, {**group, field: value})


def test_check_update_wants_handles_for_ipc_and_none_for_the_broadcast_backends():
    params: dict[str, tuple[tuple[int, ...], str]] = {f"w{i}": ((4, 8), "float32") for i in range(2)}
    with_handles = WeightUpdateInfo.model_validate(info(2))
    bare = WeightUpdateInfo.model_validate(info(2, ipc_handles=None))
    check_update(with_handles, params, "ipc")
    check_update(bare, params, "nccl")
    for update, backend in ((bare, "ipc"), (with_handles, "nccl"), (with_handles, "gloo")):
        with pytest.raises(ApiError) as refused:
            check_update(update, params, backend)
        assert refused.value.status_code == 400 and refused.value.message.startswith("update_info.ipc_handles:")


def torch_reduce_args() -> tuple[Any, ...]:
    """What `reduce_tensor` gives for a CUDA float32 [4, 8] tensor (its rebuild arguments), without a GPU."""
    return (torch.Tensor, torch.Size([4, 8]), (8, 1), 8, torch.storage.TypedStorage, torch.float32, 0,
            bytes(range(64)), 160, 512, False, b"/torch_1234_5678_0", 3, b"e" * 64, True)


def test_the_trainer_s_json_rebuilds_to_torch_s_own_arguments(monkeypatch):
    from grpo_trainer.transport import weight_ipc

    monkeypatch.setattr(weight_ipc, "reduce_tensor", lambda tensor: ("rebuild_cuda_tensor", torch_reduce_args()))
    sent = weight_ipc.ipc_handle(torch.zeros(4, 8))
    json.dumps(sent)  # JSON-serialisable as it is
    update = WeightUpdateInfo.model_validate(info(1, ipc_handles=[{UUID: sent}]))
    rebuilt = vllm_weights.vllm_ipc_handles(update)
    assert rebuilt == [{UUID: torch_reduce_args()}]
    assert rebuilt[0][UUID][4] is torch.storage.TypedStorage and rebuilt[0][UUID][5] is torch.float32


def test_the_server_picks_classes_and_dtype_and_pickles_only_its_allowlist():
    update = WeightUpdateInfo.model_validate(info(2, dtype_names=["bfloat16"] * 2, ipc_handles=[
        {UUID: handle(dtype="bfloat16", requires_grad=True, tensor_cls="os.system")} for _ in range(2)]))
    args = vllm_weights.vllm_ipc_handles(update)[1][UUID]
    assert args[0] is torch.Tensor and args[4] is torch.storage.TypedStorage
    assert args[5] is torch.bfloat16 and args[10] is False  # requires_grad is the server's, not the request's
    sent = vllm_weights.vllm_update_info(update, "ipc")
    assert set(sent) == {"names", "dtype_names", "shapes", "packed", "ipc_handles_pickled"}
    raw = base64.b64decode(sent["ipc_handles_pickled"])
    named: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            named.add((module, name))
            return super().find_class(module, name)

    assert Recording(io.BytesIO(raw)).load() == vllm_weights.vllm_ipc_handles(update)
    assert named == {("torch", "Tensor"), ("torch.storage", "TypedStorage"), ("torch", "bfloat16")}

    nccl = vllm_weights.vllm_update_info(WeightUpdateInfo.model_validate(info(1, ipc_handles=None)), "nccl")
    assert nccl == {"names": ["w0"], "dtype_names": ["float32"], "shapes": [[4, 8]], "packed": False}


def test_checkpoint_tensors_reads_names_shapes_and_dtypes_from_the_headers(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.zeros(8, dtype=torch.bfloat16), "lm.w": torch.zeros(2, 3)},
              str(tmp_path / "model.safetensors"))
    assert vllm_weights.checkpoint_tensors(tmp_path) == {
        "model.norm.weight": ((8,), "bfloat16"), "lm.w": ((2, 3), "float32")}
    assert vllm_weights.checkpoint_tensors(tmp_path / "none") == {}


def test_an_update_must_carry_every_tensor_vllm_loads_and_no_tensor_it_skips(tmp_path):
    """Older checkpoints hold rotary buffers (`inv_freq`; ColossalAI's cos/sin caches) that vLLM's
    `load_weights` skips and no trainer sends; a tied `lm_head` is the embedding's."""
    from safetensors.torch import save_file

    tensors = {"model.embed_tokens.weight": torch.zeros(4, 2), "lm_head.weight": torch.zeros(4, 2),
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2),
               "model.layers.0.self_attn.q_proj.bias": torch.zeros(2),
               "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(1),
               "model.layers.0.self_attn.rotary_emb.cos_cached": torch.zeros(1),
               "model.layers.0.self_attn.rotary_emb.sin_cached": torch.zeros(1)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    receiver = vllm_weights.VllmWeightReceiver("ipc", lambda: None, tmp_path, lambda: 1)  # type: ignore[arg-type, return-value]
    loaded = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.self_attn.q_proj.bias"}
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    assert receiver.required() == loaded
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    assert receiver.required() == loaded | {"lm_head.weight"}
    assert set(receiver.parameters()) == set(tensors)  # an update may still name them


def test_the_in_place_payload_is_plain_values_that_rebuild_to_the_same_arguments_on_the_worker_s_device():
    """In place, the handles reach vLLM's workers through msgpack (`collective_rpc`), so they travel as plain
    values; the worker adds torch's classes back and names its own device, as vLLM's receiver does."""
    update = WeightUpdateInfo.model_validate(info(2, dtype_names=["bfloat16"] * 2, ipc_handles=[
        {UUID: handle(dtype="bfloat16")}, {UUID: handle(dtype="bfloat16", tensor_offset=0)}]))
    names, handles = vllm_weights.in_place_payload(update)
    assert names == ["w0", "w1"]
    plain_types = (list, int, str, bytes, bool, type(None))
    assert all(isinstance(value, plain_types) for offers in handles for value in offers[UUID])
    for offers, rebuilt in zip(handles, vllm_weights.vllm_ipc_handles(update), strict=True):
        expected = list(rebuilt[UUID])
        assert vllm_weights.rebuild_from_plain(offers[UUID]) == tuple(expected)
        expected[6] = 5
        assert vllm_weights.rebuild_from_plain(offers[UUID], 5) == tuple(expected)
    with pytest.raises(ValueError, match=r"^update_info\.ipc_handles: required"):
        vllm_weights.in_place_payload(WeightUpdateInfo.model_validate(info(1, ipc_handles=None)))


class RecordingLLM:
    """Records the AsyncLLM calls a receiver makes (each answers at once)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args + tuple(kwargs.get("args", ()))))
            return [2] if name == "collective_rpc" else None
        return call


def test_an_in_place_receiver_opens_no_layerwise_reload_and_restores_from_disk_alone(tmp_path):
    asyncio.run(in_place_then_layerwise(tmp_path))


async def in_place_then_layerwise(tmp_path: Any) -> None:
    llm = RecordingLLM()
    receiver = vllm_weights.VllmWeightReceiver("ipc", lambda: llm, tmp_path, lambda: 1)  # type: ignore[arg-type, return-value]
    receiver.loads_in_place = True
    update = WeightUpdateInfo.model_validate(info(2))
    await receiver.start()
    await receiver.receive(update, timeout=5)
    assert await receiver.commit() == 2
    assert [name for name, _ in llm.calls] == ["collective_rpc", "reset_prefix_cache"]
    assert llm.calls[0][1] == (vllm_weights.LOAD_IN_PLACE, *vllm_weights.in_place_payload(update))
    llm.calls.clear()
    await receiver.restore()
    assert [name for name, _ in llm.calls] == ["collective_rpc", "reset_prefix_cache"]
    assert llm.calls[0][1] == ("reload_weights",)  # vLLM's path closes its open layerwise reload first
