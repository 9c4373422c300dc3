"""The transformers engine in-process: sampling semantics, processed logprobs, stops, adapters."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_server.engines.base import AdapterHandle, PromptResult, SamplingOptions
from grpo_server.engines.transformers_engine import TransformersEngine
from tests.server.adapters import LoraMaker


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[TransformersEngine]:
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eng = TransformersEngine(tiny_model_dir, tokenizer, device="cpu")
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def run(engine: TransformersEngine, prompts: list[list[int]], adapter: AdapterHandle | None = None,
        **options: object) -> list[PromptResult]:
    return asyncio.run(engine.generate(prompts, SamplingOptions(**options), adapter))  # type: ignore[arg-type]


PROMPTS = [[5, 6, 7, 8, 9], [100, 101, 102], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


def test_logprobs_are_the_sampled_tokens_after_temperature_and_top_k(engine, reference_model):
    temperature, top_k = 0.7, 20
    result = run(engine, PROMPTS[:2], n=3, max_tokens=10, temperature=temperature, top_k=top_k, seed=11,
                 ignore_eos=True)
    checked = 0
    for prompt_result in result:
        for completion in prompt_result.completions:
            ids = prompt_result.prompt_token_ids + completion.token_ids
            with torch.no_grad():
                logits = reference_model(torch.tensor([ids])).logits[0].float()
            for t, (token, logprob) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
                scores = logits[len(prompt_result.prompt_token_ids) - 1 + t] / temperature
                kth = torch.topk(scores, top_k).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
                expected = torch.log_softmax(scores, -1)[token].item()
                assert logprob == pytest.approx(expected, abs=2e-4)
                checked += 1
    assert checked == 2 * 3 * 10


def test_batched_prompts_of_different_lengths_match_single_prompt_generation(engine):
    batched = run(engine, PROMPTS, n=2, max_tokens=12, temperature=0.0, ignore_eos=True)
    for prompt, together in zip(PROMPTS, batched, strict=True):
        alone = run(engine, [prompt], n=1, max_tokens=12, temperature=0.0, ignore_eos=True)[0].completions[0]
        for completion in together.completions:
            assert completion.token_ids == alone.token_ids
            assert completion.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_seeded_sampling_is_reproducible_and_seed_dependent(engine):
    first = run(engine, PROMPTS, n=4, max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    second = run(engine, PROMPTS, n=4, max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    other = run(engine, PROMPTS, n=4, max_tokens=16, temperature=1.0, top_p=0.9, seed=4321)
    assert first == second
    assert [c.token_ids for r in first for c in r.completions] != [c.token_ids for r in other for c in r.completions]


def test_eos_is_kept_last_when_generation_stops_on_it(engine):
    eos = set(engine._eos_ids)
    result = run(engine, PROMPTS, n=16, max_tokens=40, temperature=1.5, seed=3)
    stopped = [c for r in result for c in r.completions if c.finish_reason == "stop"]
    assert stopped, "no completion hit EOS; raise n or temperature"
    for completion in stopped:
        assert completion.token_ids[-1] in eos
        assert not eos & set(completion.token_ids[:-1])
    for completion in (c for r in result for c in r.completions if c.finish_reason == "length"):
        assert len(completion.token_ids) == 40


def test_ignore_eos_and_min_tokens_keep_generating(engine):
    eos = set(engine._eos_ids)
    full = run(engine, PROMPTS, n=8, max_tokens=20, temperature=1.5, seed=3, ignore_eos=True)
    assert all(len(c.token_ids) == 20 and c.finish_reason == "length" for r in full for c in r.completions)
    early = run(engine, PROMPTS, n=8, max_tokens=20, temperature=1.5, seed=3, min_tokens=10)
    for completion in (c for r in early for c in r.completions):
        assert not eos & set(completion.token_ids[:10])


def test_stop_token_ids_end_the_completion_with_that_token(engine):
    greedy = run(engine, [PROMPTS[0]], max_tokens=10, temperature=0.0, ignore_eos=True)[0].completions[0]
    stop_at = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_at)
    stopped = run(engine, [PROMPTS[0]], max_tokens=10, temperature=0.0, ignore_eos=True,
                  stop_token_ids=(stop_at,))[0].completions[0]
    assert stopped.token_ids == greedy.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at


def test_stop_strings_cut_the_text_and_end_generation(engine):
    greedy = run(engine, [PROMPTS[1]], max_tokens=12, temperature=0.0, ignore_eos=True)[0].completions[0]
    stop = greedy.text[4:7]
    assert stop
    stopped = run(engine, [PROMPTS[1]], max_tokens=12, temperature=0.0, ignore_eos=True,
                  stop=(stop,))[0].completions[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == greedy.text[: greedy.text.index(stop)]
    assert len(stopped.token_ids) < len(greedy.token_ids)
    kept = run(engine, [PROMPTS[1]], max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop,),
               include_stop_str_in_output=True)[0].completions[0]
    assert kept.text.endswith(stop)


def test_regex_guided_generation_matches_the_pattern(engine):
    import re

    result = run(engine, PROMPTS[:1], n=4, max_tokens=16, temperature=1.0, seed=5, regex=r"[0-9]{3}-[a-z]{2}")
    for completion in result[0].completions:
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", completion.text), completion.text
        assert completion.finish_reason == "stop"


def test_adapters_change_output_and_the_base_model_stays_intact(engine, tiny_model_dir, tmp_path):
    maker = LoraMaker(tiny_model_dir)
    v1 = AdapterHandle("policy-v1", 1, str(maker.save(tmp_path / "v1", seed=1)))
    v2 = AdapterHandle("policy-v2", 2, str(maker.save(tmp_path / "v2", seed=2)))
    options: dict[str, Any] = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    base = run(engine, PROMPTS, **options)
    asyncio.run(engine.add_adapter(v1))
    asyncio.run(engine.add_adapter(v2))
    on_v1 = run(engine, PROMPTS, v1, **options)
    on_v2 = run(engine, PROMPTS, v2, **options)
    assert run(engine, PROMPTS, None, **options) == base
    assert on_v1 != base and on_v2 != base and on_v1 != on_v2
    asyncio.run(engine.remove_adapter(v1))
    assert run(engine, PROMPTS, v2, **options) == on_v2
    asyncio.run(engine.remove_adapter(v2))
    assert run(engine, PROMPTS, None, **options) == base
