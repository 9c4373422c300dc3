"""Every OpenAI / vLLM sampling field is honoured on the engine or refused naming it (`grpo_server.fields`).

Against a real server (transformers engine, tiny model) over HTTP: each honoured field changes the
output as vLLM's does (a test here fails if the field were ignored), each refused one is a 400 naming
it, and the fields that cannot change the output are accepted. With `GRPO_TEST_SERVER_ENGINE=vllm`
the same tests check the vllm engine on a GPU; the last section checks its mapping to vLLM's
`SamplingParams` (skipped without vLLM) and the reading of its prompt logprobs (pure).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from grpo_server.engines.base import RankedLogprob, SamplingOptions, StructuredOutput
from grpo_server.engines.logprobs import prompt_logprobs, rescore_equals_sampler
from grpo_server.fields import FIELDS, Endpoint, Handling, describe, names
from grpo_server.schemas import ChatRequest, CompletionRequest, StructuredOutputs
from tests.fixtures.server import ENV_ENGINE, RunningServer

SERVED_ENGINE = os.environ.get(ENV_ENGINE, "transformers")
PROMPTS = [[5, 6, 7, 8, 9], [100, 101, 102, 40, 41, 42]]
ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "hello"}]


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def ok(server: RunningServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = post(server, path, body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def completion_ids(body: dict[str, Any]) -> list[list[int]]:
    return [choice["token_ids"] for choice in body["choices"]]


@pytest.fixture(scope="module")
def tokenizer(served_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(served_model_dir)


@pytest.fixture(scope="module")
def tolerance(served_model_dir: Path) -> float:
    """Logprobs against a float32 forward pass on the CPU: the transformers engine computes exactly that;
    vLLM's GPU kernels differ a little in float32 and more in 16-bit weights."""
    if SERVED_ENGINE == "transformers":
        return 1e-4
    config = json.loads((served_model_dir / "config.json").read_text())
    return 5e-3 if config.get("torch_dtype", config.get("dtype")) == "float32" else 0.15


@pytest.fixture(scope="module")
def reference_model(served_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(served_model_dir, dtype=torch.float32).eval()


def raw_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits over ids: row j scores token j + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


# ---------------------------------------------------------------------- logit_bias, allowed_token_ids

FORCED = 77


def test_logit_bias_of_100_forces_its_token_on_every_endpoint(tiny_server):
    bias = {"logit_bias": {str(FORCED): 100}, "max_tokens": 6, "ignore_eos": True, "temperature": 1.0, "seed": 3}
    body = ok(tiny_server, "/v1/completions", {"prompt": PROMPTS, "n": 2, "return_token_ids": True, **bias})
    assert completion_ids(body) == [[FORCED] * 6] * 4
    chat = ok(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "return_token_ids": True, **bias})
    assert completion_ids(chat) == [[FORCED] * 6]
    native = ok(tiny_server, "/generate/", {"prompts": PROMPTS, "max_tokens": 6, "generation_kwargs": {
        "logit_bias": {str(FORCED): 100}, "ignore_eos": True, "seed": 3}})
    assert native["completion_ids"] == [[FORCED] * 6] * 2


