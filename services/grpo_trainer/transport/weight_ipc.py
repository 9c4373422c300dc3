"""The trainer's side of the ipc weight transfer: CUDA tensors as the JSON `update_info` of `/update_weights`.

With the ipc backend the trainer and the server share a GPU: instead of sending bytes, the trainer
sends a CUDA IPC handle per tensor (`grpo_api.weight_transfer.CudaIpcHandle`), and the server's
vLLM workers map the trainer's memory and copy from it. vLLM's own HTTP client sends the handles as a
pickle (`ipc_handles_pickled`), which this server refuses; this module writes the JSON form.

Tensors that are views of one storage (a snapshot packs its copies into one buffer) carry the same
allocation handle: torch's `rebuild_cuda_tensor` on the server keeps the storages it opened by handle, so
it opens that allocation once per update rather than once per tensor. Each entry still gets its own
`reduce_tensor` call, as `torch.multiprocessing` sends each tensor: every call takes a fresh slot of
torch's shared reference counter, which the server releases at once when the storage is already open.
One slot for every view (an earlier form) was released once per view, so the counter never returned to
zero and every pushed buffer stayed allocated: a full-fine-tuning run ran out of GPU memory after eight
pushes of 2.7 GB (H100, 2026-12-06).

The tensors are shared, not copied: the caller keeps every tensor alive and unchanged until
`/finish_weight_update` has answered (vLLM reads each tensor during `/update_weights`, but a layer
whose tensors span several `/update_weights` calls is read only once it is complete, and layers are
completed at the latest in `/finish_weight_update`), then may free them; `torch.cuda.ipc_collect()`
releases what the server let go of.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from grpo_api.weight_transfer import DTYPE_BYTES, WeightUpdateInfo


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def ipc_handle(tensor: torch.Tensor) -> dict[str, Any]:
    """The JSON form of one CUDA tensor's IPC handle (`CudaIpcHandle`), from torch's `reduce_tensor`."""
    _, args = reduce_tensor(tensor.detach())
    (_, size, stride, tensor_offset, _, _, device, storage_handle, storage_size_bytes, storage_offset_bytes, _,
     ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args
    return {
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "size": [int(d) for d in size],
        "stride": [int(d) for d in stride],
        "tensor_offset": int(tensor_offset),
        "device_index": int(device),
        "storage_handle": _b64(storage_handle),
        "storage_size_bytes": int(storage_size_bytes),
        "storage_offset_bytes": int(storage_offset_bytes),
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": _b64(event_handle) if event_handle is not None else None,
        "event_sync_required": bool(event_sync_required),
    }


def ipc_update_info(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """`update_info` for `/update_weights` on an ipc server: names, dtype_names, shapes and ipc_handles.

    Each tensor must be a dense CUDA tensor of float32, bfloat16 or float16 under its checkpoint name;
    it is offered from the GPU it lives on (by that GPU's UUID, which the server's worker matches with
    its own). The result is checked with the server's own model before it is returned, so a refusal
    here names the field the server would. Keep the tensors alive until `/finish_weight_update`
    answered (see the module doc).
    """
    names: list[str] = []
    dtype_names: list[str] = []
    shapes: list[list[int]] = []
    handles: list[dict[str, dict[str, Any]]] = []
    uuids: dict[int, str] = {}
    for name, tensor in named_tensors:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if not tensor.is_cuda:
            raise ValueError(f"{name}: on {tensor.device}; CUDA IPC shares CUDA tensors only")
        if tensor.layout != torch.strided:
            raise ValueError(f"{name}: {tensor.layout} tensors cannot be shared; send dense tensors")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"{name}: dtype {dtype}; the server takes {', '.join(DTYPE_BYTES)}")
        index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        if index not in uuids:
            uuids[index] = str(torch.cuda.get_device_properties(index).uuid)
        names.append(name)
        dtype_names.append(dtype)
        shapes.append([int(d) for d in tensor.shape])
        handles.append({uuids[index]: ipc_handle(tensor)})
    info = {"names": names, "dtype_names": dtype_names, "shapes": shapes, "ipc_handles": handles}
    WeightUpdateInfo.model_validate(info)
    return info
