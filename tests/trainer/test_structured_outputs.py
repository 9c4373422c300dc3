"""spec.trainer.structuredOutputs reaches every generation request, and the server's rollouts obey it.

The spec's constraint travels as TRL carries it: `grpo_config_kwargs` puts it into
GRPOConfig.generation_kwargs["structured_outputs"]
(vLLM's StructuredOutputsParams fields), which TRL hands to VLLMGeneration; our ServerGeneration
puts it into the sampling fields of each /v1/completions request. A real server (transformers
engine, tiny model) then generates under it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from accelerate import Accelerator
from transformers import AutoTokenizer
from trl import GRPOConfig

from grpo_api.models import GRPORunSpec, StructuredOutputsSpec
from grpo_trainer.config import Platform, grpo_config_kwargs
from grpo_trainer.generation import GenerationBackend, StalenessBound
from grpo_trainer.metrics import TrainerMetrics
from grpo_trainer.transport.adapter_store import AdapterStore
from grpo_trainer.transport.policy_sync import AdapterSync
from grpo_trainer.transport.replica_set import ReplicaSet, static_discovery
from grpo_trainer.transport.replicas import ServerPool
from grpo_trainer.trl_overrides import ServerGeneration
from tests.fixtures.server import RunningServer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
PROMPTS = [[5, 6, 7, 8], [100, 101, 102]]
GROUP = 3


def generation_for(spec: StructuredOutputsSpec | None, server: RunningServer, tmp_path: Path) -> ServerGeneration:
    """The generation backend GRPOTrainer builds from a GRPOConfig carrying the spec's constraint."""
    run_spec = GRPORunSpec.model_validate({
        "model": {"name": "tiny", "path": "/models/tiny"}, "dataset": {"path": "/data/prompts.jsonl"},
        "rewards": [{"function": "exact_match"}],
        "trainer": {"numGenerations": GROUP, "perDeviceBatchSize": GROUP, "maxCompletionLength": 48,
                    **({"structuredOutputs": spec.model_dump(by_alias=True, exclude_none=True)} if spec else {})},
    })
    cpu = Platform(cuda=False, bf16=False, vllm=False, bitsandbytes=False)
    kwargs = grpo_config_kwargs(run_spec, output_dir=str(tmp_path / "out"), server_url=server.url,
                                reward_weights=[1.0], platform=cpu)
    args = GRPOConfig(**kwargs)
    metrics = TrainerMetrics()
    store = AdapterStore(tmp_path / "adapters", "fp")
    backend = GenerationBackend(
        ServerPool(ReplicaSet(static_discovery([server.url]), expected=1, describe=server.url, token=None,
                              generation_timeout=120, metrics=metrics)),
        AdapterSync(store, None, metrics, retry_seconds=1), metrics, model_name="tiny",
        num_generations=GROUP, bound=StalenessBound(1, 0), seed=7, current_step=lambda: 0, log=lambda _: None,
    )
    bound = type("BoundServerGeneration", (ServerGeneration,), {"backend": backend})
    # the arguments GRPOTrainer.__init__ passes (trl/trainer/grpo_trainer.py)
    generation: ServerGeneration = bound(
        model=None, accelerator=Accelerator(cpu=True), processing_class=None, mode=args.vllm_mode,
        structured_outputs_regex=args.vllm_structured_outputs_regex, temperature=args.temperature,
        max_completion_length=args.max_completion_length, generation_kwargs=args.generation_kwargs,
    )
    return generation


def rollouts(generation: ServerGeneration, served_model_dir: Path) -> list[str]:
    prompts = [p for p in PROMPTS for _ in range(GROUP)]  # TRL repeats each prompt num_generations times
    prompt_ids, completion_ids, logprobs, _ = generation.generate(prompts, None, GROUP)
    assert prompt_ids == prompts and len(completion_ids) == len(logprobs) == len(prompts)
    tokenizer = AutoTokenizer.from_pretrained(served_model_dir)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]


CASES: list[tuple[str, dict[str, Any], Any]] = [
    ("choice", {"choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
    ("regex", {"regex": "[0-9]{2}-[a-z]{3}"}, lambda text: re.fullmatch("[0-9]{2}-[a-z]{3}", text)),
    ("jsonSchema", {"jsonSchema": SCHEMA}, lambda text: json.loads(text)["answer"] in ("yes", "no")),
]


@pytest.mark.parametrize(("kind", "given", "obeys"), CASES, ids=[c[0] for c in CASES])
def test_every_rollout_request_carries_the_spec_constraint(tiny_server, served_model_dir, tmp_path, kind, given,
                                                           obeys):
    spec = StructuredOutputsSpec.model_validate(given)
    generation = generation_for(spec, tiny_server, tmp_path)
    backend = generation.backend
    assert backend is not None and backend.sampling["structured_outputs"] == spec.vllm_params()
    texts = rollouts(generation, served_model_dir)
    assert all(obeys(text) for text in texts), texts


def test_without_a_constraint_requests_carry_none(tiny_server, tmp_path):
    backend = generation_for(None, tiny_server, tmp_path).backend
    assert backend is not None and "structured_outputs" not in backend.sampling
