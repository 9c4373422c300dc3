"""The pydantic half of the GRPORun contract: the models refuse what the CRD refuses, naming the field.

INVALID_SPECS is shared with tests/integration/test_crd.py, which sends the same manifests to a real
kube-apiserver: every case here must be refused by both, each naming the field.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest

from grpo_api.models import VLLM_LORA_RANKS, GRPORun
from grpo_api.runconfig import RunConfigError, parse_grporun

DELETE = object()  # in a patch: remove this key


def valid_run(name: str = "run") -> dict[str, Any]:
    """The smallest GRPORun both sides accept."""
    return {
        "apiVersion": "grpo.dev/v1alpha1",
        "kind": "GRPORun",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "tiny"},
            "dataset": {"path": "/data/prompts.jsonl"},
            "rewards": [{"function": "exact_match"}],
        },
    }


def merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """base deep-merged with patch (dicts merge, other values replace, DELETE removes)."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is DELETE:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def run_with(spec_patch: dict[str, Any], name: str = "run") -> dict[str, Any]:
    return merged(valid_run(name), {"spec": spec_patch})


@dataclass(frozen=True)
class Invalid:
    """A spec change both the API server and the models must refuse."""

    id: str
    patch: dict[str, Any]
    field: str  # the field path the API server names (spec.x.y)
    api_text: str  # fragment of the API server's message
    model_loc: str  # the path the models' error names (camelCase, as parse_grporun formats it)
    model_text: str  # fragment of the models' message


