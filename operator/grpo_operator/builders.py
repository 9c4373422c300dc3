"""Pure manifest builders: a GRPORun in, the dict of one child object out.

No API calls, no clock, no randomness (the token is passed in), so every child
can be checked in a unit test. Names are deterministic, so "create" can be
get-or-create; every child carries the run's ownerReference (garbage collection
by the controller-manager) and the run's labels (selection by the operator).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from grpo_api.childenv import child_environment, tracker_environment
from grpo_api.exit_codes import EXIT_INVALID_SPEC
from grpo_api.export_protocol import CREDENTIAL_KEYS, ENV_EXPORT_CLAIM_ROOT
from grpo_api.models import (
    API_VERSION,
    DEFAULT_SERVER_IMAGE,
    DEFAULT_TRAINER_IMAGE,
    KIND,
    MAX_RUN_NAME,
    RUN_NAME_MESSAGE,
    RUN_NAME_PATTERN,
    TRAINER_RENDEZVOUS_PORT,
    EnvVar,
    GRPORun,
    Mode,
    Resources,
    ServerSpec,
    TrainerSpec,
)
from grpo_api.prepare_protocol import EXIT_PERMANENT
from grpo_api.runconfig import RUN_CONFIG_FILE, ServerEndpoints, run_config_for
from grpo_api.sources import ClusterLayout, SourceVolume, cluster_layout, hub_tokens, s3_credentials

LABEL_PREFIX = "grpo.dev"
RUN_LABEL = f"{LABEL_PREFIX}/run"
COMPONENT_LABEL = f"{LABEL_PREFIX}/component"
ATTEMPT_LABEL = f"{LABEL_PREFIX}/attempt"
#: On the server pod template: bumping it replaces the pod (a fresh server per attempt).
ATTEMPT_ANNOTATION = f"{LABEL_PREFIX}/attempt"
#: On a GRPORun: where the operator polls health instead of the Service (tests, out-of-cluster runs).
SERVER_URL_ANNOTATION = f"{LABEL_PREFIX}/server-url"
MANAGED_BY = "grpo-operator"

SERVER = "server"
TRAINER = "trainer"
INITIALIZER = "initializer"
EXPORTER = "export"
#: Where the export step mounts the claim of a pvc:// destination.
EXPORT_CLAIM_DIR = "/grpo-export"
#: Tries of the export step's Job for a transient failure (the network, a 5xx); exit code 2 fails it at once.
EXPORT_BACKOFF_LIMIT = 3
REWARDS = "rewards"
CONFIG = "config"
STORAGE = "storage"
TOKEN = "token"

CONFIG_DIR = "/etc/grpo"
TOKEN_DIR = "/var/run/grpo/token"
TOKEN_KEY = "token"
RUN_CONFIG_PATH = f"{CONFIG_DIR}/{RUN_CONFIG_FILE}"
TOKEN_PATH = f"{TOKEN_DIR}/{TOKEN_KEY}"
NON_ROOT_UID = 1000
#: The torch.distributed rendezvous port of a trainer of several pods (on the pod of completion index 0).
RENDEZVOUS_PORT = TRAINER_RENDEZVOUS_PORT
#: What a ConfigMap may hold, keys and values together (the API server's limit).
MAX_CONFIG_MAP_BYTES = 1024 * 1024



class InvalidRunError(ValueError):
    """A run whose children cannot be built; the message names the field."""


@dataclass(frozen=True)
class ChildNames:
    """Every child's name, decided before anything is created."""

    run: str

    @property
    def config(self) -> str:
        return f"{self.run}-config"

    @property
    def data(self) -> str:
        return f"{self.run}-data"

    @property
    def token(self) -> str:
        return f"{self.run}-token"

    @property
    def rewards(self) -> str:
        """The ConfigMap of spec.rewardCode.inline."""
        return f"{self.run}-rewards"

    @property
    def initializer(self) -> str:
        return f"{self.run}-init"

    @property
    def exporter(self) -> str:
        return f"{self.run}-export"

    @property
    def server(self) -> str:
        """The server's Deployment and Service."""
        return f"{self.run}-server"

    @property
    def replicas(self) -> str:
        """The headless Service whose DNS A records are the server's ready replicas (the trainer's view).

        Short: a run name is at most MAX_RUN_NAME (48) characters, a Service name at most 63."""
        return f"{self.run}-replicas"

    @property
    def server_network_policy(self) -> str:
        return f"{self.run}-server"

    def trainer(self, attempt: int) -> str:
        return f"{self.run}-trainer-{attempt}"

    @property
    def trainer_rendezvous(self) -> str:
        """The headless Service that gives the trainer pods of several-pod runs their DNS names
        (`<job>-<index>.<run>-trainer`); one name for every attempt. At most 56 characters."""
        return f"{self.run}-trainer"


