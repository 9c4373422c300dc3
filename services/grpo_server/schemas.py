"""Request and response models of every endpoint (they are the /docs reference).

Native models follow the Axolotl/TRL-legacy server (`/generate/`); OpenAI models
follow vLLM's OpenAI server as far as TRL 1.16's client and the `openai` package
use it. Wire models shared with clients (health, adapter trigger, errors) live in
`grpo_api.protocol`.

Each generation request turns itself into the engine's `SamplingOptions`
(`options(prompts, limits)`), as vLLM's protocol models do with `to_sampling_params`:
the handlers only tokenize, convert and call the service. Which OpenAI and vLLM fields
are honoured, ignored or refused is the table in `grpo_server.fields`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from grpo_api.protocol import ActiveAdapter, AdapterPath
from grpo_server.engines.base import SamplingOptions, StructuredOutput
from grpo_server.errors import BadRequest
from grpo_server.fields import GENERATION_KWARGS, Endpoint, check_generation_kwargs, check_sent, describe
from grpo_server.sampling import MAX_LOGPROBS, Limits, resolve_max_tokens

#: Entries of logit_bias and allowed_token_ids: vLLM 0.26's sampler (V2 model runner) holds at most 1024.
MAX_SAMPLING_TOKEN_IDS = 1024


class RequestModel(BaseModel):
    # Fields the model does not declare are kept, so that `grpo_server.fields` can refuse or ignore them.
    model_config = ConfigDict(extra="allow")


def _documented(endpoint: Endpoint) -> Callable[[dict[str, Any]], None]:
    """json_schema_extra of a request model: its /docs description lists the ignored and refused fields."""

    def extra(schema: dict[str, Any]) -> None:
        schema["description"] = f"{schema.get('description', '').strip()}\n\n{describe(endpoint)}"

    return extra


class StructuredOutputs(RequestModel):
    """Guided decoding (vLLM's `StructuredOutputsParams`): exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(
        default=None, alias="json", description="A JSON schema (object or JSON text) the completion follows."
    )
    regex: str | None = Field(default=None, description="A regular expression the completion matches.")
    choice: list[str] | None = Field(default=None, min_length=1, description="The completion is one of these.")
    grammar: str | None = Field(
        default=None, description="An EBNF grammar (vllm engine only; the transformers engine answers 400)."
    )
    json_object: bool | None = Field(default=None, description="true: the completion is a JSON object.")

    @field_validator("json_schema")
    @classmethod
    def _schema_is_an_object(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
        if isinstance(value, str):
            try:
                loaded = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"json is not valid JSON: {exc}") from exc
            if not isinstance(loaded, dict):
                raise ValueError("json must be a JSON schema object")
        return value

    def constraint(self) -> StructuredOutput:
        """The one constraint set; BadRequest when none or several are."""
        kinds: list[StructuredOutput] = []
        if self.json_schema is not None:
            schema = self.json_schema if isinstance(self.json_schema, str) else json.dumps(self.json_schema)
            kinds.append(StructuredOutput("json", schema))
        if self.regex is not None:
            kinds.append(StructuredOutput("regex", self.regex))
        if self.choice is not None:
            kinds.append(StructuredOutput("choice", choices=tuple(self.choice)))
        if self.grammar is not None:
            kinds.append(StructuredOutput("grammar", self.grammar))
        if self.json_object:
            kinds.append(StructuredOutput("json_object"))
        if len(kinds) != 1:
            named = ", ".join(k.kind for k in kinds) or "none"
            raise BadRequest(
                f"structured_outputs: set exactly one of json, regex, choice, grammar, json_object (got {named})"
            )
        return kinds[0]


