"""The checks every generation request passes against the engine's limits.

Pure functions: they raise `BadRequest` naming the field (a 400). The limits are the
engine's (`max_model_len`) and the tokenizer's. Request fields become `SamplingOptions`
on the request models themselves (`grpo_server.schemas`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from grpo_server.engines.base import SamplingOptions
from grpo_server.errors import BadRequest

#: Sequences (prompts × n) one request may ask for: bounds memory, not throughput.
MAX_SEQUENCES_PER_REQUEST = 4096


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int  # token ids the tokenizer knows: 0 .. vocab_size - 1


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
    token_lists = {
        "stop_token_ids": options.stop_token_ids,
        "logit_bias": [token for token, _ in options.logit_bias],
        "allowed_token_ids": options.allowed_token_ids or (),
    }
    for field, tokens in token_lists.items():
        bad = [t for t in tokens if t < 0 or t >= limits.vocab_size]
        if bad:
            raise BadRequest(f"{field} has token id {bad[0]} outside the vocabulary (0..{limits.vocab_size - 1})")
    if options.min_tokens > options.max_tokens:
        raise BadRequest(f"min_tokens ({options.min_tokens}) exceeds max_tokens ({options.max_tokens})")
    check_ranges(options)


#: Seeds the engines' generators take (signed 64-bit).
SEED_RANGE = (-(2**63), 2**63 - 1)
#: Stop token ids per request (vLLM's sampler holds at most 128 while min_tokens applies).
MAX_STOP_TOKEN_IDS = 128
#: Alternatives per token an engine returns at most (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


def check_ranges(options: SamplingOptions) -> None:
    """The last line before the engine, whatever the request form: finite numbers, bounded integers."""
    for item in dataclasses.fields(options):
        value = getattr(options, item.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise BadRequest(f"{item.name} must be a finite number, got {value}")
    if options.seed is not None and not SEED_RANGE[0] <= options.seed <= SEED_RANGE[1]:
        raise BadRequest(f"seed must be a signed 64-bit integer, got {options.seed}")
    if len(options.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids, got {len(options.stop_token_ids)}")
    if not 0 <= options.top_logprobs <= MAX_LOGPROBS:
        raise BadRequest(f"logprobs: 0 to {MAX_LOGPROBS} alternatives per token, got {options.top_logprobs}")
    if options.max_tokens < 1 or options.min_tokens < 0 or options.n < 1:
        raise BadRequest(
            f"max_tokens must be ≥ 1, min_tokens ≥ 0 and n ≥ 1 (got {options.max_tokens}, {options.min_tokens}, "
            f"{options.n})"
        )
