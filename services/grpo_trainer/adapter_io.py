"""Writing a LoRA adapter for the server: serving dtype, hashed as it is written.

PEFT's `save_pretrained` writes the trainable float32 weights, a model card, and
leaves the publisher to read every byte back to checksum it. A served adapter needs
neither the float32 precision (vLLM casts LoRA weights to the model's dtype, so a
bf16 model serves bf16 LoRA weights either way) nor the card. `write_adapter`
serialises the same tensors PEFT would save (`get_peft_model_state_dict`) in the
serving dtype, hashes the bytes while they are in memory, writes and fsyncs them,
and returns the digests for the manifest. Checkpoints for resuming are TRL's own
and keep full precision.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo_api.adapters import write_file_durably

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: Serving dtypes an adapter may be published in; anything else keeps float32.
HALF_DTYPES = ("bfloat16", "float16")


def publish_dtype(server_dtype: str, model_dir: Path) -> str:
    """The dtype adapters are published in: the server's 16-bit compute dtype, else float32.

    `auto` means the dtype in the model's config.json, as vLLM and the transformers engine read it.
    """
    if server_dtype in HALF_DTYPES or server_dtype == "float32":
        return server_dtype
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    configured = config.get("torch_dtype") or config.get("dtype")
    return configured if configured in HALF_DTYPES else "float32"


def write_adapter(
    directory: Path, tensors: Mapping[str, Any], config: Mapping[str, Any], *, dtype: str
) -> dict[str, str]:
    """Write adapter_model.safetensors (in `dtype`) and adapter_config.json; return {file: sha256}."""
    import torch
    from safetensors.torch import save

    target = getattr(torch, dtype)
    cpu = {
        name: (t.detach().to(target) if t.is_floating_point() else t.detach()).contiguous().cpu()
        for name, t in tensors.items()
    }
    directory.mkdir(parents=True, exist_ok=True)
    weights = save(cpu, metadata={"format": "pt"})
    digests = {ADAPTER_WEIGHTS: write_file_durably(directory / ADAPTER_WEIGHTS, weights)}
    config_bytes = json.dumps(dict(config), indent=2, sort_keys=True).encode()
    digests[ADAPTER_CONFIG] = write_file_durably(directory / ADAPTER_CONFIG, config_bytes)
    return digests


def peft_adapter(model: Any, adapter_name: str = "default") -> tuple[dict[str, Any], dict[str, Any]]:
    """The tensors and adapter_config.json content PEFT's save_pretrained would write for `model`."""
    from peft import get_peft_model_state_dict

    tensors = get_peft_model_state_dict(model, adapter_name=adapter_name)
    config = copy.deepcopy(model.peft_config[adapter_name])
    config.inference_mode = True
    base = model.base_model.model
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = getattr(base, "name_or_path", None) or None
    content = _json_ready(config.to_dict())
    if config.task_type is None:  # as PEFT records it, so its loaders can find the model class
        content["auto_mapping"] = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    return tensors, content


def save_peft_adapter(model: Any, directory: Path, *, dtype: str) -> dict[str, str]:
    """Publish-ready save of a PEFT model's adapter; returns {file: sha256}."""
    tensors, config = peft_adapter(model)
    return write_adapter(directory, tensors, config, dtype=dtype)


def _json_ready(value: Any) -> Any:
    """PEFT configs hold sets and enums; adapter_config.json holds lists and strings, as PEFT writes them."""
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_json_ready(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if hasattr(value, "value") and not isinstance(value, (str, int, float, bool)):
        return value.value
    return value
