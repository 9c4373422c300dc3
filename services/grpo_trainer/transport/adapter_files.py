"""Writing a LoRA adapter for the server: serving dtype, hashed as it is written.

PEFT's `save_pretrained` writes the trainable float32 weights, a model card, and
leaves the publisher to read every byte back to checksum it. A served adapter needs
neither the float32 precision (vLLM casts LoRA weights to the model's dtype, so a
bf16 model serves bf16 LoRA weights either way) nor the card. `write_adapter`
writes the same tensors PEFT would save (`get_peft_model_state_dict`) in the serving
dtype and returns the digests for the manifest. Checkpoints for resuming are TRL's
own and keep full precision.

The file is safetensors, laid out here rather than by `safetensors.torch.save`: the
tensors are cast and concatenated where they live (the GPU, for a GPU trainer) and
copied to the host once; the 8-byte header length, the JSON header and that one
buffer are hashed while they are written, with no serialised copy in between (the
library's save copies the 74 MB of an r=32 adapter of a 1.5B model twice). Readers
are the library's own (`safe_open` in the server's checks, vLLM, PEFT).

Taking the bytes (`snapshot_*`: the cast, the one copy to the host) is separate from
writing them (`AdapterSnapshot.write`), so the trainer can snapshot at the end of a
step and write, hash and trigger in the background while the next step trains. On a
GPU the snapshot does not even wait for its copy: the copy into pinned memory is queued
behind the step's optimizer kernels and `write` waits for its event.
"""

from __future__ import annotations

import copy
import json
import struct
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_api.adapters import write_file_hashed
from grpo_trainer.errors import TrainingFailed

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: Serving dtypes an adapter may be published in; anything else keeps float32.
HALF_DTYPES = ("bfloat16", "float16")
#: safetensors' names for the dtypes adapters are published in.
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


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


@dataclass(frozen=True)
class AdapterSnapshot:
    """An adapter's files as bytes on the host, independent of the (still training) model."""

    #: 8-byte header length + JSON header of adapter_model.safetensors.
    weights_prefix: bytes
    #: The tensor data of adapter_model.safetensors (a view of one host buffer).
    weights_data: memoryview
    config: bytes
    #: A CUDA event recorded after the copy into `weights_data` when that copy is still running
    #: (a GPU model's snapshot does not wait for the queued optimizer kernels); None: the bytes are there.
    copied: Any = None

    @property
    def size_bytes(self) -> int:
        return len(self.weights_prefix) + self.weights_data.nbytes + len(self.config)

    def write(self, directory: Path) -> dict[str, str]:
        """Write adapter_model.safetensors and adapter_config.json; return {file: digest}.

        Nothing is fsynced here: `AdapterStore` flushes a version's tree once (before its rename, or beside the
        server's load), so its phases show the write and the flush apart."""
        if self.copied is not None:
            self.copied.synchronize()
        directory.mkdir(parents=True, exist_ok=True)
        digests = {ADAPTER_WEIGHTS: write_file_hashed(directory / ADAPTER_WEIGHTS, self.weights_prefix,
                                                      self.weights_data)}
        digests[ADAPTER_CONFIG] = write_file_hashed(directory / ADAPTER_CONFIG, self.config)
        return digests


def snapshot_adapter(tensors: Mapping[str, Any], config: Mapping[str, Any], *, dtype: str) -> AdapterSnapshot:
    """The files of an adapter with these tensors (cast to `dtype`) and adapter_config.json content."""
    prefix, data, copied = safetensors_parts(tensors, dtype)
    config_bytes = json.dumps(dict(config), indent=2, sort_keys=True).encode()
    return AdapterSnapshot(weights_prefix=prefix, weights_data=data, config=config_bytes, copied=copied)


def write_adapter(
    directory: Path, tensors: Mapping[str, Any], config: Mapping[str, Any], *, dtype: str
) -> dict[str, str]:
    """Write adapter_model.safetensors (in `dtype`) and adapter_config.json; return {file: sha256}."""
    return snapshot_adapter(tensors, config, dtype=dtype).write(directory)


def safetensors_parts(tensors: Mapping[str, Any], dtype: str) -> tuple[bytes, memoryview, Any]:
    """(8-byte length + JSON header, tensor data, copy event) of a safetensors file of `tensors` in `dtype`.

    For CUDA tensors the data is copied into pinned host memory without waiting: the copy is queued
    behind the kernels already on the stream (the step's optimizer), the event returned marks its end,
    and the data may be read only after `event.synchronize()`. For host tensors the event is None.
    """
    import torch

    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"adapters are published as {', '.join(SAFETENSORS_DTYPES)}, not {dtype}")
    target = getattr(torch, dtype)
    names = sorted(tensors)
    for name in names:
        if not tensors[name].is_floating_point():
            raise ValueError(f"adapter tensor {name} is {tensors[name].dtype}, not floating point")
    if names:  # one cast of the packed buffer (cat promotes mixed dtypes exactly), not a cast per tensor
        flat = torch.cat([tensors[name].detach().reshape(-1) for name in names]).to(target)
    else:
        flat = torch.empty(0, dtype=target)
    copied = None
    if flat.is_cuda:  # one device-to-host copy for the whole adapter, not waited for here
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
    else:
        host = flat.cpu()  # cat made a new tensor: the snapshot does not share the model's memory
    width = host.element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        size = tensors[name].numel() * width
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8 bytes with spaces
    data = host.view(torch.uint8).numpy().data
    return struct.pack("<Q", len(encoded)) + encoded, data, copied


