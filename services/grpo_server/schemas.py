"""Request and response models of every endpoint (they are the /docs reference).

Native models follow the Axolotl/TRL-legacy server (`/generate/`); OpenAI models
follow vLLM's OpenAI server as far as TRL 1.16's client and the `openai` package
use it. Wire models shared with clients (health, adapter trigger, errors) live in
`grpo_api.protocol`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from grpo_api.protocol import ActiveAdapter

MAX_LOGPROBS = 20


class RequestModel(BaseModel):
    # OpenAI clients send fields this server does not use (user, stream_options...): ignore them.
    model_config = ConfigDict(extra="ignore")


class StructuredOutputs(RequestModel):
    """Guided decoding; only a regex is supported."""

    regex: str | None = Field(default=None, description="Completions must match this regular expression.")


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
    seed: int | None = Field(default=None, description="Seed for reproducible sampling.")
    stop: str | list[str] | None = Field(default=None, description="Stop strings (not included in the text).")
    stop_token_ids: list[int] | None = Field(default=None, description="Token ids that end a completion.")
    min_tokens: int = Field(default=0, ge=0, description="Tokens generated before EOS or stops may end it.")
    ignore_eos: bool = Field(default=False, description="Keep generating past EOS.")
    include_stop_str_in_output: bool = Field(default=False, description="Keep the matched stop string.")
    skip_special_tokens: bool = Field(default=True, description="Leave special tokens out of the text.")
    structured_outputs: StructuredOutputs | None = Field(default=None, description="Guided decoding (regex).")
    guided_regex: str | None = Field(default=None, description="Older name of structured_outputs.regex.")


# ---------------------------------------------------------------------------------- OpenAI completions


class CompletionRequest(SamplingFields):
    """`POST /v1/completions` (TRL 1.16's generation call)."""

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


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(description="Sampled tokens (`token_id:<id>` when asked).")
    token_logprobs: list[float | None] = Field(description="Processed logprob of each sampled token.")
    top_logprobs: list[dict[str, float]] = Field(description="Per position: token -> logprob, sampled included.")
    text_offset: list[int] = Field(description="Character offset of each token in the text.")


class CompletionChoice(BaseModel):
    index: int = Field(description="Prompt-major: prompt i's j-th completion is i*n + j.")
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"]
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = Field(default=None, description="Completion ids; EOS last when it stopped on EOS.")


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


# ------------------------------------------------------------------------------------------ native


class GenerateRequest(RequestModel):
    """`POST /generate/` (Axolotl's serve script and TRL ≤ 1.10's client)."""

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
    truncate_prompt_tokens: int | None = Field(default=None, description="Accepted and ignored, as in Axolotl.")
    structured_outputs_regex: str | None = Field(default=None, description="Guided decoding regex.")
    generation_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="More sampling parameters by vLLM SamplingParams name."
    )


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
