"""The engine contract: what the HTTP layer asks of an inference engine.

Prompts arrive as token ids (the server tokenizes text and chat prompts itself),
sampling options are engine-neutral, and every completion carries the token ids,
the logprob of each sampled token after temperature/top-k/top-p/min-p processing
(vLLM's `processed_logprobs`) and why it stopped. Adapters are named per version
(`policy-v<N>`) with their own integer id; an engine never reloads a name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

from grpo_api.weight_transfer import WeightTransferInit, WeightUpdateInfo
from grpo_server.errors import ServerError

FinishReason = Literal["stop", "length"]

#: Kinds of structured output (guided decoding), by vLLM's `StructuredOutputsParams` names.
StructuredKind = Literal["regex", "json", "json_object", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredOutput:
    """One structured-output constraint: what the completion text must match."""

    kind: StructuredKind
    #: The regex or grammar text, or the JSON schema as JSON text ("" for json_object and choice).
    spec: str = ""
    choices: tuple[str, ...] = ()  # kind choice: the completion is exactly one of these

    def schema(self) -> dict[str, object]:
        """The JSON schema of a `json` constraint."""
        loaded = json.loads(self.spec)
        assert isinstance(loaded, dict)
        return loaded


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling parameters of one request, with vLLM's meanings.

    Logits are processed in vLLM's order: the structured-output mask, then
    allowed_token_ids, min_tokens, logit_bias, the penalties, temperature, min-p,
    top-k and top-p.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    top_logprobs: int = 0  # alternatives per position besides the sampled token
    #: The request asked for the sampled tokens' logprobs. False: an engine may give NaN logprobs and no
    #: alternatives (the vllm engine asks vLLM for none: computing and handing them over costs its engine core
    #: much of its speed, BENCHMARKS.md), and the response carries none.
    logprobs: bool = True
    #: Added to the raw logits of these token ids (sorted (token id, bias) pairs, bias in [-100, 100]).
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: Only these token ids may be sampled; None: any.
    allowed_token_ids: tuple[int, ...] | None = None
    #: Logprobs of each prompt token given its prefix, with this many alternatives; None: not asked.
    prompt_logprobs: int | None = None
    #: Structured output: a regex here (TRL's one kind), any other kind in `structured`.
    regex: str | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.structured is not None and (self.regex is not None or self.structured.kind == "regex"):
            raise ValueError("a regex goes in SamplingOptions.regex, other kinds in .structured; one at most")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def structured_output(self) -> StructuredOutput | None:
        """The structured-output constraint, whichever field carries it."""
        if self.regex is not None:
            return StructuredOutput("regex", self.regex)
        return self.structured


@dataclass(frozen=True)
class Completion:
    """One sampled continuation."""

    token_ids: list[int]
    logprobs: list[float]  # processed logprob of each sampled token
    #: Per position, (token id, logprob) pairs sorted by rank; the sampled token is always present.
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finish_reason: FinishReason
    stop_reason: int | str | None = None


class RankedLogprob(NamedTuple):
    """A token's logprob at one prompt position and its rank there (1: the most likely token)."""

    token_id: int
    logprob: float
    rank: int | None


#: Per prompt position, vLLM's layout: None at position 0 (no prefix), then the prompt token first and
#: the top alternatives after it (the prompt token once, even when it is among them).
PromptLogprobs = list[list[RankedLogprob] | None]


@dataclass(frozen=True)
class PromptResult:
    """The n completions of one prompt."""

    prompt_token_ids: list[int]
    completions: list[Completion] = field(default_factory=list)
    #: The raw model's logprobs of the prompt tokens, when the request asked for them.
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True)
class AdapterHandle:
    """A LoRA adapter as an engine knows it: unique name and id per version."""

    name: str
    int_id: int
    path: str


class EngineError(ServerError):
    """The engine failed to serve a request that was valid (503)."""

    default_status = 503
    default_error = "engine_error"