class JsonSchemaFormat(RequestModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(populate_by_name=True)

    name: str | None = Field(default=None, description="The schema's name (no effect).")
    description: str | None = Field(default=None, description="What the schema is for (no effect).")
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema the completion follows.")
    strict: bool | None = Field(default=None, description="Accepted: the output always follows the schema.")


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`: text (no constraint), json_object or json_schema."""

    type: str = Field(description="text, json_object or json_schema.")
    json_schema: JsonSchemaFormat | None = Field(default=None, description="The schema, for type json_schema.")

    def constraint(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.type == "json_schema":
            if self.json_schema is None:
                raise BadRequest("response_format.json_schema is required when type is json_schema")
            return StructuredOutput("json", json.dumps(self.json_schema.schema_))
        return None


class SamplingFields(RequestModel):
    """Sampling parameters shared by the generation endpoints (vLLM meanings)."""

    model: str | None = Field(
        default=None,
        description="Served model name (active adapter), `policy-v<N>` (that loaded version) or "
        "`<served>:base` (base model). Omitted: the active adapter.",
    )
    n: int = Field(default=1, ge=1, le=1024, description="Completions per prompt.")
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold.")
    top_k: int | None = Field(default=0, ge=-1, description="Top-k; 0, -1 or null disables.")
    min_p: float | None = Field(
        default=0.0, ge=0.0, le=1.0, description="Minimum probability relative to the top token."
    )
    repetition_penalty: float = Field(default=1.0, gt=0.0, description="vLLM repetition penalty (1 disables).")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="OpenAI frequency penalty.")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="OpenAI presence penalty.")
    logit_bias: dict[str, float] | None = Field(
        default=None,
        max_length=MAX_SAMPLING_TOKEN_IDS,
        description="Token id (as a string) -> bias added to its raw logit before penalties and temperature, "
        "as vLLM does; biases are clamped to [-100, 100].",
    )
    allowed_token_ids: list[int] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_SAMPLING_TOKEN_IDS,
        description="Only these token ids may be generated (EOS too only if listed).",
    )
    seed: int | None = Field(default=None, description="Seed for reproducible sampling.")
    stop: str | list[str] | None = Field(default=None, description="Stop strings (not included in the text).")
    stop_token_ids: list[int] | None = Field(default=None, description="Token ids that end a completion.")
    min_tokens: int = Field(default=0, ge=0, description="Tokens generated before EOS or stops may end it.")
    ignore_eos: bool = Field(default=False, description="Keep generating past EOS.")
    include_stop_str_in_output: bool = Field(default=False, description="Keep the matched stop string.")
    skip_special_tokens: bool = Field(default=True, description="Leave special tokens out of the text.")
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return the raw model's logprob of each prompt token given its prefix (null for the first), "
        "with this many top alternatives, in vLLM's format: `{token_id: {logprob, rank, decoded_token}}`.",
    )
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="Guided decoding: exactly one of json, regex, choice, grammar, json_object."
    )
    response_format: ResponseFormat | None = Field(
        default=None, description="OpenAI's output format: text, json_object or json_schema (guided decoding)."
    )
    guided_regex: str | None = Field(default=None, description="Older name of structured_outputs.regex.")
    truncate_prompt_tokens: int | None = Field(
        default=None,
        ge=-1,
        description="Accepted only when no prompt is longer (400 otherwise): the server does not truncate.",
    )

    def constraint(self) -> StructuredOutput | None:
        """The structured-output constraint from whichever one field sets it."""
        given = [
            name
            for name in ("structured_outputs", "response_format", "guided_regex")
            if getattr(self, name) is not None
        ]
        if len(given) > 1:
            raise BadRequest(f"{' and '.join(given)}: set one way of guided decoding")
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        if self.response_format is not None:
            return self.response_format.constraint()
        if self.guided_regex is not None:
            return StructuredOutput("regex", self.guided_regex)
        return None

    def check_fields(self, endpoint: Endpoint, prompts: Sequence[Sequence[int]]) -> None:
        """400 for any field sent that `grpo_server.fields` refuses (prompts: for truncate_prompt_tokens)."""
        check_sent(self.model_dump(exclude_unset=True, exclude={"prompt", "messages"}), endpoint, prompts)
        if self.structured_outputs is not None:
            check_sent(self.structured_outputs.model_extra or {}, endpoint, prefix="structured_outputs.")
        if self.response_format is not None:
            check_sent({"type": self.response_format.type}, endpoint, prefix="response_format.")

    def sampling_options(self, *, max_tokens: int, top_logprobs: int | None) -> SamplingOptions:
        """The engine's options (max_tokens already resolved against the budget); `top_logprobs` None: the request
        asked for no logprobs."""
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        constraint = self.constraint()
        return SamplingOptions(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k if self.top_k and self.top_k > 0 else 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            top_logprobs=top_logprobs or 0,
            logprobs=top_logprobs is not None,
            logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=tuple(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            prompt_logprobs=self.prompt_logprobs,
            regex=constraint.spec if constraint is not None and constraint.kind == "regex" else None,
            structured=constraint if constraint is not None and constraint.kind != "regex" else None,
        )


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """Sorted (token id, bias) pairs, biases clamped to [-100, 100] as vLLM clamps them."""
    pairs: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias: key {key!r} is not a token id") from None
        pairs[token] = min(100.0, max(-100.0, float(value)))
    return tuple(sorted(pairs.items()))


# ---------------------------------------------------------------------------------- OpenAI completions


class CompletionRequest(SamplingFields):
    """`POST /v1/completions` (TRL 1.16's generation and scoring calls)."""

    model_config = ConfigDict(json_schema_extra=_documented(Endpoint.COMPLETIONS))

    prompt: str | list[int] | list[list[int]] | list[str] = Field(
        description="A text, a list of texts, one token-id list, or a list of token-id lists."
    )
    max_tokens: int | None = Field(default=16, ge=1, description="Tokens per completion; null: the rest of the budget.")
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="Alternatives per token besides the sampled one; null: none."
    )
    echo: bool = Field(default=False, description="Not supported (must be false).")
    stream: bool = Field(default=False, description="Not supported (must be false).")
    return_token_ids: bool = Field(default=False, description="Add prompt_token_ids and token_ids to each choice.")
    return_tokens_as_token_ids: bool = Field(default=False, description="Logprob tokens as `token_id:<id>`.")

    def options(self, prompts: list[list[int]], limits: Limits) -> SamplingOptions:
        self.check_fields(Endpoint.COMPLETIONS, prompts)
        max_tokens = resolve_max_tokens(self.max_tokens, prompts, limits)
        return self.sampling_options(max_tokens=max_tokens, top_logprobs=self.logprobs)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(description="Sampled tokens (`token_id:<id>` when asked).")
    token_logprobs: list[float | None] = Field(description="Processed logprob of each sampled token.")
    top_logprobs: list[dict[str, float]] = Field(description="Per position: token -> logprob, sampled included.")
    text_offset: list[int] = Field(description="Character offset of each token in the text.")


class PromptLogprob(BaseModel):
    """vLLM's `Logprob`: one token's logprob at a prompt position and its rank there."""

    logprob: float = Field(description="Raw model logprob (-9999.0 for -inf, as vLLM clamps it).")
    rank: int | None = Field(description="1 for the most likely token.")
    decoded_token: str | None = Field(description="The token's text.")


#: Per prompt position: null at position 0, then token id (as a string) -> logprob; the prompt token first.
PromptLogprobsWire = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = Field(description="Prompt-major: prompt i's j-th completion is i*n + j.")
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"]
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = Field(default=None, description="Completion ids; EOS last when it stopped on EOS.")
    prompt_logprobs: PromptLogprobsWire | None = Field(
        default=None, description="With prompt_logprobs: the prompt's logprobs (the same in each of its n choices)."
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TaggedResponse(BaseModel):
    """Which server and policy produced a generation."""

    boot_id: str = Field(description="Boot id of the server process.")
    adapter_version: int | None = Field(description="Adapter version used; null for the base model.")


class CompletionResponse(TaggedResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# ------------------------------------------------------------------------------------- OpenAI chat


class ChatRequest(SamplingFields):
    """`POST /v1/chat/completions`: one conversation, chat template applied by the server."""

    model_config = ConfigDict(json_schema_extra=_documented(Endpoint.CHAT))

    messages: list[dict[str, Any]] = Field(min_length=1, description="OpenAI-style messages.")
    max_tokens: int | None = Field(
        default=None, ge=1, description="Tokens per completion; null: the rest of the budget."
    )
    max_completion_tokens: int | None = Field(default=None, ge=1, description="Newer name of max_tokens.")
    logprobs: bool = Field(default=False, description="Return the sampled tokens' logprobs.")
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, description="Alternatives per token.")
    stream: bool = Field(default=False, description="Not supported (must be false).")
    return_token_ids: bool = Field(default=False, description="Add prompt_token_ids and per-choice token_ids.")
    return_tokens_as_token_ids: bool = Field(default=False, description="Logprob tokens as `token_id:<id>`.")
    chat_template: str | None = Field(default=None, description="Jinja template overriding the tokenizer's.")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra template variables.")
    add_generation_prompt: bool = Field(default=True, description="End the prompt with the assistant header.")
    continue_final_message: bool = Field(default=False, description="Continue the last (assistant) message.")
    tools: list[dict[str, Any]] | None = Field(default=None, description="Tool schemas passed to the template.")

    def options(self, prompt: list[int], limits: Limits) -> SamplingOptions:
        self.check_fields(Endpoint.CHAT, [prompt])
        if self.top_logprobs and not self.logprobs:  # as OpenAI and vLLM: alternatives come with the logprobs
            raise BadRequest("top_logprobs: needs logprobs: true")
        requested = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        max_tokens = resolve_max_tokens(requested, [prompt], limits)
        return self.sampling_options(max_tokens=max_tokens,
                                     top_logprobs=(self.top_logprobs or 0) if self.logprobs else None)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int] | None = None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatResponse(TaggedResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = Field(default=None, description="The templated prompt's ids.")
    prompt_logprobs: PromptLogprobsWire | None = Field(
        default=None, description="With prompt_logprobs: the templated prompt's logprobs."
    )


# ------------------------------------------------------------------------------------------ native


class GenerateRequest(RequestModel):
    """`POST /generate/` (Axolotl's serve script and TRL ≤ 1.10's client)."""

    # As those servers do; sampling fields go in generation_kwargs, which refuses keys it does not know.
    model_config = ConfigDict(extra="ignore")

    prompts: list[str] | list[list[int]] = Field(description="Texts or token-id lists.")
    model: str | None = Field(default=None, description="As in /v1/completions: which policy to use.")
    images: list[Any] | None = Field(default=None, description="Not supported (must be null).")
    n: int = Field(default=1, ge=1, le=1024)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=-1, ge=-1, description="-1, 0 or null disables.")
    min_p: float | None = Field(default=0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(default=16, ge=1)
    logprobs: int | None = Field(default=0, ge=0, le=MAX_LOGPROBS, description="Alternatives per token; null: none.")
    seed: int | None = Field(default=None)
    truncate_prompt_tokens: int | None = Field(
        default=None, description="Accepted only when no prompt is longer (400 otherwise): the server does not "
        "truncate."
    )
    structured_outputs_regex: str | None = Field(default=None, description="Guided decoding regex.")
    generation_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="More sampling parameters by vLLM SamplingParams name: "
        + ", ".join(sorted(GENERATION_KWARGS)) + "; any other is refused.",
    )

    def top_logprobs(self) -> int | None:
        """Alternatives per token (generation_kwargs.logprobs wins); None: no logprobs at all."""
        value = self.generation_kwargs.get("logprobs", self.logprobs)
        return value if isinstance(value, int) else None

    def options(self, prompts: list[list[int]], limits: Limits) -> SamplingOptions:
        """The top-level fields, overridden by generation_kwargs, checked as the OpenAI fields are."""
        if self.images:
            raise BadRequest("images: image prompts are not supported")
        extra = check_generation_kwargs(self.generation_kwargs)
        merged: dict[str, Any] = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "model": self.model,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "structured_outputs": {"regex": self.structured_outputs_regex} if self.structured_outputs_regex else None,
        }
        merged.update({k: v for k, v in extra.items() if k not in ("max_tokens", "logprobs")})
        try:
            fields = SamplingFields.model_validate(merged)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise BadRequest(f"generation_kwargs: {problems}") from exc
        fields.check_fields(Endpoint.COMPLETIONS, prompts)
        max_tokens = resolve_max_tokens(extra.get("max_tokens", self.max_tokens), prompts, limits)
        return fields.sampling_options(max_tokens=max_tokens, top_logprobs=self.top_logprobs())


class GenerateResponse(TaggedResponse):
    prompt_ids: list[list[int]] = Field(description="One per prompt.")
    completion_ids: list[list[int]] = Field(description="n per prompt, prompt-major.")
    logprobs: list[list[list[float | None]]] | None = Field(description="[sequence][position][rank].")
    logprob_token_ids: list[list[list[int]]] | None = Field(description="Token ids matching `logprobs`.")
    finish_reasons: list[str] = Field(description="stop or length, per completion.")


class ClearAdapterResponse(BaseModel):
    status: str = "ok"
    adapter: ActiveAdapter | None = Field(default=None, description="Always null: the base model is active.")
    boot_id: str


class ResetPrefixCacheResponse(BaseModel):
    success: bool
    message: str


class WorldSizeResponse(BaseModel):
    world_size: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "grpo"
    root: str
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ServerInfo(BaseModel):
    """`GET /server_info`: what TRL reads from vLLM's dev-mode route, plus this server's identity."""

    vllm_config: dict[str, Any] | str
    engine: str
    boot_id: str


class LoadLoraAdapterRequest(BaseModel):
    """Body of vLLM's `POST /v1/load_lora_adapter` (TRL's `AsyncGRPOTrainer` sends it)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=256,
                           description="Name requests select it by; `<name>-v<N>` loads it as version N.")
    lora_path: AdapterPath = Field(description="Adapter directory, inside the adapter root.")
    load_inplace: bool = Field(
        default=False,
        description="Ignored: every load is a new version with its own engine name; a name loaded again moves to it.",
    )


class UnloadLoraAdapterRequest(BaseModel):
    """Body of vLLM's `POST /v1/unload_lora_adapter`."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=256, description="The name it was loaded under.")
    lora_int_id: int | None = Field(default=None, description="Ignored (vLLM's optional id).")


class UnloadLoraAdapterResponse(BaseModel):
    status: str = "ok"
    lora_name: str
    version: int


PauseMode = Literal["abort", "wait", "keep"]


class PauseResponse(BaseModel):
    status: Literal["paused", "resumed"]
    mode: PauseMode | None = None
    #: Requests the pause cancelled (mode abort) or waited for (mode wait).
    requests: int = 0


class IsPausedResponse(BaseModel):
    is_paused: bool