def child_names(run: GRPORun) -> ChildNames:
    return ChildNames(run.metadata.name)


def check_run(run: GRPORun) -> None:
    """Refuse a run whose name cannot prefix its children (Service names are DNS-1035 labels)."""
    name = run.metadata.name
    if len(name) > MAX_RUN_NAME or not re.fullmatch(RUN_NAME_PATTERN, name):
        raise InvalidRunError(f"{RUN_NAME_MESSAGE} (it is {name!r})")
    if not run.metadata.uid:
        raise InvalidRunError("metadata.uid is empty: children need it for their ownerReference")


def check_children(run: GRPORun) -> None:
    """Build every child the run can have, each way it can be built, and throw the result away: a spec no child
    can be built from is refused (InvalidRunError, naming the field) before any child exists."""
    build_config_map(run)
    build_rewards_config_map(run)
    build_initializer_job(run)
    build_exporter_job(run)
    for together in (False, True):
        where = Placement(same_node=together)
        build_server_deployment(run, 1, run.spec.effective_server.replicas, placement=where)
        build_trainer_job(run, 1, placement=where)


def volume_claim_name(run: GRPORun) -> str:
    """The shared volume's claim: the named existing one, or the run's own."""
    return run.spec.storage.existing_claim or child_names(run).data


@dataclass(frozen=True)
class Images:
    """The images a run gets when its spec names none (the operator's flags; the chart's values)."""

    server: str = DEFAULT_SERVER_IMAGE
    trainer: str = DEFAULT_TRAINER_IMAGE


@dataclass(frozen=True)
class Admitted:
    """What a queue's admission adds to the pods of one of the run's pod sets, merged into their template as Kueue
    merges it into a Job's (jobframework's podset.Merge): the node labels and tolerations of the ResourceFlavors
    Kueue assigned, and the labels, annotations, node selector and tolerations its admission checks ask for."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    """What the operator learnt about the run's claims, and its queue's admission, before building its pods."""

    #: Server and trainer must share a node: a claim both mount can be attached to one node only.
    same_node: bool = False
    #: Where Kueue admitted the pods being built (None: no queue admits the run).
    admitted: Admitted | None = None


def source_layout(run: GRPORun) -> ClusterLayout:
    """The source volumes of the run's pods and where its model, dataset and reward modules land."""
    return cluster_layout(
        run.spec, data_claim=volume_claim_name(run), inline_rewards_configmap=child_names(run).rewards
    )


def claims_of(run: GRPORun) -> tuple[str, ...]:
    """Every claim the run's pods mount: its volume's and those of its pvc:// sources."""
    cache = run.spec.storage.model_cache
    extra = (cache.existing_claim,) if cache is not None else ()
    return (volume_claim_name(run), *source_layout(run).claims, *extra)


def needs_same_node(access_modes: dict[str, list[str] | None], data_claim: str) -> bool:
    """Whether server and trainer must share a node, from each claim's access modes (None: unknown).

    The run's volume is written by both pods: it needs ReadWriteMany to span nodes. Source claims
    are mounted read-only: ReadOnlyMany is enough. An unknown claim is taken to need it.
    """
    for claim, modes in access_modes.items():
        spanning = {"ReadWriteMany"} if claim == data_claim else {"ReadWriteMany", "ReadOnlyMany"}
        if modes is None or not spanning & set(modes):
            return True
    return False


def server_url(run: GRPORun) -> str:
    """The server's in-cluster address (Service DNS)."""
    namespace = run.metadata.namespace or "default"
    return f"http://{child_names(run).server}.{namespace}.svc:{run.spec.effective_server.port}"


def labels(run: GRPORun, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": f"grpo-{component}",
        "app.kubernetes.io/instance": run.metadata.name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/part-of": "grpo-operator",
        RUN_LABEL: run.metadata.name,
        COMPONENT_LABEL: component,
    }


def selector(run: GRPORun, component: str) -> dict[str, str]:
    """Labels that select a run's children of one component (stable across attempts)."""
    return {RUN_LABEL: run.metadata.name, COMPONENT_LABEL: component}


