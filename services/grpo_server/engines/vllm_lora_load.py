"""Adapter loads straight onto the GPU in vLLM's worker (issue 28: an adapter sync of at most 100 ms).

vLLM 0.26 loads every LoRA adapter to "cpu" (`LRUCacheWorkerLoRAManager._load_adapter` passes
`device="cpu"` to `LoRAModel.from_local_checkpoint`): each of the adapter's tensors is cast and pinned one
by one, the q/k/v and gate/up pairs are packed on the host and pinned again, and only activation copies
them into the GPU slots. On the H200 that load was 0.15-0.27 s of a 0.2-0.3 s sync (BENCHMARKS.md), most
of it pinning. Loading onto the worker's GPU instead makes the cast, the packing and the copy into the
slots device work; the cost is the registered versions' bytes in GPU memory (`max_cpu_loras` of them,
37 MB each for an r=32 all-linear bf16 adapter of a 1.5B model), outside the KV cache's share.

The switch runs in the worker process, which the engine core spawns: vLLM's own `worker_extension_cls`
mixes `LoraLoadDevice` into its worker class there (through `vllm_worker.WorkerExtension`), and the server
calls `grpo_set_lora_load_device` on every worker through `collective_rpc` once the engine is up. Nothing
of vLLM is patched: the worker's LoRA manager takes its `LoRAModel` class as a constructor argument, and
this sets that attribute to a subclass that names the device.
"""

from __future__ import annotations

import inspect
from typing import Any

#: The worker method the server calls through `collective_rpc`.
SET_DEVICE = "grpo_set_lora_load_device"


def surface_problems() -> list[str]:
    """What of vLLM's surface this relies on is missing from the installed vLLM (empty: all of it is there).

    Checked by the GPU server image's smoke test (hack/gpu-image-smoke.sh), where vLLM imports without a GPU."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.worker_manager import WorkerLoRAManager
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    problems = []
    if "worker_extension_cls" not in inspect.signature(AsyncEngineArgs).parameters:
        problems.append("AsyncEngineArgs has no worker_extension_cls")
    if "worker_extension_cls" not in inspect.getsource(WorkerWrapperBase):
        problems.append("vLLM's worker wrapper no longer mixes in worker_extension_cls")
    if "device" not in inspect.signature(LoRAModel.from_local_checkpoint).parameters:
        problems.append("LoRAModel.from_local_checkpoint takes no device")
    if "self._lora_model_cls.from_local_checkpoint(" not in inspect.getsource(WorkerLoRAManager._load_adapter):
        problems.append("WorkerLoRAManager._load_adapter no longer loads through self._lora_model_cls")
    return problems


def _model_class_on(device: Any) -> type:
    """A `LoRAModel` whose checkpoint loads land on `device`, whatever device the caller names."""
    from vllm.lora.lora_model import LoRAModel

    class DeviceLoRAModel(LoRAModel):
        @classmethod
        def from_local_checkpoint(cls, *args: Any, **kwargs: Any) -> Any:
            kwargs["device"] = str(device)
            return super().from_local_checkpoint(*args, **kwargs)

    DeviceLoRAModel.__qualname__ = f"LoRAModel on {device}"
    return DeviceLoRAModel


class LoraLoadDevice:
    """Mixed into vLLM's worker class (so `self` is the worker): where its adapter loads land."""

    def grpo_set_lora_load_device(self, on_device: bool) -> str:
        """Loads onto the worker's GPU (True) or vLLM's pinned host memory (False); returns where they land.

        "no-lora" when the engine runs without LoRA (no adapter manager to switch)."""
        worker: Any = self
        manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
        if manager is None:
            return "no-lora"
        from vllm.lora.lora_model import LoRAModel

        if on_device:
            manager._lora_model_cls = _model_class_on(worker.device)
            return str(worker.device)
        manager._lora_model_cls = LoRAModel
        return "cpu"