SOURCE_AND_POD_SPECS: list[Invalid] = [
    # sources (issue 15): scheme, paths inside them, hub settings only for hf://
    Invalid("model-source-unknown-scheme", {"model": {"name": "m", "source": "s3://bucket/m"}},
            "spec.model.source", "should match", "spec.model.source", "should match pattern"),
    Invalid("model-source-configmap", {"model": {"name": "m", "source": "configmap://weights"}},
            "spec.model.source", "should match", "spec.model.source", "should match pattern"),
    Invalid("model-path-escapes-its-source", {"model": {"name": "m", "source": "pvc://models", "path": "a/../../etc"}},
            "spec.model.path", "relative path inside model.source", "spec.model", "relative path inside model.source"),
    Invalid("model-path-absolute-with-a-source", {"model": {"name": "m", "source": "pvc://models", "path": "/etc"}},
            "spec.model.path", "relative path inside model.source", "spec.model", "relative path inside model.source"),
    Invalid("model-source-dotdot", {"model": {"name": "m", "source": "pvc://models/../x"}},
            "spec.model.source", "'..'", "spec.model", "'..'"),
    Invalid("model-hub-without-hf-source", {"model": {"name": "m", "path": "/m", "hub": {"endpoint": "https://mirror"}}},
            "spec.model.hub", "applies only to an hf://", "spec.model", "applies only to an hf://"),
    Invalid("model-revision-beside-a-source", {"model": {"name": "m", "source": "hf://org/m@v1", "revision": "v2"}},
            "spec.model.revision", "write hf://ORG/NAME@REVISION", "spec.model", "write hf://ORG/NAME@REVISION"),
    Invalid("hub-endpoint-not-http", {"model": {"name": "m", "source": "hf://org/m@v1", "hub": {"endpoint": "ftp://x"}}},
            "spec.model.hub.endpoint", "should match", "spec.model.hub.endpoint", "should match pattern"),
    Invalid("dataset-configmap-path-not-a-key",
            {"dataset": {"source": "configmap://prompts", "path": "dir/prompts.jsonl"}},
            "spec.dataset.path", "must be a key of the ConfigMap", "spec.dataset", "must be a key of the ConfigMap"),
    Invalid("hub-token-secret-bad-name",
            {"dataset": {"source": "hf://org/d", "path": "train.jsonl",
                         "hub": {"tokenSecretRef": {"name": "Bad_Name", "key": "token"}}}},
            "spec.dataset.hub.tokenSecretRef.name", "should match",
            "spec.dataset.hub.tokenSecretRef.name", "should match pattern"),
    # reward code and built-in names
    Invalid("reward-unknown-builtin", {"rewards": [{"function": "accuracy"}]},
            "spec.rewards[0].function", "must be a built-in", "spec.rewards[0]", "is not a built-in"),
    Invalid("rewardCode-source-and-inline", {"rewardCode": {"source": "configmap://r", "inline": {"a.py": "x = 1"}}},
            "spec.rewardCode", "exactly one of source or inline", "spec.rewardCode", "exactly one of source or inline"),
    Invalid("rewardCode-inline-not-a-module-name", {"rewardCode": {"inline": {"../a.py": "x = 1"}}},
            "spec.rewardCode.inline", "module file names", "spec.rewardCode", "must be a module file name"),
    Invalid("rewardCode-from-the-hub", {"rewardCode": {"source": "hf://org/rewards"}},
            "spec.rewardCode.source", "should match", "spec.rewardCode.source", "should match pattern"),
    # pod settings
    Invalid("env-value-and-valueFrom",
            {"trainer": {"env": [{"name": "A", "value": "1",
                                  "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}},
            "spec.trainer.env[0]", "set value or valueFrom, not both", "spec.trainer.env[0]", "not both"),
    Invalid("env-valueFrom-two-sources",
            {"server": {"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"},
                                                            "fieldRef": {"fieldPath": "metadata.name"}}}]}},
            "spec.server.env[0].valueFrom", "exactly one of", "spec.server.env[0].valueFrom", "exactly one of"),
    Invalid("env-name-not-an-identifier", {"server": {"env": [{"name": "A-B", "value": "1"}]}},
            "spec.server.env[0].name", "should match", "spec.server.env[0].name", "should match pattern"),
    Invalid("server-volume-takes-an-operator-name", {"server": {"volumes": [{"name": "data", "emptyDir": {}}]}},
            "spec.server.volumes", "operator's volume names", "spec.server", "is used by the operator"),
    Invalid("trainer-mount-of-an-unknown-volume", {"trainer": {"volumeMounts": [{"name": "x", "mountPath": "/x"}]}},
            "spec.trainer.volumeMounts", "must be one of", "spec.trainer", "is not in trainer.volumes"),
    Invalid("trainer-mount-shadows-the-run-config",
            {"trainer": {"volumes": [{"name": "x", "emptyDir": {}}],
                         "volumeMounts": [{"name": "x", "mountPath": "/etc/grpo"}]}},
            "spec.trainer.volumeMounts", "may not overlap", "spec.trainer", "overlaps a path the operator"),
    Invalid("pod-label-of-the-operator", {"server": {"podLabels": {"grpo.dev/run": "other"}}},
            "spec.server.podLabels", "may not set", "spec.server", "is set by the operator"),
    # pod settings a stranger may not choose (tests/unit/test_spec_hostile.py has the rest)
    Invalid("server-volume-from-the-host", {"server": {"volumes": [{"name": "x", "hostPath": {"path": "/"}}]}},
            "spec.server.volumes", "needs exactly one volume source", "spec.server", "needs exactly one volume source"),
    Invalid("trainer-annotation-picks-apparmor",
            {"trainer": {"podAnnotations": {"container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"}}},
            "spec.trainer.podAnnotations", "may not choose a security profile",
            "spec.trainer", "may not choose a security profile"),
    Invalid("env-replaces-the-token-file", {"server": {"env": [{"name": "GRPO_TOKEN_FILE", "value": "/tmp/t"}]}},
            "spec.server.env[0].name", "is set by the operator", "spec.server.env[0].name", "is set by the operator"),
    Invalid("hf-revision-absolute", {"model": {"name": "m", "source": "hf://org/m@/etc"}},
            "spec.model.source", "should match", "spec.model.source", "should match pattern"),
    Invalid("seed-past-numpy", {"trainer": {"seed": 2**32}},
            "spec.trainer.seed", "less than or equal to", "spec.trainer.seed", "less than or equal to"),
    Invalid("image-pull-secret-bad-name", {"scheduling": {"imagePullSecrets": ["Bad_Name"]}},
            "spec.scheduling.imagePullSecrets[0]", "should match",
            "spec.scheduling.imagePullSecrets[0]", "should match pattern"),
    # storage a server and a trainer cannot share
    Invalid("read-write-once-pod-in-server-mode", {"storage": {"size": "1Gi", "accessModes": ["ReadWriteOncePod"]}},
            "spec.storage.accessModes", "ReadWriteOncePod", "spec", "ReadWriteOncePod"),
]

