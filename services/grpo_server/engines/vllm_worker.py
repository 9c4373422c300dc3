"""What this server mixes into vLLM's worker class: one `worker_extension_cls` (vLLM takes one) for two jobs.

- `LoraLoadDevice` (vllm_lora_load.py): adapter loads straight onto the worker's GPU;
- `WeightsInPlace` (vllm_weights.py): ipc weight updates copied straight into the live model.

Neither changes anything until the server calls its methods through `collective_rpc`.
"""

from __future__ import annotations

from grpo_server.engines.vllm_lora_load import LoraLoadDevice
from grpo_server.engines.vllm_weights import WeightsInPlace

#: vLLM's qualified name for the extension (AsyncEngineArgs.worker_extension_cls).
EXTENSION = f"{__name__}.WorkerExtension"


class WorkerExtension(LoraLoadDevice, WeightsInPlace):
    """Mixed into vLLM's worker class (so `self` is the worker)."""
