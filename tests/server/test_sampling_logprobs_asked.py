"""Whether a request asked for logprobs reaches the engine (`SamplingOptions.logprobs`): an engine may then skip
them (the vllm engine asks vLLM for none), and the response carries none."""

from __future__ import annotations

from typing import Any

import pytest

from grpo_server.errors import BadRequest
from grpo_server.sampling import Limits
from grpo_server.schemas import ChatRequest, CompletionRequest, GenerateRequest

LIMITS = Limits(max_model_len=64, vocab_size=100)


@pytest.mark.parametrize(("body", "asked", "top"), [
    ({}, False, 0),
    ({"logprobs": None}, False, 0),
    ({"logprobs": 0}, True, 0),
    ({"logprobs": 2}, True, 2),
])
def test_completions(body: dict[str, Any], asked: bool, top: int) -> None:
    options = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2, 3]], **body}).options([[1, 2, 3]],
                                                                                                    LIMITS)
    assert (options.logprobs, options.top_logprobs) == (asked, top)


@pytest.mark.parametrize(("body", "asked", "top"), [
    ({}, False, 0),
    ({"logprobs": False}, False, 0),
    ({"logprobs": True}, True, 0),
    ({"logprobs": True, "top_logprobs": 3}, True, 3),
])
def test_chat(body: dict[str, Any], asked: bool, top: int) -> None:
    request = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
    options = request.options([1, 2, 3], LIMITS)
    assert (options.logprobs, options.top_logprobs) == (asked, top)


def test_chat_alternatives_without_logprobs_are_refused_naming_the_field() -> None:
    request = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                          "top_logprobs": 2})
    with pytest.raises(BadRequest, match="top_logprobs: needs logprobs: true"):
        request.options([1, 2, 3], LIMITS)


@pytest.mark.parametrize(("body", "asked", "top"), [
    ({}, True, 0),  # TRL's /generate/ clients get the sampled logprobs unless they send null
    ({"logprobs": None}, False, 0),
    ({"logprobs": 1}, True, 1),
    ({"logprobs": None, "generation_kwargs": {"logprobs": 2}}, True, 2),
])
def test_generate(body: dict[str, Any], asked: bool, top: int) -> None:
    options = GenerateRequest.model_validate({"prompts": [[1, 2, 3]], **body}).options([[1, 2, 3]], LIMITS)
    assert (options.logprobs, options.top_logprobs) == (asked, top)
