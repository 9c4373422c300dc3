"""Inference engines behind one interface (`base.Engine`): vllm (GPU) and transformers (CPU/GPU).

`create_engine` imports an engine's module only when that engine is selected, so
vLLM is never imported where it is not installed.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_api.models import ServerSpec
from grpo_server.engines.base import Engine

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

ENGINES = ("vllm", "transformers")


def vllm_usable() -> bool:
    """`import vllm` works and a CUDA device is visible."""
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("vllm")
    except Exception as exc:  # a broken install falls back to transformers, loudly
        log.warning("vllm is installed but does not import (%s): using the transformers engine", exc)
        return False
    return True


def choose_engine(requested: str) -> str:
    """`auto` resolves to vllm when it can run here, else transformers."""
    if requested == "auto":
        return "vllm" if vllm_usable() else "transformers"
    if requested not in ENGINES:
        raise ValueError(f"engine must be one of auto, {', '.join(ENGINES)}; got {requested!r}")
    return requested


class EngineUnavailable(RuntimeError):
    """The engine asked for cannot run in this process; the message says why and what to change."""


def require_cuda_for_vllm() -> None:
    """vLLM 0.26's server runs on CUDA GPUs only: without one it fails deep in its platform detection, so
    say plainly what is missing, before importing it."""
    if importlib.util.find_spec("vllm") is None:
        raise EngineUnavailable(
            "spec.server.engine vllm: this image has no vLLM (`import vllm` finds no module); use the server image "
            "built with ENGINE=vllm (Dockerfile.server's default), or engine transformers")
    import torch

    if not torch.cuda.is_available():
        raise EngineUnavailable(
            "spec.server.engine vllm needs a CUDA GPU and this process sees none (torch.cuda.is_available() is "
            f"False; {torch.cuda.device_count()} devices): no NVIDIA driver, or no GPU given to the container (ask "
            "for nvidia.com/gpu in spec.server.resources); engine transformers runs on a CPU")


def create_engine(
    kind: str, model_dir: Path, served_name: str, server: ServerSpec, tokenizer: PreTrainedTokenizerBase,
    weight_transfer: str | None = None, adapter_loads: str = "gpu", weight_loads: str = "in-place",
    logprob_transport: str = "compact",
) -> Engine:
    """A not-yet-started engine of `kind` (vllm or transformers).

    `weight_transfer` is the vllm engine's backend for vLLM's weight transfer (nccl, ipc; None: off);
    the transformers engine always receives over gloo and ignores it. `adapter_loads` (gpu, host) is where the
    vllm engine's workers load adapters; the transformers engine loads them with PEFT and ignores it.
    `weight_loads` (layerwise, in-place) is how the vllm engine loads weights pushed over ipc.
    `logprob_transport` (compact, vllm) is how the vllm engine's core hands logprobs to the server.
    """
    if kind == "vllm":
        require_cuda_for_vllm()
        from grpo_server.engines.vllm_engine import VllmEngine

        return VllmEngine(model_dir, served_name, server, tokenizer, weight_transfer=weight_transfer,
                          adapter_loads=adapter_loads, weight_loads=weight_loads,
                          logprob_transport=logprob_transport)
    from grpo_server.engines.transformers_engine import TransformersEngine

    return TransformersEngine(model_dir, tokenizer, dtype=str(server.dtype), max_model_len=server.max_model_len)