def owner_reference(run: GRPORun) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": run.metadata.name,
        "uid": run.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(
    run: GRPORun,
    name: str,
    component: str,
    extra_labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": run.metadata.namespace or "default",
        "labels": {**labels(run, component), **(extra_labels or {})},
        "ownerReferences": [owner_reference(run)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


# ----------------------------------------------------------------------------------- simple children


def build_config_map(run: GRPORun) -> dict[str, Any]:
    """The run-config both containers read ($GRPO_RUN_CONFIG), rendered from the spec."""
    in_server_mode = run.spec.mode == Mode.SERVER
    server = run.spec.effective_server
    namespace = run.metadata.namespace or "default"
    # Server mode always names the replicas' headless Service, one replica too: one code path in the trainer.
    endpoints = (
        ServerEndpoints(
            replicas=server.replicas,
            dns_name=f"{child_names(run).replicas}.{namespace}.svc",
            port=server.port,
        )
        if in_server_mode
        else None
    )
    config = run_config_for(
        run,
        volume_root=run.spec.storage.mount_path,
        # Colocate mode has no server to reach: the trainer runs vLLM itself.
        server_url=server_url(run) if in_server_mode else "",
        token_file=TOKEN_PATH if in_server_mode else None,
        base_dir="/",
        sources=source_layout(run).sources,
        server_endpoints=endpoints,
    )
    text = config.to_yaml()
    size = len(RUN_CONFIG_FILE) + len(text.encode())
    if size > MAX_CONFIG_MAP_BYTES:
        raise InvalidRunError(
            f"spec is too large: its run-config is {size} bytes, over the {MAX_CONFIG_MAP_BYTES} a ConfigMap holds "
            "(shrink rewardCode.inline, the pods' podAnnotations, rewards[].args, trainer.structuredOutputs or "
            "server.extraEngineArgs)"
        )
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(run, child_names(run).config, CONFIG),
        "data": {RUN_CONFIG_FILE: text},
    }


def build_rewards_config_map(run: GRPORun) -> dict[str, Any] | None:
    """The modules of spec.rewardCode.inline, mounted read-only where the trainer imports them."""
    code = run.spec.reward_code
    if code is None or not code.inline:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(run, child_names(run).rewards, REWARDS),
        "data": dict(code.inline),
    }


def build_token_secret(run: GRPORun, token: str) -> dict[str, Any]:
    """The bearer token the server requires on mutating endpoints; the trainer presents it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(run, child_names(run).token, TOKEN),
        "stringData": {TOKEN_KEY: token},
    }


def build_volume_claim(run: GRPORun) -> dict[str, Any] | None:
    """The run's own claim for adapters, checkpoints and progress; None when an existing claim is named."""
    storage = run.spec.storage
    if storage.existing_claim is not None:
        return None
    spec: dict[str, Any] = {
        "accessModes": list(storage.access_modes),
        "resources": {"requests": {"storage": storage.size}},
    }
    if storage.storage_class_name is not None:
        spec["storageClassName"] = storage.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(run, child_names(run).data, STORAGE),
        "spec": spec,
    }


def _service(run: GRPORun, name: str, component: str, ports: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    """A Service of the run's pods of one component."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(run, name, component),
        "spec": {**spec, "selector": selector(run, component), "ports": ports},
    }


def _http_port(run: GRPORun) -> list[dict[str, Any]]:
    return [{"name": "http", "port": run.spec.effective_server.port, "targetPort": "http", "protocol": "TCP"}]


def build_service(run: GRPORun) -> dict[str, Any]:
    return _service(run, child_names(run).server, SERVER, _http_port(run), type="ClusterIP")


def build_replica_service(run: GRPORun) -> dict[str, Any]:
    """The headless Service of the server's replicas: its DNS name resolves to one A record per Ready
    server pod (not-ready ones are left out), so the trainer reaches each replica itself."""
    return _service(run, child_names(run).replicas, SERVER, _http_port(run), clusterIP="None",
                    publishNotReadyAddresses=False)


def build_trainer_service(run: GRPORun) -> dict[str, Any]:
    """The headless Service of the trainer pods (spec.trainer.numNodes > 1): as the pods' subdomain it
    gives each one a DNS name, `<job>-<index>.<run>-trainer`, where the other ranks find rank 0's
    rendezvous. Not-ready pods are published: the ranks must find each other before any is Ready."""
    ports = [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT, "protocol": "TCP"}]
    return _service(run, child_names(run).trainer_rendezvous, TRAINER, ports, clusterIP="None",
                    publishNotReadyAddresses=True)


# ---------------------------------------------------------------------------------- network policy

#: The operator pod's labels as the chart sets them (its selectorLabels, less the release name).
DEFAULT_OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "grpo-operator", "app.kubernetes.io/component": "operator"}
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^({_LABEL_NAME})?$")


def parse_label_selector(text: str) -> dict[str, str]:
    """matchLabels from kubectl's equality form, k=v,k2=v2; an empty text is the empty selector (everything)."""
    labels: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
            raise ValueError(f"{part!r} is not KEY=VALUE with a valid Kubernetes label key and value")
        labels[key] = value
    return labels


@dataclass(frozen=True)
class ServerIngress:
    """Who may reach a run server's port besides the same run's trainer pods (the run's NetworkPolicy).

    A NetworkPolicy works on ports (L4), not paths: the server's /metrics shares its port with the
    mutating endpoints, so an allowed scraper can reach those too (the run's bearer token guards them).
    """

    #: matchLabels of the operator's pods, which poll the server's health before a trainer may start.
    operator_pods: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_OPERATOR_POD_LABELS))
    #: matchLabels of the operator's namespace; empty: any namespace.
    operator_namespaces: dict[str, str] = field(default_factory=dict)
    #: matchLabels of the namespaces whose pods may scrape /metrics; None: no scraper is admitted.
    scraper_namespaces: dict[str, str] | None = None
    #: matchLabels of the scraper pods in those namespaces; empty: any pod there.
    scraper_pods: dict[str, str] = field(default_factory=dict)


