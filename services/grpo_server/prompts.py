"""Text and chat prompts to token ids, off the event loop and bounded.

Templating and tokenization of a large or odd request can take seconds of CPU;
on the event loop that would stall every other request and `/health/` with it.
`PromptEncoder` runs both on one dedicated thread (HF tokenizers must not be
driven from several threads at once) and refuses, before any work, a text that
cannot fit `maxModelLen` tokens however it is tokenized: no token of the
vocabulary covers more than `max_token_chars` characters, so a longer text would
exceed the model's length anyway.

Chat templates sent by clients are Jinja programs run in the server; they are
refused unless the server was started with `--allow-client-chat-templates`
(or `GRPO_SERVER_ALLOW_CHAT_TEMPLATES=1`), and even then a rendering is stopped
and answered 400 after `TEMPLATE_SECONDS`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from grpo_server.errors import BadRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")

#: Longest a chat template may render for (seconds) before the request is refused.
TEMPLATE_SECONDS = 10.0
#: Margin on the characters-per-token bound (normalizers may drop characters, e.g. accents).
CHARS_MARGIN = 2


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """Characters of the longest token string in the vocabulary (added tokens included)."""
    vocab: dict[str, int] = tokenizer.get_vocab()
    return max((len(token) for token in vocab), default=1)


class TemplateTimeout(Exception):
    """A client's chat template ran past its deadline."""


@contextlib.contextmanager
def _deadline(deadline: float) -> Iterator[None]:
    """Interrupt the Python code run in this thread (a compiled Jinja template) once `deadline` passes.

    A trace function sees every call and line of the template's code and raises there; jinja's sandbox
    bounds single ranges but not nested loops. Only this thread is traced, only for client templates.
    """

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise TemplateTimeout
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)


class PromptEncoder:
    """Tokenizes on one worker thread; every method raises BadRequest naming the field."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, *, max_model_len: int, allow_chat_templates: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.allow_chat_templates = allow_chat_templates
        self.max_chars = max_model_len * max(longest_token_chars(tokenizer), 1) * CHARS_MARGIN
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._token_texts: dict[int, str] = {}  # bounded by the vocabulary

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _check_length(self, text: str, field: str) -> None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadRequest(f"{field} is not valid Unicode text (character {exc.start} is a lone surrogate)") from None
        if len(text) > self.max_chars:
            raise BadRequest(
                f"{field} has {len(text)} characters; no text over {self.max_chars} characters fits "
                "maxModelLen tokens of this model"
            )

    def _ids(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        return ids

    async def text(self, text: str, field: str = "prompt") -> list[int]:
        self._check_length(text, field)
        return await self._run(lambda: self._ids(text))

    async def prompts(
        self, prompt: str | list[int] | list[list[int]] | list[str], field: str = "prompt"
    ) -> list[list[int]]:
        """Any OpenAI prompt form (a text, texts, one id list, id lists) as a list of token-id lists."""
        if isinstance(prompt, str):
            return [await self.text(prompt, field)]
        if not prompt:
            return []
        items: list[Any] = list(prompt)
        if all(isinstance(item, int) for item in items):  # a single token-id prompt
            return [[int(t) for t in items]]
        texts = [(i, item) for i, item in enumerate(items) if isinstance(item, str)]
        for i, item in texts:
            self._check_length(item, f"{field}[{i}]")
        encoded = await self._run(lambda: {i: self._ids(item) for i, item in texts})
        return [encoded[i] if isinstance(item, str) else [int(t) for t in item] for i, item in enumerate(items)]

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        chat_template: str | None,
        template_kwargs: dict[str, Any],
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None,
    ) -> list[int]:
        tokenizer = self.tokenizer
        if chat_template is not None and not self.allow_chat_templates:
            raise BadRequest(
                "chat_template: this server does not run client-supplied chat templates (start it with "
                "--allow-client-chat-templates to allow them); the model's own template is used without it"
            )
        if chat_template is None and not tokenizer.chat_template:
            raise BadRequest("messages: the model has no chat template")

        def render() -> str:
            deadline = time.monotonic() + TEMPLATE_SECONDS
            try:
                with _deadline(deadline) if chat_template is not None else contextlib.nullcontext():
                    text = tokenizer.apply_chat_template(
                        messages,
                        chat_template=chat_template,
                        tools=tools,  # type: ignore[arg-type]
                        add_generation_prompt=add_generation_prompt and not continue_final_message,
                        continue_final_message=continue_final_message,
                        tokenize=False,
                        **template_kwargs,
                    )
            except TemplateTimeout as exc:
                raise BadRequest(f"chat_template: rendering ran longer than {TEMPLATE_SECONDS:.0f}s") from exc
            except Exception as exc:  # jinja and template errors of many types: the request's fault
                raise BadRequest(f"messages: the chat template failed: {type(exc).__name__}: {exc}") from exc
            if not isinstance(text, str):
                raise BadRequest("messages: the chat template did not produce text")
            return text

        text = await self._run(render)
        self._check_length(text, "messages (templated)")
        return await self._run(lambda: self._ids(text, add_special_tokens=False))

    def decode_token(self, token_id: int) -> str:
        """One token's text, cached: logprob names and text offsets ask for every sampled token."""
        text = self._token_texts.get(token_id)
        if text is None:
            decoded = self.tokenizer.decode([token_id])
            assert isinstance(decoded, str)
            text = self._token_texts[token_id] = decoded
        return text
