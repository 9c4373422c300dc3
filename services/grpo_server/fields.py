"""Which OpenAI and vLLM request fields the server honours, ignores or refuses: the one table.

`FIELDS` has a row for every field that OpenAI's API or vLLM 0.26's OpenAI server defines for
`/v1/completions` and `/v1/chat/completions`:

- honoured: a typed field of the request model (`grpo_server.schemas`), applied by both engines;
- ignored: accepted and dropped, because it cannot change what is generated (`user`, `metadata`...);
- refused: a 400 naming the field, unless its value is one that changes nothing (`stream: false`,
  `best_of` equal to `n`...).

A field in no row is no OpenAI or vLLM field: it is ignored and logged once, as vLLM does. The
request models check what a client sent against this table (`check_sent`) and put the lists of
ignored and refused fields into their /docs description (`describe`). The native `/generate/`
takes vLLM SamplingParams names in `generation_kwargs`: `GENERATION_KWARGS`, any other refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from grpo_server.errors import BadRequest

log = logging.getLogger(__name__)


class Handling(StrEnum):
    HONOURED = "honoured"
    IGNORED = "ignored"
    REFUSED = "refused"


class Endpoint(StrEnum):
    COMPLETIONS = "completions"
    CHAT = "chat"


BOTH = frozenset(Endpoint)
COMPLETIONS = frozenset({Endpoint.COMPLETIONS})
CHAT = frozenset({Endpoint.CHAT})


@dataclass(frozen=True)
class Sent:
    """What a refused field's value is judged against: the request it came in."""

    fields: Mapping[str, Any]  # every field the client sent, by wire name
    endpoint: Endpoint
    prompts: Sequence[Sequence[int]]


#: Whether a refused field's value changes nothing (so the request is served).
Inert = Callable[[Any, Sent], bool]


def _unset(value: Any, sent: Sent) -> bool:
    return value is None or value == [] or value == {} or value == ""


def _unset_or(*inert_values: Any) -> Inert:
    def inert(value: Any, sent: Sent) -> bool:
        return value is None or value in inert_values

    return inert


def _best_of_is_n(value: Any, sent: Sent) -> bool:
    return value is None or value == sent.fields.get("n", 1)


def _truncates_nothing(value: Any, sent: Sent) -> bool:
    # -1 is vLLM's "truncate to max_model_len": prompts that long are refused anyway
    return value is None or value == -1 or all(len(p) <= value for p in sent.prompts)


def _special_tokens_as_served(value: Any, sent: Sent) -> bool:
    # text prompts get the tokenizer's special tokens; a chat template writes its own (vLLM's defaults)
    return value is None or value == (sent.endpoint is Endpoint.COMPLETIONS)


@dataclass(frozen=True)
class Rule:
    handling: Handling
    note: str
    endpoints: frozenset[Endpoint] = BOTH
    inert: Inert = _unset  # refused rows: the values accepted because they change nothing


def _honoured(note: str, endpoints: frozenset[Endpoint] = BOTH) -> Rule:
    return Rule(Handling.HONOURED, note, endpoints)


def _ignored(note: str, endpoints: frozenset[Endpoint] = BOTH) -> Rule:
    return Rule(Handling.IGNORED, note, endpoints)


def _refused(note: str, endpoints: frozenset[Endpoint] = BOTH, inert: Inert = _unset) -> Rule:
    return Rule(Handling.REFUSED, note, endpoints, inert)


_LEGACY_GUIDED = "vLLM's removed guided decoding field; use structured_outputs"
_NO_FUNCTIONS = "deprecated function calling is not supported; use tools"

