"""The pydantic half of the GRPORun contract: the models refuse what the CRD refuses, naming the field.

INVALID_SPECS (tests/fixtures/run_specs.py) is shared with tests/integration/test_crd.py, which sends the same
manifests to a real kube-apiserver: every case here must be refused by both, each naming the field.
"""

from __future__ import annotations

import pytest

from grpo_api.models import VLLM_LORA_RANKS, GRPORun
from grpo_api.runconfig import parse_grporun
from tests.fixtures.run_specs import INVALID_SPECS, Invalid, refusal, run_with, valid_run


def test_the_smallest_run_is_accepted_with_defaults() -> None:
    run = parse_grporun(valid_run(), "run.yaml")
    assert run.spec.trainer.num_generations == 8
    assert run.spec.run_policy.backoff_limit == 2
    assert run.spec.storage.size == "20Gi"
    assert run.spec.server is None and run.spec.effective_server.max_lora_rank == 64


def test_every_vllm_rank_is_accepted_when_the_server_allows_it() -> None:
    for rank in VLLM_LORA_RANKS:
        doc = run_with({"server": {"maxLoraRank": 512}, "trainer": {"lora": {"r": rank}}})
        assert parse_grporun(doc, "run.yaml").spec.trainer.lora.r == rank


def test_colocate_mode_without_server_is_accepted_with_any_vllm_rank() -> None:
    run = parse_grporun(run_with({"mode": "colocate", "trainer": {"lora": {"r": 128}}}), "run.yaml")
    assert run.spec.mode == "colocate" and run.spec.trainer.lora.r == 128


@pytest.mark.parametrize("case", INVALID_SPECS, ids=lambda c: c.id)
def test_models_refuse_invalid_spec_naming_the_field(case: Invalid) -> None:
    message = refusal(run_with(case.patch))
    assert message.startswith("case.yaml is invalid:")
    lines = [line.strip() for line in message.splitlines()[1:]]
    assert any(line.startswith(f"{case.model_loc}:") and case.model_text in line for line in lines), (
        f"expected a line '{case.model_loc}: ...{case.model_text}...' in:\n{message}"
    )


def test_the_invalid_cases_each_break_one_thing() -> None:
    """Guard for the shared list: ids are unique, and undoing a patch gives back a valid run."""
    assert len({c.id for c in INVALID_SPECS}) == len(INVALID_SPECS) >= 10
    assert isinstance(GRPORun.model_validate(valid_run()), GRPORun)


def test_model_is_wire_round_trippable() -> None:
    run = parse_grporun(run_with({"server": {}}), "run.yaml")
    again = parse_grporun(run.to_wire(), "again.yaml")
    assert again.to_wire() == run.to_wire()


def test_structured_outputs_take_one_kind_and_give_vllms_params() -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    cases = [
        ({"regex": "(yes|no)"}, {"regex": "(yes|no)"}),
        ({"jsonSchema": schema}, {"json": schema}),
        ({"choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ]
    for given, params in cases:
        run = parse_grporun(run_with({"trainer": {"structuredOutputs": given}}), "run.yaml")
        spec = run.spec.trainer.structured_outputs
        assert spec is not None and spec.vllm_params() == params
        assert run.to_wire()["spec"]["trainer"]["structuredOutputs"] == given  # round-trips camelCase
    assert parse_grporun(valid_run(), "run.yaml").spec.trainer.structured_outputs is None


def test_a_structured_outputs_regex_that_does_not_compile_is_refused() -> None:
    """The API server cannot compile a regex (no CEL for it): the models refuse it before a run starts."""
    message = refusal(run_with({"trainer": {"structuredOutputs": {"regex": "(unclosed"}}}))
    assert "spec.trainer.structuredOutputs: " in message and "regex does not compile" in message
