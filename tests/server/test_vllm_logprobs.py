"""Reading vLLM's FlatLogprobs (the container the vllm engine asks for): pure, so tested without vLLM.

`Flat` has FlatLogprobs' fields, filled the way vLLM 0.26's `append_logprobs_for_next_position`
fills them: per position the sampled token first (with its rank), then the top-k by rank 1..k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from grpo_server.engines.base import SamplingOptions
from grpo_server.engines.logprobs import completion_logprobs, rescore_equals_sampler, sampled_logprobs


@dataclass
class Flat:
    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)

    def add(self, sampled: tuple[int, float, int], top: list[tuple[int, float]]) -> None:
        self.start_indices.append(len(self.token_ids))
        for (token, logprob), rank in [(sampled[:2], sampled[2]), *((t, r) for r, t in enumerate(top, 1))]:
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            self.ranks.append(rank)
        self.end_indices.append(len(self.token_ids))


def test_sampled_only_positions_give_one_entry_each():
    flat = Flat()
    flat.add((7, -0.5, 2), [])
    flat.add((9, -1.25, 1), [])
    logprobs, top = sampled_logprobs(flat, 2)
    assert logprobs == [-0.5, -1.25]
    assert top == [[(7, -0.5)], [(9, -1.25)]]


def test_top_alternatives_are_ranked_and_the_sampled_token_appears_once():
    flat = Flat()
    flat.add((4, -0.1, 1), [(4, -0.1), (8, -2.5)])  # sampled is the best token
    flat.add((3, -3.0, 5), [(1, -0.2), (2, -0.9)])  # sampled ranks 5th: listed after the top 2
    logprobs, top = sampled_logprobs(flat, 2)
    assert logprobs == [-0.1, -3.0]
    assert top == [[(4, -0.1), (8, -2.5)], [(1, -0.2), (2, -0.9), (3, -3.0)]]


def test_no_logprobs_requested_gives_nan_and_empty_alternatives():
    logprobs, top = sampled_logprobs(None, 3)
    assert all(math.isnan(v) for v in logprobs) and top == [[], [], []]


def test_a_container_that_does_not_cover_every_token_or_is_not_flat_is_an_error():
    flat = Flat()
    flat.add((7, -0.5, 2), [])
    with pytest.raises(ValueError, match="cover 1 positions"):
        sampled_logprobs(flat, 2)
    with pytest.raises(ValueError, match="flat logprobs"):
        sampled_logprobs([{7: -0.5}], 1)


def prompt_flat(tokens: list[int], logprobs: list[float]) -> Flat:
    """Prompt logprobs as vLLM lays them out: position 0 empty, then one entry per token (the token itself)."""
    flat = Flat(start_indices=[0], end_indices=[0])
    for token, logprob in zip(tokens[1:], logprobs[1:], strict=True):
        flat.add((token, logprob, 1), [])
    return flat


def test_completion_logprobs_are_read_at_the_completion_positions():
    prompt, completion = [10, 11, 12], [20, 21]
    flat = prompt_flat(prompt + completion, [0.0, -1.0, -2.0, -3.0, -4.0])
    assert completion_logprobs(flat, len(prompt), completion) == [-3.0, -4.0]


def test_completion_logprobs_refuse_positions_of_other_tokens_or_missing_ones():
    prompt, completion = [10, 11, 12], [20, 21]
    flat = prompt_flat([*prompt, 20, 99], [0.0, -1.0, -2.0, -3.0, -4.0])
    with pytest.raises(ValueError, match="for token 99, not 21"):
        completion_logprobs(flat, len(prompt), completion)
    with pytest.raises(ValueError, match="cover 4 of 5"):
        completion_logprobs(prompt_flat([10, 11, 12, 20], [0.0, -1.0, -2.0, -3.0]), 3, completion)


def test_only_untouched_logits_are_rescored():
    assert rescore_equals_sampler(SamplingOptions(temperature=1.0, max_tokens=8))
    for change in ({"temperature": 0.7}, {"top_p": 0.9}, {"top_k": 50}, {"min_p": 0.05},
                   {"repetition_penalty": 1.1}, {"frequency_penalty": 0.5}, {"presence_penalty": 0.5},
                   {"min_tokens": 2}, {"regex": "(a|b)"}, {"top_logprobs": 3}, {"temperature": 0.0}):
        assert not rescore_equals_sampler(SamplingOptions(**change)), change
    assert rescore_equals_sampler(SamplingOptions(top_k=-1, stop=("x",), ignore_eos=True, seed=3))