def _selector(labels: dict[str, str]) -> dict[str, Any]:
    return {"matchLabels": dict(labels)} if labels else {}


def build_network_policy(run: GRPORun, ingress: ServerIngress) -> dict[str, Any]:
    """The run's server pods accept connections on the server port only from the run's own trainer
    pods, the operator, and (if configured) the metrics scrapers; nothing else reaches the load trigger."""
    peers: list[dict[str, Any]] = [
        # A bare podSelector means pods of the policy's own namespace: the run's.
        {"podSelector": {"matchLabels": selector(run, TRAINER)}},
        {
            "namespaceSelector": _selector(ingress.operator_namespaces),
            "podSelector": _selector(ingress.operator_pods),
        },
    ]
    if ingress.scraper_namespaces is not None:
        peers.append(
            {
                "namespaceSelector": _selector(ingress.scraper_namespaces),
                "podSelector": _selector(ingress.scraper_pods),
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(run, child_names(run).server_network_policy, SERVER),
        "spec": {
            "podSelector": {"matchLabels": selector(run, SERVER)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": peers,
                    "ports": [{"protocol": "TCP", "port": run.spec.effective_server.port}],
                }
            ],
        },
    }


# --------------------------------------------------------------------------------------- pod parts


def _resources(resources: Resources) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if resources.requests:
        out["requests"] = {k: str(v) for k, v in resources.requests.items()}
    if resources.limits:
        out["limits"] = {k: str(v) for k, v in resources.limits.items()}
    return out


def _source_volume(volume: SourceVolume) -> dict[str, Any]:
    if volume.kind == "claim":
        return {"name": volume.name, "persistentVolumeClaim": {"claimName": volume.ref, "readOnly": True}}
    if volume.kind == "image":
        # A Kubernetes image volume: the OCI image's file system, read-only (ImageVolume, 1.33+).
        return {"name": volume.name, "image": {"reference": volume.ref}}
    # optional: a missing ConfigMap (a typo, not staged yet) leaves an empty directory, so the
    # initializer starts and names the missing file instead of its pod waiting for a mount forever.
    return {"name": volume.name, "configMap": {"name": volume.ref, "optional": True}}


def _volumes(
    run: GRPORun, extra: list[dict[str, Any]], *, shm_size: str | None, token: bool
) -> list[dict[str, Any]]:
    names = child_names(run)
    volumes: list[dict[str, Any]] = [
        {"name": "run-config", "configMap": {"name": names.config}},
        {"name": "data", "persistentVolumeClaim": {"claimName": volume_claim_name(run)}},
    ]
    if shm_size is not None:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}})
    if token:
        volumes.append({"name": "token", "secret": {"secretName": names.token, "defaultMode": 0o440}})
    cache = run.spec.storage.model_cache
    if cache is not None:
        volumes.append(
            {
                "name": "model-cache",
                "persistentVolumeClaim": {"claimName": cache.existing_claim, "readOnly": True},
            }
        )
    volumes.extend(_source_volume(v) for v in source_layout(run).volumes)
    volumes.extend(extra)
    return volumes