class InvalidRequestError(ServerError):
    """The engine refused a request's parameters (400)."""

    default_status = 400
    default_error = "invalid_request"


class GenerationAborted(Exception):
    """A generation stopped because its request was cancelled (the client left); nobody receives it."""


class AdapterLoadError(RuntimeError):
    """The engine could not load an adapter that passed the server's checks."""


class WeightTransferError(ServerError):
    """A weight transfer failed in the transport (rendezvous, a broadcast); the update cannot finish (503)."""

    default_status = 503
    default_error = "weight_transfer_failed"


class WeightReceiver(Protocol):
    """An engine's side of vLLM's weight transfer: join the trainer's group, receive tensors, apply them.

    Two kinds (`in_place`), and `weight_updates.WeightUpdates` keeps the same rules for both:

    - staging (the transformers engine's gloo): `receive` fills staging buffers while generation
      goes on, `commit` copies them into the model (the service runs it while no generation runs),
      and a failed `receive` leaves the served weights as they were;
    - in place (vLLM's own engine, nccl or ipc): `start` and `receive` load into the live model, so
      the service runs them, and `commit`, while no generation runs, from the update's first tensor
      to its end; an update that does not end in `commit` is undone with `restore`.
    """

    #: The transport, as vLLM's `weight_transfer_config.backend` names it (nccl, ipc), or gloo.
    backend: str
    #: True when `receive` writes into the served model (no staging).
    in_place: bool

    def parameters(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every parameter an update may name (checkpoint names): its shape and dtype name."""

    def required(self) -> frozenset[str]:
        """The tensors an update must carry before it may `commit` (empty: any of `parameters`)."""

    async def join(self, init: WeightTransferInit, timeout: float) -> None:
        """Join the trainer's transfer group (replacing an earlier one); raises WeightTransferError."""

    async def start(self) -> None:
        """Prepare the model for an update's tensors (in place: vLLM's `start_weight_update`); raises
        WeightTransferError."""

    async def receive(self, update: WeightUpdateInfo, timeout: float) -> None:
        """Receive the tensors `update` names, in its order (into staging, or in place); raises WeightTransferError."""

    async def commit(self) -> int:
        """Make the update the served weights (no generation runs meanwhile); how many tensors it had."""

    async def restore(self) -> None:
        """In place: load the checkpoint's weights from disk again over an unfinished update; raises when
        it cannot, and the served weights are then unknown."""

    def discard(self) -> None:
        """Drop staged tensors."""

    def close(self) -> None:
        """Leave the transfer group."""


class Engine(Protocol):
    """An inference engine serving one base model plus runtime LoRA adapters."""

    name: str

    async def start(self) -> None:
        """Load the model; returns when a generation can be served."""

    @property
    def max_model_len(self) -> int:
        """Longest prompt + completion, in tokens."""

    @property
    def world_size(self) -> int:
        """Devices serving the model (TP × PP × DP)."""

    def healthy(self) -> bool:
        """False once the engine can no longer serve (dead worker, dead engine core)."""

    async def generate(
        self, prompts: list[list[int]], options: SamplingOptions, adapter: AdapterHandle | None
    ) -> list[PromptResult]:
        """n completions per prompt, prompt-major, on `adapter` (None: the base model).

        Cancelling the awaiting task aborts the generation in the engine (the client left).
        """

    def serves_adapters(self) -> bool:
        """Whether the engine runs LoRA adapters (the vllm engine turns LoRA off when it takes whole weights)."""

    async def add_adapter(self, adapter: AdapterHandle) -> None:
        """Load an adapter so later requests can use it; raises AdapterLoadError."""

    async def remove_adapter(self, adapter: AdapterHandle) -> None:
        """Unload an adapter no request uses any more."""

    async def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes; True when the cache was reset."""

    def weight_receiver(self) -> WeightReceiver | None:
        """The engine's side of vLLM's weight transfer, or None when it cannot take one."""

    async def shutdown(self) -> None:
        """Stop the engine and its child processes or threads."""
