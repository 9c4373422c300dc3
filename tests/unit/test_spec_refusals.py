"""A GRPORun written by a stranger: hostile values that the models (and the operator's checks before any child
exists) must refuse, naming the field, instead of carrying them into a pod, a path or a child the API server
refuses after others were created."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from grpo_api.models import GRPORun
from grpo_api.sources import MODEL_DEFAULT_ALLOW_PATTERNS, HubSource, cluster_layout, hub_dir, hub_key, local_sources
from grpo_operator import builders as b
from tests.fixtures.child_manifests import make_run
from tests.fixtures.run_specs import refusal, run_with


def refused(spec_patch: dict[str, Any], loc: str, text: str) -> None:
    message = refusal(run_with(spec_patch))
    lines = [line.strip() for line in message.splitlines()[1:]]
    assert any(line.startswith(f"{loc}:") and text in line for line in lines), (
        f"expected a line '{loc}: ...{text}...' in:\n{message}"
    )


def accepted(spec_patch: dict[str, Any]) -> GRPORun:
    return GRPORun.model_validate(run_with(spec_patch))


# ------------------------------------------------------------------------------- least privilege in pods


@pytest.mark.parametrize("source", [
    {"hostPath": {"path": "/"}},
    {"hostPath": {"path": "/var/run/containerd/containerd.sock", "type": "Socket"}},
    {"nfs": {"server": "10.0.0.1", "path": "/"}},
    {"gitRepo": {"repository": "https://example.com/x.git"}},
    {"flexVolume": {"driver": "example.com/x"}},
    {},  # no source at all: the API server refuses the pod after the run's other children exist
    {"emptyDir": {}, "secret": {"secretName": "s"}},  # two sources: likewise
])
@pytest.mark.parametrize("section", ["server", "trainer"])
def test_extra_volumes_are_limited_to_the_restricted_pod_security_kinds(section: str, source: dict[str, Any]) -> None:
    volume = {"name": "x", **source}
    refused({section: {"volumes": [volume]}}, f"spec.{section}", f"{section}.volumes[0]")


@pytest.mark.parametrize("source", [
    {"configMap": {"name": "c"}}, {"secret": {"secretName": "s"}}, {"emptyDir": {}},
    {"persistentVolumeClaim": {"claimName": "c"}}, {"downwardAPI": {"items": []}},
    {"projected": {"sources": []}}, {"ephemeral": {"volumeClaimTemplate": {"spec": {}}}},
    {"csi": {"driver": "secrets-store.csi.k8s.io"}}, {"image": {"reference": "registry.corp/x:1"}},
])
def test_extra_volumes_of_the_restricted_kinds_reach_the_pods(source: dict[str, Any]) -> None:
    run = make_run(trainer={"volumes": [{"name": "x", **source}]})
    volumes = {v["name"]: v for v in b.build_trainer_job(run, 1)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["x"] == {"name": "x", **source}


@pytest.mark.parametrize("key", [
    "container.apparmor.security.beta.kubernetes.io/server",
    "container.apparmor.security.beta.kubernetes.io/trainer",
    "seccomp.security.alpha.kubernetes.io/pod",
    "container.seccomp.security.alpha.kubernetes.io/trainer",
])
@pytest.mark.parametrize("section", ["server", "trainer"])
def test_pod_annotations_may_not_choose_the_pods_security_profiles(section: str, key: str) -> None:
    refused({section: {"podAnnotations": {key: "unconfined"}}}, f"spec.{section}", "security profile")


def test_ordinary_pod_annotations_are_kept() -> None:
    run = accepted({"server": {"podAnnotations": {"prometheus.io/scrape": "true"}}})
    assert run.spec.server is not None and run.spec.server.pod_annotations == {"prometheus.io/scrape": "true"}


#: The variables the operator sets in a pod from the run itself, with the server's token variable that wins
#: over its token file. HF_HOME, HF_HUB_DISABLE_TELEMETRY and GRPO_MASTER_PORT a spec may override on purpose.
OPERATOR_ENV = ["GRPO_RUN_CONFIG", "GRPO_ATTEMPT", "GRPO_TOKEN_FILE", "GRPO_TOKEN", "GRPO_SERVER_URL",
                "GRPO_MASTER_ADDR", "GRPO_TRAINER_ADDRESS", "GRPO_HF_TOKEN_MODEL", "GRPO_HF_TOKEN_DATASET",
                "GRPO_HF_TOKEN_ADAPTER", "GRPO_S3_MODEL_SECRET_ACCESS_KEY", "GRPO_S3_ANY_NAME"]
OVERRIDABLE_ENV = {"HF_HOME", "HF_HUB_DISABLE_TELEMETRY", "GRPO_MASTER_PORT"}


@pytest.mark.parametrize("name", OPERATOR_ENV)
@pytest.mark.parametrize("section", ["server", "trainer"])
def test_env_may_not_replace_a_variable_the_operator_sets(section: str, name: str) -> None:
    refused({section: {"env": [{"name": "OK", "value": "1"}, {"name": name, "value": "/dev/null"}]}},
            f"spec.{section}.env[1].name", "set by the operator")


def test_the_reserved_env_names_cover_every_variable_the_operator_sets() -> None:
    run = make_run(
        model={"name": "m", "source": "hf://org/m", "hub": {"tokenSecretRef": {"name": "hf", "key": "t"}}},
        dataset={"source": "hf://org/d", "path": "d.jsonl",
                 "hub": {"tokenSecretRef": {"name": "hf", "key": "t"}}},
        storage={"size": "1Gi", "modelCache": {"existingClaim": "weights"}},
        trainer={"numNodes": 2, "tuning": "full"},
    )
    lora = make_run(   # the sources full tuning cannot have: a warm-start adapter and s3:// with credentials
        model={"name": "m", "source": "s3://models/m", "s3": {"credentialsSecret": "keys"},
               "adapter": {"source": "hf://org/a", "hub": {"tokenSecretRef": {"name": "hf", "key": "t"}}}},
        dataset={"source": "s3://sets/d", "path": "d.jsonl", "s3": {"credentialsSecret": "keys"}},
    )
    pods = [build(r) for r in (run, lora) for build in (
        lambda r: b.build_server_deployment(r, 1, 1), lambda r: b.build_trainer_job(r, 1), b.build_initializer_job)]
    ours = {e["name"] for pod in pods for e in pod["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {"GRPO_HF_TOKEN_ADAPTER", "GRPO_S3_MODEL_SECRET_ACCESS_KEY", "GRPO_S3_DATASET_ACCESS_KEY_ID"} <= ours
    assert {n for n in ours - OVERRIDABLE_ENV if not n.startswith("GRPO_S3_")} <= set(OPERATOR_ENV)


def test_env_of_other_names_may_still_override_ours() -> None:
    run = make_run(trainer={"env": [{"name": "HF_HUB_DISABLE_TELEMETRY", "value": "0"}]})
    env = b.build_initializer_job(run)["spec"]["template"]["spec"]["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "HF_HUB_DISABLE_TELEMETRY"] == ["1", "0"]


# ---------------------------------------------------------------------------------- paths from strings


@pytest.mark.parametrize("revision", ["/etc", "/home/u/.ssh", ".", "./.", "a//b", "main/", ".hidden", "a/../b"])
def test_an_hf_revision_cannot_lead_the_fetch_out_of_the_volume(revision: str) -> None:
    refused({"model": {"name": "m", "source": f"hf://org/m@{revision}"}}, "spec.model.source", "")
    refused({"dataset": {"source": f"hf://org/d@{revision}", "path": "d.jsonl"}}, "spec.dataset.source", "")


@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/1", "refs/convert/parquet", "a" * 40, "my_branch-2"])
def test_hf_revisions_of_branches_tags_and_commits_land_under_the_volume(revision: str, tmp_path: Path) -> None:
    run = make_run(model={"name": "m", "source": f"hf://org/m@{revision}"})
    model_dir = cluster_layout(run.spec, data_claim="d", inline_rewards_configmap="r").sources.model_dir
    assert model_dir == hub_dir("/data", hub_key("model", HubSource("org/m", revision), None,
                                                 MODEL_DEFAULT_ALLOW_PATTERNS))
    assert model_dir.rpartition("/")[0] == "/data/hub/models"  # one folder, whatever '/' the revision holds
    local = local_sources(run.spec, tmp_path).model_dir
    assert local is not None and Path(local).resolve().is_relative_to(tmp_path)


@pytest.mark.parametrize("revision", ["../../../etc", "/etc", "main\n--force", "a\x00b", "x" * 300])
def test_model_revision_is_a_revision(revision: str) -> None:
    refused({"model": {"name": "m", "revision": revision}}, "spec.model.revision", "")


def test_model_revision_of_a_branch_is_kept() -> None:
    assert accepted({"model": {"name": "m", "revision": "refs/pr/3"}}).spec.model.revision == "refs/pr/3"


# ------------------------------------------------------------------------------------------- affinity


@pytest.mark.parametrize("affinity", [
    {"podAffinity": ["x"]},
    {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}},
    {"nodeAffinity": []},
    {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}},
    {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": {}}},
    {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": ["term"]}},
    {"nodeAfinity": {}},
])
def test_an_affinity_that_is_not_one_is_refused_before_any_child(affinity: dict[str, Any]) -> None:
    refused({"scheduling": {"affinity": affinity}}, "spec.scheduling.affinity", "scheduling.affinity")


def test_a_user_affinity_keeps_its_terms_beside_the_operators() -> None:
    term = {"labelSelector": {"matchLabels": {"a": "b"}}, "topologyKey": "zone"}
    run = make_run(scheduling={"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}})
    pod = b.build_trainer_job(run, 1, placement=b.Placement(same_node=True))["spec"]["template"]["spec"]
    terms = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0] == term and len(terms) == 2


# -------------------------------------------------------------------------------------------- numbers


def test_the_trainer_metrics_port_may_not_take_the_rendezvous_port_of_several_pods() -> None:
    refused({"trainer": {"numNodes": 2, "metricsPort": b.RENDEZVOUS_PORT}}, "spec.trainer", "metricsPort")
    assert accepted({"trainer": {"numNodes": 1, "metricsPort": b.RENDEZVOUS_PORT}})
    assert accepted({"trainer": {"numNodes": 2, "metricsPort": 9400}})


def test_the_seed_fits_the_generators_that_take_it() -> None:
    refused({"trainer": {"seed": 2**32}}, "spec.trainer.seed", "less than or equal to 4294967295")
    assert accepted({"trainer": {"seed": 2**32 - 1}}).spec.trainer.seed == 2**32 - 1


@pytest.mark.parametrize(("patch", "loc"), [
    ({"rewards": [{"function": "exact_match", "weight": math.nan}]}, "spec.rewards[0].weight"),
    ({"rewards": [{"function": "exact_match", "weight": math.inf}]}, "spec.rewards[0].weight"),
    ({"trainer": {"generationTimeoutSeconds": math.inf}}, "spec.trainer.generationTimeoutSeconds"),
    ({"trainer": {"beta": math.inf}}, "spec.trainer.beta"),
    ({"trainer": {"offPolicyMaskThreshold": math.inf}}, "spec.trainer.offPolicyMaskThreshold"),
    ({"trainer": {"importanceSampling": {"clipMax": math.inf}}}, "spec.trainer.importanceSampling.clipMax"),
])
def test_numbers_that_are_not_finite_are_refused(patch: dict[str, Any], loc: str) -> None:
    """A `grpo run` file may say .nan or .inf (YAML); the API server never sees one (JSON has none)."""
    refused(patch, loc, "finite")


# --------------------------------------------------------------------------- children before creation


def test_a_spec_whose_run_config_no_config_map_can_hold_is_refused_before_any_child() -> None:
    """Each part within its own limit, together over the 1 MiB of the run-config's ConfigMap (the API server
    would refuse it, the run's first child, with no word of the spec)."""
    big = {f"a{i}": "x" * 64000 for i in range(4)}
    run = make_run(
        server={"podAnnotations": big}, trainer={"podAnnotations": big},
        rewardCode={"inline": {f"m{i}.py": "#" * 65000 for i in range(8)}},
        rewards=[{"function": "regex_match", "args": {"pattern": "y" * 20000}}],
    )
    assert len(b.build_rewards_config_map(run)["data"]) == 8  # type: ignore[index]
    with pytest.raises(b.InvalidRunError, match="1048576"):
        b.check_children(run)


def test_check_children_passes_every_child_of_a_valid_run() -> None:
    b.check_children(make_run(server={"replicas": 2}, trainer={"numNodes": 2}))