FIELDS: dict[str, Rule] = {
    # ---- honoured: typed fields of the request models, applied by both engines
    "model": _honoured("which policy generates (see the API description)"),
    "prompt": _honoured("text, texts or token ids", COMPLETIONS),
    "messages": _honoured("the conversation, rendered with the chat template", CHAT),
    "n": _honoured("completions per prompt"),
    "max_tokens": _honoured("tokens per completion"),
    "max_completion_tokens": _honoured("newer name of max_tokens", CHAT),
    "temperature": _honoured("vLLM meaning"),
    "top_p": _honoured("vLLM meaning"),
    "top_k": _honoured("vLLM meaning"),
    "min_p": _honoured("vLLM meaning"),
    "repetition_penalty": _honoured("vLLM meaning"),
    "frequency_penalty": _honoured("vLLM meaning"),
    "presence_penalty": _honoured("vLLM meaning"),
    "logit_bias": _honoured("added to the raw logits before the penalties, as vLLM does"),
    "allowed_token_ids": _honoured("every other token is masked"),
    "seed": _honoured("reproducible sampling"),
    "stop": _honoured("stop strings"),
    "stop_token_ids": _honoured("stop tokens"),
    "min_tokens": _honoured("EOS and stop tokens masked before this many tokens"),
    "ignore_eos": _honoured("generate past EOS"),
    "include_stop_str_in_output": _honoured("keep the matched stop string"),
    "skip_special_tokens": _honoured("special tokens left out of the text"),
    "logprobs": _honoured("the sampled tokens' processed logprobs (and alternatives)"),
    "top_logprobs": _honoured("alternatives per token (above 0: with logprobs true, or refused)", CHAT),
    "prompt_logprobs": _honoured("the raw model's logprobs of the prompt tokens, in vLLM's format"),
    "structured_outputs": _honoured("guided decoding: json, regex, choice, json_object; grammar on vllm only"),
    "response_format": _honoured("text, json_object or json_schema"),
    "guided_regex": _honoured("older name of structured_outputs.regex"),
    "return_token_ids": _honoured("token ids in each choice"),
    "return_tokens_as_token_ids": _honoured("logprob tokens as token_id:<id>"),
    "chat_template": _honoured("Jinja template overriding the tokenizer's", CHAT),
    "chat_template_kwargs": _honoured("extra template variables", CHAT),
    "add_generation_prompt": _honoured("end the prompt with the assistant header", CHAT),
    "continue_final_message": _honoured("continue the last (assistant) message", CHAT),
    "tools": _honoured("tool schemas rendered by the chat template", CHAT),
    # ---- ignored: no effect on what is generated
    "user": _ignored("end-user id for abuse monitoring"),
    "metadata": _ignored("stored-completion tags"),
    "store": _ignored("nothing is stored"),
    "service_tier": _ignored("one tier"),
    "request_id": _ignored("the server names its responses"),
    "session_id": _ignored("a routing hint"),
    "priority": _ignored("requests are served in arrival order, which changes no output"),
    "stream_interval": _ignored("streaming only"),
    "truncation_side": _ignored("prompts are never truncated (see truncate_prompt_tokens)"),
    "parallel_tool_calls": _ignored("tool calls are not parsed out of the text", CHAT),
    "routed_experts_prompt_start": _ignored("routed-expert data is not returned"),
    "return_token_offsets": _ignored("render endpoints only"),
    "return_mm_kwargs": _ignored("render endpoints only"),
    # ---- refused, unless set to a value that changes nothing
    "stream": _refused("streaming responses are not supported", BOTH, _unset_or(False)),
    "stream_options": _refused("stream_options apply to streaming, which is not supported"),
    "echo": _refused("echoing the prompt is not supported", BOTH, _unset_or(False)),
    "best_of": _refused("best_of other than n is not supported (no server-side ranking)", COMPLETIONS,
                        _best_of_is_n),
    "suffix": _refused("insertion (suffix) is not supported", COMPLETIONS),
    "truncate_prompt_tokens": _refused("the server does not truncate prompts, and a prompt is longer", BOTH,
                                       _truncates_nothing),
    "add_special_tokens": _refused("special tokens are added to text prompts only, as vLLM does by default", BOTH,
                                   _special_tokens_as_served),
    "use_beam_search": _refused("beam search is not supported", BOTH, _unset_or(False)),
    "length_penalty": _refused("length_penalty applies to beam search, which is not supported", BOTH,
                               _unset_or(1, 1.0)),
    "watermarking": _refused("watermarking is not supported", BOTH, _unset_or(False)),
    "bad_words": _refused("bad_words is not supported"),
    "logprob_token_ids": _refused("logprobs of chosen token ids are not supported; use logprobs"),
    "logits_processors": _refused("custom logits processors are not supported"),
    "spaces_between_special_tokens": _refused("the text is decoded with the tokenizer's default", BOTH,
                                              _unset_or(True)),
    "prompt_embeds": _refused("embedding prompts are not supported", COMPLETIONS),
    "cache_salt": _refused("prefix-cache salting is not supported"),
    "kv_transfer_params": _refused("disaggregated serving is not supported"),
    "ec_transfer_params": _refused("disaggregated serving is not supported"),
    "vllm_xargs": _refused("extension arguments are not supported"),
    "repetition_detection": _refused("repetition detection is not supported"),
    "thinking_token_budget": _refused("thinking budgets are not supported", BOTH, _unset_or(-1)),
    "guided_json": _refused(_LEGACY_GUIDED + ".json"),
    "guided_choice": _refused(_LEGACY_GUIDED + ".choice"),
    "guided_grammar": _refused(_LEGACY_GUIDED + ".grammar"),
    "guided_decoding_backend": _refused("the structured-output backend is the engine's"),
    "guided_whitespace_pattern": _refused("whitespace patterns are not supported"),
    "tool_choice": _refused("only tool_choice none or auto: tool calls come back as text, not parsed", CHAT,
                            _unset_or("none", "auto")),
    "functions": _refused(_NO_FUNCTIONS, CHAT),
    "function_call": _refused(_NO_FUNCTIONS, CHAT, _unset_or("none", "auto")),
    "reasoning_effort": _refused("reasoning effort is not supported", CHAT),
    "include_reasoning": _refused("reasoning is never split from the text", CHAT, _unset_or(True)),
    "modalities": _refused("text output only", CHAT, _unset_or(["text"])),
    "audio": _refused("audio output is not supported", CHAT),
    "prediction": _refused("predicted outputs are not supported", CHAT),
    "web_search_options": _refused("web search is not supported", CHAT),
    "documents": _refused("RAG documents are not passed to the chat template", CHAT),
    "mm_processor_kwargs": _refused("multimodal inputs are not supported", CHAT),
    # ---- inside structured_outputs and response_format
    "structured_outputs.structural_tag": _refused("structural tags are not supported"),
    "structured_outputs.disable_any_whitespace": _refused("whitespace options are not supported", BOTH,
                                                          _unset_or(False)),
    "structured_outputs.disable_additional_properties": _refused(
        "additionalProperties applies as the schema says", BOTH, _unset_or(False)),
    "structured_outputs.whitespace_pattern": _refused("whitespace patterns are not supported"),
    "response_format.type": _refused("response_format type must be text, json_object or json_schema", BOTH,
                                     _unset_or("text", "json_object", "json_schema")),
}