INVALID_SPECS: list[Invalid] = [
    *SOURCE_AND_POD_SPECS,
    # wrong types
    Invalid("numGenerations-not-an-integer", {"trainer": {"numGenerations": "eight"}},
            "spec.trainer.numGenerations", "must be of type integer",
            "spec.trainer.numGenerations", "valid integer"),
    Invalid("rewards-not-a-list", {"rewards": "exact_match"},
            "spec.rewards", "must be of type array", "spec.rewards", "valid list"),
    Invalid("suspend-not-a-boolean", {"runPolicy": {"suspend": "later"}},
            "spec.runPolicy.suspend", "must be of type boolean", "spec.runPolicy.suspend", "valid boolean"),
    # out of range
    Invalid("learningRate-above-1", {"trainer": {"learningRate": 2.0}},
            "spec.trainer.learningRate", "less than or equal to 1",
            "spec.trainer.learningRate", "less than or equal to 1"),
    Invalid("server-port-above-65535", {"server": {"port": 70000}},
            "spec.server.port", "less than or equal to 65535",
            "spec.server.port", "less than or equal to 65535"),
    Invalid("temperature-zero", {"trainer": {"temperature": 0}},
            "spec.trainer.temperature", "greater than 0", "spec.trainer.temperature", "greater than 0"),
    Invalid("backoffLimit-negative", {"runPolicy": {"backoffLimit": -1}},
            "spec.runPolicy.backoffLimit", "greater than or equal to 0",
            "spec.runPolicy.backoffLimit", "greater than or equal to 0"),
    Invalid("rewards-empty", {"rewards": []},
            "spec.rewards", "at least 1 item", "spec.rewards", "at least 1 item"),
    Invalid("reward-function-not-an-import-path", {"rewards": [{"function": "rm -rf /"}]},
            "spec.rewards[0].function", "should match", "spec.rewards[0].function", "should match pattern"),
    Invalid("storage-size-not-a-quantity", {"storage": {"size": "lots"}},
            "spec.storage.size", "should match", "spec.storage.size", "should match pattern"),
    # unknown enum values
    Invalid("mode-unknown", {"mode": "hybrid"},
            "spec.mode", 'Unsupported value: "hybrid"', "spec.mode", "'server' or 'colocate'"),
    Invalid("lossType-unknown", {"trainer": {"lossType": "ppo"}},
            "spec.trainer.lossType", 'Unsupported value: "ppo"', "spec.trainer.lossType", "'dapo'"),
    Invalid("strategy-deepspeed", {"trainer": {"strategy": "deepspeed"}},
            "spec.trainer.strategy", 'Unsupported value: "deepspeed"', "spec.trainer.strategy", "'ddp' or 'fsdp'"),
    Invalid("cleanupPolicy-unknown", {"runPolicy": {"cleanupPolicy": "Nuke"}},
            "spec.runPolicy.cleanupPolicy", 'Unsupported value: "Nuke"',
            "spec.runPolicy.cleanupPolicy", "'StopServer'"),
    # missing required fields
    Invalid("model-missing", {"model": DELETE},
            "spec.model", "Required value", "spec.model", "Field required"),
    Invalid("dataset-missing", {"dataset": DELETE},
            "spec.dataset", "Required value", "spec.dataset", "Field required"),
    Invalid("rewards-missing", {"rewards": DELETE},
            "spec.rewards", "Required value", "spec.rewards", "Field required"),
    Invalid("model-name-missing", {"model": {"name": DELETE, "path": "/models/tiny"}},
            "spec.model.name", "Required value", "spec.model.name", "Field required"),
    # unknown field (strict field validation on the API server)
    Invalid("unknown-field", {"trainer": {"numGeneration": 4}},
            "spec.trainer.numGeneration", "unknown field",
            "spec.trainer.numGeneration", "Extra inputs are not permitted"),
    # the cross-field rules (CEL on the API server, model validators in pydantic)
    Invalid("numGenerations-below-2", {"trainer": {"numGenerations": 1}},
            "spec.trainer.numGenerations", "greater than or equal to 2",
            "spec.trainer.numGenerations", "greater than or equal to 2"),
    Invalid("generation-batch-not-divisible", {"trainer": {"numGenerations": 3}},
            "spec.trainer.numGenerations", "divisible by numGenerations",
            "spec.trainer", "must be divisible by numGenerations (3)"),
    Invalid("lora-rank-not-served-by-vllm", {"trainer": {"lora": {"r": 24}}},
            "spec.trainer.lora.r", "r must be one of", "spec.trainer.lora", "lora.r must be one of"),
    Invalid("server-maxLoraRank-not-served-by-vllm", {"server": {"maxLoraRank": 48}},
            "spec.server.maxLoraRank", "maxLoraRank must be one of",
            "spec.server", "maxLoraRank must be one of"),
    Invalid("storage-existingClaim-and-size", {"storage": {"existingClaim": "shared", "size": "10Gi"}},
            "spec.storage", "exactly one of existingClaim or size",
            "spec.storage", "exactly one of existingClaim or size"),
    Invalid("storage-neither-existingClaim-nor-size", {"storage": {"mountPath": "/data"}},
            "spec.storage", "exactly one of existingClaim or size",
            "spec.storage", "exactly one of existingClaim or size"),
    Invalid("colocate-with-server-section", {"mode": "colocate", "server": {}},
            "spec.server", "mode colocate runs vLLM inside the trainer",
            "spec", "mode colocate runs vLLM inside the trainer"),
    Invalid("lora-rank-above-server-maxLoraRank",
            {"server": {"maxLoraRank": 32}, "trainer": {"lora": {"r": 64}}},
            "spec.trainer.lora.r", "must not exceed",
            "spec", "trainer.lora.r (64) exceeds server.maxLoraRank (32)"),
    Invalid("lora-rank-above-default-maxLoraRank", {"trainer": {"lora": {"r": 128}}},
            "spec.trainer.lora.r", "must not exceed",
            "spec", "trainer.lora.r (128) exceeds server.maxLoraRank (64)"),
    Invalid("lm_head-in-targetModules", {"trainer": {"lora": {"targetModules": ["q_proj", "lm_head"]}}},
            "spec.trainer.lora.targetModules", "may not include lm_head",
            "spec.trainer.lora", "may not include ['lm_head']"),
    # guided decoding of the rollouts
    Invalid("structuredOutputs-two-kinds", {"trainer": {"structuredOutputs": {"regex": "yes|no", "choice": ["yes"]}}},
            "spec.trainer.structuredOutputs", "exactly one of regex, jsonSchema or choice",
            "spec.trainer.structuredOutputs", "exactly one of regex, jsonSchema or choice"),
    Invalid("structuredOutputs-no-kind", {"trainer": {"structuredOutputs": {}}},
            "spec.trainer.structuredOutputs", "exactly one of regex, jsonSchema or choice",
            "spec.trainer.structuredOutputs", "exactly one of regex, jsonSchema or choice"),
    Invalid("structuredOutputs-jsonSchema-not-an-object", {"trainer": {"structuredOutputs": {"jsonSchema": "x"}}},
            "spec.trainer.structuredOutputs.jsonSchema", "must be of type object",
            "spec.trainer.structuredOutputs.jsonSchema", "valid dictionary"),
    Invalid("structuredOutputs-no-choices", {"trainer": {"structuredOutputs": {"choice": []}}},
            "spec.trainer.structuredOutputs.choice", "should have at least 1 items",
            "spec.trainer.structuredOutputs.choice", "at least 1 item"),
]


def refusal(doc: dict[str, Any]) -> str:
    """The models' error message for doc (fails the test if the models accept it)."""
    with pytest.raises(RunConfigError) as info:
        parse_grporun(doc, "case.yaml")
    return str(info.value)


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
