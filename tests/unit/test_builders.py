"""Pure manifest builders of the operator: every child of a GRPORun, checked field by field."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from grpo_api.models import GRPORun
from grpo_api.runconfig import RunConfig
from grpo_operator import builders as b
from tests.fixtures.child_manifests import container, make_run, mounts_of, volumes_of


def env_of(obj: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(obj)["env"]}


def all_children(run: GRPORun) -> list[dict[str, Any]]:
    children = [
        b.build_config_map(run),
        b.build_token_secret(run, "t0ken"),
        b.build_service(run),
        b.build_replica_service(run),
        b.build_network_policy(run, b.ServerIngress()),
        b.build_server_deployment(run, 1, 1),
        b.build_trainer_job(run, 1),
    ]
    claim = b.build_volume_claim(run)
    if claim is not None:
        children.append(claim)
    return children


def test_every_child_is_owned_by_the_run_and_labelled_with_it() -> None:
    run = make_run()
    for child in all_children(run):
        meta = child["metadata"]
        assert meta["namespace"] == "team"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "grpo.dev/v1alpha1",
                "kind": "GRPORun",
                "name": "r1",
                "uid": "uid-1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], child["kind"]
        assert meta["labels"][b.RUN_LABEL] == "r1"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "grpo-operator"


def test_child_names_are_deterministic() -> None:
    run = make_run("alpha")
    names = b.child_names(run)
    assert [names.config, names.data, names.token, names.server, names.trainer(3)] == [
        "alpha-config",
        "alpha-data",
        "alpha-token",
        "alpha-server",
        "alpha-trainer-3",
    ]
    assert b.build_server_deployment(run, 2, 1)["metadata"]["name"] == "alpha-server"
    assert b.build_trainer_job(run, 3)["metadata"]["name"] == "alpha-trainer-3"


def test_config_map_holds_the_run_config_rendered_from_the_spec() -> None:
    run = make_run(trainer={"maxSteps": 7, "lora": {"r": 8}})
    data = b.build_config_map(run)["data"]
    config = RunConfig.model_validate(yaml.safe_load(data["run-config.yaml"]))
    assert config.spec.trainer.max_steps == 7
    assert config.run.name == "r1" and config.run.namespace == "team" and config.run.uid == "uid-1"
    assert config.server_url == "http://r1-server.team.svc:8000"
    assert config.token_file == b.TOKEN_PATH
    assert config.paths.adapter_root == "/data/adapters/r1"
    # One replica too: the trainer always finds the server through the headless Service.
    assert config.server_endpoints is not None
    assert config.server_endpoints.model_dump() == {
        "replicas": 1, "dns_name": "r1-replicas.team.svc", "port": 8000, "urls": []
    }


def test_config_map_names_the_replicas_headless_service_and_their_count() -> None:
    run = make_run(server={"replicas": 4, "port": 9000})
    data = b.build_config_map(run)["data"]
    config = RunConfig.model_validate(yaml.safe_load(data["run-config.yaml"]))
    endpoints = config.server_endpoints
    assert endpoints is not None
    assert (endpoints.replicas, endpoints.dns_name, endpoints.port) == (4, "r1-replicas.team.svc", 9000)
    assert endpoints.dns_name.split(".")[0] == b.build_replica_service(run)["metadata"]["name"]
    assert config.server_url == "http://r1-server.team.svc:9000"


def test_token_secret_carries_the_given_token() -> None:
    secret = b.build_token_secret(make_run(), "s3cret")
    assert secret["stringData"] == {"token": "s3cret"} and secret["type"] == "Opaque"


def test_volume_claim_is_created_from_size_or_the_existing_claim_is_used() -> None:
    run = make_run(storage={"size": "5Gi", "storageClassName": "fast", "accessModes": ["ReadWriteMany"]})
    claim = b.build_volume_claim(run)
    assert claim is not None
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "5Gi"}},
        "storageClassName": "fast",
    }
    existing = make_run(storage={"existingClaim": "shared"})
    assert b.build_volume_claim(existing) is None
    assert volumes_of(b.build_trainer_job(existing, 1))["data"]["persistentVolumeClaim"] == {
        "claimName": "shared"
    }
    assert volumes_of(b.build_server_deployment(run, 1, 1))["data"]["persistentVolumeClaim"] == {
        "claimName": "r1-data"
    }


def test_service_selects_the_server_pods_on_the_http_port() -> None:
    run = make_run(server={"port": 9000})
    service = b.build_service(run)
    deployment = b.build_server_deployment(run, 1, 1)
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    for key, value in service["spec"]["selector"].items():
        assert deployment["spec"]["template"]["metadata"]["labels"][key] == value
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}
    ]


def test_replica_service_is_headless_and_selects_only_ready_server_pods() -> None:
    run = make_run(server={"port": 9000, "replicas": 3})
    service = b.build_replica_service(run)
    deployment = b.build_server_deployment(run, 1, 3)
    assert service["apiVersion"] == "v1" and service["kind"] == "Service"
    assert service["metadata"]["name"] == "r1-replicas" and service["metadata"]["namespace"] == "team"
    assert service["metadata"]["labels"] == b.build_service(run)["metadata"]["labels"]
    assert service["metadata"]["ownerReferences"] == [b.owner_reference(run)]
    spec = service["spec"]
    # Headless: DNS answers with one A record per Ready pod, no virtual IP in between.
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is False
    assert "type" not in spec
    assert spec["selector"] == deployment["spec"]["selector"]["matchLabels"] == b.selector(run, b.SERVER)
    assert pod_labels(deployment).items() >= spec["selector"].items()
    assert spec["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]


def test_replica_service_name_is_a_dns_label_for_the_longest_run_name() -> None:
    name = b.child_names(make_run("a" * 48)).replicas
    assert name == "a" * 48 + "-replicas" and len(name) <= 63


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """What a NetworkPolicy label selector (matchLabels only) selects."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def pod_labels(obj: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = obj["spec"]["template"]["metadata"]["labels"]
    return labels


