"""From request fields to engine `SamplingOptions`, and the checks every generation request passes.

Pure functions: they raise `BadRequest` naming the field, and the HTTP layer turns
that into a 400. The limits are the engine's (`max_model_len`) and the tokenizer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo_server.engines.base import SamplingOptions
from grpo_server.schemas import SamplingFields

#: Sequences (prompts × n) one request may ask for: bounds memory, not throughput.
MAX_SEQUENCES_PER_REQUEST = 4096

#: `generation_kwargs` keys of `/generate/` (vLLM SamplingParams names) and their types.
GENERATION_KWARGS: dict[str, type | tuple[type, ...]] = {
    "seed": int,
    "stop": (str, list),
    "stop_token_ids": list,
    "ignore_eos": bool,
    "min_tokens": int,
    "frequency_penalty": (int, float),
    "presence_penalty": (int, float),
    "repetition_penalty": (int, float),
    "include_stop_str_in_output": bool,
    "skip_special_tokens": bool,
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": int,
    "min_p": (int, float),
    "max_tokens": int,
    "n": int,
    "logprobs": int,
}


class BadRequest(ValueError):
    """A request that cannot be served as asked; the message names the field."""

    def __init__(self, message: str, error: str = "invalid_request") -> None:
        super().__init__(message)
        self.error = error


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int  # token ids the tokenizer knows: 0 .. vocab_size - 1


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def regex_of(fields: SamplingFields) -> str | None:
    if fields.structured_outputs is not None and fields.structured_outputs.regex is not None:
        return fields.structured_outputs.regex
    return fields.guided_regex


def options_from_fields(fields: SamplingFields, *, max_tokens: int, top_logprobs: int) -> SamplingOptions:
    """SamplingOptions of an OpenAI-style request (max_tokens already resolved against the budget)."""
    return SamplingOptions(
        n=fields.n,
        temperature=fields.temperature,
        top_p=fields.top_p,
        top_k=fields.top_k if fields.top_k and fields.top_k > 0 else 0,
        min_p=fields.min_p or 0.0,
        repetition_penalty=fields.repetition_penalty,
        frequency_penalty=fields.frequency_penalty,
        presence_penalty=fields.presence_penalty,
        max_tokens=max_tokens,
        min_tokens=fields.min_tokens,
        seed=fields.seed,
        stop=stop_strings(fields.stop),
        stop_token_ids=tuple(fields.stop_token_ids or ()),
        include_stop_str_in_output=fields.include_stop_str_in_output,
        ignore_eos=fields.ignore_eos,
        skip_special_tokens=fields.skip_special_tokens,
        top_logprobs=top_logprobs,
        regex=regex_of(fields),
    )


def check_generation_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`/generate/`'s generation_kwargs: known keys with the right types, else BadRequest."""
    for key, value in kwargs.items():
        expected = GENERATION_KWARGS.get(key)
        if expected is None:
            known = ", ".join(sorted(GENERATION_KWARGS))
            raise BadRequest(f"generation_kwargs.{key} is not supported (supported: {known})")
        if isinstance(value, bool) and expected is not bool:
            raise BadRequest(f"generation_kwargs.{key} must be a number, got a boolean")
        if not isinstance(value, expected):
            raise BadRequest(f"generation_kwargs.{key} has the wrong type {type(value).__name__}")
    return kwargs


def check_prompts(prompts: list[list[int]], limits: Limits, field: str = "prompt") -> None:
    """Non-empty list of non-empty prompts of known token ids, each shorter than max_model_len."""
    if not prompts:
        raise BadRequest(f"{field}: the prompt list is empty")
    for i, ids in enumerate(prompts):
        if not ids:
            raise BadRequest(f"{field}[{i}] is empty")
        bad = [t for t in ids if t < 0 or t >= limits.vocab_size]
        if bad:
            raise BadRequest(
                f"{field}[{i}] has token id {bad[0]} outside the vocabulary (0..{limits.vocab_size - 1})"
            )
        if len(ids) >= limits.max_model_len:
            raise BadRequest(
                f"{field}[{i}] has {len(ids)} tokens; maxModelLen is {limits.max_model_len} "
                "(prompt plus at least one generated token)"
            )


def resolve_max_tokens(requested: int | None, prompts: list[list[int]], limits: Limits) -> int:
    """max_tokens, or the budget left by the longest prompt when None; BadRequest when over the budget."""
    longest = max(len(p) for p in prompts)
    budget = limits.max_model_len - longest
    if requested is None:
        return budget
    if requested > budget:
        raise BadRequest(
            f"max_tokens ({requested}) plus the longest prompt ({longest} tokens) exceeds "
            f"maxModelLen ({limits.max_model_len}); at most {budget} tokens can be generated"
        )
    return requested


def check_options(options: SamplingOptions, prompts: list[list[int]], limits: Limits) -> None:
    if options.n * len(prompts) > MAX_SEQUENCES_PER_REQUEST:
        raise BadRequest(
            f"n × prompts = {options.n * len(prompts)} sequences; at most {MAX_SEQUENCES_PER_REQUEST} per request"
        )
    bad = [t for t in options.stop_token_ids if t < 0 or t >= limits.vocab_size]
    if bad:
        raise BadRequest(f"stop_token_ids has token id {bad[0]} outside the vocabulary")
    if options.min_tokens > options.max_tokens:
        raise BadRequest(f"min_tokens ({options.min_tokens}) exceeds max_tokens ({options.max_tokens})")
