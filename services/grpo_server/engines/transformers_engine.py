"""The transformers engine: real Hugging Face inference on CPU (or one GPU), slow but exact.

Used by tests, CI and the CPU demo. It samples with its own loop over the model's
forward pass (KV cache, left padding) so that it can return, per sampled token,
the logprob after the same processing vLLM applies with
`logprobs_mode="processed_logprobs"`, in vLLM's order: the structured-output mask,
allowed_token_ids, min_tokens, logit_bias, the penalties, then temperature, min-p,
top-k and top-p, renormalised. Prompt logprobs are the raw log-softmax of the first
forward pass, as vLLM computes them. Structured outputs use lm-format-enforcer (one of
vLLM's own backends) for regex, JSON schema, JSON object and choice. LoRA adapters are
PEFT adapters loaded into the model under their version name (transformers' PEFT
integration); the active one is switched per request. All model access runs on one
worker thread (see `serial.py`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, assert_never

import torch

from grpo_server.engines.base import (
    AdapterHandle,
    AdapterLoadError,
    Completion,
    FinishReason,
    GenerationAborted,
    InvalidRequestError,
    PromptLogprobs,
    PromptResult,
    RankedLogprob,
    SamplingOptions,
    StructuredOutput,
)
from grpo_server.engines.gloo_weights import DTYPES, GlooWeightReceiver
from grpo_server.engines.serial import PRIORITY_ADAPTER, PRIORITY_GENERATE, SerialWorker

if TYPE_CHECKING:
    from lmformatenforcer import CharacterLevelParser, TokenEnforcer, TokenEnforcerTokenizerData
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)



@dataclass
class _Row:
    """One sequence being sampled (a prompt repeated n times gives n rows)."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    text_end: int | None = None  # character offset where a stop string cut the text
    enforcer: TokenEnforcer | None = None
    prompt_logprobs: PromptLogprobs | None = None