def test_logit_bias_is_clamped_to_100_and_shifts_the_processed_logprobs(tiny_server, reference_model, tolerance):
    prompt = PROMPTS[0]
    request = {"prompt": [prompt], "max_tokens": 1, "logprobs": 2, "temperature": 1.0, "seed": 1,
               "return_token_ids": True, "return_tokens_as_token_ids": True}

    def biased_by(bias: float) -> dict[str, Any]:
        choice: dict[str, Any] = ok(tiny_server, "/v1/completions",
                                    {**request, "logit_bias": {str(FORCED): bias}})["choices"][0]
        return choice

    clamped, at_100, at_50 = biased_by(1000), biased_by(100), biased_by(50)
    assert clamped["token_ids"] == at_100["token_ids"] == [FORCED]
    clamped_top, top_100, top_50 = (c["logprobs"]["top_logprobs"][0] for c in (clamped, at_100, at_50))
    assert clamped_top == pytest.approx(top_100, abs=1e-3)  # as vLLM's OpenAI server clamps it
    assert clamped_top.keys() == top_50.keys() and clamped_top != pytest.approx(top_50, abs=1.0)
    biased = raw_logprobs(reference_model, prompt)[-1].clone()
    biased[FORCED] += 100.0
    expected = torch.log_softmax(biased, -1)
    runner_up = int(torch.topk(expected, 2).indices[1])
    alternatives = clamped["logprobs"]["top_logprobs"][0]
    # near -100 a 16-bit engine rounds to its own spacing (0.5 in bfloat16): relative as well as absolute
    assert alternatives[f"token_id:{runner_up}"] == pytest.approx(expected[runner_up].item(), abs=tolerance,
                                                                  rel=0 if tolerance < 0.1 else 2**-7)


def test_allowed_token_ids_restrict_every_sampled_token_and_alternative(tiny_server):
    allowed = [10, 11, 12, 300]
    sampling = {"allowed_token_ids": allowed, "max_tokens": 8, "temperature": 1.5, "seed": 5, "ignore_eos": True,
                "return_token_ids": True, "return_tokens_as_token_ids": True}
    body = ok(tiny_server, "/v1/completions", {"prompt": PROMPTS, "n": 3, "logprobs": 3, **sampling})
    for choice in body["choices"]:
        assert len(choice["token_ids"]) == 8 and set(choice["token_ids"]) <= set(allowed)
        for alternatives in choice["logprobs"]["top_logprobs"]:  # masked tokens have no finite logprob
            assert {int(t.removeprefix("token_id:")) for t in alternatives} <= set(allowed)
    tokens = {t for ids in completion_ids(body) for t in ids}
    assert len(tokens) > 1  # sampled among the allowed, not one forced token
    chat = ok(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "n": 2, **sampling})
    assert all(set(ids) <= set(allowed) for ids in completion_ids(chat))


# ------------------------------------------------------------------------------------ prompt logprobs


