"""Sources (pvc://, hf://, oci://, configmap://, inline reward code) and pod settings, as the pure
builders turn them into volumes, mounts, env and the run-config; and `grpo run`'s local resolution.

The API server's admission of the same specs is in tests/integration/test_crd.py; the pods built
here are sent to a real API server in tests/operator/test_sources_flow.py and run on a real node in
tests/e2e.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from grpo_api.models import DEFAULT_SERVER_IMAGE, DEFAULT_TRAINER_IMAGE, GRPORun
from grpo_api.prepare_protocol import EXIT_PERMANENT
from grpo_api.runconfig import RunConfig, RunConfigError, run_config_for
from grpo_api.sources import (
    ADAPTER_TOKEN_ENV,
    CLAIMS_ROOT,
    DATASET_TOKEN_ENV,
    MODEL_DEFAULT_ALLOW_PATTERNS,
    MODEL_TOKEN_ENV,
    REWARDS_DIR,
    ClaimSource,
    HubKey,
    HubSource,
    ImageSource,
    ObjectKey,
    SourceError,
    cluster_layout,
    hub_dir,
    hub_key,
    local_sources,
    object_dir,
    parse_source,
)
from grpo_operator import builders as b
from tests.fixtures.child_manifests import container, make_run, mounts_of, volumes_of


def run_config(run: GRPORun) -> RunConfig:
    data = yaml.safe_load(b.build_config_map(run)["data"]["run-config.yaml"])
    return RunConfig.model_validate(data)


def every_pod(run: GRPORun) -> list[dict[str, Any]]:
    return [b.build_initializer_job(run), b.build_server_deployment(run, 1, 1), b.build_trainer_job(run, 1)]


def raw_env(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container(obj)["env"]}


@pytest.mark.parametrize(
    ("uri", "parsed"),
    [
        ("pvc://models", ClaimSource("models", "")),
        ("pvc://models/qwen/7b/", ClaimSource("models", "qwen/7b")),
        ("hf://Qwen/Qwen2.5-0.5B@v1.0", HubSource("Qwen/Qwen2.5-0.5B", "v1.0")),
        ("hf://gpt2", HubSource("gpt2", None)),
        ("oci://registry.corp:5000/m/qwen:7b", ImageSource("registry.corp:5000/m/qwen:7b")),
    ],
)
def test_source_uris_parse(uri: str, parsed: object) -> None:
    assert parse_source(uri, "spec.model.source") == parsed


@pytest.mark.parametrize("uri", ["gs://bucket/k", "s3://b/k", "s3://my-bucket/a/../k", "https://h.example/x?sig=1",
                                 "pvc://models/../etc", "hf://org/name@../x", "models"])
def test_bad_source_uris_are_refused_naming_the_field(uri: str) -> None:
    with pytest.raises(SourceError, match=r"spec\.model\.source"):
        parse_source(uri, "spec.model.source")


def test_a_model_on_another_claim_is_mounted_read_only_in_every_pod() -> None:
    run = make_run(model={"name": "tiny", "source": "pvc://models/tiny"})
    for pod in every_pod(run):
        assert volumes_of(pod)["src-claim-0"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        assert mounts_of(pod)["src-claim-0"] == {
            "name": "src-claim-0", "mountPath": "/mnt/grpo/claims/models", "readOnly": True}
    assert run_config(run).sources.model_dir == "/mnt/grpo/claims/models/tiny"


def test_a_source_on_the_runs_own_claim_needs_no_second_mount() -> None:
    run = make_run(model={"name": "tiny", "source": "pvc://grpo-data", "path": "models/tiny"},
                   dataset={"source": "pvc://grpo-data/datasets", "path": "prompts.jsonl"},
                   storage={"existingClaim": "grpo-data"})
    assert not [v for v in volumes_of(b.build_trainer_job(run, 1)) if v.startswith("src-")]
    sources = run_config(run).sources
    assert (sources.model_dir, sources.dataset_path) == ("/data/models/tiny", "/data/datasets/prompts.jsonl")


def test_two_sources_on_one_claim_share_one_volume() -> None:
    run = make_run(model={"name": "tiny", "source": "pvc://shared/m"},
                   dataset={"source": "pvc://shared/d", "path": "p.jsonl"})
    claims = [v for v in volumes_of(b.build_server_deployment(run, 1, 1)).values() if "persistentVolumeClaim" in v]
    assert [c["persistentVolumeClaim"]["claimName"] for c in claims] == ["r1-data", "shared"]
    assert b.claims_of(run) == ("r1-data", "shared")


def test_an_hf_model_is_fetched_by_the_initializer_alone_with_its_token() -> None:
    run = make_run(model={"name": "qwen", "source": "hf://Qwen/Qwen2.5-0.5B@abc123",
                          "hub": {"tokenSecretRef": {"name": "hf", "key": "token"},
                                  "endpoint": "https://mirror.corp"}})
    (fetch,) = run_config(run).sources.fetches
    assert fetch.model_dump() == {
        "field": "spec.model.source", "repo_id": "Qwen/Qwen2.5-0.5B", "revision": "abc123", "repo_type": "model",
        "local_dir": hub_dir("/data", HubKey("model", "Qwen/Qwen2.5-0.5B", "abc123", "https://mirror.corp",
                                             MODEL_DEFAULT_ALLOW_PATTERNS)),
        "token_env": MODEL_TOKEN_ENV, "endpoint": "https://mirror.corp",
        "allow_patterns": list(MODEL_DEFAULT_ALLOW_PATTERNS), "ignore_patterns": [], "model_weights": True,
        "default_patterns": True}
    assert re.fullmatch(r"/data/hub/models/Qwen--Qwen2\.5-0\.5B@abc123-[0-9a-f]{16}", fetch.local_dir)
    assert run_config(run).sources.model_dir == fetch.local_dir
    init = b.build_initializer_job(run)
    # optional: a missing Secret reaches `grpo prepare` as an unset variable, which it names
    assert raw_env(init)[MODEL_TOKEN_ENV]["valueFrom"] == {
        "secretKeyRef": {"name": "hf", "key": "token", "optional": True}}
    for pod in every_pod(run)[1:]:
        assert MODEL_TOKEN_ENV not in raw_env(pod), "only the initializer sees the hub token"


def test_an_hf_dataset_without_token_lands_under_datasets() -> None:
    run = make_run(dataset={"source": "hf://org/prompts", "path": "data/train.parquet"})
    (fetch,) = run_config(run).sources.fetches
    assert (fetch.repo_type, fetch.revision, fetch.token_env) == ("dataset", "main", None)
    local_dir = hub_dir("/data", HubKey("dataset", "org/prompts", "main", None))
    assert fetch.local_dir == local_dir and local_dir.startswith("/data/hub/datasets/org--prompts@main-")
    assert run_config(run).sources.dataset_path == f"{local_dir}/data/train.parquet"
    assert DATASET_TOKEN_ENV not in raw_env(b.build_initializer_job(run))


def test_s3_sources_are_fetched_by_the_initializer_alone_with_the_secrets_credentials() -> None:
    access = {"credentialsSecret": "s3-keys", "endpoint": "http://minio.storage:9000/", "region": "auto"}
    run = make_run(model={"name": "m", "source": "s3://models/qwen", "s3": access},
                   dataset={"source": "s3://data-bucket/sets", "path": "gsm8k/train.jsonl"},
                   rewards=[{"function": "r:f"}], rewardCode={"source": "https://code.example.com/r/r.py"})
    sources = run_config(run).sources
    model, dataset, code = sources.object_fetches
    assert model.model_dump() == {
        "field": "spec.model.source", "uri": "s3://models/qwen", "select": "", "endpoint": "http://minio.storage:9000",
        "local_dir": object_dir("/data", ObjectKey("s3://models/qwen", "http://minio.storage:9000")),
        "region": "auto", "credentials_role": "model", "max_bytes": None}
    assert re.fullmatch(r"/data/objects/models--qwen-[0-9a-f]{16}", model.local_dir)
    assert sources.model_dir == model.local_dir
    # a dataset fetches only its path, and no credentials without a Secret (boto3's own chain in the pod)
    assert (dataset.select, dataset.credentials_role) == ("gsm8k/train.jsonl", None)
    assert sources.dataset_path == f"{dataset.local_dir}/gsm8k/train.jsonl"
    assert (code.uri, code.max_bytes, sources.reward_paths) == ("https://code.example.com/r/r.py", 1 << 20,
                                                                 [code.local_dir])
    init = raw_env(b.build_initializer_job(run))
    assert {name: init[name]["valueFrom"] for name in init if name.startswith("GRPO_S3_")} == {
        "GRPO_S3_MODEL_ACCESS_KEY_ID": {"secretKeyRef": {"name": "s3-keys", "key": "accessKeyId", "optional": True}},
        "GRPO_S3_MODEL_SECRET_ACCESS_KEY": {"secretKeyRef": {"name": "s3-keys", "key": "secretAccessKey",
                                                             "optional": True}},
        "GRPO_S3_MODEL_SESSION_TOKEN": {"secretKeyRef": {"name": "s3-keys", "key": "sessionToken", "optional": True}},
    }
    for pod in every_pod(run)[1:]:
        assert not [name for name in raw_env(pod) if name.startswith("GRPO_S3_")], "only the initializer sees them"
        assert not [v for v in volumes_of(pod).values() if "src-" in str(v)], "fetched sources mount nothing"


def test_object_sources_that_differ_get_folders_of_their_own_and_grpo_run_fetches_them_too(tmp_path: Path) -> None:
    distinct = [
        {"source": "s3://bucket-a/sets", "path": "train.jsonl"},
        {"source": "s3://bucket-a/sets", "path": "test.jsonl"},  # another selection of the prefix
        {"source": "s3://bucket-a/sets", "path": "train.jsonl", "s3": {"endpoint": "http://minio:9000"}},
        {"source": "s3://bucket-a/sets/train.jsonl", "path": "train.jsonl"},
        {"source": "https://bucket-a/sets/train.jsonl"},  # the same readable name, another source
    ]
    cluster, local = [], []
    for dataset in distinct:
        run = make_run(dataset=dataset if "path" in dataset else {**dataset, "path": None})
        cluster += cluster_layout(run.spec, data_claim="d", inline_rewards_configmap="r").sources.object_fetches
        local += local_sources(run.spec, tmp_path).object_fetches
    assert len({f.local_dir for f in cluster}) == len(distinct)
    assert {posixpath.dirname(f.local_dir) for f in cluster} == {"/data/objects"}
    assert {posixpath.dirname(f.local_dir) for f in local} == {f"{tmp_path}/objects"}
    assert all(f.credentials_role is None for f in local)  # `grpo run`: boto3's own AWS_* variables


#: Sources that a path of ORG/NAME/REVISION folders could not tell apart or would nest in one another
#: ('/' in both ids and revisions), or whose readable names coincide.
DISTINCT_HUB_SOURCES = [
    ("model", "hf://org/model@main", None),
    ("model", "hf://org@model/main", None),  # hub/models/org/model/main too, in the old layout
    ("model", "hf://org@model", None),  # its folder held the two above
    ("model", "hf://org/model@main/x", None),  # inside the first one's
    ("model", "hf://org/model@refs/pr/1", None),
    ("model", "hf://org/model@refs--pr--1", None),  # readable name equal to refs/pr/1's
    ("model", "hf://org--model@main", None),  # readable name equal to the first one's
    ("model", "hf://org/model@main", "https://mirror.corp"),  # another hub's main
    ("dataset", "hf://org/model@main", None),
]


@pytest.mark.parametrize("where", ["cluster", "local"])
def test_every_distinct_hub_source_gets_a_folder_of_its_own(where: str, tmp_path: Path) -> None:
    folders = []
    for role, uri, endpoint in DISTINCT_HUB_SOURCES:
        hub = {"hub": {"endpoint": endpoint}} if endpoint else {}
        section = {"name": "m", "source": uri, **hub} if role == "model" else {"source": uri, "path": "d", **hub}
        run = make_run(**{role: section})
        sources = (cluster_layout(run.spec, data_claim="d", inline_rewards_configmap="r").sources
                   if where == "cluster" else local_sources(run.spec, tmp_path))
        (fetch,) = sources.fetches
        folders.append(fetch.local_dir)
    root = "/data" if where == "cluster" else str(tmp_path)
    assert len(set(folders)) == len(folders), folders
    for folder, (role, _, _) in zip(folders, DISTINCT_HUB_SOURCES, strict=True):
        assert posixpath.dirname(folder) == f"{root}/hub/{role}s"  # one element: none inside another


def test_a_hub_model_fetches_weights_config_and_tokenizer_by_default_and_its_patterns_name_its_folder() -> None:
    default = make_run(model={"name": "m", "source": "hf://org/m"})
    chosen = make_run(model={"name": "m", "source": "hf://org/m",
                             "hub": {"allowPatterns": ["*.safetensors", "*.json"], "ignorePatterns": ["onnx/*"]}})
    (by_default,) = run_config(default).sources.fetches
    (by_patterns,) = run_config(chosen).sources.fetches
    assert (by_default.allow_patterns, by_default.ignore_patterns) == (list(MODEL_DEFAULT_ALLOW_PATTERNS), [])
    assert by_default.default_patterns and by_default.model_weights
    assert (by_patterns.allow_patterns, by_patterns.ignore_patterns) == (["*.safetensors", "*.json"], ["onnx/*"])
    assert not by_patterns.default_patterns and by_patterns.model_weights
    assert by_patterns.patterns_field == "spec.model.hub.allowPatterns/ignorePatterns"
    # one folder holds one selection of the files: other patterns, another folder
    assert by_default.local_dir != by_patterns.local_dir
    assert by_patterns.key.to_json()["ignorePatterns"] == ["onnx/*"]


def test_hub_datasets_and_adapters_fetch_every_file_unless_patterns_say_otherwise() -> None:
    run = make_run(model={"name": "m", "adapter": {"source": "hf://org/adapter"}},
                   dataset={"source": "hf://org/prompts", "hub": {"allowPatterns": ["data/*"]}})
    adapter, dataset = run_config(run).sources.fetches
    assert (adapter.allow_patterns, adapter.model_weights) == (None, False)
    assert (dataset.allow_patterns, dataset.model_weights) == (["data/*"], False)
    # a dataset repository named without a path is read whole, from the folder of the commit fetched
    assert run_config(run).sources.dataset_path == dataset.local_dir
    assert "allowPatterns" not in adapter.key.to_json()  # a folder fetched whole keeps its name


def test_one_source_spelled_two_ways_has_one_folder() -> None:
    assert hub_key("model", HubSource("org/m", None), None) == hub_key("model", HubSource("org/m", "main"), None)
    assert (hub_key("model", HubSource("org/m", "v1"), "https://mirror.corp/")
            == hub_key("model", HubSource("org/m", "v1"), "https://mirror.corp"))


def test_a_hub_folder_name_fits_one_path_element_and_stays_readable() -> None:
    revision = "/".join(["r" * 128] * 8)  # the longest revision the spec admits
    longest = hub_dir("/data", HubKey("model", f"{'o' * 96}/{'n' * 96}", revision, None))
    assert len(posixpath.basename(longest).encode()) <= 255
    other = hub_dir("/data", HubKey("model", f"{'o' * 96}/{'n' * 96}", revision[:-1] + "s", None))
    assert longest != other  # the cut readable part is equal; the digest is not
    readable = posixpath.basename(hub_dir("/d", HubKey("model", "org/m", "refs/pr/1", None)))
    assert re.fullmatch(r"org--m@refs--pr--1-[0-9a-f]{16}", readable)


def test_image_and_configmap_sources_become_read_only_volumes() -> None:
    run = make_run(model={"name": "m", "source": "oci://registry.corp/models/tiny:1", "path": "models/tiny"},
                   dataset={"source": "configmap://prompts", "path": "prompts.jsonl"},
                   rewardCode={"source": "oci://registry.corp/rewards:2", "path": "src"})
    for pod in every_pod(run):
        volumes = volumes_of(pod)
        assert volumes["src-model"] == {"name": "src-model", "image": {"reference": "registry.corp/models/tiny:1"}}
        # optional: a missing ConfigMap is an empty directory, so the initializer names the missing key
        assert volumes["src-dataset"] == {"name": "src-dataset", "configMap": {"name": "prompts", "optional": True}}
        assert volumes["src-rewards"] == {"name": "src-rewards", "image": {"reference": "registry.corp/rewards:2"}}
        assert all(mounts_of(pod)[name]["readOnly"] for name in ("src-model", "src-dataset", "src-rewards"))
    sources = run_config(run).sources
    assert sources.model_dir == "/mnt/grpo/model/models/tiny"
    assert sources.dataset_path == "/mnt/grpo/dataset/prompts.jsonl"
    assert sources.reward_paths == [f"{REWARDS_DIR}/src"]


def test_inline_reward_code_goes_into_a_config_map_owned_by_the_run() -> None:
    code = "def share(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    run = make_run(rewards=[{"function": "target:share"}], rewardCode={"inline": {"target.py": code}})
    cm = b.build_rewards_config_map(run)
    assert cm is not None and cm["data"] == {"target.py": code}
    assert cm["metadata"]["name"] == "r1-rewards" and cm["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert volumes_of(b.build_trainer_job(run, 1))["src-rewards"]["configMap"] == {"name": "r1-rewards",
                                                                                  "optional": True}
    assert run_config(run).sources.reward_paths == [REWARDS_DIR]
    assert b.build_rewards_config_map(make_run()) is None


def test_the_initializer_fails_at_once_on_a_permanent_error_and_retries_a_transient_one() -> None:
    run = make_run(initializer={"backoffLimit": 4, "activeDeadlineSeconds": 900})
    job = b.build_initializer_job(run)
    spec = job["spec"]
    assert (spec["backoffLimit"], spec["activeDeadlineSeconds"]) == (4, 900)
    fail_job = spec["podFailurePolicy"]["rules"][0]
    assert fail_job == {"action": "FailJob", "onExitCodes": {"containerName": "initializer", "operator": "In",
                                                             "values": [EXIT_PERMANENT]}}
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never", "podFailurePolicy needs restartPolicy Never"
    assert container(job)["command"] == ["grpo", "prepare"]
    assert container(job)["image"] == DEFAULT_TRAINER_IMAGE
    assert "token" not in volumes_of(job) and "dshm" not in volumes_of(job)
    assert job["metadata"]["name"] == "r1-init"
    assert spec["template"]["metadata"]["labels"][b.COMPONENT_LABEL] == b.INITIALIZER


def test_a_warm_start_adapter_on_another_runs_claim_is_mounted_read_only_for_every_pod() -> None:
    run = make_run(model={"name": "tiny", "path": "/models/tiny",
                          "adapter": {"source": "pvc://run-a-data", "path": "adapters/run-a/v4"}})
    for pod in every_pod(run):
        (claim,) = [v for v in volumes_of(pod).values() if v.get("persistentVolumeClaim", {}).get("claimName")
                    == "run-a-data"]
        assert mounts_of(pod)[claim["name"]]["readOnly"] is True
    assert run_config(run).sources.adapter_dir == f"{CLAIMS_ROOT}/run-a-data/adapters/run-a/v4"


def test_a_warm_start_adapter_on_the_runs_own_claim_needs_no_other_volume() -> None:
    run = make_run(storage={"existingClaim": "shared"},
                   model={"name": "tiny", "path": "/models/tiny",
                          "adapter": {"source": "pvc://shared", "path": "adapters/run-a/v4"}})
    assert run_config(run).sources.adapter_dir == f"{run.spec.storage.mount_path}/adapters/run-a/v4"


def test_hf_and_oci_warm_start_adapters_are_fetched_or_mounted_like_a_model() -> None:
    hub = make_run(model={"name": "tiny", "path": "/models/tiny", "adapter": {
        "source": "hf://org/tiny-lora@v1", "hub": {"tokenSecretRef": {"name": "hf", "key": "token"}}}})
    (fetch,) = run_config(hub).sources.fetches
    assert (fetch.field, fetch.repo_type, fetch.repo_id, fetch.revision, fetch.token_env) == (
        "spec.model.adapter.source", "model", "org/tiny-lora", "v1", ADAPTER_TOKEN_ENV)
    assert run_config(hub).sources.adapter_dir == fetch.local_dir
    assert raw_env(b.build_initializer_job(hub))[ADAPTER_TOKEN_ENV]["valueFrom"]["secretKeyRef"]["name"] == "hf"
    image = make_run(model={"name": "tiny", "path": "/models/tiny",
                            "adapter": {"source": "oci://registry.corp/adapters/tiny:1", "path": "v4"}})
    for pod in every_pod(image):
        assert volumes_of(pod)["src-adapter"] == {"name": "src-adapter",
                                                  "image": {"reference": "registry.corp/adapters/tiny:1"}}
    assert run_config(image).sources.adapter_dir == "/mnt/grpo/adapter/v4"


def test_grpo_run_reads_a_warm_start_adapter_from_a_path_and_refuses_a_claim_naming_the_field(tmp_path: Path) -> None:
    run = make_run(model={"name": "tiny", "path": "/models/tiny", "adapter": {"path": "../run-a/adapters/v4"}})
    cfg = run_config_for(run, volume_root=tmp_path, server_url="http://x", token_file=None, base_dir=tmp_path / "b")
    assert cfg.adapter_dir() == tmp_path / "b" / "../run-a/adapters/v4"
    claim = make_run(model={"name": "tiny", "path": "/models/tiny", "adapter": {"source": "pvc://run-a-data"}})
    with pytest.raises(SourceError, match=r"spec\.model\.adapter\.source: 'pvc://run-a-data' names a cluster object"):
        local_sources(claim.spec, tmp_path)
    plain = run_config_for(make_run(), volume_root=tmp_path, server_url="http://x", token_file=None)
    assert plain.adapter_dir() is None


def test_env_reads_secrets_config_maps_and_pod_fields() -> None:
    env = [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
           {"name": "CFG", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "x", "optional": True}}},
           {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "PLAIN", "value": "1"}]
    run = make_run(server={"env": env}, trainer={"env": env})
    for pod in every_pod(run):
        got = raw_env(pod)
        assert got["KEY"] == {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
        assert got["CFG"]["valueFrom"] == {"configMapKeyRef": {"name": "c", "key": "x", "optional": True}}
        assert got["POD"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert got["PLAIN"] == {"name": "PLAIN", "value": "1"}


def test_pod_labels_annotations_volumes_and_pull_secrets_reach_the_pods_ours_win() -> None:
    run = make_run(
        server={"podLabels": {"team": "a"}, "podAnnotations": {"note": "s"},
                "volumes": [{"name": "certs", "secret": {"secretName": "ca"}}],
                "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/corp", "readOnly": True}]},
        trainer={"podLabels": {"team": "b"}, "podAnnotations": {"grpo.dev/attempt": "99"},
                 "volumes": [{"name": "scratch", "emptyDir": {}}],
                 "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]},
        scheduling={"imagePullSecrets": ["creds"]},
    )
    server, trainer = b.build_server_deployment(run, 3, 1), b.build_trainer_job(run, 3)
    s_meta, t_meta = server["spec"]["template"]["metadata"], trainer["spec"]["template"]["metadata"]
    assert s_meta["labels"]["team"] == "a" and s_meta["annotations"]["note"] == "s"
    assert s_meta["labels"][b.RUN_LABEL] == "r1" and s_meta["labels"][b.ATTEMPT_LABEL] == "3"
    assert t_meta["labels"]["team"] == "b"
    assert t_meta["annotations"][b.ATTEMPT_ANNOTATION] == "3", "the operator's annotation wins"
    assert volumes_of(server)["certs"] == {"name": "certs", "secret": {"secretName": "ca"}}
    assert mounts_of(server)["certs"] == {"name": "certs", "mountPath": "/etc/ssl/corp", "readOnly": True}
    assert "scratch" in volumes_of(trainer) and "scratch" not in volumes_of(server)
    init = b.build_initializer_job(run)
    assert "scratch" in volumes_of(init), "the initializer shares the trainer's pod settings"
    for pod in (server, trainer, init):
        assert pod["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "creds"}]


def test_images_default_from_the_operator_and_a_spec_image_wins() -> None:
    images = b.Images(server="registry.corp/server:1", trainer="registry.corp/trainer:1")
    run = make_run()
    assert container(b.build_server_deployment(run, 1, 1, images))["image"] == "registry.corp/server:1"
    assert container(b.build_trainer_job(run, 1, images))["image"] == "registry.corp/trainer:1"
    assert container(b.build_initializer_job(run, images))["image"] == "registry.corp/trainer:1"
    assert container(b.build_server_deployment(run, 1, 1))["image"] == DEFAULT_SERVER_IMAGE
    named = make_run(server={"image": "mine/server:2"}, trainer={"image": "mine/trainer:2"})
    assert container(b.build_server_deployment(named, 1, 1, images))["image"] == "mine/server:2"
    assert container(b.build_initializer_job(named, images))["image"] == "mine/trainer:2"


def test_the_trainer_joins_the_servers_node_when_a_claim_cannot_span_nodes() -> None:
    user = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}},
            "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": "zone",
                                                                                "labelSelector": {}}]}}
    run = make_run(scheduling={"affinity": user})
    job = b.build_trainer_job(run, 1, placement=b.Placement(same_node=True))
    affinity = job["spec"]["template"]["spec"]["affinity"]
    terms = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0] == {"topologyKey": "zone", "labelSelector": {}}, "the user's term stays"
    assert terms[1] == {"labelSelector": {"matchLabels": b.selector(run, b.SERVER)},
                        "topologyKey": "kubernetes.io/hostname"}
    assert affinity["nodeAffinity"] == user["nodeAffinity"]
    assert b.build_server_deployment(run, 1, 1)["spec"]["template"]["spec"]["affinity"] == user
    plain = b.build_trainer_job(make_run(), 1, placement=b.Placement(same_node=False))
    assert "affinity" not in plain["spec"]["template"]["spec"]
    colocate = b.build_trainer_job(make_run(mode="colocate"), 1, placement=b.Placement(same_node=True))
    assert "affinity" not in colocate["spec"]["template"]["spec"], "one pod has no one to join"


@pytest.mark.parametrize(
    ("modes", "same_node"),
    [
        ({"data": ["ReadWriteMany"]}, False),
        ({"data": ["ReadWriteOnce"]}, True),
        ({"data": None}, True),
        ({"data": ["ReadWriteMany"], "models": ["ReadOnlyMany"]}, False),
        ({"data": ["ReadWriteMany"], "models": ["ReadWriteOnce"]}, True),
        ({"data": ["ReadOnlyMany"]}, True),
    ],
)
def test_same_node_follows_the_claims_access_modes(modes: dict[str, list[str] | None], same_node: bool) -> None:
    assert b.needs_same_node(modes, "data") is same_node


def test_grpo_run_fetches_hf_sources_into_the_run_directory_and_refuses_cluster_sources(tmp_path: Path) -> None:
    run = make_run(model={"name": "m", "source": "hf://org/m@v2"}, rewards=[{"function": "mine:f"}],
                   rewardCode={"inline": {"mine.py": "def f(**k):\n    return []\n"}})
    cfg = run_config_for(run, volume_root=tmp_path, server_url="http://127.0.0.1:1", token_file=None)
    assert cfg.sources.model_dir == hub_dir(str(tmp_path), HubKey("model", "org/m", "v2", None,
                                                                   MODEL_DEFAULT_ALLOW_PATTERNS))
    assert cfg.sources.inline_rewards_dir == str(tmp_path / "rewards")
    assert cfg.reward_search_paths()[0] == tmp_path / "rewards"
    for spec in ({"model": {"name": "m", "source": "pvc://models/m"}},
                 {"dataset": {"source": "configmap://p", "path": "p.jsonl"}},
                 {"rewardCode": {"source": "configmap://r"}}):
        field = next(iter(spec))
        with pytest.raises(RunConfigError, match=f"spec.{field}.source"):
            run_config_for(make_run(**spec), volume_root=tmp_path, server_url="", token_file=None)


@pytest.mark.parametrize(("role", "uri", "endpoint"), DISTINCT_HUB_SOURCES)
def test_no_hub_folder_lies_in_or_holds_a_folder_of_the_old_layout(role: str, uri: str, endpoint: str | None) -> None:
    """Releases before the escaped names fetched into hub/<type>s/<repo id>/<revision> (repo ids and revisions hold
    no '@'); every folder name now holds the '@' of ORG--NAME@REVISION, so an old folder is never read as a new one."""
    source = parse_source(uri, "f")
    assert isinstance(source, HubSource)
    folder = hub_dir("/data", hub_key(role, source, endpoint))  # type: ignore[arg-type]
    name = posixpath.relpath(folder, f"/data/hub/{role}s")
    assert "/" not in name and "@" in name
    for _, other_uri, _ in DISTINCT_HUB_SOURCES:
        other = parse_source(other_uri, "f")
        assert isinstance(other, HubSource)
        old = posixpath.join(f"/data/hub/{role}s", other.repo_id, other.revision or "main")
        assert "@" not in posixpath.relpath(old, f"/data/hub/{role}s")
        assert not old.startswith(folder + "/") and not folder.startswith(old + "/") and old != folder
