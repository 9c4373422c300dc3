"""Engine results to wire shapes (pure): OpenAI completions and chat, and the native /generate/.

All shapes are prompt-major: prompt i's j-th completion is sequence i*n + j. Logprob
lists have one entry per completion token; non-finite values (tokens masked to
probability 0) are dropped from alternatives and sent as null for sampled tokens,
since JSON has no infinity. Prompt logprobs follow vLLM's wire format exactly (TRL's
`get_sequence_logprobs` parses it): per position null or `{token_id: {logprob, rank,
decoded_token}}`, -inf clamped to -9999.0 as vLLM's `clamp_prompt_logprobs` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from grpo_server.engines.base import Completion, PromptLogprobs, PromptResult
from grpo_server.schemas import (
    ChatChoice,
    ChatLogprobs,
    ChatMessage,
    ChatResponse,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    GenerateResponse,
    PromptLogprob,
    PromptLogprobsWire,
    Usage,
)

TOKEN_ID_PREFIX = "token_id:"
#: What vLLM sends for a prompt logprob of -inf.
CLAMPED_LOGPROB = -9999.0


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Tagging:
    """Identity of the response: request id, model name and the policy that produced it."""

    request_id: str
    created: int
    model: str
    boot_id: str
    adapter_version: int | None


class TokenNamer:
    """Token strings for logprobs: `token_id:<id>` or the decoded token."""

    def __init__(self, decode: Callable[[int], str], as_ids: bool) -> None:
        self._decode = decode
        self._as_ids = as_ids

    def __call__(self, token_id: int) -> str:
        return f"{TOKEN_ID_PREFIX}{token_id}" if self._as_ids else self._decode(token_id)

    def text(self, token_id: int) -> str:
        return self._decode(token_id)


def usage(results: list[PromptResult]) -> Usage:
    prompt_tokens = sum(len(r.prompt_token_ids) for r in results)
    completion_tokens = sum(len(c.token_ids) for r in results for c in r.completions)
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


def completion_logprobs(completion: Completion, names: TokenNamer) -> CompletionLogprobs:
    offsets, position = [], 0
    for token in completion.token_ids:
        offsets.append(position)
        position += len(names.text(token))
    return CompletionLogprobs(
        tokens=[names(t) for t in completion.token_ids],
        token_logprobs=[finite(lp) for lp in completion.logprobs],
        top_logprobs=[{names(t): lp for t, lp in top if math.isfinite(lp)} for top in completion.top_logprobs],
        text_offset=offsets,
    )


def prompt_logprobs(logprobs: PromptLogprobs | None, names: TokenNamer) -> PromptLogprobsWire | None:
    if logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            str(entry.token_id): PromptLogprob(
                logprob=entry.logprob if math.isfinite(entry.logprob) else CLAMPED_LOGPROB,
                rank=entry.rank,
                decoded_token=names.text(entry.token_id),
            )
            for entry in position
        }
        for position in logprobs
    ]


def completion_response(
    results: list[PromptResult],
    tag: Tagging,
    names: TokenNamer,
    *,
    with_logprobs: bool,
    return_token_ids: bool,
) -> CompletionResponse:
    choices = []
    for i, result in enumerate(results):
        n = len(result.completions)
        prompt_wire = prompt_logprobs(result.prompt_logprobs, names)
        for j, completion in enumerate(result.completions):
            choices.append(
                CompletionChoice(
                    index=i * n + j,
                    text=completion.text,
                    logprobs=completion_logprobs(completion, names) if with_logprobs else None,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    prompt_token_ids=list(result.prompt_token_ids) if return_token_ids else None,
                    token_ids=list(completion.token_ids) if return_token_ids else None,
                    prompt_logprobs=prompt_wire,
                )
            )
    return CompletionResponse(
        id=tag.request_id,
        created=tag.created,
        model=tag.model,
        choices=choices,
        usage=usage(results),
        boot_id=tag.boot_id,
        adapter_version=tag.adapter_version,
    )


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(completion: Completion, names: TokenNamer) -> ChatLogprobs:
    content = []
    for token, logprob, top in zip(completion.token_ids, completion.logprobs, completion.top_logprobs, strict=True):
        content.append(
            ChatTokenLogprob(
                token=names(token),
                logprob=finite(logprob),
                bytes=_token_bytes(names.text(token)),
                top_logprobs=[
                    ChatTopLogprob(token=names(t), logprob=lp, bytes=_token_bytes(names.text(t)))
                    for t, lp in top
                    if math.isfinite(lp)
                ],
            )
        )
    return ChatLogprobs(content=content)


def chat_response(
    result: PromptResult,
    tag: Tagging,
    names: TokenNamer,
    *,
    with_logprobs: bool,
    return_token_ids: bool,
) -> ChatResponse:
    choices = [
        ChatChoice(
            index=j,
            message=ChatMessage(content=completion.text),
            logprobs=chat_logprobs(completion, names) if with_logprobs else None,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            token_ids=list(completion.token_ids) if return_token_ids else None,
        )
        for j, completion in enumerate(result.completions)
    ]
    return ChatResponse(
        id=tag.request_id,
        created=tag.created,
        model=tag.model,
        choices=choices,
        usage=usage([result]),
        prompt_token_ids=list(result.prompt_token_ids) if return_token_ids else None,
        prompt_logprobs=prompt_logprobs(result.prompt_logprobs, names),
        boot_id=tag.boot_id,
        adapter_version=tag.adapter_version,
    )


def generate_response(results: list[PromptResult], tag: Tagging, *, with_logprobs: bool) -> GenerateResponse:
    completions = [c for r in results for c in r.completions]
    logprobs = None
    token_ids = None
    if with_logprobs:
        logprobs = [[[finite(lp) for _, lp in top] for top in c.top_logprobs] for c in completions]
        token_ids = [[[t for t, _ in top] for top in c.top_logprobs] for c in completions]
    return GenerateResponse(
        prompt_ids=[list(r.prompt_token_ids) for r in results],
        completion_ids=[list(c.token_ids) for c in completions],
        logprobs=logprobs,
        logprob_token_ids=token_ids,
        finish_reasons=[c.finish_reason for c in completions],
        boot_id=tag.boot_id,
        adapter_version=tag.adapter_version,
    )