class TransformersEngine:
    """Engine over `AutoModelForCausalLM` with PEFT adapters."""

    name = "transformers"

    def __init__(
        self,
        model_dir: Path,
        tokenizer: PreTrainedTokenizerBase,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        device: str | None = None,
        max_top_logprobs: int = 20,
    ) -> None:
        self._model_dir = model_dir
        self._tokenizer = tokenizer
        self._dtype = dtype
        self._max_model_len_setting = max_model_len
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._max_top_logprobs = max_top_logprobs
        self._worker: SerialWorker | None = None
        self._model: PreTrainedModel | None = None
        self._eos_ids: frozenset[int] = frozenset()
        self._max_model_len = 0
        self._adapters: set[str] = set()
        self._enforcer_data: dict[bool, TokenEnforcerTokenizerData] = {}  # for JSON or not
        self._weights: GlooWeightReceiver | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._worker = SerialWorker("transformers-engine")
        await self._worker.call(self._load, PRIORITY_ADAPTER)

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        # Adapter loads print a per-key report for every other loaded adapter: noise.
        hf_logging.set_verbosity_error()
        if self._dtype in DTYPES:
            dtype: Any = DTYPES[self._dtype]
        else:
            dtype = torch.float32 if self._device.type == "cpu" else "auto"
        model = AutoModelForCausalLM.from_pretrained(self._model_dir, dtype=dtype)
        model.to(self._device)  # type: ignore[arg-type]  # transformers' stub types .to() oddly
        model.eval()
        self._model = model
        eos: set[int] = set()
        configured = model.generation_config.eos_token_id
        if isinstance(configured, int):
            eos.add(configured)
        elif configured:
            eos.update(int(i) for i in configured)
        if self._tokenizer.eos_token_id is not None:
            eos.add(int(self._tokenizer.eos_token_id))
        self._eos_ids = frozenset(eos)
        limit = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 1 << 30
        self._max_model_len = min(self._max_model_len_setting or limit, limit)
        log.info("transformers engine loaded %s on %s (%s)", self._model_dir, self._device, model.dtype)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def world_size(self) -> int:
        return 1

    def healthy(self) -> bool:
        return self._worker is not None and self._worker.alive() and self._model is not None

    async def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close(timeout=10)

    async def reset_prefix_cache(self) -> bool:
        return True  # no cache outlives a request

    def serves_adapters(self) -> bool:
        return True  # PEFT adapters on the loaded model, whatever weights it holds

    def weight_receiver(self) -> GlooWeightReceiver:
        """vLLM's weight transfer over gloo (see gloo_weights.py)."""
        if self._weights is None:
            def model() -> PreTrainedModel:
                assert self._model is not None, "weights are received once the engine has started"
                return self._model

            def worker() -> SerialWorker:
                assert self._worker is not None
                return self._worker

            self._weights = GlooWeightReceiver(model, worker)
        return self._weights

    # ------------------------------------------------------------------ adapters

    async def add_adapter(self, adapter: AdapterHandle) -> None:
        assert self._worker is not None
        await self._worker.call(lambda: self._add_adapter(adapter), PRIORITY_ADAPTER)

    def _add_adapter(self, adapter: AdapterHandle) -> None:
        assert self._model is not None
        if adapter.name in self._adapters:
            raise AdapterLoadError(f"adapter {adapter.name} is already loaded")
        try:
            with warnings.catch_warnings():
                # PEFT warns on every adapter after the first: several adapters per model is the point here
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                self._model.load_adapter(adapter.path, adapter_name=adapter.name)
        except Exception as exc:
            self._drop_partial(adapter.name)
            raise AdapterLoadError(f"{adapter.path}: {type(exc).__name__}: {exc}") from exc
        self._adapters.add(adapter.name)

    def _drop_partial(self, name: str) -> None:
        """Remove what a failed load may have injected, so the name is not half-present."""
        assert self._model is not None
        try:
            if name in getattr(self._model, "peft_config", {}):
                self._model.delete_adapter(name)
        except Exception:  # a failed cleanup must not hide the load error
            log.exception("cleanup after failed load of %s", name)

    async def remove_adapter(self, adapter: AdapterHandle) -> None:
        assert self._worker is not None
        await self._worker.call(lambda: self._remove_adapter(adapter), PRIORITY_ADAPTER)

    def _remove_adapter(self, adapter: AdapterHandle) -> None:
        assert self._model is not None
        if adapter.name in self._adapters:
            self._model.delete_adapter(adapter.name)
            self._adapters.discard(adapter.name)

    def _activate(self, adapter: AdapterHandle | None) -> None:
        assert self._model is not None
        if not self._adapters:
            return
        if adapter is None:
            self._model.disable_adapters()
            return
        if adapter.name not in self._adapters:
            raise InvalidRequestError(f"adapter {adapter.name} is not loaded")
        self._model.enable_adapters()
        self._model.set_adapter(adapter.name)

    # ------------------------------------------------------------------ generation

    async def generate(
        self, prompts: list[list[int]], options: SamplingOptions, adapter: AdapterHandle | None
    ) -> list[PromptResult]:
        assert self._worker is not None
        for name, asked in (("logprobs", options.top_logprobs), ("prompt_logprobs", options.prompt_logprobs or 0)):
            if asked > self._max_top_logprobs:
                raise InvalidRequestError(
                    f"{name}: at most {self._max_top_logprobs} alternatives per token, got {asked}"
                )
        structured = options.structured_output
        if structured is not None and structured.kind == "grammar":
            raise InvalidRequestError(
                "structured_outputs.grammar: grammars need the vllm engine (lm-format-enforcer, which the "
                "transformers engine uses, has no grammar support)"
            )
        aborted = threading.Event()
        try:
            return await self._worker.call(
                lambda: self._generate(prompts, options, adapter, aborted), PRIORITY_GENERATE
            )
        except asyncio.CancelledError:  # the client left: a queued call never starts, a running one stops
            aborted.set()
            raise

    def _generate(
        self,
        prompts: list[list[int]],
        options: SamplingOptions,
        adapter: AdapterHandle | None,
        aborted: threading.Event,
    ) -> list[PromptResult]:
        assert self._model is not None
        self._activate(adapter)
        rows = [_Row(prompt=list(p)) for p in prompts for _ in range(options.n)]
        if options.structured_output is not None:
            self._attach_enforcers(rows, options.structured_output)
        generator = torch.Generator(device=self._device)
        generator.manual_seed(options.seed if options.seed is not None else secrets.randbits(63))
        with torch.inference_mode():
            try:
                self._sample(rows, options, generator, aborted)
            except GenerationAborted as exc:
                log.info("generation %s (%d sequences)", exc, len(rows))
                raise
        results = []
        for i, prompt in enumerate(prompts):
            chunk = rows[i * options.n : (i + 1) * options.n]
            completions = [self._completion(r, options) for r in chunk]
            results.append(PromptResult(list(prompt), completions, prompt_logprobs=chunk[0].prompt_logprobs))
        return results

    def _sample(
        self, rows: list[_Row], options: SamplingOptions, generator: torch.Generator, aborted: threading.Event
    ) -> None:
        assert self._model is not None
        from transformers import DynamicCache

        device = self._device
        batch = len(rows)
        width = max(len(r.prompt) for r in rows)
        input_ids = torch.zeros((batch, width), dtype=torch.long, device=device)
        attention = torch.zeros((batch, width), dtype=torch.long, device=device)
        for b, row in enumerate(rows):  # left padding: every row's next token is at the last column
            input_ids[b, width - len(row.prompt) :] = torch.tensor(row.prompt, device=device)
            attention[b, width - len(row.prompt) :] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        vocab = int(self._model.get_output_embeddings().weight.shape[0])
        seen = torch.zeros((batch, vocab), dtype=torch.bool, device=device)
        for b, row in enumerate(rows):
            seen[b, row.prompt] = True
        counts = torch.zeros((batch, vocab), dtype=torch.float32, device=device)
        blocked_early = sorted(set(options.stop_token_ids) | (set() if options.ignore_eos else self._eos_ids))
        disallowed = None
        if options.allowed_token_ids is not None:
            disallowed = torch.ones(vocab, dtype=torch.bool, device=device)
            disallowed[list(options.allowed_token_ids)] = False
        bias = torch.zeros(vocab, dtype=torch.float32, device=device) if options.logit_bias else None
        if bias is not None:
            bias[[token for token, _ in options.logit_bias]] = torch.tensor(
                [value for _, value in options.logit_bias], device=device
            )
        cache = DynamicCache()
        step_ids, step_positions = input_ids, positions
        for step in range(options.max_tokens):
            if aborted.is_set():
                raise GenerationAborted(f"aborted after {step} of at most {options.max_tokens} tokens")
            out = self._model(
                input_ids=step_ids,
                attention_mask=attention,
                position_ids=step_positions,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            if step == 0 and options.prompt_logprobs is not None:
                for b in range(0, batch, options.n):  # the n rows of a prompt share its prompt logprobs
                    prompt = rows[b].prompt
                    rows[b].prompt_logprobs = self._prompt_logprobs(
                        out.logits[b, width - len(prompt) :], prompt, options.prompt_logprobs
                    )
            logits = out.logits[:, -1, :].float()
            # vLLM's order: the structured-output bitmask (model runner), then the sampler's
            # allowed_token_ids, min_tokens and logit_bias, all before the penalties
            self._mask_by_enforcers(rows, logits, options.structured_output)
            if disallowed is not None:
                logits.masked_fill_(disallowed, float("-inf"))
            if step < options.min_tokens and blocked_early:
                logits[:, blocked_early] = float("-inf")
            if bias is not None:
                logits += bias
            scores = self._process(logits, options, seen, counts)
            self._check_samplable(rows, scores, step)
            logprobs = torch.log_softmax(scores, dim=-1)
            if options.greedy:
                next_ids = scores.argmax(dim=-1)
            else:
                next_ids = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator).squeeze(1)
            sampled_lp = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            top = torch.topk(logprobs, options.top_logprobs, dim=-1) if options.top_logprobs else None
            next_list = next_ids.tolist()
            lp_list = sampled_lp.tolist()
            for b, row in enumerate(rows):
                if row.finish_reason is not None:
                    continue
                token = next_list[b]
                row.tokens.append(token)
                row.logprobs.append(lp_list[b])
                row.top.append(self._rank_sorted(token, lp_list[b], top, b))
                self._check_stop(row, token, options, step + 1)
            seen[torch.arange(batch, device=device), next_ids] = True
            counts[torch.arange(batch, device=device), next_ids] += 1
            if all(r.finish_reason is not None for r in rows):
                break
            step_ids = next_ids.unsqueeze(1)
            attention = torch.cat([attention, torch.ones((batch, 1), dtype=attention.dtype, device=device)], 1)
            step_positions = step_positions[:, -1:] + 1
        for row in rows:
            if row.finish_reason is None:
                row.finish_reason = "length"

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, prompt: list[int], top: int) -> PromptLogprobs:
        """vLLM's prompt logprobs of one prompt from its logits (one row per prompt token).

        Raw log-softmax (no temperature or other processing, as vLLM scores prompts); the rank of
        a token counts the tokens at least as likely, itself included, as vLLM counts it, or is its
        place among the top alternatives when it is one of them (vLLM's dict keeps that entry).
        """
        logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)  # row j scores prompt[j + 1]
        targets = torch.tensor(prompt[1:], device=logits.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1))
        ranks = (logprobs >= chosen).sum(dim=1).tolist()
        chosen_list = chosen.squeeze(1).tolist()
        best = torch.topk(logprobs, top, dim=-1) if top else None
        out: PromptLogprobs = [None]
        for j, token in enumerate(prompt[1:]):
            entries = {token: RankedLogprob(token, chosen_list[j], int(ranks[j]))}
            if best is not None:
                for rank, (t, lp) in enumerate(zip(best.indices[j].tolist(), best.values[j].tolist(), strict=True), 1):
                    entries[t] = RankedLogprob(t, lp, rank)
            out.append(list(entries.values()))
        return out

    @staticmethod
    def _check_samplable(rows: list[_Row], scores: torch.Tensor, step: int) -> None:
        """A row whose every token is masked cannot be sampled: the request's constraints contradict."""
        dead = torch.isneginf(scores).all(dim=-1).tolist()
        if any(d and row.finish_reason is None for d, row in zip(dead, rows, strict=True)):
            raise InvalidRequestError(
                f"no token can be generated at position {step}: allowed_token_ids, min_tokens, stop and "
                "structured outputs exclude every token"
            )

    @staticmethod
    def _rank_sorted(
        token: int, logprob: float, top: Any, b: int
    ) -> list[tuple[int, float]]:
        if top is None:
            return [(token, logprob)]
        pairs = list(zip(top.indices[b].tolist(), top.values[b].tolist(), strict=True))
        if token not in {t for t, _ in pairs}:
            pairs.append((token, logprob))  # ranked below the alternatives, as vLLM orders it
        return pairs

    @staticmethod
    def _process(
        logits: torch.Tensor, options: SamplingOptions, seen: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """vLLM's order: penalties on the raw logits, then temperature, min-p, top-k, top-p."""
        if options.repetition_penalty != 1.0:
            penalised = torch.where(
                logits > 0, logits / options.repetition_penalty, logits * options.repetition_penalty
            )
            logits = torch.where(seen, penalised, logits)
        if options.frequency_penalty:
            logits = logits - options.frequency_penalty * counts
        if options.presence_penalty:
            logits = logits - options.presence_penalty * (counts > 0).float()
        if options.greedy:
            return logits
        scores = logits / options.temperature
        if options.min_p > 0.0:
            probs = torch.softmax(scores, dim=-1)
            threshold = options.min_p * probs.max(dim=-1, keepdim=True).values
            scores = scores.masked_fill(probs < threshold, float("-inf"))
        if options.top_k > 0 and options.top_k < scores.shape[-1]:
            kth = torch.topk(scores, options.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if options.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
            cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
            # drop a token when the tokens ranked above it already reach top_p (the first always stays)
            drop_sorted = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= options.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        return scores

    def _check_stop(self, row: _Row, token: int, options: SamplingOptions, produced: int) -> None:
        if produced < options.min_tokens:
            return
        if token in options.stop_token_ids:
            row.finish_reason, row.stop_reason = "stop", token
        elif token in self._eos_ids and not options.ignore_eos:
            row.finish_reason = "stop"
        elif options.stop:
            text = self._decode(row.tokens, options.skip_special_tokens)
            hits = [(text.find(s), s) for s in options.stop if s and s in text]
            if hits:
                at, stop = min(hits)
                row.finish_reason, row.stop_reason = "stop", stop
                row.text_end = at + len(stop) if options.include_stop_str_in_output else at

    def _decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)
        return text

    def _completion(self, row: _Row, options: SamplingOptions) -> Completion:
        text = self._decode(row.tokens, options.skip_special_tokens)
        if row.text_end is not None:
            text = text[: row.text_end]
        assert row.finish_reason is not None
        return Completion(
            token_ids=row.tokens,
            logprobs=row.logprobs,
            top_logprobs=row.top,
            text=text,
            finish_reason=row.finish_reason,
            stop_reason=row.stop_reason,
        )

    # ------------------------------------------------------------------ guided decoding

    def _attach_enforcers(self, rows: list[_Row], constraint: StructuredOutput) -> None:
        from lmformatenforcer import TokenEnforcer

        parser = self._parser(constraint)
        data = self._enforcer_tokenizer_data(for_json=constraint.kind in ("json", "json_object"))
        for row in rows:
            row.enforcer = TokenEnforcer(data, parser)
            row.enforcer.get_allowed_tokens(row.prompt)  # the first call marks the prompt as the root

    @staticmethod
    def _parser(constraint: StructuredOutput) -> CharacterLevelParser:
        """lm-format-enforcer's parser for a constraint, as vLLM's lm-format-enforcer backend builds it."""
        from lmformatenforcer import JsonSchemaParser, RegexParser, StringParser, UnionParser

        try:
            match constraint.kind:
                case "regex":
                    return RegexParser(constraint.spec)
                case "json":
                    return JsonSchemaParser(constraint.schema())
                case "json_object":  # vLLM's backends: an object, not any JSON value
                    return JsonSchemaParser({"type": "object"})
                case "choice":
                    return UnionParser([StringParser(choice) for choice in constraint.choices])
                case "grammar":
                    raise ValueError("grammars need the vllm engine")
                case _:
                    assert_never(constraint.kind)
        except Exception as exc:
            raise InvalidRequestError(
                f"structured_outputs.{constraint.kind} is not supported: {type(exc).__name__}: {exc}"
            ) from exc

    def _enforcer_tokenizer_data(self, for_json: bool) -> TokenEnforcerTokenizerData:
        """lm-format-enforcer's token table (its transformers integration does not import on transformers 5).

        Left out: pieces of multi-byte characters (the parser would take one for a character of its
        own, and lose track when the whole character decodes differently) and, for JSON, tokens with
        control characters other than newlines, which a JSON string may not hold raw and which
        lm-format-enforcer's string check lets through (newlines it checks itself).
        """
        if for_json not in self._enforcer_data:
            from lmformatenforcer import TokenEnforcerTokenizerData

            tok = self._tokenizer
            special = set(tok.all_special_ids)
            anchor = tok.encode("0", add_special_tokens=False)[-1]
            regular = []
            for token_id in range(len(tok)):
                if token_id in special:
                    continue
                # decoding after an anchor token reveals a leading space that decoding alone may strip
                after_anchor = tok.decode([anchor, token_id])[1:]
                if "\ufffd" in after_anchor or (for_json and any(c < " " and c not in "\n\r" for c in after_anchor)):
                    continue
                alone = tok.decode([token_id])
                regular.append((token_id, after_anchor, len(after_anchor) > len(alone)))
            eos = sorted(self._eos_ids)
            self._enforcer_data[for_json] = TokenEnforcerTokenizerData(
                regular, lambda ids: self._decode(ids).rstrip("\ufffd"), eos, False, len(tok)
            )
        return self._enforcer_data[for_json]

    @staticmethod
    def _mask_by_enforcers(rows: list[_Row], logits: torch.Tensor, constraint: StructuredOutput | None) -> None:
        """Mask what the constraint forbids next. lm-format-enforcer allows EOS once the text is complete,
        and only EOS at a dead end it cannot continue from (it logs that), as in vLLM's backend of it."""
        if constraint is None:
            return
        from lmformatenforcer import LMFormatEnforcerException

        for b, row in enumerate(rows):
            if row.enforcer is None or row.finish_reason is not None:
                continue
            try:
                allowed = row.enforcer.get_allowed_tokens(row.prompt + row.tokens).allowed_tokens
            except LMFormatEnforcerException as exc:
                raise InvalidRequestError(f"structured_outputs.{constraint.kind}: {exc}") from exc
            mask = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
            mask[allowed] = False
            logits[b].masked_fill_(mask, float("-inf"))
