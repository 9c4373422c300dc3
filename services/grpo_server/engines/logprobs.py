"""Reading vLLM's flat logprobs (`vllm.logprobs.FlatLogprobs`) without per-token objects.

Pure: it reads the container's flat lists by attribute, so it is tested without vLLM.
vLLM's sampler puts the sampled token first at every position, then the top-k
alternatives by rank (the sampled token a second time when it is among them).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from grpo_server.engines.base import PromptLogprobs, RankedLogprob, SamplingOptions


class FlatLogprobsLike(Protocol):
    """The fields of `vllm.logprobs.FlatLogprobs` this module reads."""

    start_indices: list[int]
    end_indices: list[int]
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int | None]


def sampled_logprobs(flat: Any, positions: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Per position: the sampled token's logprob, and (token id, logprob) pairs ranked best first.

    `flat` is None when the request asked for no logprobs (NaN per position then).
    Raises ValueError when the container is not flat or does not cover every position.
    """
    if flat is None:
        return [math.nan] * positions, [[] for _ in range(positions)]
    if not all(hasattr(flat, name) for name in ("start_indices", "end_indices", "token_ids", "logprobs", "ranks")):
        raise ValueError(f"expected flat logprobs (flat_logprobs=True), got {type(flat).__name__}")
    starts, ends = flat.start_indices, flat.end_indices
    if len(starts) != positions or len(ends) != positions:
        raise ValueError(f"logprobs cover {len(starts)} positions, the completion has {positions} tokens")
    ids, values, ranks = flat.token_ids, flat.logprobs, flat.ranks
    sampled = [float(values[i]) for i in starts]
    if all(end - start == 1 for start, end in zip(starts, ends, strict=True)):  # logprobs=0: sampled only
        return sampled, [[(int(ids[i]), float(values[i]))] for i in starts]
    top: list[list[tuple[int, float]]] = []
    for start, end in zip(starts, ends, strict=True):
        entries: dict[int, tuple[float, float]] = {}
        for i in range(start, end):
            rank = ranks[i]
            entries.setdefault(int(ids[i]), (math.inf if rank is None else float(rank), float(values[i])))
        ranked = sorted(entries.items(), key=lambda item: item[1][0])
        top.append([(token, logprob) for token, (_rank, logprob) in ranked])
    return sampled, top


def rescore_equals_sampler(options: SamplingOptions) -> bool:
    """True when vLLM's processed logprobs of a sample equal the model's own log-softmax.

    Temperature 1 with no top-k/top-p/min-p truncation, no penalties, no min_tokens (EOS
    masking), no logit_bias or allowed_token_ids and no structured output leaves the logits
    untouched before sampling, so the logprob of a sampled token can be computed afterwards
    in a prefill pass over prompt + completion. Alternatives (top_logprobs > 0) still come
    from the sampler.
    """
    return (
        options.top_logprobs == 0
        and options.temperature == 1.0
        and options.top_p == 1.0
        and options.top_k <= 0
        and options.min_p == 0.0
        and options.repetition_penalty == 1.0
        and options.frequency_penalty == 0.0
        and options.presence_penalty == 0.0
        and options.min_tokens == 0
        and not options.logit_bias
        and options.allowed_token_ids is None
        and options.structured_output is None
    )


def prompt_logprobs(flat: Any, prompt: list[int]) -> PromptLogprobs:
    """`RequestOutput.prompt_logprobs` (flat) as per-position ranked entries, vLLM's dict order kept.

    Position 0 is empty (None); at each other position vLLM put the prompt token first (with its
    rank), then the top-k by rank 1..k, where the prompt token may appear a second time: as in
    vLLM's dict, it keeps the first place and takes the later entry. Raises ValueError when the
    container is not flat, does not cover the prompt, or names another token first.
    """
    if flat is None or not hasattr(flat, "start_indices"):
        raise ValueError(f"expected flat prompt logprobs, got {type(flat).__name__}")
    starts, ends = flat.start_indices, flat.end_indices
    if len(starts) != len(prompt):
        raise ValueError(f"prompt logprobs cover {len(starts)} positions, the prompt has {len(prompt)} tokens")
    ids, values, ranks = flat.token_ids, flat.logprobs, flat.ranks
    out: PromptLogprobs = [None]
    for position in range(1, len(prompt)):
        start, end = starts[position], ends[position]
        if end <= start or int(ids[start]) != prompt[position]:
            found = int(ids[start]) if end > start else None
            raise ValueError(f"prompt logprobs at position {position} are for token {found}, not {prompt[position]}")
        entries: dict[int, RankedLogprob] = {}
        for i in range(start, end):
            token, rank = int(ids[i]), ranks[i]
            entries[token] = RankedLogprob(token, float(values[i]), None if rank is None else int(rank))
        out.append(list(entries.values()))
    return out


def completion_logprobs(flat: Any, prompt_len: int, completion: list[int]) -> list[float]:
    """The completion tokens' logprobs out of the prompt logprobs of prompt + completion.

    Position i of vLLM's prompt logprobs holds the logprob of token i given tokens < i
    (position 0 is empty); each position's first entry is the actual token. Raises
    ValueError when the positions are missing or name other tokens.
    """
    if flat is None or not hasattr(flat, "start_indices"):
        raise ValueError(f"expected flat prompt logprobs, got {type(flat).__name__}")
    starts, ids, values = flat.start_indices, flat.token_ids, flat.logprobs
    ends = flat.end_indices
    if len(starts) < prompt_len + len(completion):
        raise ValueError(f"prompt logprobs cover {len(starts)} of {prompt_len + len(completion)} positions")
    out = []
    for offset, token in enumerate(completion):
        start, end = starts[prompt_len + offset], ends[prompt_len + offset]
        if end <= start or int(ids[start]) != token:
            found = int(ids[start]) if end > start else None
            raise ValueError(f"prompt logprobs at position {prompt_len + offset} are for token {found}, not {token}")
        out.append(float(values[start]))
    return out