#: `/generate/`'s generation_kwargs (vLLM SamplingParams names) and their JSON types; any other key is refused.
GENERATION_KWARGS: dict[str, type | tuple[type, ...]] = {
    "seed": int,
    "stop": (str, list),
    "stop_token_ids": list,
    "ignore_eos": bool,
    "min_tokens": int,
    "frequency_penalty": (int, float),
    "presence_penalty": (int, float),
    "repetition_penalty": (int, float),
    "logit_bias": dict,
    "allowed_token_ids": list,
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


def check_sent(
    sent: Mapping[str, Any],
    endpoint: Endpoint,
    prompts: Sequence[Sequence[int]] = (),
    *,
    prefix: str = "",
) -> None:
    """BadRequest naming the first refused field `sent` sets to a value that would change the output.

    `sent` holds the fields the client sent (typed ones and any others); `prefix` names the object
    they sit in (`structured_outputs.`). Fields in no row are logged once and ignored.
    """
    for name, value in sent.items():
        rule = FIELDS.get(prefix + name)
        if rule is None or endpoint not in rule.endpoints:
            _log_unknown(endpoint, prefix + name)
            continue
        if rule.handling is Handling.REFUSED and not rule.inert(value, Sent(sent, endpoint, prompts)):
            raise BadRequest(f"{prefix}{name}: {rule.note}")


_logged: set[tuple[Endpoint, str]] = set()


def _log_unknown(endpoint: Endpoint, name: str) -> None:
    if (endpoint, name) not in _logged:
        _logged.add((endpoint, name))
        log.warning("%s requests: field %r is not an OpenAI or vLLM field; ignored", endpoint, name)


def names(handling: Handling, endpoint: Endpoint) -> list[str]:
    return sorted(name for name, rule in FIELDS.items() if rule.handling is handling and endpoint in rule.endpoints)


def describe(endpoint: Endpoint) -> str:
    """The /docs text listing the fields this endpoint ignores and refuses."""
    ignored = ", ".join(f"`{n}`" for n in names(Handling.IGNORED, endpoint))
    refused = "; ".join(f"`{n}` ({FIELDS[n].note})" for n in names(Handling.REFUSED, endpoint))
    return (
        f"Accepted and ignored (no effect on the output): {ignored}. "
        f"Refused with a 400 naming the field when set to a value that would change the output: {refused}. "
        "Any other field is not an OpenAI or vLLM field and is ignored."
    )