def _mounts(run: GRPORun, extra: list[dict[str, Any]], *, shm: bool, token: bool) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {"name": "run-config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "data", "mountPath": run.spec.storage.mount_path},
    ]
    if shm:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if token:
        mounts.append({"name": "token", "mountPath": TOKEN_DIR, "readOnly": True})
    cache = run.spec.storage.model_cache
    if cache is not None:
        mounts.append({"name": "model-cache", "mountPath": cache.mount_path, "readOnly": True})
    mounts.extend(
        {"name": v.name, "mountPath": v.mount_path, "readOnly": True} for v in source_layout(run).volumes
    )
    mounts.extend(extra)
    return mounts


def _env_var(var: EnvVar) -> dict[str, Any]:
    if var.value_from is not None:
        return {"name": var.name, "valueFrom": var.value_from.to_wire()}
    return {"name": var.name, "value": var.literal}


def _env(
    run: GRPORun, attempt: int, ours: list[dict[str, Any]], user: list[EnvVar], *, token: bool, server: bool = False
) -> list[dict[str, Any]]:
    cache = run.spec.storage.model_cache
    common = child_environment(
        run_config=RUN_CONFIG_PATH,
        attempt=attempt,
        token_file=TOKEN_PATH if token else None,
        server_url=server_url(run) if server else None,
        model_cache=cache.mount_path if cache is not None else None,
    )
    env: list[dict[str, Any]] = [{"name": name, "value": value} for name, value in common]
    env.extend(ours)
    # User variables come last so they may override ours on purpose.
    env.extend(_env_var(var) for var in user)
    return env


def _extra_volumes(section: ServerSpec | TrainerSpec) -> list[dict[str, Any]]:
    return [dict(v) for v in section.volumes]


def _extra_mounts(section: ServerSpec | TrainerSpec) -> list[dict[str, Any]]:
    return [m.to_wire() for m in section.volume_mounts]


def _container_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_spec(
    run: GRPORun,
    container: dict[str, Any],
    volumes: list[dict[str, Any]],
    restart_policy: str,
    affinity: dict[str, Any] | None = None,
    admitted: Admitted | None = None,
) -> dict[str, Any]:
    scheduling = run.spec.scheduling
    pod: dict[str, Any] = {
        "restartPolicy": restart_policy,
        # Neither container talks to the Kubernetes API.
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": NON_ROOT_UID,
            "runAsGroup": NON_ROOT_UID,
            "fsGroup": NON_ROOT_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }
    node_selector = _merged(dict(scheduling.node_selector), admitted.node_selector if admitted else {},
                            "spec.scheduling.nodeSelector")
    if node_selector:
        pod["nodeSelector"] = node_selector
    tolerations = [t.to_wire() for t in scheduling.tolerations]
    tolerations += [t for t in (admitted.tolerations if admitted else ()) if t not in tolerations]
    if tolerations:
        pod["tolerations"] = tolerations
    merged = _merge_affinity(scheduling.affinity, affinity or {})
    if merged:
        pod["affinity"] = merged
    if scheduling.priority_class_name:
        pod["priorityClassName"] = scheduling.priority_class_name
    if scheduling.runtime_class_name:
        pod["runtimeClassName"] = scheduling.runtime_class_name
    if scheduling.service_account_name:
        pod["serviceAccountName"] = scheduling.service_account_name
    if scheduling.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": name} for name in scheduling.image_pull_secrets]
    return pod


def section_name(section: ServerSpec | TrainerSpec) -> str:
    """The spec field of a pod section (for messages that name a field)."""
    return "server" if isinstance(section, ServerSpec) else "trainer"


def _merged(ours: dict[str, str], admitted: dict[str, str], field_name: str) -> dict[str, str]:
    """Ours plus what the admission adds; a key both set to different values cannot be merged (Kueue refuses to
    start a Job so: podset.Merge), so the run fails naming the field."""
    for key, value in admitted.items():
        if ours.get(key, value) != value:
            raise InvalidRunError(f"{field_name} has {key}={ours[key]}, which Kueue's admission of the run sets to "
                                  f"{key}={value} (its ResourceFlavor or an admission check): they cannot both hold")
    return {**ours, **admitted}


def _merge_affinity(user: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """The user's affinity plus ours: our required pod-affinity terms are appended to theirs."""
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in user.items()}
    for kind, rules in ours.items():
        target = merged.setdefault(kind, {})
        if not isinstance(target, dict):
            raise InvalidRunError(f"scheduling.affinity.{kind} must be an object")
        for key, terms in rules.items():
            existing = target.get(key, [])
            if not isinstance(existing, list):
                raise InvalidRunError(f"scheduling.affinity.{kind}.{key} must be a list")
            target[key] = [*existing, *terms]
    return merged


