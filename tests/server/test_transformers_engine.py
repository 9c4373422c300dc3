"""The transformers engine in-process: sampling semantics, processed logprobs, stops, adapters,
logit bias and allowed tokens, prompt logprobs and structured outputs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_server.engines.base import (
    AdapterHandle,
    InvalidRequestError,
    PromptResult,
    SamplingOptions,
    StructuredOutput,
)
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


# ------------------------------------------------------------------- logit_bias, allowed_token_ids


def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([ids])).logits[0].float()
    return logits


def test_logit_bias_of_100_forces_its_token(engine):
    forced = 77
    result = run(engine, PROMPTS, n=3, max_tokens=6, temperature=1.0, seed=2, ignore_eos=True,
                 logit_bias=((forced, 100.0),))
    assert all(c.token_ids == [forced] * 6 for r in result for c in r.completions)


def test_logit_bias_is_added_to_the_raw_logits_before_the_repetition_penalty(engine, reference_model):
    """vLLM's order: bias, then penalties, then temperature; the logprob is the processed one."""
    prompt, token, penalty, temperature = PROMPTS[0], PROMPTS[0][2], 1.7, 0.8
    logits = reference_logits(reference_model, prompt)[-1]
    bias = round(10.0 - logits[token].item(), 3)  # biased logit 10: positive, so the penalty divides it
    got = run(engine, [prompt], max_tokens=1, temperature=temperature, seed=4, repetition_penalty=penalty,
              logit_bias=((token, bias),), top_logprobs=20)[0].completions[0]
    biased = logits.clone()
    biased[token] += bias
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[prompt] = True
    penalised = torch.where(seen, torch.where(biased > 0, biased / penalty, biased * penalty), biased)
    expected = torch.log_softmax(penalised / temperature, -1)
    sampled = got.token_ids[0]
    assert got.logprobs[0] == pytest.approx(expected[sampled].item(), abs=2e-4)
    alternatives = dict(got.top_logprobs[0])
    assert alternatives[token] == pytest.approx(expected[token].item(), abs=2e-4)
    penalised_first = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    penalised_first[token] += bias
    assert abs(torch.log_softmax(penalised_first / temperature, -1)[token].item() - alternatives[token]) > 0.1


def test_allowed_token_ids_restrict_every_token_and_renormalise_over_them(engine, reference_model):
    allowed = (10, 11, 12, 300)
    result = run(engine, PROMPTS[:2], n=4, max_tokens=8, temperature=1.0, seed=6, allowed_token_ids=allowed)
    for prompt_result in result:
        for completion in prompt_result.completions:
            assert set(completion.token_ids) <= set(allowed) and len(completion.token_ids) == 8
            ids = prompt_result.prompt_token_ids + completion.token_ids
            first = reference_logits(reference_model, ids)[len(prompt_result.prompt_token_ids) - 1]
            expected = torch.log_softmax(first[list(allowed)], -1)[allowed.index(completion.token_ids[0])]
            assert completion.logprobs[0] == pytest.approx(expected.item(), abs=2e-4)


def test_constraints_that_exclude_every_token_are_refused(engine):
    with pytest.raises(InvalidRequestError, match="no token can be generated"):
        run(engine, PROMPTS[:1], max_tokens=4, allowed_token_ids=(10,), regex="[a-z]+")


# ------------------------------------------------------------------------------- prompt logprobs


def test_prompt_logprobs_are_the_raw_model_logprobs_of_each_prompt_token(engine, reference_model):
    """As vLLM scores prompts: no temperature, position 0 empty, the prompt token first with its rank."""
    top = 3
    result = run(engine, PROMPTS, n=2, max_tokens=2, temperature=0.5, top_k=5, seed=1, prompt_logprobs=top)
    for prompt_result in result:
        prompt = prompt_result.prompt_token_ids
        scored = prompt_result.prompt_logprobs
        assert scored is not None and len(scored) == len(prompt) and scored[0] is None
        expected = torch.log_softmax(reference_logits(reference_model, prompt), -1)
        for position in range(1, len(prompt)):
            entries = scored[position]
            assert entries is not None
            row = expected[position - 1]
            actual = entries[0]
            assert actual.token_id == prompt[position]
            assert actual.logprob == pytest.approx(row[prompt[position]].item(), abs=1e-4)
            assert actual.rank == int((row >= row[prompt[position]]).sum())
            best = torch.topk(row, top)
            alternatives = {e.token_id: e for e in entries}
            assert set(best.indices.tolist()) <= set(alternatives)
            for rank, (token, logprob) in enumerate(zip(best.indices.tolist(), best.values.tolist(), strict=True), 1):
                assert alternatives[token].logprob == pytest.approx(logprob, abs=1e-4)
                assert alternatives[token].rank == rank
            assert len(entries) == top + (0 if prompt[position] in best.indices.tolist() else 1)


def test_no_prompt_logprobs_unless_asked(engine):
    assert all(r.prompt_logprobs is None for r in run(engine, PROMPTS, max_tokens=1))
    only_the_token = run(engine, PROMPTS[:1], max_tokens=1, prompt_logprobs=0)[0].prompt_logprobs
    assert only_the_token is not None and all(len(entries) == 1 for entries in only_the_token[1:])


# ------------------------------------------------------------------------------ structured outputs

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


def test_json_schema_guided_generation_follows_the_schema(engine):
    import json

    constraint = StructuredOutput("json", json.dumps(ANSWER_SCHEMA))
    result = run(engine, PROMPTS[:2], n=4, max_tokens=96, seed=5, structured=constraint)
    for completion in (c for r in result for c in r.completions):
        assert completion.finish_reason == "stop", completion.text
        value = json.loads(completion.text)
        assert set(value) == {"answer", "sure"} and value["answer"] in ("yes", "no")
        assert isinstance(value["sure"], bool)


def test_json_object_guided_generation_gives_json_objects(engine):
    import json

    result = run(engine, PROMPTS, n=8, max_tokens=64, seed=11, structured=StructuredOutput("json_object"))
    finished = [c for r in result for c in r.completions if c.finish_reason == "stop"]
    assert len(finished) >= 4, "too few finished: raise max_tokens"
    for completion in finished:  # strict JSON: no raw control characters inside strings
        assert isinstance(json.loads(completion.text), dict), completion.text


def test_choice_guided_generation_gives_one_of_the_choices(engine):
    choices = ("alpha", "beta gamma", "d")
    result = run(engine, PROMPTS, n=4, max_tokens=16, seed=3, structured=StructuredOutput("choice", choices=choices))
    texts = [c.text for r in result for c in r.completions]
    assert set(texts) <= set(choices) and len(set(texts)) > 1


def test_grammar_is_refused_by_the_transformers_engine_naming_the_field(engine):
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.grammar"):
        run(engine, PROMPTS[:1], max_tokens=4, structured=StructuredOutput("grammar", 'root ::= "a"'))
