"""Server settings derived from the run-config (pure, apart from locating the model directory)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from grpo_api.models import ServerSpec
from grpo_api.protocol import ENV_ATTEMPT
from grpo_api.runconfig import RunConfig
from grpo_api.weight_transfer import ENV_WEIGHT_TRANSFER, resolve_weight_transfer

#: Largest request body accepted; more is answered 413. Overridable for very large token-id batches.
ENV_MAX_BODY_BYTES = "GRPO_SERVER_MAX_BODY_BYTES"
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
#: Largest header block (names and values, all headers) the app accepts; more is answered 431 with the
#: JSON error body. A bearer token or a W3C trace header is far below it.
MAX_HEADER_BYTES = 64 * 1024
#: What the HTTP parser (h11) buffers while a request's head is incomplete. Above MAX_HEADER_BYTES, so
#: every head up to it reaches the app however the network splits it (h11's 16 KiB default refused a
#: 100 KB head only when it arrived in pieces); a head over this is refused by uvicorn with a plain 400.
HTTP_HEAD_BUFFER_BYTES = 1024 * 1024
#: Set to 1 to let requests carry their own chat_template (Jinja run in the server): off by default.
ENV_ALLOW_CHAT_TEMPLATES = "GRPO_SERVER_ALLOW_CHAT_TEMPLATES"
#: Where the vllm engine's workers load adapters: `gpu` (the default: straight onto the worker's GPU,
#: engines/vllm_lora_load.py) or `host` (vLLM's own load into pinned host memory).
ENV_ADAPTER_LOADS = "GRPO_SERVER_ADAPTER_LOADS"
ADAPTER_LOADS = ("gpu", "host")
#: How the vllm engine loads weights pushed over ipc: `in-place` (the default: copied straight into the live
#: parameters, engines/vllm_weights.py; a quantized model still takes vLLM's path) or `layerwise` (vLLM's own
#: layerwise reload). A full push of the 1.5B shape took 0.080 s in place against 0.154 s layerwise (BENCHMARKS.md).
ENV_WEIGHT_LOADS = "GRPO_SERVER_WEIGHT_LOADS"
WEIGHT_LOADS = ("in-place", "layerwise")
#: How the vllm engine's core hands the sampled tokens' logprobs to this server: `compact` (the default: plain
#: lists, engines/vllm_compact_logprobs.py; checked against vLLM's own at start, and vLLM's is kept where they
#: differ or on another vLLM release) or `vllm` (three small arrays per request per step, as vLLM 0.26 does).
#: Generation with logprobs from a pushed-weights server: 19,512 tokens/s compact, 17,542 vllm (H100, BENCHMARKS.md).
ENV_LOGPROB_TRANSPORT = "GRPO_SERVER_LOGPROB_TRANSPORT"
LOGPROB_TRANSPORTS = ("compact", "vllm")
#: Listen address unless told otherwise: pods pass 0.0.0.0 explicitly.
DEFAULT_HOST = "127.0.0.1"
#: How long SIGTERM waits for in-flight requests before closing them.
GRACEFUL_SHUTDOWN_SECONDS = 20
#: How long a second adapter trigger waits for the first before it is refused.
TRIGGER_WAIT_SECONDS = 120.0


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    model_dir: Path
    adapter_root: Path
    progress_file: Path
    token: str | None
    engine: str  # requested: auto, vllm or transformers
    server: ServerSpec
    host: str
    port: int
    max_body_bytes: int
    run_name: str
    allow_chat_templates: bool = False
    #: vLLM's weight-transfer backend (ipc, nccl) for a full fine-tuning run; None: weight updates are off.
    weight_transfer: str | None = None
    #: The run's attempt this server belongs to ($GRPO_ATTEMPT, set by the operator and `grpo run`): requests
    #: tagged with an earlier attempt are refused. None (a server started by hand): no attempt is checked.
    attempt: int | None = None
    #: Where the vllm engine loads adapters (ADAPTER_LOADS); the transformers engine ignores it.
    adapter_loads: str = "gpu"
    #: How the vllm engine loads weights pushed over ipc (WEIGHT_LOADS); the transformers engine ignores it.
    weight_loads: str = "in-place"
    #: How the vllm engine's core hands logprobs to the server (LOGPROB_TRANSPORTS); the transformers engine has none.
    logprob_transport: str = "compact"


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def attempt_from(raw: str | None) -> int | None:
    """The server's attempt from ${ENV_ATTEMPT}; None when it is unset."""
    if raw is None or not raw.strip():
        return None
    if not raw.strip().isdigit() or len(raw.strip()) > 9:
        raise ValueError(f"${ENV_ATTEMPT}={raw[:40]!r} must be a whole number (the run's attempt)")
    return int(raw)


def choice_from(name: str, raw: str | None, choices: tuple[str, ...]) -> str:
    """The value of environment variable `name` among `choices`, the first when it is unset or empty."""
    value = (raw or "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"${name}={str(raw)[:40]!r} must be one of {', '.join(choices)}")
    return value


def adapter_loads_from(raw: str | None) -> str:
    """${ENV_ADAPTER_LOADS}: gpu (unset or empty) or host."""
    return choice_from(ENV_ADAPTER_LOADS, raw, ADAPTER_LOADS)


def weight_loads_from(raw: str | None) -> str:
    """${ENV_WEIGHT_LOADS}: in-place (unset or empty) or layerwise."""
    return choice_from(ENV_WEIGHT_LOADS, raw, WEIGHT_LOADS)


def logprob_transport_from(raw: str | None) -> str:
    """${ENV_LOGPROB_TRANSPORT}: compact (unset or empty) or vllm."""
    return choice_from(ENV_LOGPROB_TRANSPORT, raw, LOGPROB_TRANSPORTS)


def settings_from_config(
    config: RunConfig,
    *,
    host: str | None,
    port: int | None,
    engine: str | None,
    max_body_bytes: int | None = None,
    allow_chat_templates: bool | None = None,
) -> ServerSettings:
    server = config.spec.effective_server
    if max_body_bytes is None:
        raw = os.environ.get(ENV_MAX_BODY_BYTES, str(DEFAULT_MAX_BODY_BYTES))
        try:
            max_body_bytes = int(raw)
        except ValueError:
            raise ValueError(f"${ENV_MAX_BODY_BYTES}={raw!r} is not a number of bytes") from None
    if max_body_bytes < 1024:
        raise ValueError(f"the request body limit must be at least 1024 bytes, got {max_body_bytes}")
    return ServerSettings(
        served_model_name=config.spec.model.name,
        model_dir=config.model_dir(),
        adapter_root=Path(config.paths.adapter_root),
        progress_file=Path(config.paths.progress_file),
        token=config.read_token(),
        engine=engine or str(server.engine),
        server=server,
        host=host or DEFAULT_HOST,
        port=port or server.port,
        max_body_bytes=max_body_bytes,
        run_name=config.run.name,
        allow_chat_templates=(
            env_flag(ENV_ALLOW_CHAT_TEMPLATES) if allow_chat_templates is None else allow_chat_templates
        ),
        weight_transfer=resolve_weight_transfer(config.spec, os.environ.get(ENV_WEIGHT_TRANSFER)),
        attempt=attempt_from(os.environ.get(ENV_ATTEMPT)),
        adapter_loads=adapter_loads_from(os.environ.get(ENV_ADAPTER_LOADS)),
        weight_loads=weight_loads_from(os.environ.get(ENV_WEIGHT_LOADS)),
        logprob_transport=logprob_transport_from(os.environ.get(ENV_LOGPROB_TRANSPORT)),
    )