def _same_node_as_server(run: GRPORun) -> dict[str, Any]:
    """Required pod affinity to the run's server pod: a claim both mount attaches to one node only."""
    return {
        "podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": selector(run, SERVER)}, "topologyKey": "kubernetes.io/hostname"}
            ]
        }
    }


def _template_metadata(
    run: GRPORun, component: str, section: ServerSpec | TrainerSpec, attempt: int | None,
    admitted: Admitted | None = None,
) -> dict[str, Any]:
    """The pod template's labels and annotations: the user's extras, ours on top, then what the admission adds."""
    meta: dict[str, Any] = {
        "labels": _merged({**section.pod_labels, **labels(run, component)}, admitted.labels if admitted else {},
                          f"spec.{section_name(section)}.podLabels"),
        "annotations": _merged(dict(section.pod_annotations), admitted.annotations if admitted else {},
                               f"spec.{section_name(section)}.podAnnotations"),
    }
    if attempt is not None:
        meta["labels"][ATTEMPT_LABEL] = str(attempt)
        meta["annotations"][ATTEMPT_ANNOTATION] = str(attempt)
    if not meta["annotations"]:
        del meta["annotations"]
    return meta


# ------------------------------------------------------------------------------------------ server


def _probe(path: str, period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def build_server_deployment(
    run: GRPORun, attempt: int, replicas: int, images: Images | None = None, placement: Placement | None = None
) -> dict[str, Any]:
    """The server of one attempt: `replicas` pods (spec.server.replicas; 0 stops it), all replaced
    (Recreate) when the attempt changes. Several replicas that share a claim which cannot span nodes
    (placement.same_node) go to one node (required affinity to each other; the first may go anywhere)."""
    server: ServerSpec = run.spec.effective_server
    images = images or Images()
    startup_period = 10
    startup_failures = max(1, math.ceil(run.spec.run_policy.server_ready_timeout_seconds / startup_period))
    container = {
        "name": "server",
        "image": server.image or images.server,
        "imagePullPolicy": server.image_pull_policy,
        "command": ["grpo", "serve", "--host", "0.0.0.0", "--port", str(server.port)],
        "ports": [{"name": "http", "containerPort": server.port, "protocol": "TCP"}],
        "env": _env(run, attempt, [], server.env, token=True),
        "resources": _resources(server.resources),
        "volumeMounts": _mounts(run, _extra_mounts(server), shm=True, token=True),
        # The startup probe covers the model load (as long as the operator's own deadline);
        # readiness and liveness start after it, so they need no initial delay.
        "startupProbe": _probe(server.health_path, startup_period, startup_failures),
        "readinessProbe": _probe(server.health_path, 5, 3),
        "livenessProbe": _probe(server.health_path, 10, 6),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }
    volumes = _volumes(run, _extra_volumes(server), shm_size=server.shm_size, token=True)
    together = server.replicas > 1 and placement is not None and placement.same_node
    affinity = _same_node_as_server(run) if together else None
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(
            run, child_names(run).server, SERVER, annotations={ATTEMPT_ANNOTATION: str(attempt)}
        ),
        "spec": {
            "replicas": replicas,
            # Every replica of an attempt is fresh: the old pods are gone before the new ones start
            # (a rolling update would also wait for spare GPUs, and mix replicas of two attempts).
            "strategy": {"type": "Recreate"},
            "revisionHistoryLimit": 2,
            "progressDeadlineSeconds": max(600, run.spec.run_policy.server_ready_timeout_seconds + 60),
            "selector": {"matchLabels": selector(run, SERVER)},
            "template": {
                "metadata": _template_metadata(run, SERVER, server, attempt, placement.admitted if placement else None),
                "spec": _pod_spec(run, container, volumes, "Always", affinity=affinity,
                                  admitted=placement.admitted if placement else None),
            },
        },
    }


# ----------------------------------------------------------------------------------------- trainer


def rendezvous_address(run: GRPORun, attempt: int) -> str:
    """The DNS name of the attempt's trainer pod of completion index 0 (an Indexed Job's pod is named
    host `<job>-<index>`; the Service of its subdomain makes `<host>.<subdomain>` resolve in the namespace)."""
    names = child_names(run)
    return f"{names.trainer(attempt)}-0.{names.trainer_rendezvous}"