def test_network_policy_admits_only_the_runs_trainer_and_the_operator_to_the_server_port() -> None:
    run = make_run(server={"port": 9000})
    other = make_run("r2")
    policy = b.build_network_policy(run, b.ServerIngress())
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
    assert policy["metadata"]["name"] == "r1-server" and policy["metadata"]["namespace"] == "team"
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert matches(spec["podSelector"], pod_labels(b.build_server_deployment(run, 3, 1)))
    assert not matches(spec["podSelector"], pod_labels(b.build_server_deployment(other, 1, 1)))
    assert not matches(spec["podSelector"], pod_labels(b.build_trainer_job(run, 1)))
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 9000}]
    trainers, operator = rule["from"]
    assert trainers.keys() == {"podSelector"}, "no namespaceSelector: the run's own namespace only"
    assert matches(trainers["podSelector"], pod_labels(b.build_trainer_job(run, 2)))
    assert not matches(trainers["podSelector"], pod_labels(b.build_trainer_job(other, 1)))
    assert not matches(trainers["podSelector"], pod_labels(b.build_server_deployment(run, 1, 1)))
    assert operator == {"namespaceSelector": {},
                        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "grpo-operator",
                                                        "app.kubernetes.io/component": "operator"}}}


def test_network_policy_takes_the_operator_and_scraper_selectors_it_is_given() -> None:
    ingress = b.ServerIngress(
        operator_pods={"app": "op"},
        operator_namespaces={"kubernetes.io/metadata.name": "grpo-system"},
        scraper_namespaces={"monitoring": "yes"},
        scraper_pods={"app.kubernetes.io/name": "prometheus"},
    )
    peers = b.build_network_policy(make_run(), ingress)["spec"]["ingress"][0]["from"]
    assert peers[1:] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "grpo-system"}},
         "podSelector": {"matchLabels": {"app": "op"}}},
        {"namespaceSelector": {"matchLabels": {"monitoring": "yes"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
    ]
    anywhere = b.build_network_policy(make_run(), b.ServerIngress(scraper_namespaces={}))
    assert anywhere["spec"]["ingress"][0]["from"][2] == {"namespaceSelector": {}, "podSelector": {}}


@pytest.mark.parametrize(("text", "labels"), [
    ("", {}),
    ("a=b", {"a": "b"}),
    (" app.kubernetes.io/name=grpo-operator , tier= ", {"app.kubernetes.io/name": "grpo-operator", "tier": ""}),
])
def test_label_selector_text_parses_into_match_labels(text: str, labels: dict[str, str]) -> None:
    assert b.parse_label_selector(text) == labels


@pytest.mark.parametrize("text", ["a", "a==b", "=b", "a=b c", "Bad_/x=1", "a=" + "v" * 64])
def test_label_selector_text_that_kubernetes_would_refuse_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="KEY=VALUE"):
        b.parse_label_selector(text)


def test_server_deployment_is_one_recreated_gpu_pod_with_shm_probes_and_mounts() -> None:
    run = make_run(
        server={
            "resources": {"limits": {"nvidia.com/gpu": 2, "memory": "80Gi"}, "requests": {"cpu": "8"}},
            "shmSize": "16Gi",
            "healthPath": "/health/",
            "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
        },
        storage={"size": "1Gi", "modelCache": {"existingClaim": "hf-cache", "mountPath": "/cache"}},
        runPolicy={"serverReadyTimeoutSeconds": 300},
    )
    deployment = b.build_server_deployment(run, 3, 1)
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    assert spec["template"]["metadata"]["annotations"] == {b.ATTEMPT_ANNOTATION: "3"}
    server = container(deployment)
    assert server["resources"] == {
        "limits": {"nvidia.com/gpu": "2", "memory": "80Gi"},
        "requests": {"cpu": "8"},
    }
    assert server["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health/", "port": "http"}, probe
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    volumes = volumes_of(deployment)
    assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    assert volumes["token"]["secret"]["secretName"] == "r1-token"
    assert volumes["run-config"]["configMap"]["name"] == "r1-config"
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "hf-cache", "readOnly": True}
    mounts = mounts_of(deployment)
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert mounts["token"] == {"name": "token", "mountPath": b.TOKEN_DIR, "readOnly": True}
    assert mounts["data"]["mountPath"] == "/data"
    assert mounts["model-cache"]["mountPath"] == "/cache"
    env = env_of(deployment)
    assert env["GRPO_RUN_CONFIG"] == b.RUN_CONFIG_PATH and env["GRPO_TOKEN_FILE"] == b.TOKEN_PATH
    assert env["GRPO_ATTEMPT"] == "3" and env["HF_HOME"] == "/cache" and env["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_pods_run_as_non_root_without_api_credentials() -> None:
    run = make_run()
    for obj in (b.build_server_deployment(run, 1, 1), b.build_trainer_job(run, 1)):
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        sc = container(obj)["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}


def test_scheduling_fields_reach_both_pod_templates() -> None:
    run = make_run(
        scheduling={
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}
            },
            "priorityClassName": "high",
            "runtimeClassName": "nvidia",
            "serviceAccountName": "trainer-sa",
        }
    )
    for obj in (b.build_server_deployment(run, 1, 1), b.build_trainer_job(run, 1)):
        pod = obj["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"gpu": "h100"}
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert "nodeAffinity" in pod["affinity"]
        assert (pod["priorityClassName"], pod["runtimeClassName"], pod["serviceAccountName"]) == (
            "high",
            "nvidia",
            "trainer-sa",
        )


def test_server_deployment_runs_the_requested_replicas_of_one_attempt_recreated_together() -> None:
    run = make_run(server={"replicas": 4})
    deployment = b.build_server_deployment(run, 2, 4)
    spec = deployment["spec"]
    assert spec["replicas"] == 4 and spec["strategy"] == {"type": "Recreate"}
    assert spec["template"]["metadata"]["annotations"][b.ATTEMPT_ANNOTATION] == "2"
    assert spec["template"]["metadata"]["labels"][b.ATTEMPT_LABEL] == "2"


def test_server_replicas_on_a_claim_that_cannot_span_nodes_share_one_node() -> None:
    many, one = make_run(server={"replicas": 2}), make_run()
    same_node = b.Placement(same_node=True)
    pod = b.build_server_deployment(many, 1, 2, placement=same_node)["spec"]["template"]["spec"]
    (term,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == b.selector(many, b.SERVER)
    assert "affinity" not in b.build_server_deployment(many, 1, 2, placement=b.Placement())["spec"]["template"]["spec"]
    assert "affinity" not in b.build_server_deployment(one, 1, 1, placement=same_node)["spec"]["template"]["spec"]


def test_scaled_down_server_keeps_its_definition() -> None:
    deployment = b.build_server_deployment(make_run(), 2, 0)
    assert deployment["spec"]["replicas"] == 0
    assert deployment["spec"]["template"]["metadata"]["annotations"][b.ATTEMPT_ANNOTATION] == "2"


def test_trainer_job_never_retries_itself_and_knows_its_attempt() -> None:
    run = make_run(trainer={"env": [{"name": "WANDB_MODE", "value": "offline"}], "metricsPort": 9500})
    job = b.build_trainer_job(run, 4)
    assert job["spec"]["backoffLimit"] == 0
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert job["metadata"]["labels"][b.ATTEMPT_LABEL] == "4"
    env = env_of(job)
    assert env["GRPO_ATTEMPT"] == "4" and env["GRPO_RUN_CONFIG"] == b.RUN_CONFIG_PATH
    assert env["GRPO_SERVER_URL"] == "http://r1-server.team.svc:8000" and env["WANDB_MODE"] == "offline"
    assert env["GRPO_TOKEN_FILE"] == b.TOKEN_PATH
    assert container(job)["command"] == ["grpo", "train"]
    assert container(job)["ports"][0]["containerPort"] == 9500
    assert set(mounts_of(job)) == {"run-config", "data", "dshm", "token"}


def test_trainer_job_writes_tracker_files_on_the_claim_and_takes_their_credentials_from_secrets() -> None:
    """TensorBoard's event files, W&B's and trackio's folders go under <mountPath>/tracking/<run>; a user's env comes
    after ours (it may move them), and a credential reaches the pod as a secretKeyRef, never as a value."""
    key = {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}}
    run = make_run(storage={"size": "1Gi", "mountPath": "/data"},
                   trainer={"reportTo": ["tensorboard", "mlflow", "wandb", "trackio"],
                            "env": [key, {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow.tracking:5000"}]})
    env = container(b.build_trainer_job(run, 1))["env"]
    names = [e["name"] for e in env]
    values = {e["name"]: e.get("value") for e in env}
    assert values["TENSORBOARD_LOGGING_DIR"] == "/data/tracking/r1/tensorboard"
    assert values["WANDB_DIR"] == "/data/tracking/r1" and values["TRACKIO_DIR"] == "/data/tracking/r1/trackio"
    assert values["MLFLOW_TRACKING_URI"] == "http://mlflow.tracking:5000"
    assert names.index("TENSORBOARD_LOGGING_DIR") < names.index("MLFLOW_TRACKING_URI"), "the user's env comes last"
    assert next(e for e in env if e["name"] == "WANDB_API_KEY") == key
    untracked = env_of(b.build_trainer_job(make_run(), 1))
    assert not {"TENSORBOARD_LOGGING_DIR", "WANDB_DIR", "TRACKIO_DIR"} & set(untracked)
    assert "TENSORBOARD_LOGGING_DIR" not in env_of(b.build_server_deployment(run, 1, 1))


@pytest.mark.parametrize("mode", ["server", "colocate"])
def test_trainer_job_fails_at_once_on_the_invalid_spec_exit_code_and_names_a_disruption(mode: str) -> None:
    """Exit code 2 fails the Job by the first rule (the run fails as InvalidSpec); a pod preempted or evicted by
    the second, never Ignore (a replacement pod inside the attempt would meet a server with later adapters), so
    the Job's Failed condition names the DisruptionTarget rule after the pod is gone."""
    from grpo_api.exit_codes import EXIT_INVALID_SPEC

    job = b.build_trainer_job(make_run(mode=mode), 1)
    assert job["spec"]["podFailurePolicy"] == {"rules": [
        {
            "action": "FailJob",
            "onExitCodes": {"containerName": container(job)["name"], "operator": "In", "values": [EXIT_INVALID_SPEC]},
        },
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]},
    ]}
    assert job["spec"]["backoffLimit"] == 0
    assert EXIT_INVALID_SPEC == 2
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never", "podFailurePolicy needs restartPolicy Never"


def test_colocate_trainer_has_no_server_address_or_token() -> None:
    run = make_run(mode="colocate")
    job = b.build_trainer_job(run, 1)
    env = env_of(job)
    assert "GRPO_SERVER_URL" not in env and "GRPO_TOKEN_FILE" not in env
    assert "token" not in volumes_of(job)
    assert volumes_of(job)["dshm"]["emptyDir"]["medium"] == "Memory"
    config = RunConfig.model_validate(yaml.safe_load(b.build_config_map(run)["data"]["run-config.yaml"]))
    assert config.server_url == "" and config.token_file is None and config.server_endpoints is None


@pytest.mark.parametrize("name", ["9lives", "a" * 49, "has.dot"])
def test_run_names_that_cannot_prefix_children_are_refused_naming_the_field(name: str) -> None:
    # The model refuses them (as admission does); check_run refuses them too, for a run built around it.
    with pytest.raises(ValidationError, match=r"metadata\.name"):
        make_run(name)
    run = make_run("ok").model_copy(update={"metadata": make_run("ok").metadata.model_copy(update={"name": name})})
    with pytest.raises(b.InvalidRunError, match=r"metadata\.name"):
        b.check_run(run)


def test_valid_run_name_passes_the_check() -> None:
    b.check_run(make_run("a" * 48))


# ------------------------------------------------------------------------------- trainer of several pods


def test_trainer_of_several_pods_is_an_indexed_job_under_the_rendezvous_subdomain() -> None:
    run = make_run("big", trainer={"numNodes": 3, "numProcPerNode": 2,
                                   "env": [{"name": "GRPO_MASTER_PORT", "value": "1234"}]})
    job = b.build_trainer_job(run, 2)
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 3
    assert spec["backoffLimit"] == 0, "a lost pod fails the Job, hence the attempt"
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "big-trainer" == b.child_names(run).trainer_rendezvous
    assert pod["restartPolicy"] == "Never"
    env = container(job)["env"]
    ours = {e["name"]: e["value"] for e in env[:-1]}
    assert ours["GRPO_MASTER_ADDR"] == "big-trainer-2-0.big-trainer" == b.rendezvous_address(run, 2)
    assert ours["GRPO_MASTER_PORT"] == str(b.RENDEZVOUS_PORT) == "29500"
    assert "JOB_COMPLETION_INDEX" not in ours, "the Job controller sets it in Indexed mode"
    # The user's variables come last: they may override ours on purpose.
    assert env[-1] == {"name": "GRPO_MASTER_PORT", "value": "1234"}
    assert container(job)["ports"] == [
        {"name": "metrics", "containerPort": run.spec.trainer.metrics_port, "protocol": "TCP"},
        {"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"},
    ]
    assert b.build_trainer_job(run, 3)["spec"]["template"]["spec"]["subdomain"] == "big-trainer"
    assert env_of(b.build_trainer_job(run, 3))["GRPO_MASTER_ADDR"] == "big-trainer-3-0.big-trainer"


def test_trainer_service_is_headless_publishes_unready_pods_and_selects_the_trainer_pods() -> None:
    run = make_run(trainer={"numNodes": 2})
    service = b.build_trainer_service(run)
    job = b.build_trainer_job(run, 1)
    assert service["apiVersion"] == "v1" and service["kind"] == "Service"
    meta = service["metadata"]
    assert meta["name"] == "r1-trainer" and meta["namespace"] == "team"
    assert meta["ownerReferences"] == [b.owner_reference(run)]
    assert meta["labels"][b.RUN_LABEL] == "r1" and meta["labels"][b.COMPONENT_LABEL] == b.TRAINER
    spec = service["spec"]
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True
    assert "type" not in spec
    assert spec["selector"] == b.selector(run, b.TRAINER)
    assert pod_labels(job).items() >= spec["selector"].items()
    assert spec["ports"] == [{"name": "rendezvous", "port": 29500, "targetPort": 29500, "protocol": "TCP"}]


def test_trainer_service_name_and_pod_hostnames_are_dns_labels_for_the_longest_run_name() -> None:
    run = make_run("a" * 48, trainer={"numNodes": 64})
    name = b.build_trainer_service(run)["metadata"]["name"]
    assert name == "a" * 48 + "-trainer" and len(name) <= 63
    host, subdomain = b.rendezvous_address(run, 999).split(".")
    assert subdomain == name and host == f"{b.child_names(run).trainer(999)}-0" and len(host) <= 63


def test_trainer_of_one_pod_is_the_job_as_before() -> None:
    run = make_run()
    job = b.build_trainer_job(run, 1)
    assert job == b.build_trainer_job(make_run(trainer={"numNodes": 1, "numProcPerNode": 4}), 1)
    spec = job["spec"]
    assert list(spec) == ["backoffLimit", "completions", "parallelism", "podFailurePolicy", "template"]
    assert spec["completions"] == spec["parallelism"] == 1 and "completionMode" not in spec
    assert "subdomain" not in spec["template"]["spec"]
    assert not any(name.startswith("GRPO_MASTER_") for name in env_of(job))
    assert [p["name"] for p in container(job)["ports"]] == ["metrics"]


def test_a_full_tuning_trainer_learns_its_pod_ip_for_the_weight_transfer_rendezvous() -> None:
    full = b.build_trainer_job(make_run(trainer={"tuning": "full"}), attempt=1)
    env = {e["name"]: e for e in container(full)["env"]}
    assert env["GRPO_TRAINER_ADDRESS"] == {"name": "GRPO_TRAINER_ADDRESS",
                                           "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    lora = b.build_trainer_job(make_run(), attempt=1)
    assert "GRPO_TRAINER_ADDRESS" not in env_of(lora)