def test_prompt_logprobs_equal_a_direct_forward_pass_in_vllm_format(tiny_server, reference_model, tokenizer,
                                                                   tolerance):
    top = 3
    response = post(tiny_server, "/v1/completions", {"prompt": PROMPTS, "n": 2, "max_tokens": 1, "temperature": 0.6,
                                                    "prompt_logprobs": top})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 4
    for k, choice in enumerate(choices):
        prompt = PROMPTS[k // 2]
        scored = choice["prompt_logprobs"]
        assert scored == choices[k - k % 2]["prompt_logprobs"]  # the n choices of a prompt share them
        assert len(scored) == len(prompt) and scored[0] is None
        expected = raw_logprobs(reference_model, prompt)  # no temperature: vLLM scores prompts raw
        for position in range(1, len(prompt)):
            entries = scored[position]
            row = expected[position - 1]
            token = prompt[position]
            assert next(iter(entries)) == str(token)  # the prompt token first, key as a string
            assert all(set(entry) == {"logprob", "rank", "decoded_token"} for entry in entries.values())
            assert entries[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=tolerance)
            assert entries[str(token)]["decoded_token"] == tokenizer.decode([token])
            best = torch.topk(row, top)
            ranked = {entry["rank"]: int(t) for t, entry in entries.items() if t != str(token) or token in
                      best.indices.tolist()}
            if SERVED_ENGINE == "transformers":  # near-ties may order differently on a GPU
                assert entries[str(token)]["rank"] == int((row >= row[token]).sum())
                assert [ranked[r] for r in range(1, top + 1)] == best.indices.tolist()
            assert len(entries) in (top, top + 1)


def test_chat_prompt_logprobs_score_the_templated_prompt(tiny_server, reference_model, tolerance):
    body = ok(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0,
                                                    "return_token_ids": True})
    prompt = body["prompt_token_ids"]
    scored = body["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None
    expected = raw_logprobs(reference_model, prompt)
    for position in range(1, len(prompt)):
        (token, entry), = scored[position].items()
        assert int(token) == prompt[position]
        assert entry["logprob"] == pytest.approx(expected[position - 1, prompt[position]].item(),
                                                 abs=tolerance)


def test_no_prompt_logprobs_unless_asked(tiny_server):
    body = ok(tiny_server, "/v1/completions", {"prompt": PROMPTS, "max_tokens": 1})
    assert all(choice["prompt_logprobs"] is None for choice in body["choices"])


def test_trl_client_scores_sequences_through_the_server(tiny_server, reference_model, tolerance):
    """TRL 1.16's own VLLMClient.get_sequence_logprobs (constructor bypassed: it insists on vLLM)."""
    requests = pytest.importorskip("requests")
    from trl.generation.vllm_client import VLLMClient

    client = object.__new__(VLLMClient)
    client.session = requests.Session()
    client.base_url = tiny_server.url
    client.model = httpx.get(tiny_server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    sequences = [PROMPTS[0] + [300, 301, 302], PROMPTS[1] + [7, 8]]
    prompt_lengths = [len(PROMPTS[0]), len(PROMPTS[1])]
    top = 4
    out = client.get_sequence_logprobs(sequences, prompt_lengths, top_logprobs=top, chunk_size=1)
    for i, sequence in enumerate(sequences):
        expected = raw_logprobs(reference_model, sequence)
        completion = range(prompt_lengths[i], len(sequence))
        assert out["actual_token_ids"][i] == [[sequence[p]] for p in completion]
        for row, p in enumerate(completion):
            assert out["actual_logprobs"][i][row][0] == pytest.approx(expected[p - 1, sequence[p]].item(),
                                                                     abs=tolerance)
            values = out["logprobs"][i][row]
            assert len(values) == top and values == sorted(values, reverse=True)
            best = torch.topk(expected[p - 1], top)
            assert values == pytest.approx(best.values.tolist(), abs=tolerance)
            if SERVED_ENGINE == "transformers":
                assert out["logprob_token_ids"][i][row] == best.indices.tolist()


# -------------------------------------------------------------------------------- structured outputs


def assert_answer(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"answer", "sure"} and value["answer"] in ("yes", "no") and isinstance(value["sure"], bool)


JSON_SCHEMA_FORMS: list[tuple[str, dict[str, Any]]] = [
    ("response_format json_schema",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}}),
    ("structured_outputs json object", {"structured_outputs": {"json": ANSWER_SCHEMA}}),
    ("structured_outputs json text", {"structured_outputs": {"json": json.dumps(ANSWER_SCHEMA)}}),
]


@pytest.mark.parametrize(("case", "fields"), JSON_SCHEMA_FORMS, ids=[c for c, _ in JSON_SCHEMA_FORMS])
def test_json_schema_output_parses_and_follows_the_schema(tiny_server, case, fields):
    body = ok(tiny_server, "/v1/completions", {"prompt": PROMPTS, "n": 3, "max_tokens": 128, "seed": 2, **fields})
    assert_answers([(c["text"], c["finish_reason"]) for c in body["choices"]])


#: Every whole answer, without whitespace outside strings.
ANSWERS = [json.dumps(d, separators=(",", ":")) for a in ("yes", "no") for b in (True, False)
           for d in ({"answer": a, "sure": b}, {"sure": b, "answer": a})]


def squeezed(text: str) -> str:
    """The JSON text without whitespace outside strings."""
    kept, in_string, escaped = [], False, False
    for char in text:
        if in_string:
            escaped = char == "\\" and not escaped
            in_string = not (char == '"' and not escaped)
        elif char.isspace():
            continue
        else:
            in_string = char == '"'
        kept.append(char)
    return "".join(kept)