def build_trainer_job(
    run: GRPORun, attempt: int, images: Images | None = None, placement: Placement | None = None
) -> dict[str, Any]:
    """The trainer of one attempt. The Job never retries itself: a retry needs a fresh server first.

    A trainer that exits with EXIT_INVALID_SPEC (a configuration problem no retry fixes) fails the Job by
    its podFailurePolicy, so its Failed condition says `PodFailurePolicy` and the run fails without
    another attempt. A pod preempted or evicted (DisruptionTarget) fails it by another rule of the policy,
    which its Failed condition's message names: the next attempt does not count against backoffLimit.

    With spec.trainer.numNodes > 1 it is an Indexed Job of that many pods, all started together, under
    the subdomain of the trainer's headless Service; each learns rank 0's address from GRPO_MASTER_ADDR
    and GRPO_MASTER_PORT, and its own node rank from JOB_COMPLETION_INDEX (set by the Job controller).
    One lost pod fails the Job (backoffLimit 0), hence the attempt; the next attempt resumes."""
    trainer = run.spec.trainer
    images = images or Images()
    placement = placement or Placement()
    server_mode = run.spec.mode == Mode.SERVER
    several = trainer.num_nodes > 1
    ours: list[dict[str, Any]] = []
    ports = [{"name": "metrics", "containerPort": trainer.metrics_port, "protocol": "TCP"}]
    if several:
        ours = [
            {"name": "GRPO_MASTER_ADDR", "value": rendezvous_address(run, attempt)},
            {"name": "GRPO_MASTER_PORT", "value": str(RENDEZVOUS_PORT)},
        ]
        ports.append({"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"})
    if server_mode and trainer.pushes_weights:
        # Full fine-tuning or merged LoRA: the server's workers join the trainer's weight-transfer group
        # (nccl) at this address.
        ours.append({"name": "GRPO_TRAINER_ADDRESS", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    # The trackers that write files (TensorBoard's event files, W&B's run folders) write them on the claim.
    tracking = tracker_environment(trainer.report_to, volume_root=run.spec.storage.mount_path,
                                   run_name=run.metadata.name)
    ours.extend({"name": name, "value": value} for name, value in tracking)
    container = {
        "name": TRAINER,
        "image": trainer.image or images.trainer,
        "imagePullPolicy": trainer.image_pull_policy,
        "command": ["grpo", "train"],
        "ports": ports,
        "env": _env(run, attempt, ours, trainer.env, token=server_mode, server=server_mode),
        "resources": _resources(trainer.resources),
        "volumeMounts": _mounts(run, _extra_mounts(trainer), shm=True, token=server_mode),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }
    # Colocate mode runs vLLM inside the trainer, so it gets the server's shared-memory size.
    volumes = _volumes(run, _extra_volumes(trainer), shm_size=run.spec.effective_server.shm_size, token=server_mode)
    affinity = _same_node_as_server(run) if server_mode and placement.same_node else None
    pod = _pod_spec(run, container, volumes, "Never", affinity, placement.admitted)
    spec: dict[str, Any] = {"backoffLimit": 0}
    if several:
        pod["subdomain"] = child_names(run).trainer_rendezvous
        spec["completionMode"] = "Indexed"
    spec |= {
        "completions": trainer.num_nodes,
        "parallelism": trainer.num_nodes,
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": TRAINER, "operator": "In", "values": [EXIT_INVALID_SPEC]},
                },
                # A pod preempted or evicted fails the Job too (backoffLimit 0 would), but the Job's Failed
                # condition then names the DisruptionTarget rule, which outlives the pod: the operator starts
                # the next attempt without counting it against the run's backoffLimit. Not Ignore: the Job would
                # replace the pod inside the attempt, beside a server that already serves later adapters.
                {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]},
            ]
        },
        "template": {
            "metadata": _template_metadata(run, TRAINER, trainer, attempt, placement.admitted),
            "spec": pod,
        },
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(
            run,
            child_names(run).trainer(attempt),
            TRAINER,
            {ATTEMPT_LABEL: str(attempt)},
            {ATTEMPT_ANNOTATION: str(attempt)},
        ),
        "spec": spec,
    }


# ------------------------------------------------------------------------------------- initializer


