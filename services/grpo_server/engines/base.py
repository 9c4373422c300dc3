"""The engine contract: what the HTTP layer asks of an inference engine.

Prompts arrive as token ids (the server tokenizes text and chat prompts itself),
sampling options are engine-neutral, and every completion carries the token ids,
the logprob of each sampled token after temperature/top-k/top-p/min-p processing
(vLLM's `processed_logprobs`) and why it stopped. Adapters are named per version
(`policy-v<N>`) with their own integer id; an engine never reloads a name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling parameters of one request, with vLLM's meanings."""

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
    regex: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


@dataclass(frozen=True)
class PromptResult:
    """The n completions of one prompt."""

    prompt_token_ids: list[int]
    completions: list[Completion] = field(default_factory=list)


@dataclass(frozen=True)
class AdapterHandle:
    """A LoRA adapter as an engine knows it: unique name and id per version."""

    name: str
    int_id: int
    path: str


class EngineError(RuntimeError):
    """The engine failed to serve a request that was valid."""


class InvalidRequestError(ValueError):
    """The engine refused a request's parameters (mapped to a 400)."""


class AdapterLoadError(RuntimeError):
    """The engine could not load an adapter that passed the server's checks."""


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
        """n completions per prompt, prompt-major, on `adapter` (None: the base model)."""

    async def add_adapter(self, adapter: AdapterHandle) -> None:
        """Load an adapter so later requests can use it; raises AdapterLoadError."""

    async def remove_adapter(self, adapter: AdapterHandle) -> None:
        """Unload an adapter no request uses any more."""

    async def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes; True when the cache was reset."""

    async def shutdown(self) -> None:
        """Stop the engine and its child processes or threads."""