def peft_adapter(model: Any, adapter_name: str = "default") -> tuple[dict[str, Any], dict[str, Any]]:
    """The tensors and adapter_config.json content PEFT's save_pretrained would write for `model`.

    PEFT finds the adapter's tensors by the names of its layers, which wrappers (activation checkpointing,
    FSDP1, torch.compile) lengthen while the state dict's keys stay short: PEFT then finds none. So the
    tensors are looked up among the parameters, named as the modules nest, and the wrappers' segments
    dropped from the names afterwards. Under FSDP the tensors are shards (DTensors): each is gathered whole,
    which is a collective, so every process of the run must call this at the same point, in the same order.

    PEFT's search walks the module tree once per module (33 ms for 28 layers on the H100's host, on the
    training loop's path at every publish: BENCHMARKS.md, sixth lease), and its answer, which parameter each
    key is, does not change while the model trains: it is found once per model and adapter (`_adapter_layout`)
    and the parameters are looked up by name at each call, so a replaced parameter is read where it now is.
    """
    from torch.distributed.tensor import DTensor

    parameters = dict(model.named_parameters())
    layout = _adapter_layout(model, adapter_name, parameters)
    found: list[tuple[str, Any]]
    if layout.keys is None:
        found = list(_peft_state_dict(model, adapter_name, parameters).items())
    else:
        found = [(key, parameters[name]) for key, name in layout.keys]
    tensors = {key: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor for key, tensor in found}
    return tensors, copy.deepcopy(layout.config)


@dataclass(frozen=True)
class AdapterLayout:
    """Where an adapter's tensors are among a model's parameters, and its adapter_config.json content."""

    #: (the key PEFT saves the tensor under, wrappers' segments dropped; the parameter's name), PEFT's order;
    #: None where PEFT hands back tensors that are not parameters: it is asked again at every call.
    keys: tuple[tuple[str, str], ...] | None
    config: dict[str, Any]
    #: How many parameters the model had when this was found (another count: the model changed, find again).
    parameter_count: int

    def fits(self, parameters: Mapping[str, Any]) -> bool:
        return len(parameters) == self.parameter_count and all(name in parameters for _, name in self.keys or ())


#: Layouts found, by model (weakly: a model let go of takes its entry with it) and adapter name.
_LAYOUTS: weakref.WeakKeyDictionary[Any, dict[str, AdapterLayout]] = weakref.WeakKeyDictionary()


def _adapter_layout(model: Any, adapter_name: str, parameters: Mapping[str, Any]) -> AdapterLayout:
    known = _LAYOUTS.get(model, {}).get(adapter_name)
    if known is not None and known.fits(parameters):
        return known
    layout = find_adapter_layout(model, adapter_name, parameters)
    _LAYOUTS.setdefault(model, {})[adapter_name] = layout
    return layout


def _peft_state_dict(model: Any, adapter_name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    """PEFT's own search for the adapter's tensors among `parameters`, keyed as PEFT saves them."""
    from peft import get_peft_model_state_dict

    found = get_peft_model_state_dict(model, adapter_name=adapter_name, state_dict=dict(parameters))
    if not found:
        raise TrainingFailed(f"the model holds no tensors of LoRA adapter {adapter_name!r}: nothing to publish")
    return {_unwrapped_name(key): tensor for key, tensor in found.items()}


def find_adapter_layout(model: Any, adapter_name: str, parameters: Mapping[str, Any]) -> AdapterLayout:
    """Which parameter each of the adapter's tensors is (by PEFT's search), and its adapter_config.json."""
    found = _peft_state_dict(model, adapter_name, parameters)
    names = {id(tensor): name for name, tensor in parameters.items()}
    keys = None
    if all(id(tensor) in names for tensor in found.values()):
        keys = tuple((key, names[id(tensor)]) for key, tensor in found.items())
    config = copy.deepcopy(model.peft_config[adapter_name])
    config.inference_mode = True
    base = model.base_model.model
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = getattr(base, "name_or_path", None) or None
    content = _json_ready(config.to_dict())
    if config.task_type is None:  # as PEFT records it, so its loaders can find the model class
        content["auto_mapping"] = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    return AdapterLayout(keys=keys, config=content, parameter_count=len(parameters))


#: Name segments wrappers add to a module's parameters (activation checkpointing, FSDP1, torch.compile).
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def _unwrapped_name(name: str) -> str:
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def snapshot_peft_adapter(model: Any, *, dtype: str) -> AdapterSnapshot:
    """The publish-ready files of a PEFT model's adapter, taken now (the model may train on)."""
    tensors, config = peft_adapter(model)
    return snapshot_adapter(tensors, config, dtype=dtype)


def save_peft_adapter(model: Any, directory: Path, *, dtype: str) -> dict[str, str]:
    """Publish-ready save of a PEFT model's adapter; returns {file: sha256}."""
    return snapshot_peft_adapter(model, dtype=dtype).write(directory)


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