def assert_answers(outputs: list[tuple[str, str]]) -> None:
    """Every completion follows the schema. vLLM's grammars allow whitespace between any two tokens, where a
    random-weight model may spend all of max_tokens: a completion cut by max_tokens must then still be the
    start of an answer (no token outside the grammar)."""
    for text, finish_reason in outputs:
        if SERVED_ENGINE == "vllm" and finish_reason == "length":
            assert any(answer.startswith(squeezed(text)) for answer in ANSWERS), text
            continue
        assert finish_reason == "stop", text
        assert_answer(text)


def test_chat_json_schema_output_parses_and_follows_the_schema(tiny_server):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA,
                                                               "strict": True}}
    body = ok(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "n": 3, "max_tokens": 128, "seed": 4,
                                                    "response_format": response_format})
    assert_answers([(c["message"]["content"], c["finish_reason"]) for c in body["choices"]])


def test_json_object_output_is_a_json_object(tiny_server):
    body = ok(tiny_server, "/v1/completions", {"prompt": PROMPTS, "n": 8, "max_tokens": 96, "seed": 11,
                                               "response_format": {"type": "json_object"}})
    finished = [c["text"] for c in body["choices"] if c["finish_reason"] == "stop"]
    assert len(finished) >= 3, "too few finished: raise max_tokens"
    assert all(isinstance(json.loads(text), dict) for text in finished), finished


def test_choice_output_is_one_of_the_choices(tiny_server):
    choices = ["alpha", "beta gamma", "d"]
    body = ok(tiny_server, "/v1/completions", {"prompt": PROMPTS, "n": 6, "max_tokens": 16, "seed": 3,
                                               "structured_outputs": {"choice": choices}})
    texts = [c["text"] for c in body["choices"]]
    assert set(texts) <= set(choices) and len(set(texts)) > 1


@pytest.mark.parametrize("fields", [{"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
                                    {"guided_regex": "[0-9]{3}-[a-z]{2}"}], ids=["structured_outputs", "guided"])
def test_regex_output_matches(tiny_server, fields):
    body = ok(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "n": 3, "max_tokens": 16, "seed": 1,
                                                    **fields})
    assert all(re.fullmatch("[0-9]{3}-[a-z]{2}", c["message"]["content"]) for c in body["choices"])


def test_response_format_text_adds_no_constraint(tiny_server):
    plain = {"prompt": PROMPTS, "max_tokens": 8, "seed": 9, "ignore_eos": True}
    assert ok(tiny_server, "/v1/completions", {**plain, "response_format": {"type": "text"}})["choices"] == \
        ok(tiny_server, "/v1/completions", plain)["choices"]