def build_initializer_job(
    run: GRPORun, images: Images | None = None, admitted: Admitted | None = None
) -> dict[str, Any]:
    """The run's initializer: fetches its hf://, s3:// and https:// sources onto its volume and checks that the
    model, the dataset and every reward function load, once per run, before any server.

    A transient failure (network, hub) is retried by the Job (backoffLimit, its exponential delay) and
    the fetch resumes; a permanent one (exit code 2: not found, a missing module) fails the Job at
    once (podFailurePolicy). It runs in the trainer image with the trainer's env, volumes and pod
    settings (a proxy or a CA bundle for a mirror applies to both), and reads hub tokens and s3://
    credentials that only it is given. A run Kueue admits runs it where the trainer's pod set was admitted
    (`admitted`): it is no pod set of its own, running before the trainer within that pod set's reservation.
    """
    trainer = run.spec.trainer
    init = run.spec.initializer
    images = images or Images()
    ours: list[dict[str, Any]] = [
        # optional: a missing Secret or key leaves the variable unset, which the initializer reports
        # (naming hub.tokenSecretRef or s3.credentialsSecret) instead of its pod never starting.
        {"name": env, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}
        for env, secret, key in [*hub_tokens(run.spec), *s3_credentials(run.spec)]
    ]
    ours.append({"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"})
    container = {
        "name": INITIALIZER,
        "image": trainer.image or images.trainer,
        "imagePullPolicy": trainer.image_pull_policy,
        "command": ["grpo", "prepare"],
        "env": _env(run, 0, ours, trainer.env, token=False),
        "resources": _resources(init.resources),
        "volumeMounts": _mounts(run, _extra_mounts(trainer), shm=False, token=False),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }
    volumes = _volumes(run, _extra_volumes(trainer), shm_size=None, token=False)
    spec: dict[str, Any] = {
        "backoffLimit": init.backoff_limit,
        "completions": 1,
        "parallelism": 1,
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": INITIALIZER, "operator": "In", "values": [EXIT_PERMANENT]},
                },
                # A node drained or a pod preempted is no fault of the sources.
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
            ]
        },
        "template": {
            "metadata": _template_metadata(run, INITIALIZER, trainer, None, admitted),
            "spec": _pod_spec(run, container, volumes, "Never", admitted=admitted),
        },
    }
    if init.active_deadline_seconds is not None:
        spec["activeDeadlineSeconds"] = init.active_deadline_seconds
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(run, child_names(run).initializer, INITIALIZER),
        "spec": spec,
    }


# ------------------------------------------------------------------------------------------ export step


def build_exporter_job(
    run: GRPORun, images: Images | None = None, admitted: Admitted | None = None
) -> dict[str, Any] | None:
    """The run's export step (spec.output), once its trainer succeeded: `grpo export` uploads the final
    adapter, or the base model with it merged in, and leaves where it went as its termination message.

    It runs in the trainer image (the merge needs torch, transformers and PEFT) with the run's volume, the
    trainer's env and volumes, and the destination's credentials from spec.output.credentialsSecret, which no
    other container of the run gets (the trainer runs user reward code). A transient failure is retried by the
    Job; a permanent one (exit code 2) fails it at once. A merge gets the trainer's resources, an adapter the
    initializer's. A run Kueue admits runs it where the trainer's pod set was admitted (`admitted`), after the
    trainer, within that pod set's reservation.
    """
    output = run.spec.output
    if output is None:
        return None
    trainer = run.spec.trainer
    images = images or Images()
    destination = output.parsed
    ours: list[dict[str, Any]] = [{"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    if output.credentials_secret is not None:
        ours += [
            {"name": env, "valueFrom": {"secretKeyRef": {"name": output.credentials_secret, "key": key,
                                                         **({"optional": True} if optional else {})}}}
            for env, key, optional in CREDENTIAL_KEYS[destination.scheme]
        ]
    mounts = _mounts(run, _extra_mounts(trainer), shm=False, token=False)
    volumes = _volumes(run, _extra_volumes(trainer), shm_size=None, token=False)
    if destination.scheme == "pvc":
        ours.append({"name": ENV_EXPORT_CLAIM_ROOT, "value": EXPORT_CLAIM_DIR})
        mounts.append({"name": "export-claim", "mountPath": EXPORT_CLAIM_DIR})
        volumes.append({"name": "export-claim", "persistentVolumeClaim": {"claimName": destination.target}})
    resources = trainer.resources if output.form == "merged" else run.spec.initializer.resources
    container = {
        "name": EXPORTER,
        "image": trainer.image or images.trainer,
        "imagePullPolicy": trainer.image_pull_policy,
        "command": ["grpo", "export"],
        "env": _env(run, 0, ours, trainer.env, token=False),
        "resources": _resources(resources),
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }
    spec: dict[str, Any] = {
        "backoffLimit": EXPORT_BACKOFF_LIMIT,
        "completions": 1,
        "parallelism": 1,
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": EXPORTER, "operator": "In", "values": [EXIT_PERMANENT]},
                },
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
            ]
        },
        "template": {
            "metadata": _template_metadata(run, EXPORTER, trainer, None, admitted),
            "spec": _pod_spec(run, container, volumes, "Never", admitted=admitted),
        },
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(run, child_names(run).exporter, EXPORTER),
        "spec": spec,
    }