def test_grammar_is_honoured_by_vllm_and_refused_by_the_transformers_engine(tiny_server):
    body = {"prompt": PROMPTS, "n": 3, "max_tokens": 8, "structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}
    response = post(tiny_server, "/v1/completions", body)
    if SERVED_ENGINE == "transformers":
        assert response.status_code == 400 and "structured_outputs.grammar" in response.json()["message"]
    else:
        assert response.status_code == 200, response.text
        assert {c["text"] for c in response.json()["choices"]} <= {"yes", "no"}


# ------------------------------------------------------------------------- refused, ignored, unknown

COMPLETION = {"prompt": [[5, 6, 7]], "max_tokens": 2}
CHAT = {"messages": MESSAGES, "max_tokens": 2}

#: (endpoint body, field set to a value that would change the output, the name the 400 must give)
REFUSED: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    (COMPLETION, {"best_of": 3}, "best_of"),
    (COMPLETION, {"suffix": "end"}, "suffix"),
    (COMPLETION, {"echo": True}, "echo"),
    (COMPLETION, {"stream": True}, "stream"),
    (CHAT, {"stream": True}, "stream"),
    (COMPLETION, {"stream_options": {"include_usage": True}}, "stream_options"),
    (COMPLETION, {"use_beam_search": True}, "use_beam_search"),
    (COMPLETION, {"length_penalty": 0.5}, "length_penalty"),
    (COMPLETION, {"watermarking": True}, "watermarking"),
    (COMPLETION, {"bad_words": ["x"]}, "bad_words"),
    (COMPLETION, {"logprob_token_ids": [1, 2]}, "logprob_token_ids"),
    (CHAT, {"logits_processors": ["my.module:proc"]}, "logits_processors"),
    (COMPLETION, {"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    (COMPLETION, {"add_special_tokens": False}, "add_special_tokens"),
    (CHAT, {"add_special_tokens": True}, "add_special_tokens"),
    (COMPLETION, {"prompt_embeds": "AAAA"}, "prompt_embeds"),
    (COMPLETION, {"cache_salt": "salt"}, "cache_salt"),
    (COMPLETION, {"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    (CHAT, {"ec_transfer_params": {"do_remote_encode": True}}, "ec_transfer_params"),
    (COMPLETION, {"vllm_xargs": {"a": 1}}, "vllm_xargs"),
    (COMPLETION, {"repetition_detection": {"max_pattern_size": 4, "min_count": 2}}, "repetition_detection"),
    (CHAT, {"thinking_token_budget": 16}, "thinking_token_budget"),
    (COMPLETION, {"truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
    (COMPLETION, {"guided_json": ANSWER_SCHEMA}, "guided_json"),
    (COMPLETION, {"guided_choice": ["a", "b"]}, "guided_choice"),
    (COMPLETION, {"guided_grammar": 'root ::= "a"'}, "guided_grammar"),
    (COMPLETION, {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    (COMPLETION, {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"function_call": {"name": "f"}}, "function_call"),
    (CHAT, {"reasoning_effort": "low"}, "reasoning_effort"),
    (CHAT, {"include_reasoning": False}, "include_reasoning"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    (CHAT, {"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
    (CHAT, {"documents": [{"title": "t", "text": "x"}]}, "documents"),
    (CHAT, {"mm_processor_kwargs": {"num_crops": 4}}, "mm_processor_kwargs"),
    (COMPLETION, {"structured_outputs": {"regex": "a+", "structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    (COMPLETION, {"structured_outputs": {"json": ANSWER_SCHEMA, "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    (COMPLETION, {"structured_outputs": {"json": ANSWER_SCHEMA, "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties"),
    (COMPLETION, {"structured_outputs": {"json": ANSWER_SCHEMA, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    (CHAT, {"response_format": {"type": "structural_tag", "format": {}}}, "response_format.type"),
]


def path_of(endpoint: dict[str, Any]) -> str:
    return "/v1/completions" if "prompt" in endpoint else "/v1/chat/completions"


@pytest.mark.parametrize(("endpoint", "fields", "name"), REFUSED, ids=[f"{path_of(e)[4:]}-{n}" for e, _, n in REFUSED])
def test_refused_fields_get_400_naming_them(tiny_server, endpoint, fields, name):
    response = post(tiny_server, path_of(endpoint), {**endpoint, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["message"].startswith(f"{name}:"), response.json()


def test_every_refused_row_has_a_case():
    refused = {n for n, rule in FIELDS.items() if rule.handling is Handling.REFUSED}
    assert refused == {name for _, _, name in REFUSED}


#: Refused fields at values that change nothing, ignored fields, and a field no API defines: all served.
ACCEPTED: list[tuple[dict[str, Any], dict[str, Any]]] = [
    (COMPLETION, {"best_of": 2, "n": 2}),
    (COMPLETION, {"echo": False, "stream": False, "stream_options": None, "suffix": ""}),
    (COMPLETION, {"use_beam_search": False, "length_penalty": 1.0, "watermarking": False, "bad_words": []}),
    (COMPLETION, {"add_special_tokens": True, "spaces_between_special_tokens": True, "thinking_token_budget": -1}),
    (COMPLETION, {"truncate_prompt_tokens": 3}),
    (COMPLETION, {"truncate_prompt_tokens": -1, "truncation_side": "left"}),
    (COMPLETION, {"structured_outputs": {"regex": "a+", "disable_any_whitespace": False}}),
    (CHAT, {"add_special_tokens": False, "tool_choice": "none", "include_reasoning": True, "modalities": ["text"]}),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "auto",
            "parallel_tool_calls": False}),
    (COMPLETION, {"user": "u1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto"}),
    (CHAT, {"request_id": "r1", "session_id": "s1", "priority": 5, "stream_interval": 4}),
    (COMPLETION, {"routed_experts_prompt_start": 2, "return_token_offsets": True, "return_mm_kwargs": False}),
    (COMPLETION, {"frobnicate": 1}),
]


@pytest.mark.parametrize(("endpoint", "fields"), ACCEPTED, ids=[",".join(f) for _, f in ACCEPTED])
def test_inert_ignored_and_unknown_fields_are_served(tiny_server, endpoint, fields):
    response = post(tiny_server, path_of(endpoint), {**endpoint, **fields})
    assert response.status_code == 200, response.text


BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({**COMPLETION, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs: set exactly one"),
    ({**COMPLETION, "structured_outputs": {}}, "structured_outputs: set exactly one"),
    ({**COMPLETION, "structured_outputs": {"json": "[1, 2]"}}, "json must be a JSON schema object"),
    ({**COMPLETION, "structured_outputs": {"choice": []}}, "choice: List should have at least 1 item"),
    ({**COMPLETION, "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs and response_format"),
    ({**COMPLETION, "response_format": {"type": "json_schema"}}, "response_format.json_schema is required"),
    ({**COMPLETION, "logit_bias": {"x": 1}}, "logit_bias: key 'x' is not a token id"),
    ({**COMPLETION, "logit_bias": {"99999999": 1}}, "logit_bias has token id 99999999 outside the vocabulary"),
    ({**COMPLETION, "allowed_token_ids": []}, "allowed_token_ids"),
    ({**COMPLETION, "allowed_token_ids": [1, 99999999]}, "allowed_token_ids has token id 99999999"),
    ({**COMPLETION, "allowed_token_ids": [1] * 1025}, "allowed_token_ids: List should have at most 1024 items"),
    ({**COMPLETION, "logit_bias": {str(t): 1 for t in range(1025)}}, "logit_bias: Dictionary should have at most"),
    ({**COMPLETION, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({**COMPLETION, "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompts": [[5, 6]], "generation_kwargs": {"prompt_logprobs": 1}}, "generation_kwargs.prompt_logprobs"),
    ({"prompts": [[5, 6, 7]], "truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
]


@pytest.mark.parametrize(("body", "fragment"), BAD_VALUES, ids=[f for _, f in BAD_VALUES])
def test_bad_values_of_honoured_fields_get_400_naming_them(tiny_server, body, fragment):
    path = "/generate/" if "prompts" in body else path_of(body)
    response = post(tiny_server, path, body)
    assert response.status_code == 400, response.text
    assert fragment in response.json()["message"]


# -------------------------------------------------------------------------------------- the table

MODELS = {Endpoint.COMPLETIONS: CompletionRequest, Endpoint.CHAT: ChatRequest}


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_the_table_and_the_request_models_agree(endpoint):
    """Honoured rows are exactly the typed fields; a typed field is honoured, or refused at some values."""
    declared = {info.alias or name for name, info in MODELS[endpoint].model_fields.items()}
    honoured = {name for name in names(Handling.HONOURED, endpoint) if "." not in name}
    assert honoured <= declared
    nested = {name.split(".", 1)[1] for name in names(Handling.HONOURED, endpoint) if "." in name}
    assert nested <= {info.alias or name for name, info in StructuredOutputs.model_fields.items()}  # none yet
    refused_typed = declared - honoured
    assert all(FIELDS[name].handling is Handling.REFUSED for name in refused_typed), refused_typed
    assert not set(names(Handling.IGNORED, endpoint)) & declared


def test_docs_list_the_ignored_and_refused_fields(tiny_server):
    schemas = httpx.get(tiny_server.url + "/openapi.json", timeout=30).json()["components"]["schemas"]
    for endpoint, model in MODELS.items():
        description = schemas[model.__name__]["description"]
        assert describe(endpoint) in description
        for name in names(Handling.IGNORED, endpoint) + names(Handling.REFUSED, endpoint):
            assert f"`{name}`" in description
        for name in names(Handling.HONOURED, endpoint):  # a nested one (`structured_outputs.x`) by its parent
            assert name.split(".")[0] in schemas[model.__name__]["properties"]


# ------------------------------------------------------------------ the vllm engine's mapping (pure)


@dataclass
class Flat:
    """vllm.logprobs.FlatLogprobs' fields, filled as vLLM fills prompt logprobs."""

    start_indices: list[int] = field(default_factory=lambda: [0])
    end_indices: list[int] = field(default_factory=lambda: [0])  # position 0: no entries
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)

    def add(self, entries: list[tuple[int, float, int]]) -> None:
        self.start_indices.append(len(self.token_ids))
        for token, logprob, rank in entries:
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            self.ranks.append(rank)
        self.end_indices.append(len(self.token_ids))


def test_vllm_prompt_logprobs_keep_vllms_dict_order_and_entries():
    flat = Flat()
    flat.add([(11, -2.0, 4), (30, -0.5, 1), (31, -1.0, 2)])  # the prompt token ranks 4th
    flat.add([(12, -0.2, 1), (12, -0.2, 1), (40, -3.0, 2)])  # the prompt token is also the best
    assert prompt_logprobs(flat, [10, 11, 12]) == [
        None,
        [RankedLogprob(11, -2.0, 4), RankedLogprob(30, -0.5, 1), RankedLogprob(31, -1.0, 2)],
        [RankedLogprob(12, -0.2, 1), RankedLogprob(40, -3.0, 2)],
    ]


def test_vllm_prompt_logprobs_of_other_tokens_or_positions_are_an_error():
    flat = Flat()
    flat.add([(99, -2.0, 4)])
    with pytest.raises(ValueError, match="for token 99, not 11"):
        prompt_logprobs(flat, [10, 11])
    with pytest.raises(ValueError, match="cover 2 positions"):
        prompt_logprobs(flat, [10, 11, 12])


def test_constrained_sampling_is_never_rescored():
    for change in ({"logit_bias": ((5, 1.0),)}, {"allowed_token_ids": (5, 6)},
                   {"structured": StructuredOutput("choice", choices=("a",))}):
        assert not rescore_equals_sampler(SamplingOptions(**change)), change  # type: ignore[arg-type]
    assert rescore_equals_sampler(SamplingOptions(prompt_logprobs=3))


def test_vllm_sampling_params_carry_every_honoured_field():
    pytest.importorskip("vllm")
    from grpo_server.engines.vllm_engine import sampling_params

    params = sampling_params(SamplingOptions(logit_bias=((5, 2.5), (9, -100.0)), allowed_token_ids=(5, 9, 12),
                                             prompt_logprobs=3, regex="[a-z]+"))
    assert params.logit_bias == {5: 2.5, 9: -100.0}
    assert params.allowed_token_ids == [5, 9, 12]
    assert params.prompt_logprobs == 3
    assert params.structured_outputs is not None and params.structured_outputs.regex == "[a-z]+"
    kinds = {
        "json": (StructuredOutput("json", json.dumps(ANSWER_SCHEMA)), ANSWER_SCHEMA),
        "json_object": (StructuredOutput("json_object"), True),
        "choice": (StructuredOutput("choice", choices=("a", "b")), ["a", "b"]),
        "grammar": (StructuredOutput("grammar", 'root ::= "a"'), 'root ::= "a"'),
    }
    for kind, (constraint, expected) in kinds.items():
        structured = sampling_params(SamplingOptions(structured=constraint)).structured_outputs
        assert structured is not None and getattr(structured, kind) == expected, kind
    plain = sampling_params(SamplingOptions())
    assert plain.logit_bias is None and plain.allowed_token_ids is None and plain.prompt_logprobs is None
    assert plain.structured_outputs is None and not math.isnan(plain.temperature)
